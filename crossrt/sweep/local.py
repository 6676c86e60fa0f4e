"""Running cells on this machine: one after another in this process, or a few at a time in
worker processes while the threads they need fit in a budget (ggml threads busy-wait, so more
threads than free cores slow every cell down)."""

from __future__ import annotations

import socket
import time
from multiprocessing.connection import wait
from typing import Any, Callable, Optional, Sequence

from crossrt.run.driver import LoadedModels
from crossrt.run.isolation import Isolated, RuntimeCrashed, prompt_hook, isolated
from crossrt.sweep.cell_run import CellJob, run_job
from crossrt.sweep.cell import Cell
from crossrt.sweep.plan import Resources

OnDone = Callable[[Cell, dict[str, Any], str], None]


def _crashed(crash: RuntimeCrashed, started: float) -> dict[str, Any]:
    """A crashed cell's outcome: a failure, in one line, like any other (its prompts are run again)."""
    return {"error": str(crash), "wall_s": time.perf_counter() - started, "host": socket.gethostname(), "pid": None}


def _run_group(jobs: Sequence[CellJob], emit) -> None:
    """In a child process: cells of one (runtime, pair) in order, their driven sessions kept
    loaded from one to the next; each cell's outcome sent back as it ends."""
    models = LoadedModels()
    try:
        for index, job in enumerate(jobs):
            emit((index, run_job(job, prompt_hook(job.cell.runtime), models)))
    finally:
        models.close()


def _in_order_here(jobs: Sequence[CellJob], on_done: OnDone) -> None:
    """Cells of one (runtime, pair) whose runtime runs its own program: here, sessions shared."""
    models = LoadedModels()
    try:
        for job in jobs:
            on_done(job.cell, run_job(job, models=models), "local")
    finally:
        models.close()


def run_in_order(jobs: Sequence[CellJob], on_done: OnDone) -> None:
    """Each cell in plan order: the reference a sweep elsewhere is checked against. Consecutive
    cells of one (runtime, pair) keep their driven sessions loaded (LoadedModels, as a Ray actor
    does): a k sweep then costs its runs, not a model load per cell; they are closed when the
    next cell needs other models, so one group's models are in memory at a time. A group of an
    in-process runtime runs in a process of its own (crossrt/run/isolation.py): a crash fails the
    cell it was in, in one line, and the group goes on in a fresh process."""
    groups: list[list[CellJob]] = []
    for job in jobs:
        if groups and (groups[-1][0].cell.runtime, groups[-1][0].pair) == (job.cell.runtime, job.pair):
            groups[-1].append(job)
        else:
            groups.append([job])
    for group in groups:
        if not isolated(group[0].cell.runtime):
            _in_order_here(group, on_done)
            continue
        while group:
            ended, started = 0, time.perf_counter()

            def done(payload, group=group) -> None:
                nonlocal ended, started
                index, outcome = payload
                on_done(group[index].cell, outcome, "local")
                ended, started = index + 1, time.perf_counter()
            try:
                Isolated(group[0].cell.runtime, _run_group, (group,), events=True).wait(done)
                group = []
            except RuntimeCrashed as crash:
                on_done(group[ended].cell, _crashed(crash, started), "local")
                group = group[ended + 1:]


def run_in_parallel(jobs: Sequence[CellJob], on_done: OnDone, needs: Callable[[Cell], Resources],
                    thread_budget: int) -> None:
    """Cells in processes of their own (each forked by its runtime's zygote, never from this
    process: runtimes hold threads that do not survive a fork), started in plan order while
    their threads fit in thread_budget.
    A cell needing more than the whole budget runs alone. A cell attaching to a server waits while
    another cell uses that server (its counters are read around each request: CellJob.exclusive).
    A cell whose process crashes fails in one line naming the signal (crossrt/run/isolation.py);
    the others go on."""
    waiting = list(jobs)
    running: dict[Isolated, tuple[CellJob, int, float]] = {}
    used = 0
    try:
        while waiting or running:
            while waiting:
                serving = {server for job, _, _ in running.values() for server in job.exclusive}
                job = next((job for job in waiting if serving.isdisjoint(job.exclusive)), None)
                if job is None:
                    break
                threads = needs(job.cell).threads
                if running and used + threads > thread_budget:
                    break
                waiting.remove(job)
                running[Isolated(job.cell.runtime, _run_one, (job,))] = (job, threads, time.perf_counter())
                used += threads
            ready = wait([cell.connection for cell in running])
            for cell in [cell for cell in running if cell.connection in ready]:
                if not cell.step():
                    continue
                job, threads, started = running.pop(cell)
                used -= threads
                try:
                    outcome = cell.outcome()
                except RuntimeCrashed as crash:
                    outcome = _crashed(crash, started)
                on_done(job.cell, outcome, "local-process")
    except KeyboardInterrupt:
        for cell in running:
            cell.interrupt()
        raise


def _run_one(job: CellJob) -> dict[str, Any]:
    """In a child process: one cell (the test hook, if set, may crash it: crossrt/run/isolation.py)."""
    return run_job(job, prompt_hook(job.cell.runtime))


def run_local(jobs: Sequence[CellJob], on_done: OnDone, needs: Callable[[Cell], Resources],
              thread_budget: Optional[int]) -> None:
    if thread_budget is None or thread_budget <= 1:
        run_in_order(jobs, on_done)
    else:
        run_in_parallel(jobs, on_done, needs, thread_budget)
