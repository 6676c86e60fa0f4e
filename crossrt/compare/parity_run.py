"""Running a parity matrix: one record per (runtime, mode), then logits of every output
re-scored on each record's runtime, for crossrt.compare.parity and crossrt.compare.parity_report."""

from __future__ import annotations

import contextlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from crossrt.run.baselines import BaselineStore
from crossrt.inputs.chat_template import ChatRendering
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.pairs import Pair
from crossrt.compare.parity_report import NotRun
from crossrt.inputs.prompts import Prompt
from crossrt.compare.rescore import open_scorer, score, scoring_runtime
from crossrt.run.runtime import DraftRules, RuntimeOptions, RuntimeUnavailable, runtime_class
from crossrt.records.schema import PromptFormat, RunRecord


@dataclass(frozen=True)
class Matrix:
    pair: Pair
    runtimes: tuple[str, ...]
    modes: tuple[str, ...]
    options: RuntimeOptions
    rules: DraftRules
    max_new_tokens: int
    out_dir: Path
    chat: Optional[ChatRendering] = None  # the chat template prompts were rendered with, for template parity
    prompt_format: Optional[PromptFormat] = None


def _run_cell(matrix: Matrix, name: str, mode: str, prompts: Sequence[Prompt],
              shared_ids: Optional[dict]) -> RunRecord | NotRun:
    """One (runtime, mode) of the matrix: its record, or why the runtime could not run."""
    out = matrix.out_dir / f"{matrix.pair.name}-{name}-{mode}-k{matrix.rules.k}.json"
    request = RunRequest(matrix.pair, name, matrix.options, matrix.rules, matrix.max_new_tokens,
                         out, mode=mode, overwrite=True, shared_prompt_ids=shared_ids,
                         chat=matrix.chat, prompt_format=matrix.prompt_format, baselines=BaselineStore.default())
    try:
        return run_pair(request, prompts)
    except RuntimeUnavailable as error:
        return NotRun(f"{name}/{mode}", str(error))


def run_matrix(matrix: Matrix, prompts: Sequence[Prompt], on_run: Optional[Callable[[str], None]] = None,
               jobs: int = 1) -> tuple[list[RunRecord], list[NotRun], list[str]]:
    """Records of every (runtime, mode) the runtime has; the combinations that could not run
    (failures), and those skipped because the runtime lacks the mode (not failures).

    The first run's tokenization feeds every later run, so cells run one by one until one has
    run; with jobs > 1 the others then run that many at once, each in a process of its own
    (spawned: a runtime's libraries and threads are not forked), results kept in matrix order."""
    cells, skipped = [], []
    for name in matrix.runtimes:
        for mode in matrix.modes:
            if mode in runtime_class(name).modes:
                cells.append((name, mode))
            else:
                skipped.append(f"{name}/{mode}: {name} has no {mode} mode")
    announce = on_run or (lambda label: None)
    outcomes: list[RunRecord | NotRun] = []
    shared_ids = None
    while cells and shared_ids is None:
        name, mode = cells.pop(0)
        announce(f"{name}/{mode}")
        outcomes.append(_run_cell(matrix, name, mode, prompts, None))
        if isinstance(outcomes[-1], RunRecord):
            shared_ids = {r.prompt_id: r.prompt_ids for r in outcomes[-1].results if r.prompt_ids}
    if jobs > 1 and len(cells) > 1:
        with ProcessPoolExecutor(min(jobs, len(cells)), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = []
            for name, mode in cells:
                announce(f"{name}/{mode}")
                futures.append(pool.submit(_run_cell, matrix, name, mode, prompts, shared_ids))
            outcomes += [future.result() for future in futures]
    else:
        for name, mode in cells:
            announce(f"{name}/{mode}")
            outcomes.append(_run_cell(matrix, name, mode, prompts, shared_ids))
    records = [o for o in outcomes if isinstance(o, RunRecord)]
    return records, [o for o in outcomes if isinstance(o, NotRun)], skipped


def score_records(runs: Sequence[tuple[str, RunRecord]]) -> dict[tuple[str, str], np.ndarray]:
    """(run label, prompt id) -> the logits rows that predicted each output token, re-scored
    on the record's runtime (or its in-process sibling). One model load per runtime and file."""
    scorers = {}
    scored = {}
    with contextlib.ExitStack() as stack:
        for label, record in runs:
            key = (scoring_runtime(record.runtime.name), record.pair.target.path, record.runtime.kv_cache,
                   record.runtime.flash_attn)
            if key not in scorers:
                scorers[key] = stack.enter_context(open_scorer(record))
            for result in record.results:
                if result.ok and result.output_ids:
                    scored[(label, result.prompt_id)] = score(scorers[key], result.prompt_ids, result.output_ids)
    return scored

