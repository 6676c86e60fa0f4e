"""Running a parity matrix: one record per (runtime, mode), then logits of every output
re-scored on each record's runtime, for crossrt.parity and crossrt.parity_report."""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from crossrt.chat_template import ChatRendering
from crossrt.driver import RunRequest, run_pair
from crossrt.pairs import Pair
from crossrt.parity_report import NotRun
from crossrt.prompts import Prompt
from crossrt.rescore import open_scorer, score, scoring_runtime
from crossrt.runtime import DraftRules, RuntimeOptions, RuntimeUnavailable, runtime_class
from crossrt.schema import PromptFormat, RunRecord


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


def run_matrix(matrix: Matrix, prompts: Sequence[Prompt],
               on_run: Optional[Callable[[str], None]] = None) -> tuple[list[RunRecord], list[NotRun], list[str]]:
    """Records of every (runtime, mode) the runtime has; the combinations that could not run
    (failures), and those skipped because the runtime lacks the mode (not failures)."""
    records, not_run, skipped = [], [], []
    shared_ids = None  # the first run's tokenization feeds every later run
    for name in matrix.runtimes:
        for mode in matrix.modes:
            label = f"{name}/{mode}"
            try:
                if mode not in runtime_class(name).modes:
                    skipped.append(f"{label}: {name} has no {mode} mode")
                    continue
                if on_run is not None:
                    on_run(label)
                out = matrix.out_dir / f"{matrix.pair.name}-{name}-{mode}-k{matrix.rules.k}.json"
                request = RunRequest(matrix.pair, name, matrix.options, matrix.rules, matrix.max_new_tokens,
                                     out, mode=mode, overwrite=True, shared_prompt_ids=shared_ids,
                                     chat=matrix.chat, prompt_format=matrix.prompt_format)
                records.append(run_pair(request, prompts))
                if shared_ids is None:
                    shared_ids = {r.prompt_id: r.prompt_ids for r in records[0].results if r.prompt_ids}
            except RuntimeUnavailable as error:
                not_run.append(NotRun(label, str(error)))
    return records, not_run, skipped


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

