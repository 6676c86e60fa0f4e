"""A sweep's run: the cells of the plan not finished in the store, on the chosen executor,
each one kept in the store as it comes back, then the index rebuilt."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from crossrt.records.schema import RunRecord
from crossrt.sweep.cell_run import CellJob
from crossrt.sweep.local import run_in_order, run_local
from crossrt.sweep.cell import Cell
from crossrt.sweep.plan import Sweep
from crossrt.sweep.store import SweepStore


@dataclass(frozen=True)
class Executor:
    """Where cells run: ray None for this machine (thread_budget: threads in use at once; None
    or 1: one cell after another in this process), else a Ray address, "auto" or "local"."""

    ray: Optional[str] = None
    thread_budget: Optional[int] = None
    strategy: Optional[str] = None  # None: the sweep file's [ray] strategy
    max_retries: Optional[int] = None  # None: the sweep file's [ray] max_retries
    kill_once: Optional[Path] = None  # test hook only (crossrt/sweep/on_ray.py)


@dataclass
class Progress:
    total: int
    finished: int = 0
    failed: list[str] = field(default_factory=list)


# (position, total, cell, record or None, outcome) after each cell comes back
OnCell = Callable[[int, int, Cell, Optional[RunRecord], dict[str, Any]], None]


def run_sweep(sweep: Sweep, store: SweepStore, executor: Executor, on_cell: Optional[OnCell] = None,
              fresh_baseline: bool = False) -> Progress:
    """Run what is left of sweep into store, holding its lock (SweepError at once if another
    run holds it). Cells come back one by one and are kept at once, so Ctrl-C or a lost driver
    keeps the finished ones; failed and damaged cells are tried again next time. fresh_baseline:
    every cell decodes its baselines instead of taking them from the baseline store."""
    with store.writing():
        done = store.done()
        todo = [cell for cell in sweep.runnable() if cell.id not in done]
        progress = Progress(len(todo))
        jobs = [CellJob.of(sweep, cell, fresh_baseline) for cell in todo]

        def keep(cell: Cell, outcome: dict[str, Any], where: str) -> None:
            record = store.put(cell, outcome, where)
            progress.finished += 1
            if record is None:
                progress.failed.append(cell.id)
            if on_cell is not None:
                on_cell(progress.finished, progress.total, cell, record, outcome)

        try:
            if executor.ray is None:
                run_local(jobs, keep, sweep.needs, executor.thread_budget)
            elif jobs:
                from crossrt.sweep.on_ray import connect, import_ray, run_on_ray  # Ray only when asked for

                # Cells attaching to a server run here, one after another: the server does their
                # work, and two of its cells at once would mix their counters.
                attached = [job for job in jobs if job.exclusive]
                others = [job for job in jobs if not job.exclusive]
                started = connect(executor.ray, executor.thread_budget) if others else False
                try:
                    if others:
                        run_on_ray(others, keep, sweep.needs, executor.strategy or sweep.strategy,
                                   sweep.max_retries if executor.max_retries is None else executor.max_retries,
                                   executor.kill_once)
                    run_in_order(attached, keep)
                finally:
                    if started:
                        import_ray().shutdown()
        finally:
            if store.done():
                store.index_path()
    return progress
