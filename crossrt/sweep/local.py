"""Running cells on this machine: one after another in this process, or a few at a time in
worker processes while the threads they need fit in a budget (ggml threads busy-wait, so more
threads than free cores slow every cell down)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional, Sequence

from crossrt.run.driver import LoadedModels
from crossrt.sweep.cell_run import CellJob, run_job
from crossrt.sweep.cell import Cell, SweepError
from crossrt.sweep.plan import Resources

OnDone = Callable[[Cell, dict[str, Any], str], None]


def run_in_order(jobs: Sequence[CellJob], on_done: OnDone) -> None:
    """Each cell in this process, in plan order: the reference a sweep elsewhere is checked against.
    Consecutive cells of one (runtime, pair) keep their driven sessions loaded (LoadedModels, as a
    Ray actor does): a k sweep then costs its runs, not a model load per cell; they are closed
    when the next cell needs other models, so one group's models are in memory at a time."""
    models = LoadedModels()
    group = None
    try:
        for job in jobs:
            if (job.cell.runtime, job.pair) != group:
                models.close()
                group = (job.cell.runtime, job.pair)
            on_done(job.cell, run_job(job, models=models), "local")
    finally:
        models.close()


def run_in_parallel(jobs: Sequence[CellJob], on_done: OnDone, needs: Callable[[Cell], Resources],
                    thread_budget: int) -> None:
    """Cells in worker processes (a fresh interpreter each: spawn, as runtimes hold threads
    that do not survive a fork), started in plan order while their threads fit in thread_budget.
    A cell needing more than the whole budget runs alone."""
    waiting = list(jobs)
    running: dict[Future, tuple[CellJob, int]] = {}
    used = 0
    with ProcessPoolExecutor(max_workers=thread_budget, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            while waiting or running:
                while waiting:
                    threads = needs(waiting[0].cell).threads
                    if running and used + threads > thread_budget:
                        break
                    job = waiting.pop(0)
                    running[pool.submit(run_job, job)] = (job, threads)
                    used += threads
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    job, threads = running.pop(future)
                    used -= threads
                    on_done(job.cell, future.result(), "local-process")
        except BrokenProcessPool:
            raise SweepError("a local worker process died (killed, or out of memory); the finished cells are "
                             "kept: run the sweep again to continue") from None
        except KeyboardInterrupt:
            for future in running:
                future.cancel()
            raise


def run_local(jobs: Sequence[CellJob], on_done: OnDone, needs: Callable[[Cell], Resources],
              thread_budget: Optional[int]) -> None:
    if thread_budget is None or thread_budget <= 1:
        run_in_order(jobs, on_done)
    else:
        run_in_parallel(jobs, on_done, needs, thread_budget)
