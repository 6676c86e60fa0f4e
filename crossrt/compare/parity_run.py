"""Running a parity matrix: one record per (runtime, mode), then the runs compared, splits
explained and logits of every output re-scored on each record's runtime, for
crossrt.compare.parity and crossrt.compare.parity_report."""

from __future__ import annotations

import time
import dataclasses
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Optional, Sequence

from crossrt import progress
from crossrt.run.baselines import BaselineStore
from crossrt.inputs.chat_template import ChatRendering
from crossrt.run.driver import RunRequest
from crossrt.run.crashes import RuntimeCrashed
from crossrt.run.isolation import RESCORING, IsolatedRun, call_safely
from crossrt.inputs.pairs import Pair
from crossrt.compare.parity import PromptParity, compare_against, compare_all
from crossrt.compare.parity_report import LogitCheck, NotRun, logit_checks
from crossrt.compare.control import ControlCheck, float_controls, judged_by_control, shared_keys
from crossrt.compare.dequantization import dequantization_checks
from crossrt.compare.head_check import head_checks
from crossrt.compare.diagnosis import Explainer, twins_of
from crossrt.compare.replay import Replayer
from crossrt.compare.tolerance import tolerance_for
from crossrt.inputs.prompts import Prompt
from crossrt.compare.rescore import DecodedRows
from crossrt.compare.tau_gap import GapBuild, PairGap
from crossrt.compare.departures import departure_checks
from crossrt.compare.verification import PathCheck, judged_by_paths, scored_with_path_checks
from crossrt.speculative.loop import SCHEDULE
from crossrt.run.rules import run_rules
from crossrt.run.runtime import DraftRules, RuntimeOptions, RuntimeUnavailable, runtime_class
from crossrt.records.schema import PromptFormat, RunRecord


@dataclass(frozen=True)
class Matrix:
    pair: Pair
    runtimes: tuple[str, ...]
    modes: tuple[str, ...]
    options: RuntimeOptions
    k: int  # every cell's draft length; each cell's rules are its own (crossrt/run/rules.py)
    max_new_tokens: int
    out_dir: Path
    chat: Optional[ChatRendering] = None  # the chat template prompts were rendered with, for template parity
    prompt_format: Optional[PromptFormat] = None
    resume: bool = False  # continue each cell's record (the same settings only), else replace it

    def record_path(self, name: str, mode: str) -> Path:
        return self.out_dir / f"{self.pair.name}-{name}-{mode}-k{self.k}.json"


def cell_rules(matrix: Matrix, name: str, mode: str) -> tuple[DraftRules, tuple[str, ...]]:
    """A cell's drafting rules and warnings, built as every run's are (crossrt/run/rules.py), under
    the schedule its request runs (driven: crossrt's own)."""
    return run_rules(name, mode, SCHEDULE, matrix.max_new_tokens, matrix.k)


def _request(matrix: Matrix, name: str, mode: str, shared_ids: Optional[dict]) -> RunRequest:
    return RunRequest(pair=matrix.pair, runtime=name, options=matrix.options, rules=cell_rules(matrix, name, mode)[0],
                      max_new_tokens=matrix.max_new_tokens, out=matrix.record_path(name, mode), mode=mode,
                      resume=matrix.resume, overwrite=not matrix.resume,
                      shared_prompt_ids=shared_ids, chat=matrix.chat, prompt_format=matrix.prompt_format,
                      baselines=BaselineStore.default(),
                      # --jobs runs start at once: each checks memory and loads in turn
                      loading_lock=matrix.out_dir / ".loading.lock")


def _outcome(run: IsolatedRun, label: str) -> RunRecord | NotRun:
    """A cell's record, or why it has none: the runtime could not run here, or it crashed."""
    try:
        return run.outcome()
    except RuntimeUnavailable as error:
        return NotRun(label, str(error))
    except RuntimeCrashed as crash:
        return NotRun(label, crash.cause() + (f"; {crash.detail}" if crash.detail else ""), what="crashed")


def _run_cells(matrix: Matrix, cells: Sequence[tuple[str, str]], prompts: Sequence[Prompt],
               shared_ids: Optional[dict], jobs: int, announce: Callable[[str], None]) -> list[RunRecord | NotRun]:
    """The cells, up to jobs at once, each in a process of its own; outcomes in cells' order."""
    outcomes: list[Optional[RunRecord | NotRun]] = [None] * len(cells)
    waiting = list(enumerate(cells))
    running: dict[int, IsolatedRun] = {}
    bars = {}  # a bar per running cell, a step per prompt finished (the child's events)
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                index, (name, mode) = waiting.pop(0)
                announce(f"{name}/{mode}")
                bars[index] = progress.bar(f"{name}/{mode}", len(prompts))
                running[index] = IsolatedRun(_request(matrix, name, mode, shared_ids), prompts, events=True)
            ready = wait([run.connection for run in running.values()])
            for index, run in list(running.items()):
                if run.connection in ready and run.step(lambda _, shown=bars[index]: shown.update(1)):
                    bars.pop(index).close()
                    outcomes[index] = _outcome(running.pop(index), "/".join(cells[index]))
    except KeyboardInterrupt:
        for run in running.values():
            run.interrupt()
        raise
    finally:
        for shown in bars.values():
            shown.close()
    return outcomes


def run_matrix(matrix: Matrix, prompts: Sequence[Prompt], on_run: Optional[Callable[[str], None]] = None,
               jobs: int = 1, on_warning: Optional[Callable[[str], None]] = None,
               ) -> tuple[list[RunRecord], list[NotRun], list[str]]:
    """Records of every (runtime, mode) the runtime has; the combinations that could not run or
    crashed (failures), and those skipped because the runtime lacks the mode (not failures).
    Each cell's rules' warnings go to on_warning before any cell runs.

    Every cell runs in a process of its own (an IsolatedRun, whatever its runtime: --jobs keeps
    several going at once; crossrt/run/isolation.py), so a runtime that crashes is its cell's
    failure and every other cell still runs. The first run's tokenization feeds every later run, so cells run one
    by one until one has run; then jobs at once, results kept in matrix order."""
    cells, skipped = [], []
    warn = on_warning or (lambda line: None)
    for name in matrix.runtimes:
        for mode in matrix.modes:
            if mode in runtime_class(name).modes:
                cells.append((name, mode))
                for warning in cell_rules(matrix, name, mode)[1]:
                    warn(f"{name}/{mode}: {warning}")
            else:
                skipped.append(f"{name}/{mode}: {name} has no {mode} mode")
    announce = on_run or (lambda label: None)
    outcomes: list[RunRecord | NotRun] = []
    shared_ids = None
    while cells and shared_ids is None:
        outcomes += _run_cells(matrix, [cells.pop(0)], prompts, None, 1, announce)
        if isinstance(outcomes[-1], RunRecord):
            shared_ids = {r.prompt_id: r.prompt_ids for r in outcomes[-1].results if r.prompt_ids}
    outcomes += _run_cells(matrix, cells, prompts, shared_ids, jobs, announce)
    records = [o for o in outcomes if isinstance(o, RunRecord)]
    return records, [o for o in outcomes if isinstance(o, NotRun)], skipped


@dataclass(frozen=True)
class Verdicts:
    comparisons: tuple[PromptParity, ...]
    logit_checks: tuple[LogitCheck, ...]
    # The float control and quantization checks (crossrt/compare/control.py), then the
    # verification-path checks (crossrt/compare/verification.py).
    controls: tuple[ControlCheck | PathCheck, ...]
    passes: int  # passes re-scored to explain splits
    explain_s: float
    verdict_s: float = 0.0  # the whole comparison: explaining, re-scoring, every check

    def cost(self, runs: Sequence[tuple[str, RunRecord]]) -> str:
        """The verdict's cost against the runs' own generation (their prompts' recorded timings)."""
        generated = sum(t.prefill_s + t.decode_s + t.baseline_prefill_s + t.baseline_decode_s
                        for _, record in runs for result in record.results if (t := result.timings) is not None)
        ratio = f", {self.verdict_s / generated:.2f}x the runs' own generation ({generated:.1f} s)" if generated else ""
        return f"verdict: {self.verdict_s:.1f} s of explaining, re-scoring and checks{ratio}"


@dataclass(frozen=True)
class Checks:
    """What a verdict does beyond comparing ids and counters (parity's options)."""

    counter_tolerance: float = 0.0  # allowed relative difference of counters between like runs
    logit_tolerance: Optional[float] = None  # None: chosen by what is compared (crossrt/compare/tolerance.py)
    strict: bool = False  # every divergence fails, also those explained as numerics
    rescore: bool = True  # splits explained by re-scoring passes in their runs' shapes
    logits: bool = True  # outputs re-scored: logit checks, verification paths, departures
    control: bool = True  # with logits: the float control and the dequantization check
    jobs: int = 1  # parity's --jobs: with 2 or more, the drafters' checks and the tau gaps' oracle run beside


def compare_runs(runs: Sequence[tuple[str, RunRecord]], saved: Sequence[RunRecord], checks: Checks) -> Verdicts:
    """Every comparison of the runs (and of them against saved records), splits explained by
    re-scoring passes where checks.rescore, logits along the reference sequences re-scored where
    checks.logits, and the float control (crossrt/compare/control.py) where logits and control.
    Where logits, each run's verification path is checked first (crossrt/compare/verification.py),
    and its measured batch-shape noise sets how near a tie its splits may be."""
    counter_tolerance, logit_tolerance, strict = checks.counter_tolerance, checks.logit_tolerance, checks.strict
    rescore, logits, control = checks.rescore, checks.logits, checks.control
    began = time.perf_counter()
    scored = [run for run in runs if not run[1].imported]  # imported: no outputs to re-score
    as_run, paths, noises = {}, (), {}
    # The float control's scorings that are a run's own: the path check's decodes serve both.
    decodes = DecodedRows(shared_keys(scored) if logits and control else ())
    if logits:
        as_run, paths, noises = scored_with_path_checks(scored, decodes=decodes, beside=checks.jobs > 1)
    with Replayer() as replay:
        started = time.perf_counter()
        comparisons = compare_all(runs, counter_tolerance, logit_tolerance, strict, replay=replay if rescore else None,
                                  batch_noise=noises)
        if saved:
            comparisons += compare_against(runs, saved, counter_tolerance, replay if rescore else None)
        passes, explain_s = replay.passes, time.perf_counter() - started
    by_label = dict(runs)
    logit_rows, controls = (), ()
    if logits:
        views = Explainer(twins_of(scored))
        paths += departure_checks(scored, noises, as_run, lambda record, result: views.views(record, result)[1])
        logit_rows = logit_checks(comparisons, as_run,
                                  lambda a, b: tolerance_for(by_label[a], by_label[b], logit_tolerance))
        if control:
            controls = float_controls(scored, as_run, decodes=decodes) + dequantization_checks(scored)
            comparisons = judged_by_control(comparisons, controls)
        comparisons = judged_by_paths(comparisons, paths)
    # Runs that drafted with a head: the same head, setting by setting, whatever file each read.
    heads = head_checks(scored)
    return Verdicts(tuple(comparisons), tuple(logit_rows), tuple(controls) + tuple(paths) + heads, passes, explain_s,
                    time.perf_counter() - began)


def compare_safely(runs: Sequence[tuple[str, RunRecord]], saved: Sequence[RunRecord],
                   checks: Checks = Checks()) -> tuple[Verdicts, list[NotRun]]:
    """compare_runs where it may load a runtime to re-score, as crossrt/run/isolation.py's call_safely
    places RESCORING (a process of its own). If that process crashes, the crash is a failure (NotRun,
    crashed) and the runs are compared here from what they recorded, nothing re-scored."""
    if not (checks.rescore or checks.logits) or all(record.imported for _, record in runs):  # nothing to load
        return compare_runs(runs, saved, checks), []
    try:
        return call_safely(RESCORING, compare_runs, list(runs), list(saved), checks), []
    except RuntimeCrashed as crash:
        verdicts = compare_runs(runs, saved, dataclasses.replace(checks, rescore=False, logits=False))
        return verdicts, [NotRun(RESCORING, f"{crash.cause()}; the runs were compared from what they recorded, "
                                            "nothing re-scored", what="crashed")]


def verdicts_and_gaps(runs: Sequence[tuple[str, RunRecord]], saved: Sequence[RunRecord], checks: Checks,
                      gap_threads: Optional[int]) -> tuple[Verdicts, list[NotRun], list[PairGap]]:
    """compare_safely, and the tau gaps (crossrt/compare/tau_gap.py's GapBuild) on gap_threads
    unless it is None (`--no-tau-gap`). With checks.jobs > 1 the gaps' oracles build in their
    process while the verdict is computed in its own (both load the pair: --jobs says that many
    fit at once); else one after the other."""
    build = GapBuild(runs, gap_threads, beside=checks.jobs > 1) if gap_threads is not None else None
    try:
        verdicts, crashed = compare_safely(runs, saved, checks)
        return verdicts, crashed, build.gaps() if build is not None else []
    finally:
        if build is not None:
            build.close()
