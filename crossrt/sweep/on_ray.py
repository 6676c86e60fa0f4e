"""Running cells on a Ray cluster (an existing one, or one started here).

strategy "task": one Ray task per cell, asking for the runtime's num_cpus and num_gpus; a
task whose worker dies is run again (max_retries); a GPU task gets a fresh worker (max_calls=1),
so its GPU memory goes with that worker. strategy "actor": one actor per (runtime, pair) that
runs all of that pair's cells on the runtime one after another in one process (its imports and
warm-up paid once), restarted with its cell run again if it dies (max_restarts,
max_task_retries), and killed once its last cell is back, freeing its resources for the next.

Workers hand records back as JSON-ready data; the driver (this process) writes the store, so
the cluster needs crossrt and the model files on each host, not a shared file system.
"""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from crossrt.run.driver import LoadedModels
from crossrt.sweep.cell_run import CellJob, run_job
from crossrt.sweep.local import OnDone
from crossrt.sweep.cell import Cell, SweepError
from crossrt.sweep.plan import Resources


def import_ray():
    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs Ray: pip install 'crossrt[ray]'") from None
    return ray


def connect(address: str, num_cpus: Optional[int] = None) -> bool:
    """Join the cluster at address ("auto": the one `ray start` made here; "local": start one
    in this process, with num_cpus CPUs). True when this call started or joined it (and so
    should shut it down), False when this process was joined already."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    # Workers' output (llama.cpp's logs) stays in the cluster's log files, not on this terminal.
    if address == "local":
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    else:
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as error:
            raise SweepError(f"no Ray cluster at {address!r}: {str(error).splitlines()[0]} (start one with "
                             "`ray start --head`, or use --ray local)") from None
    return True


def _killer(marker: Path) -> Callable[[Any, Any], None]:
    def on_prompt(prompt, result) -> None:
        if not marker.exists():
            marker.write_text(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
    return on_prompt


def _run_on_worker(job: CellJob, kill_once: Optional[str] = None, models: Optional[LoadedModels] = None) -> dict[str, Any]:
    """run_job on a Ray worker. kill_once is a test hook, not a sweep setting: the path of a
    marker file; when it does not exist yet, the worker creates it and kills itself with
    SIGKILL after the cell's first prompt, as a lost worker mid-cell."""
    return run_job(job, None if kill_once is None else _killer(Path(kill_once)), models)


class CellRunner:
    """The actor: cells of one (runtime, pair), one at a time, in one worker process. Driven
    cells load the pair's models once, for all the actor's cells with the same options."""

    def __init__(self):
        self.models = LoadedModels()

    def run(self, job: CellJob, kill_once: Optional[str] = None) -> dict[str, Any]:
        return _run_on_worker(job, kill_once, self.models)


def _lost(error: Exception, retries: int) -> dict[str, Any]:
    """A cell whose work did not come back, as a failure the next run retries."""
    ray = import_ray()
    if isinstance(error, ray.exceptions.RayTaskError):  # a bug in crossrt on the worker: keep its last line
        lines = [line for line in str(error).splitlines() if line.strip()]
        return {"error": f"the worker raised: {lines[-1] if lines else type(error).__name__}"}
    first = (str(error).splitlines() or [type(error).__name__])[0]
    return {"error": f"the worker was lost ({retries} retries spent): {first}"}


def run_on_ray(jobs: Sequence[CellJob], on_done: OnDone, needs: Callable[[Cell], Resources], strategy: str,
               max_retries: int, kill_once: Optional[Path] = None) -> None:
    """Every job on the cluster this process is connected to (connect() first)."""
    ray = import_ray()
    marker = str(kill_once) if kill_once is not None else None
    pending: dict[Any, CellJob] = {}
    actor_of: dict[Any, int] = {}  # strategy "actor": each pending ref -> its actor's number
    actors: list[Any] = []
    left: list[int] = []  # cells each actor has still to send back
    if strategy == "task":
        cpu_task = ray.remote(_run_on_worker)
        gpu_task = ray.remote(num_gpus=1, max_calls=1)(_run_on_worker)  # max_calls: not settable per call
        for job in jobs:
            want = needs(job.cell)
            task = gpu_task if want.num_gpus else cpu_task
            ref = task.options(num_cpus=want.cpus, num_gpus=want.num_gpus, max_retries=max_retries).remote(job, marker)
            pending[ref] = job
    else:
        groups: dict[tuple[str, str], list[CellJob]] = defaultdict(list)
        for job in jobs:
            groups[(job.cell.runtime, job.pair)].append(job)
        runner = ray.remote(CellRunner)
        for group in groups.values():
            actor = runner.options(num_cpus=max(needs(j.cell).cpus for j in group),
                                   num_gpus=max(needs(j.cell).num_gpus for j in group),
                                   max_restarts=max_retries, max_task_retries=max_retries).remote()
            for job in group:
                ref = actor.run.remote(job, marker)
                pending[ref] = job
                actor_of[ref] = len(actors)
            actors.append(actor)
            left.append(len(group))
    executor = f"ray-{strategy}"
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                job = pending.pop(ref)
                try:
                    outcome = ray.get(ref)
                except ray.exceptions.RayError as error:
                    outcome = _lost(error, max_retries)
                number = actor_of.pop(ref, None)
                if number is not None:
                    left[number] -= 1
                    if not left[number]:  # its last cell: free its resources for the actors waiting
                        ray.kill(actors[number])
                on_done(job.cell, outcome, executor)
    except KeyboardInterrupt:
        for ref in pending:
            if ref not in actor_of:  # actor calls cannot be force-cancelled: their actors are killed
                ray.cancel(ref, force=True)
        for number, actor in enumerate(actors):
            if left[number]:
                ray.kill(actor)
        raise
