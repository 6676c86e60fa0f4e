"""Running one cell wherever it lands (this process, a local worker process, a Ray worker): the
same run as `crossrt run` with the cell's settings, written in a temporary folder on that machine,
and handed back as JSON-ready data, so the sweep's driver alone writes the store and no shared
file system is needed. Baselines come from that machine's baseline store (crossrt/run/baselines.py):
the first cell of a (runtime, numerics, prompt, budget) decodes each one, later cells read it,
and cells running at once on one machine wait on the key's lock rather than decode it twice."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from crossrt.errors import USER_ERRORS
from crossrt.speculative import loop
from crossrt.run.baselines import BaselineStore
from crossrt.inputs.chat_template import apply_template
from crossrt.inputs.pairs import resolve_pair
from crossrt.run.driver import LoadedModels, RunRequest, run_pair
from crossrt.inputs.prompts import Prompt, load_prompts
from crossrt.records.record_json import record_to_json
from crossrt.run.attach import reusing
from crossrt.run.rules import run_rules
from crossrt.run.runtime import RuntimeOptions, Server
from crossrt.records.schema import PromptResult
from crossrt.sweep.cell import Cell
from crossrt.sweep.plan import Sweep


@dataclass(frozen=True)
class CellJob:
    """What a worker needs to run a cell: the cell, and its pair and prompts as that worker
    resolves them (absolute paths where the sweep file named files next to it)."""

    cell: Cell
    pair: str
    prompts: str
    # Decode every baseline (and replace its store entry) rather than take it from the store.
    fresh_baseline: bool = False
    # A cell attaching to a server: its URLs as given (user info sent, never written), the
    # servers (URLs without credentials) no other cell may use while it runs, and both servers as
    # the plan attached them, so that the run does not ask them again (crossrt/run/attach.py).
    url: Optional[str] = None
    baseline_url: Optional[str] = None
    exclusive: tuple[str, ...] = ()
    attached: tuple[tuple[str, Server], ...] = ()

    @classmethod
    def of(cls, sweep: Sweep, cell: Cell, fresh_baseline: bool = False) -> "CellJob":
        attachment = sweep.attachments.get(cell.server) if cell.server is not None else None
        servers = (attachment.url, attachment.baseline_url, attachment.exclusive,
                   tuple(attachment.attached().items())) if attachment else ()
        return cls(cell, sweep.resolve(cell.pair), sweep.resolve(cell.prompts), fresh_baseline, *servers)


def run_job(job: CellJob, on_prompt: Optional[Callable[[Prompt, Optional[PromptResult]], None]] = None,
            models: Optional[LoadedModels] = None) -> dict[str, Any]:
    """{"record": the run record's JSON, "wall_s", "host", "pid"}, or {"error": one line, ...}
    for what crossrt explains (a runtime not usable there, a missing model). A bug raises.
    models: driven sessions kept from earlier cells of the same worker (a sweep actor)."""
    cell = job.cell
    start = time.perf_counter()
    where = {"host": socket.gethostname(), "pid": os.getpid()}
    try:
        pair = resolve_pair(job.pair)
        prompts, rendering, prompt_format = apply_template(load_prompts(job.prompts), pair, "auto", None, ())
        options = RuntimeOptions(n_ctx=cell.n_ctx, threads=cell.threads, n_gpu_layers=cell.n_gpu_layers,
                                 gpu_split=cell.gpu_split, f32_kv_cache=cell.f32_kv_cache, flash_attn=cell.flash_attn,
                                 url=job.url, baseline_url=job.baseline_url)
        # The plan warns of k at or above the budget (sweep/plan.py), which these warnings imply.
        rules, _ = run_rules(cell.runtime, cell.mode, cell.schedule or loop.SCHEDULE, cell.max_new_tokens, cell.k,
                             cell.draft_n_min, cell.draft_p_min, cell.spec_type)
        with tempfile.TemporaryDirectory(prefix=f"crossrt-cell-{cell.id}-") as work:
            request = RunRequest(pair=pair, runtime=cell.runtime, options=options, rules=rules,
                                 max_new_tokens=cell.max_new_tokens, out=Path(work) / "record.json", mode=cell.mode,
                                 schedule=cell.schedule or loop.SCHEDULE, chat=rendering, prompt_format=prompt_format,
                                 baselines=BaselineStore.default(refresh=job.fresh_baseline), strategy=cell.strategy)
            with reusing(dict(job.attached)):
                record = run_pair(request, prompts, on_prompt, models)
    except USER_ERRORS as error:
        return {"error": str(error), "wall_s": time.perf_counter() - start, **where}
    return {"record": record_to_json(record), "wall_s": time.perf_counter() - start, **where}
