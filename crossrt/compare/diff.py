"""Where and why two runs part: `crossrt diff a.json b.json`.

Per prompt: a tokenization or template split; else each run against its own baseline; else the
first token where the baselines part, each side's token and both re-scored top-5, with the
near-tie verdict `crossrt parity` gives (crossrt/speculative/numerics.py). The noise between the runs is
shown beside it and decides nothing; parity's float control does, and diff exits as parity
would. Re-scoring runs where crossrt/run/isolation.py places RESCORING.
Each step: docs/parity.md, "`crossrt diff a.json b.json`".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from crossrt import progress
from crossrt.compare.diagnosis import Explainer, explain_record, twins_of
from crossrt.compare.splits import (DISAGREEMENT, Split, first_divergence, own_tokenization, template_split,
                                    tokenization_split)
from crossrt.run.isolation import RESCORING, call_safely
from crossrt.speculative.numerics import NOISE_PERCENTILE, gap_shifts
from crossrt.compare.replay import Replayer
from crossrt.compare.rescore import score, top_k
from crossrt.run.runtime import ModelSession
from crossrt.records.schema import PromptResult, RunRecord



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
    index: int  # position in the compared sequences where the runs part
    context: str  # decoded text of the last common tokens
    views: tuple[RuntimeView, ...]  # re-scored candidates; empty when not re-scored
    note: str = ""
    compared: str = "outputs"  # "outputs", or "baselines" when the runs' own greedy outputs part
    link: Optional[Split] = None  # the baselines' split, judged (crossrt/compare/diagnosis.py)
    within: tuple[Split, ...] = ()  # a run's speculative output leaving its own baseline
    tokenization: Optional[Split] = None  # prompt ids that differ before generation


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


def _view(label: str, row: np.ndarray, chosen: int, detokenize) -> RuntimeView:
    probabilities = softmax(row)
    order = top_k(row, 5)
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
    # Failures of parity's float control or weights check for these runs (crossrt/compare/control.py):
    # where the two are not one function, no split between them is a near-tie.
    not_one_function: tuple[str, ...] = ()

    def verdict(self, divergence: Divergence) -> str:
        if divergence.tokenization is not None:
            return f"{divergence.tokenization.kind}: {divergence.tokenization.detail}"
        if divergence.within and divergence.compared == "outputs":
            split = divergence.within[0]
            return (f"{split.kind} inside {split.sides[0].label.rsplit(' ', 1)[0]}: its speculative output left its "
                    f"own greedy baseline at token {split.index}, and the two runtimes' baselines agree; {split.detail}")
        if divergence.link is None:
            return "stop: one run ends here"
        if self.not_one_function:
            return f"{DISAGREEMENT}: the runs do not compute the same function ({self.not_one_function[0]})"
        link = divergence.link
        return f"near-tie ({link.kind}): {link.detail}" if link.numerics else f"{link.kind}: {link.detail}"


def _score_with_prompt(scorer, prompt_ids: Sequence[int], ids: Sequence[int]) -> np.ndarray:
    """Rows predicting prompt_ids[1:] and then ids: the prompt's own rows are common to both runs
    too, so the noise is measured even where the runs part at their first token."""
    return score(scorer, prompt_ids[:1], list(prompt_ids[1:]) + list(ids))


def _sequences(result_a: PromptResult, result_b: PromptResult) -> tuple[str, Sequence[int], Sequence[int]]:
    """Which sequences explain the runs' split: their baselines when each run's own greedy
    output is there to compare and those part, else the speculative outputs."""
    if result_a.baseline_ids and result_b.baseline_ids and \
            first_divergence(result_a.baseline_ids, result_b.baseline_ids) is not None:
        return "baselines", result_a.baseline_ids, result_b.baseline_ids
    return "outputs", result_a.output_ids, result_b.output_ids


def _divergence(labels, records, results, scorers, explainer: Explainer):
    """The divergence of two runs of one prompt, and the gap shifts measured on its common prefix."""
    result_a, result_b = results
    within = tuple(split for label, record, result in zip(labels, records, results)
                   for split in [explainer.lossless(label, record, result)] if split is not None)
    compared, ids_a, ids_b = _sequences(result_a, result_b)
    index = first_divergence(ids_a, ids_b)
    common = list(ids_a[:index])
    context = scorers[0].detokenize(common[-12:])
    if compared == "outputs" and within:
        return Divergence(result_a.prompt_id, index, context, (), compared=compared, within=within), None
    if index >= min(len(ids_a), len(ids_b)):
        note = f"stop reasons: {result_a.stop_reason} vs {result_b.stop_reason}"
        return Divergence(result_a.prompt_id, index, context, (), note, compared, within=within), None
    link = explainer.baselines(labels, records, results) if compared == "baselines" else None
    token_a, token_b = ids_a[index], ids_b[index]
    rows_a = _score_with_prompt(scorers[0], result_a.prompt_ids, common + [token_a])
    rows_b = _score_with_prompt(scorers[1], result_b.prompt_ids, common + [token_b])
    views = (_view(labels[0], rows_a[-1], token_a, scorers[0].detokenize),
             _view(labels[1], rows_b[-1], token_b, scorers[1].detokenize))
    return (Divergence(result_a.prompt_id, index, context, views, compared=compared, link=link, within=within),
            gap_shifts(rows_a[:-1], rows_b[:-1]))


def diff_records(label_a: str, a: RunRecord, label_b: str, b: RunRecord,
                 not_one_function: Sequence[str] = ()) -> DiffReport:
    """Where and why two runs part (module docstring); splits the runs recorded no passes for
    are re-scored in the runtime's own pass shapes. not_one_function: parity's float control
    failures for these runs, which no split between them can be numerics against."""
    return call_safely(RESCORING, _rescored_diff, label_a, a, label_b, b, tuple(not_one_function))


def _rescored_diff(label_a: str, a: RunRecord, label_b: str, b: RunRecord,
                   not_one_function: tuple[str, ...]) -> DiffReport:
    with Replayer() as replay:
        scorers = (replay.session(a, "target"), replay.session(b, "target"))
        explainer = Explainer(twins_of([(label_a, a), (label_b, b)]), replay,
                              scorers[0].detokenize)
        return _diff((label_a, label_b), (a, b), scorers, explainer, not_one_function)


def _diff(labels: tuple[str, str], records: tuple[RunRecord, RunRecord], scorers: tuple[ModelSession, ModelSession],
          explainer: Explainer, not_one_function: tuple[str, ...]) -> DiffReport:
    (label_a, label_b), (a, b) = labels, records
    results_b = {r.prompt_id: r for r in b.results}
    both = [(r, results_b[r.prompt_id]) for r in a.results if r.ok and r.prompt_id in results_b
            and results_b[r.prompt_id].ok]
    divergences, agreeing, measured = [], [], []
    for result_a, result_b in progress.each(both, "diff"):
        tokenization = tokenization_split(result_a.prompt_id, (label_a, label_b),
                                          (result_a.prompt_ids, result_b.prompt_ids), scorers[0].detokenize) \
            or own_tokenization(label_a, result_a, scorers[0].detokenize) \
            or own_tokenization(label_b, result_b, scorers[1].detokenize) \
            or template_split(label_a, result_a, scorers[0].detokenize) \
            or template_split(label_b, result_b, scorers[1].detokenize)
        if tokenization is not None:
            divergences.append(Divergence(result_a.prompt_id, tokenization.index, "", (),
                                          tokenization=tokenization))
            continue
        if first_divergence(result_a.output_ids, result_b.output_ids) is None:
            agreeing.append(result_a.prompt_id)
            # Agreeing prompts measure the noise too: score both outputs in full.
            rows_a = _score_with_prompt(scorers[0], result_a.prompt_ids, result_a.output_ids)
            rows_b = _score_with_prompt(scorers[1], result_b.prompt_ids, result_b.output_ids)
            measured.append(gap_shifts(rows_a, rows_b))
            continue
        divergence, prefix = _divergence(labels, records, (result_a, result_b), scorers, explainer)
        divergences.append(divergence)
        if prefix is not None:
            measured.append(prefix)
    margins = np.concatenate([m for m, _ in measured]) if measured else np.zeros(0)
    shifts = np.concatenate([s for _, s in measured]) if measured else np.zeros(0)
    if not len(shifts):
        return DiffReport(label_a, label_b, tuple(divergences), tuple(agreeing), None, None, None, not_one_function)
    return DiffReport(label_a, label_b, tuple(divergences), tuple(agreeing),
                      float(np.percentile(shifts, NOISE_PERCENTILE)), float(shifts.max()), float(np.median(margins)),
                      not_one_function)


def render_diff(report: DiffReport) -> str:
    lines = [f"{report.label_a} vs {report.label_b}: {len(report.agreeing)} prompts agree, "
             f"{len(report.divergences)} part",
             "noise: " + (f"top-2 gaps shift by {report.noise:.3g} logits (p{NOISE_PERCENTILE}; max "
                          f"{report.max_shift:.3g}) between the runs on common tokens; median top-2 margin "
                          f"{report.median_margin:.3g}" if report.noise is not None else "not measured (no common tokens)")]
    for divergence in report.divergences:
        where = "prompt position" if divergence.tokenization else \
            {"outputs": "output token", "baselines": "baseline token"}[divergence.compared]
        lines += ["", f"{divergence.prompt_id}: part at {where} {divergence.index}"]
        if divergence.context:
            lines.append(f"  text before: {divergence.context!r}")
        for split in divergence.within:
            owner = split.sides[0].label.rsplit(" ", 1)[0] if split.sides else "a run"
            lines.append(f"  {owner} left its own baseline at token {split.index}: {split.kind}")
            lines += [f"    {s.describe()}" for s in split.sides]
        if divergence.link is not None and divergence.link.sides:
            lines.append(f"  the {divergence.compared} part at token {divergence.index}:")
            lines += [f"    {side.describe()}" for side in divergence.link.sides]
        for view in divergence.views:
            candidates = ", ".join(f"{c.text!r} {c.probability:.3f} ({c.logit:.3f})" for c in view.top)
            lines.append(f"  re-scored in one pass on {view.label}: top-2 margin {view.margin:.3g}; top-5: {candidates}")
        if divergence.note:
            lines.append(f"  {divergence.note}")
        lines.append(f"  verdict: {report.verdict(divergence)}")
    return "\n".join(lines)


def record_splits(label: str, record: RunRecord) -> list[Split]:
    """`crossrt diff RUN.json`: the record's lossless failures and tokenization splits, each
    explained; where the run recorded no passes, re-scored in its runtime's pass shapes (where
    RESCORING runs: module docstring)."""
    return call_safely(RESCORING, _rescored_splits, label, record)


def _rescored_splits(label: str, record: RunRecord) -> list[Split]:
    with Replayer() as replay:
        detokenize = replay.session(record, "target").detokenize
        return explain_record(label, record, Explainer(replay=replay, detokenize=detokenize))


def render_record_splits(label: str, splits: Sequence[Split], finished: int) -> str:
    """`crossrt diff RUN.json`: one record's lossless failures and tokenization splits."""
    lines = [f"{label}: {finished - len(splits)} of {finished} finished prompts lossless with their own "
             f"tokenization, {len(splits)} split"]
    for split in splits:
        lines += [""] + split.render()
    return "\n".join(lines)
