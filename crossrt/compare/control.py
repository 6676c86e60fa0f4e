"""Parity's float control: runtimes compared where they compute the same function, against a
noise floor measured on these prompts, with the power of the check stated.

A quantized GGUF on llama.cpp and its dequantized weights on transformers differ by whole
logits, and any bound that wide passes a wrong model. So every run's target is also scored in
F32 throughout (a quantized GGUF through its float twin), distinct files' weights are compared
first, each pair of float scorings is held to FACTOR times the noise one-token decodes make,
and each check states the smallest logit perturbation it flags.
Why, the bounds and measured numbers: docs/parity.md, "The float control".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from crossrt import progress
from crossrt.compare.power import Power, find_power
from crossrt.compare.rescore import (DecodedRows, LogitAgreement, RowStatistics, ScoredRows, logits_of, row_statistics,
                                     score, score_stepwise, scorer_key)
from crossrt.compare.tolerance import QUANTIZED_ONE_RUNTIME, Tolerance
from crossrt.compare.weights import WeightsMatch, compare_weights
from crossrt.records.schema import RunRecord
from crossrt.run.runtime import ModelSession, RuntimeOptions, RuntimeUnavailable, open_runtime, runtime_class

FACTOR = 10.0  # how many times the noise control's logit differences a float comparison may reach
CONTROL_ROWS = 24  # output rows per prompt decoded one token at a time for the noise control
FLOAT32_EPS = float(np.finfo(np.float32).eps)
FLOAT_CONTROL, QUANTIZATION, WEIGHTS = "float control", "quantization", "weights"


@dataclass(frozen=True)
class FloatScoring:
    """One function scored in F32: a runtime and the model file it loads for that."""

    runtime: str
    source: str  # the run's own model file
    digest: str  # its sha256, as the record names it
    twin: bool  # a quantized GGUF on a runtime that runs GGUFs: scored through its float twin

    @property
    def model(self) -> str:
        """The file loaded: the float twin (written on first use) or the source."""
        from crossrt.builders.float_twin import float_twin

        return str(float_twin(Path(self.source))) if self.twin else self.source

    def label(self, among: Sequence["FloatScoring"] = ()) -> str:
        """`transformers on target-hf`; with its folder where another of among has its file's name."""
        path = Path(self.source)
        shared = sum(Path(other.source).name == path.name for other in among) > 1
        return f"{self.runtime} on {path.parent.name + '/' if shared else ''}{path.name}" \
               f"{' (float twin)' if self.twin else ''}"


def float_scoring(record: RunRecord) -> FloatScoring:
    """How a record's target is scored in F32 (module docstring)."""
    from crossrt.builders.float_twin import is_float
    from crossrt.compare.rescore import scoring_runtime

    runtime = scoring_runtime(record.runtime)
    source = record.pair.target.path
    formats = runtime_class(runtime).model_format
    runs_gguf = (formats if isinstance(formats, str) else formats[0]) == "gguf"  # not one it dequantizes on load
    twin = source.endswith(".gguf") and runs_gguf and not is_float(Path(source))
    return FloatScoring(runtime, source, record.pair.target.sha256, twin)


def _float_options(n_ctx: int, threads: int = 1) -> RuntimeOptions:
    return RuntimeOptions(n_ctx=n_ctx, threads=threads, f32_kv_cache=True, flash_attn=False, dtype="float32")


def open_float(scoring: FloatScoring, n_ctx: int, threads: int = 1) -> ModelSession:
    return open_runtime(scoring.runtime, _float_options(n_ctx, threads)).load(Path(scoring.model))


def float_key(scoring: FloatScoring) -> Optional[tuple]:
    """The scoring's scorer key (rescore.scorer_key) with the numerics its runtime reports in F32,
    None for a float twin (no run loads it): a run whose key is this one was scored as the float
    control scores, and its rows serve (shared_keys)."""
    if scoring.twin:
        return None
    try:
        info = open_runtime(scoring.runtime, _float_options(1)).info()
    except RuntimeUnavailable:  # its float control fails as it opens, saying why
        return None
    return (scoring.runtime, scoring.source, info.kv_cache, info.flash_attn, info.dtype)


def shared_keys(runs: Sequence[tuple[str, RunRecord]]) -> frozenset:
    """The scorer keys both of a run as run and of the float control (transformers in float32; a
    float GGUF run with an F32 cache and no flash attention): their decodes are kept for it."""
    ran = {scorer_key(record) for _, record in runs if not record.imported}
    return frozenset(key for key in {float_key(float_scoring(record)) for _, record in runs if not record.imported}
                     if key in ran)


@dataclass(frozen=True)
class ControlCheck:
    """One comparison of the float control (or of a quantized model with its float twin): the
    two scorings, the runs they stand for, what was measured, the bounds and the power."""

    kind: str  # FLOAT_CONTROL or QUANTIZATION
    scorings: tuple[str, str]
    runs: tuple[tuple[str, ...], tuple[str, ...]]  # run labels scored by each side
    prompts: int
    measured: LogitAgreement
    bounds: Tolerance
    noise: Optional[LogitAgreement]  # the noise control the bounds come from (None: constant ceilings)
    power: Optional[Power]
    weights: Optional[WeightsMatch] = None  # the two scorings' weights compared, where their files differ

    @property
    def problems(self) -> list[str]:
        if self.kind == WEIGHTS:
            return [f"not the same model: {self.weights.describe()}"] if self.weights.wrong else []
        return self.bounds.problems(self.measured)

    @property
    def ok(self) -> bool:
        return not self.problems

    def failure(self) -> str:
        """What diverged, for the FAIL line."""
        if self.kind == WEIGHTS:
            return "; ".join(self.problems)
        beyond = "the noise control" if self.noise is not None else "the ceiling"
        return f"logits beyond {beyond}: {'; '.join(self.problems)} (bounds {self.bounds.describe()})"

    def describe(self) -> str:
        if self.kind == WEIGHTS:
            what = "" if self.weights.wrong else (": the float control cannot make them one function; their "
                                                   "logits are checked at the as-run tolerance only (weaker)")
            return f"weights: {self.scorings[0]} vs {self.scorings[1]}: {self.weights.describe()}{what}"
        measured = (f"max abs diff {self.measured.max_abs_diff:.3g}, mean KL {self.measured.kl_mean:.3g}, "
                    f"p99 KL {self.measured.kl_p99:.3g}, same top-1 {self.measured.top1_agreement:.3f}")
        power = f"; {self.power.describe()}" if self.power else ""
        return (f"{self.kind}: {self.scorings[0]} vs {self.scorings[1]}, {self.prompts} prompts, "
                f"{self.measured.positions} rows: {measured}; bounds {self.bounds.describe()}{power}")


def noise_bounds(noise: LogitAgreement, logit_scale: float) -> Tolerance:
    """The float control's bounds: FACTOR times the noise control's differences (FACTOR squared
    for KL), each at least float32's rounding of logits of this scale."""
    floor = FLOAT32_EPS * max(logit_scale, 1.0)
    max_abs = FACTOR * max(noise.max_abs_diff, floor)
    return Tolerance(f"{FACTOR:g}x the noise control (one-token decodes against one pass: max abs diff "
                     f"{noise.max_abs_diff:.3g}, mean KL {noise.kl_mean:.3g}, p99 KL {noise.kl_p99:.3g}); "
                     f"{FACTOR ** 2:g}x for KL", max_abs_diff=max_abs,
                     kl_mean=FACTOR ** 2 * max(noise.kl_mean, floor ** 2),
                     kl_p99=FACTOR ** 2 * max(noise.kl_p99, floor ** 2), top1=1.0, near_tie_flip=2 * max_abs)


def pooled(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> LogitAgreement:
    """One agreement over the rows of every prompt (each pair: both sides' rows of one prompt)."""
    # Prompt by prompt: concatenating every prompt's rows first held several copies of them all
    # (a parity of ten Gemma runs, 10 prompts x 64 tokens, peaked at 14.6 GB).
    return RowStatistics.joined([row_statistics(a, b) for a, b in pairs if len(a) and len(b)]).summary()


def reference_sequences(runs: Sequence[tuple[str, RunRecord]]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """prompt id -> (prompt ids, output ids) of the first run that finished it with an output:
    the one token sequence every runtime scores for that prompt."""
    found = {}
    for _, record in runs:
        if record.imported:
            continue
        for result in record.results:
            if result.ok and result.output_ids and result.prompt_id not in found:
                found[result.prompt_id] = (tuple(result.prompt_ids), tuple(result.output_ids))
    return found


def _reused(runs, as_run: dict, decodes: DecodedRows, scoring: FloatScoring, references: dict) -> Optional[dict]:
    """prompt id -> (one pass, one-token decodes) of a scoring whose rows a run's own scoring and the
    verification-path check already computed (shared_keys), or None where any is missing."""
    key = float_key(scoring)
    label = next((label for label, record in runs if not record.imported and scorer_key(record) == key), None)
    found = {}
    for prompt_id in references:
        full = as_run.get((label, prompt_id))
        step = decodes.get(key, prompt_id, min(CONTROL_ROWS, len(full))) if full is not None else None
        if step is None:
            return None
        found[prompt_id] = (ScoredRows(full), step)
    return found


def float_controls(runs: Sequence[tuple[str, RunRecord]], as_run: dict[tuple[str, str], np.ndarray],
                   threads: int = 1, decodes: Optional[DecodedRows] = None) -> tuple[ControlCheck, ...]:
    """The float control over runs (module docstring): each pair of distinct float scorings, and
    each quantized scoring against its float twin. as_run: the rows each run's own scoring gave
    along the reference sequences, by (run label, prompt id); decodes: the one-token decodes the
    verification-path check kept, which serve a scoring that is a run's own (shared_keys)."""
    references = reference_sequences(runs)
    groups: dict[FloatScoring, list[tuple[str, RunRecord]]] = {}
    for label, record in runs:
        if not record.imported:
            groups.setdefault(float_scoring(record), []).append((label, record))
    if not references or not groups:
        return ()
    n_ctx = max(r.params.n_ctx for _, r in runs if not r.imported)
    checks, controlled = [], []
    scorings = list(groups)
    for i, first in enumerate(scorings):
        for second in scorings[i + 1:]:
            match = compare_weights(Path(first.source), Path(second.source)) if first.digest != second.digest else None
            if match is not None and not match.same:
                checks.append(ControlCheck(WEIGHTS, (first.label(scorings), second.label(scorings)),
                                           _runs_of(groups, first, second),
                                           len(references), LogitAgreement(0, 0.0, 0.0, 1.0, 1.0),
                                           QUANTIZED_ONE_RUNTIME, None, None, match))
            # Another precision is not one function to control; another model fails on its
            # weights alone. One copy edited is both: its logits are shown too.
            if match is None or match.same or match.partly:
                controlled.append((first, second))
    scored = {s for pair in controlled for s in pair} or (set(scorings) if len(scorings) == 1 else set())
    rows, noise = {}, {}
    for scoring in scorings:  # one model loaded at a time, only those a check reads
        if scoring not in scored:
            continue
        reused = _reused(runs, as_run, decodes, scoring, references) if decodes else None
        if reused is not None:
            for prompt_id, (full, step) in reused.items():
                rows[scoring, prompt_id], noise[scoring, prompt_id] = full, (full.prefix(len(step)), step)
            continue
        with open_float(scoring, n_ctx, threads) as session:
            for prompt_id, (prompt_ids, output_ids) in progress.each(references.items(), "float control",
                                                                     total=len(references)):
                full = ScoredRows(score(session, prompt_ids, output_ids))  # log-probabilities computed once
                rows[scoring, prompt_id] = full
                step = score_stepwise(session, prompt_ids, output_ids, min(CONTROL_ROWS, len(full)))
                noise[scoring, prompt_id] = (full.prefix(len(step)), step)
    for first, second in controlled:
        pairs = [(rows[first, p], rows[second, p]) for p in references]
        control = _worst(pooled([noise[first, p] for p in references]),
                         pooled([noise[second, p] for p in references]))
        bounds = noise_bounds(control, max(float(np.abs(logits_of(a)).max()) for a, _ in pairs))
        checks.append(ControlCheck(FLOAT_CONTROL, (first.label(scorings), second.label(scorings)),
                                   _runs_of(groups, first, second),
                                   len(references), pooled(pairs), bounds, control, find_power(pairs, bounds)))
    for scoring in scorings:
        if not scoring.twin or scoring not in scored:
            continue
        members = groups[scoring]
        label = members[0][0]
        pairs = [(rows[scoring, p], as_run[label, p]) for p in references if (label, p) in as_run]
        checks.append(ControlCheck(QUANTIZATION, (scoring.label(scorings), f"{label} as run"),
                                   ((), tuple(l for l, _ in members)), len(pairs), pooled(pairs),
                                   QUANTIZED_ONE_RUNTIME, None, find_power(pairs, QUANTIZED_ONE_RUNTIME)))
    return tuple(checks)


def _runs_of(groups, first: FloatScoring, second: FloatScoring) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return tuple(label for label, _ in groups[first]), tuple(label for label, _ in groups[second])


def _worst(a: LogitAgreement, b: LogitAgreement) -> LogitAgreement:
    """The larger noise of two controls, statistic by statistic."""
    return LogitAgreement(min(a.positions, b.positions), max(a.max_abs_diff, b.max_abs_diff),
                          max(a.mean_abs_diff, b.mean_abs_diff), min(a.top1_agreement, b.top1_agreement),
                          min(a.top5_overlap, b.top5_overlap), max(a.kl_mean, b.kl_mean),
                          max(a.kl_median, b.kl_median), max(a.kl_p99, b.kl_p99), max(a.kl_max, b.kl_max),
                          max(a.rms_delta_p, b.rms_delta_p))


def not_one_function(controls: Sequence[ControlCheck]) -> list[ControlCheck]:
    """The failed checks that find two scorings are not one function (the float control, the
    weights): between their runs no split is a near-tie (parity's judged_by_control, diff's
    verdict). A failed quantization check is a finding about one runtime's kernels, not this."""
    return [c for c in controls if not c.ok and c.kind in (FLOAT_CONTROL, WEIGHTS)]


def judged_by_control(comparisons: Sequence, controls: Sequence[ControlCheck]) -> list:
    """The comparisons with every split between two runs on opposite sides of a failed float
    control or weights check taken out of "numerics": a near-tie between two functions that are
    not the same model is no near-tie. Such splits become problems that say why."""
    failed = not_one_function(controls)
    judged = []
    for comparison in comparisons:
        pair = (comparison.run_a, comparison.run_b)
        why = next((c for c in failed if pair in _across(c)), None)
        if why is None or not comparison.explained or comparison.imported:
            judged.append(comparison)
            continue
        judged.append(demoted(comparison, f"the {why.kind} fails for these runs: {why.failure()}"))
    return judged


def demoted(comparison, why: str):
    """The comparison with its splits explained as numerics turned into problems saying why not."""
    lines = tuple(f"not numerics: {line} ({why})" for line in comparison.explained)
    return dataclasses.replace(comparison, problems=comparison.problems + lines, explained=())


def _across(check: ControlCheck) -> set[tuple[str, str]]:
    """Pairs of run labels with one run on each side of a check, in either order."""
    first, second = check.runs
    return {pair for a in first for b in second for pair in ((a, b), (b, a))}
