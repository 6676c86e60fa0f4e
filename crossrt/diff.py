"""Where and why two runs part: `crossrt diff a.json b.json`.

At the first diverging output token of each prompt, both targets re-score the common prefix
on their own runtime; the report shows each runtime's top-5 tokens with probabilities, the
decoded text around the divergence, and a verdict:
- near-tie (numerics): the two runtimes swapped two candidates whose logit gap is within
  what the runtimes' disagreement on the common prefix can shift it;
- disagreement: the gap is beyond that noise, a real difference (weights, conventions,
  tokenization) worth investigating.
The noise is measured, not assumed: for every common row (agreeing prompts and the prefixes
before divergences), how far the gap between that row's top-2 tokens moves from one runtime to
the other; the 90th percentile of those shifts is the noise (the max would let one outlier
excuse everything). F32 runtimes shift gaps by ~1e-5, quantized ones by tenths of a logit.
When the noise is a sizeable share of the typical top-2 margin itself, the two runs do not
compute the same function at all (a different model, a convention bug): every divergence is
then a disagreement, however its own flip compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from crossrt.parity import first_divergence
from crossrt.rescore import open_scorer, score
from crossrt.schema import PromptResult, RunRecord

NEAR_TIE_FACTOR = 3.0  # a flip within 3x the typical-high gap shift on common tokens is numerics
NOISE_PERCENTILE = 90
GAP_NOISE_FLOOR = 1e-5  # float32 logits of order 10 carry ~1e-6 rounding; batch shapes add more
BROAD_DISAGREEMENT = 0.25  # noise above this share of the median top-2 margin: not numerics


@dataclass(frozen=True)
class Candidate:
    token_id: int
    text: str
    logit: float
    probability: float


@dataclass(frozen=True)
class RuntimeView:
    label: str
    top: tuple[Candidate, ...]
    chosen: int

    @property
    def margin(self) -> float:
        return self.top[0].logit - self.top[1].logit


@dataclass(frozen=True)
class Divergence:
    prompt_id: str
    index: int  # position in the outputs where the runs part
    context: str  # decoded text of the last common tokens
    views: tuple[RuntimeView, ...]  # empty when one run simply stopped earlier
    flip: Optional[float]  # A's gap for its token over B's, plus B's gap for its over A's
    note: str = ""


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


def gap_shifts(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: runtime A's top-2 margin, and how much that gap moves in runtime B."""
    if len(a) == 0:
        return np.zeros(0), np.zeros(0)
    top2 = np.argsort(-a, axis=1, kind="stable")[:, :2]
    rows = np.arange(len(a))
    gap_a = a[rows, top2[:, 0]] - a[rows, top2[:, 1]]
    gap_b = b[rows, top2[:, 0]] - b[rows, top2[:, 1]]
    return gap_a, np.abs(gap_a - gap_b)


def _view(label: str, row: np.ndarray, chosen: int, detokenize) -> RuntimeView:
    probabilities = softmax(row)
    order = np.argsort(-row, kind="stable")[:5]
    top = tuple(Candidate(int(t), detokenize([int(t)]), float(row[t]), float(probabilities[t])) for t in order)
    return RuntimeView(label, top, chosen)


@dataclass(frozen=True)
class DiffReport:
    label_a: str
    label_b: str
    divergences: tuple[Divergence, ...]
    agreeing: tuple[str, ...]
    noise: Optional[float]  # NOISE_PERCENTILE of top-2 gap shifts on common rows; None if none
    max_shift: Optional[float]
    median_margin: Optional[float]  # of runtime A's top-2 margins on common rows

    @property
    def broadly_different(self) -> bool:
        return self.noise is not None and self.noise > BROAD_DISAGREEMENT * self.median_margin

    def verdict(self, divergence: Divergence) -> str:
        if divergence.flip is None:
            return "stop: one run ends here"
        if self.noise is None:
            return "unknown: no common prefix to measure the runtimes' noise on"
        if self.broadly_different:
            return (f"disagreement: the runs do not compute the same function (gap shifts of {self.noise:.3g} "
                    f"on common tokens against a typical margin of {self.median_margin:.3g})")
        threshold = NEAR_TIE_FACTOR * max(self.noise, GAP_NOISE_FLOOR)
        if divergence.flip <= threshold:
            return f"near-tie (numerics): flip {divergence.flip:.3g} <= {threshold:.3g}"
        return f"disagreement (a real difference to investigate): flip {divergence.flip:.3g} > {threshold:.3g}"


def _divergence(label_a, label_b, result_a: PromptResult, result_b: PromptResult, index: int, scorers):
    """The divergence at index, and the gap shifts measured on its common prefix."""
    common = list(result_a.output_ids[:index])
    scorer_a, scorer_b = scorers
    context = scorer_a.detokenize(common[-12:])
    if index >= min(len(result_a.output_ids), len(result_b.output_ids)):
        note = f"stop reasons: {result_a.stop_reason} vs {result_b.stop_reason}"
        return Divergence(result_a.prompt_id, index, context, (), None, note), (np.zeros(0), np.zeros(0))
    token_a, token_b = result_a.output_ids[index], result_b.output_ids[index]
    rows_a = score(scorer_a, result_a.prompt_ids, common + [token_a])
    rows_b = score(scorer_b, result_b.prompt_ids, common + [token_b])
    row_a, row_b = rows_a[index], rows_b[index]
    flip = float((row_a[token_a] - row_a[token_b]) + (row_b[token_b] - row_b[token_a]))
    views = (_view(label_a, row_a, token_a, scorer_a.detokenize), _view(label_b, row_b, token_b, scorer_b.detokenize))
    return Divergence(result_a.prompt_id, index, context, views, flip), gap_shifts(rows_a[:index], rows_b[:index])


def diff_records(label_a: str, a: RunRecord, label_b: str, b: RunRecord) -> DiffReport:
    results_b = {r.prompt_id: r for r in b.results}
    both = [(r, results_b[r.prompt_id]) for r in a.results if r.ok and r.prompt_id in results_b
            and results_b[r.prompt_id].ok]
    scorers = (open_scorer(a), open_scorer(b))
    divergences, agreeing, measured = [], [], []
    for result_a, result_b in both:
        index = first_divergence(result_a.output_ids, result_b.output_ids)
        if index is None:
            agreeing.append(result_a.prompt_id)
            # Agreeing prompts measure the noise too: score both outputs in full.
            rows_a = score(scorers[0], result_a.prompt_ids, result_a.output_ids)
            rows_b = score(scorers[1], result_b.prompt_ids, result_b.output_ids)
            measured.append(gap_shifts(rows_a, rows_b))
            continue
        divergence, prefix = _divergence(label_a, label_b, result_a, result_b, index, scorers)
        divergences.append(divergence)
        measured.append(prefix)
    margins = np.concatenate([m for m, _ in measured]) if measured else np.zeros(0)
    shifts = np.concatenate([s for _, s in measured]) if measured else np.zeros(0)
    if not len(shifts):
        return DiffReport(label_a, label_b, tuple(divergences), tuple(agreeing), None, None, None)
    return DiffReport(label_a, label_b, tuple(divergences), tuple(agreeing),
                      float(np.percentile(shifts, NOISE_PERCENTILE)), float(shifts.max()), float(np.median(margins)))


def render_diff(report: DiffReport) -> str:
    lines = [f"{report.label_a} vs {report.label_b}: {len(report.agreeing)} prompts agree, "
             f"{len(report.divergences)} part",
             "noise: " + (f"top-2 gaps shift by {report.noise:.3g} logits (p{NOISE_PERCENTILE}; max "
                          f"{report.max_shift:.3g}) between the runs on common tokens; median top-2 margin "
                          f"{report.median_margin:.3g}" if report.noise is not None else "not measured (no common tokens)")]
    for divergence in report.divergences:
        lines += ["", f"{divergence.prompt_id}: part at output token {divergence.index}",
                  f"  text before: {divergence.context!r}"]
        for view in divergence.views:
            candidates = ", ".join(f"{c.text!r} {c.probability:.3f} ({c.logit:.3f})" for c in view.top)
            lines.append(f"  {view.label} chose {view.chosen}; top-2 margin {view.margin:.3g}; top-5: {candidates}")
        if divergence.note:
            lines.append(f"  {divergence.note}")
        lines.append(f"  verdict: {report.verdict(divergence)}")
    return "\n".join(lines)
