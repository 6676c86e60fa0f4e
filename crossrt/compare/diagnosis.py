"""The cause of every split, from what the runs saw or from their passes reproduced.

Each split gets exactly one kind (tokenization or template, template, batch-shape numerics,
disagreement inside the runtime, native output not reproduced, cross-runtime numerics or
disagreement, drafter numerics, draft rule, counters unexplained, stop, unexplained), judged by
the one near-tie verdict of crossrt/speculative/numerics.py. Where a run recorded no passes, a driven
twin lends its pass views, else the Explainer re-scores the split (a Replayer) and says which.
Each kind: docs/parity.md, "The near-tie verdict".
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import numpy as np

from crossrt import progress
from crossrt.compare.splits import (BATCH_SHAPE, COUNTERS_UNEXPLAINED, CROSS_NUMERICS, DISAGREEMENT, DRAFT_RULE,
                                    DRAFTER_NUMERICS, INSIDE_DISAGREEMENT, NOT_REPRODUCED, STOP, UNEXPLAINED,
                                    Detokenize, Side, Split, first_divergence, no_text, own_tokenization,
                                    recorded_side, template_split, token_text)
from crossrt.compare.tolerance import batch_shape_ceiling, tolerance_for
from crossrt.records.schema import PassView, PromptResult, RunRecord
from crossrt.compare.rescore import scoring_runtime
from crossrt.errors import CrossrtError
from crossrt.run.runtime import HEAD_SPEC_TYPES
from crossrt.speculative.schedules import first_from_prompt
from crossrt.speculative.numerics import NOISE_FACTOR, Gap, Noise, gap_shifts, judge, rescored_gap

P_MIN_BAND = 0.05  # a drafter probability this close to p_min can fall on either side of it
DECODED_ROWS = 24  # output rows a drafter re-scores one token at a time to measure its batch-shape noise

Twins = dict[tuple, tuple[str, PromptResult]]


def twins_of(runs: Sequence[tuple[str, RunRecord]]) -> Twins:
    """Results that recorded pass views, by everything a run of the same schedule would share
    with them (schedule, k, prompt, prompt ids, output and baseline ids): a native run that
    produced exactly these tokens under the same schedule is explained by its driven twin's views."""
    found: Twins = {}
    for label, record in runs:
        for result in record.results:
            if result.ok and result.output_view is not None:
                found.setdefault(_twin_key(record, result), (label, result))
    return found


def _twin_key(record: RunRecord, result: PromptResult) -> tuple:
    return (record.params.schedule, record.params.k, result.prompt_id, result.prompt_ids, result.output_ids,
            result.baseline_ids)


class Replay(Protocol):
    """Re-scored passes (crossrt/compare/replay.py's Replayer)."""

    def gap(self, record: RunRecord, prefix: Sequence[int], following: Sequence[int], shape: int,
            emitted: int, other: int) -> Gap: ...

    def drafter_rows(self, record: RunRecord, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> np.ndarray: ...

    def scorer_name(self, record: RunRecord) -> str: ...

    def head_counts(self, record: RunRecord, prompt_ids: Sequence[int], max_new_tokens: int,
                    variant: str) -> Optional[tuple[int, int, int]]: ...


def _plain_shape(record: RunRecord, result: PromptResult, index: int) -> int:
    """The pass that chose baseline token index: llama-server's schedule takes the first token
    from the prompt pass (its baseline too), every other token is a one-token decode."""
    return len(result.prompt_ids) if index == 0 and first_from_prompt(record.params.schedule) else 1


class Explainer:
    """Names the cause of each split (module docstring). twins: driven runs' views for native
    runs that emitted the same ids; replay: re-scored passes where neither exists (None: such
    splits stay unexplained, with the hint to re-score)."""

    def __init__(self, twins: Optional[Twins] = None, replay: Optional[Replay] = None,
                 detokenize: Detokenize = no_text, logit_tolerance: Optional[float] = None,
                 batch_noise: Optional[dict] = None):
        self.twins = twins or {}
        self.replay = replay
        self.detokenize = detokenize
        self.logit_tolerance = logit_tolerance
        # run label -> its scorer's measured batch-shape noise (crossrt/compare/verification.py)
        self.batch_noise = batch_noise or {}

    def _threshold(self, a: RunRecord, b: RunRecord):
        return tolerance_for(a, b, self.logit_tolerance)

    def batch_threshold(self, label: str, record: RunRecord) -> tuple[float, str]:
        """How near a tie a split of one run's speculative output from its own baseline may be:
        the measured batch-shape noise of the arithmetic the run did (verification.BatchNoise),
        under the constant of its class as a ceiling; the ceiling alone where nothing was
        measured (logits not re-scored), and said so."""
        if self.logit_tolerance is not None:
            tolerance = tolerance_for(record, record, self.logit_tolerance)
            return tolerance.near_tie_flip, tolerance.reason
        ceiling = batch_shape_ceiling(record)
        noise = self.batch_noise.get(label)
        if noise is None:
            return ceiling.near_tie_flip, f"{ceiling.reason}; a constant ceiling (no batch-shape noise measured)"
        measured = noise.near_tie()
        if measured >= ceiling.near_tie_flip:
            return ceiling.near_tie_flip, (f"the ceiling for {ceiling.reason}, below {noise.describe()} = "
                                           f"{measured:.3g}")
        return measured, f"{noise.describe()}; ceiling {ceiling.near_tie_flip:g} for {ceiling.reason}"

    def views(self, record: RunRecord, result: PromptResult) -> tuple[Optional[PassView], Optional[PassView], str]:
        if result.output_view is not None:
            return result.output_view, result.baseline_view, "the run's own passes"
        twin = self.twins.get(_twin_key(record, result)) if result.ok else None
        if twin is not None:
            return (twin[1].output_view, twin[1].baseline_view,
                    f"seen in {twin[0]}, which emitted the same tokens with pass views")
        return None, None, ""

    def lossless(self, label: str, record: RunRecord, result: PromptResult) -> Optional[Split]:
        """Why one run's speculative output left its own greedy baseline; None when it did not."""
        if not result.ok or result.lossless is not False:
            return None
        out, base = result.output_ids, result.baseline_ids
        index = first_divergence(out, base)
        if index >= min(len(out), len(base)):
            return Split(result.prompt_id, STOP, index, (), "one output ends here (an EOS emitted by one run only)")
        output_view, baseline_view, how = self.views(record, result)
        spec_label, base_label = f"{label} speculative", f"{label} baseline"
        if output_view is not None and baseline_view is not None:
            sides = (recorded_side(spec_label, out, output_view, index, base[index], self.detokenize),
                     recorded_side(base_label, base, baseline_view, index, out[index], self.detokenize))
            replayed = False
        elif self.replay is not None:
            prefix = tuple(result.prompt_ids) + tuple(out[:index])
            spec_shape, base_shape = record.params.k + 1, _plain_shape(record, result, index)
            if index == 0 and first_from_prompt(record.params.schedule):
                spec_shape = base_shape  # its first token comes from the prompt pass too
            sides = (self._replayed_side(spec_label, record, prefix, out[index:], spec_shape, out[index], base[index]),
                     self._replayed_side(base_label, record, prefix, base[index:], base_shape, base[index], out[index]))
            how = (f"re-scored on {self.replay.scorer_name(record)} in the native schedule's pass shapes "
                   "(the run recorded no passes)")
            replayed = True
        else:
            sides = (recorded_side(spec_label, out, None, index, base[index], self.detokenize),
                     recorded_side(base_label, base, None, index, out[index], self.detokenize))
            return Split(result.prompt_id, UNEXPLAINED, index, sides,
                         "the run recorded no pass views (native mode) and re-scoring was off (--no-rescore)")
        verdict = judge([s.gap for s in sides], *self.batch_threshold(label, record))
        if verdict.near:
            kind, what = BATCH_SHAPE, (f"the same weights after the same {index} tokens; the two passes put the "
                                       f"two tokens within the near-tie threshold: {verdict.describe()}")
        elif replayed:
            kind, what = NOT_REPRODUCED, (f"its passes reproduced in-process put the native run's token beyond "
                                          f"numerics ({verdict.describe()}): a finding about the runtime")
        else:
            kind, what = INSIDE_DISAGREEMENT, (f"more than rounding ({verdict.describe()}); look for a cache or "
                                               "batching bug")
        return Split(result.prompt_id, kind, index, sides, f"{what} ({how})", verdict)

    def _replayed_side(self, label, record, prefix, following, shape, emitted, other) -> Side:
        gap = self.replay.gap(record, prefix, following[1:], shape, emitted, other)
        return Side(label, emitted, self.detokenize([emitted]), other, self.detokenize([other]), gap, shape)

    def baselines(self, labels: tuple[str, str], records: tuple[RunRecord, RunRecord],
                  results: tuple[PromptResult, PromptResult]) -> Optional[Split]:
        """Where two runs' plain greedy baselines part, and whether at a near-tie; None if equal."""
        ids = [r.baseline_ids for r in results]
        index = first_divergence(*ids)
        if index is None:
            return None
        prompt_id = results[0].prompt_id
        if index >= min(len(i) for i in ids):
            return Split(prompt_id, STOP, index, (), "one baseline ends here (an EOS emitted by one run only)")
        sides, hows = [], set()
        for label, record, result, own, other in zip(labels, records, results, ids, reversed(ids)):
            _, baseline_view, how = self.views(record, result)
            if baseline_view is not None:
                sides.append(recorded_side(f"{label} baseline", own, baseline_view, index, other[index],
                                           self.detokenize))
                hows.add(how)
            elif self.replay is not None:
                prefix = tuple(result.prompt_ids) + tuple(own[:index])
                sides.append(self._replayed_side(f"{label} baseline", record, prefix, own[index:],
                                                 _plain_shape(record, result, index), own[index], other[index]))
                hows.add(f"{label} re-scored on {self.replay.scorer_name(record)}")
            else:
                return Split(prompt_id, UNEXPLAINED, index, (), f"{label} recorded no pass views (native mode) and "
                             "re-scoring was off (--no-rescore)")
        tolerance = self._threshold(*records)
        verdict = judge([s.gap for s in sides], tolerance.near_tie_flip, tolerance.reason)
        kind = CROSS_NUMERICS if verdict.near else DISAGREEMENT
        what = "a near-tie" if verdict.near else "beyond numerics: a real difference to investigate"
        return Split(prompt_id, kind, index, tuple(sides),
                     f"the baselines part at {what}: {verdict.describe()} ({'; '.join(sorted(hows))})", verdict)

    def outputs(self, labels: tuple[str, str], records: tuple[RunRecord, RunRecord],
                results: tuple[PromptResult, PromptResult]) -> list[Split]:
        """Why two runs' outputs part: the chain output A - baseline A - baseline B - output B,
        each link identical or split; the outputs' divergence is numerics when every split
        link is (the first broken link is where they part)."""
        links = [self.lossless(labels[0], records[0], results[0]), self.baselines(labels, records, results),
                 self.lossless(labels[1], records[1], results[1])]
        return [link for link in links if link is not None]

    def _head_counters(self, prompt_id: str, labels: tuple[str, str], records: tuple[RunRecord, RunRecord],
                       results: tuple[PromptResult, PromptResult], where: str) -> Split:
        """Counts of a head's drafting (EAGLE3, DFlash) that differ with identical outputs. A
        head's drafts are no model's rows to re-score, so each run's drafting is replayed on its
        scorer instead, in the arithmetics runtimes use (replay.HEAD_VARIANTS: llama.cpp's float16
        keys and values and 8-bit activations into a quantized borrowed LM head, float32 keys and
        values, a float head). Counts that move between them are near-ties in the head's own
        arithmetic; counts every replay keeps, against a run that counted otherwise, are not."""
        from crossrt.compare.replay import HEAD_VARIANTS

        replays = []
        for label, record, result in zip(labels, records, results):
            budget = record.params.max_new_tokens or len(result.output_ids)
            variants = {variant: self.replay.head_counts(record, result.prompt_ids, budget, variant)
                        for variant in HEAD_VARIANTS}
            if None in variants.values():
                return Split(prompt_id, COUNTERS_UNEXPLAINED, None, (), f"counts differ with identical "
                             f"outputs{where}; {label}'s head file has no torch folder beside it to replay")
            if len(set(variants.values())) > 1:
                shown = "; ".join(f"{_counts(counts)} {variant}" for variant, counts in variants.items())
                return Split(prompt_id, DRAFTER_NUMERICS, None, (), f"counts differ with identical outputs{where}: "
                             f"{label}'s head drafting, replayed on {self.replay.scorer_name(record)}, counts {shown}: "
                             "near-ties in the head's own arithmetic, which runtimes break either way")
            replays.append(f"{label} {_counts(variants[HEAD_VARIANTS[0]])}")
        return Split(prompt_id, COUNTERS_UNEXPLAINED, None, (), f"counts differ with identical outputs{where}, and "
                     f"each run's head drafting, replayed in {len(HEAD_VARIANTS)} arithmetics, counts the same every "
                     f"way ({'; '.join(replays)}): not the head's arithmetic")

    def counters(self, labels: tuple[str, str], records: tuple[RunRecord, RunRecord],
                 results: tuple[PromptResult, PromptResult]) -> Split:
        """Identical outputs, different counts (same schedule and rules): the first draft where
        they differ, and the two drafters' candidates there."""
        prompt_id, output = results[0].prompt_id, results[0].output_ids
        window, where = _draft_window(records[0].params.schedule, results)
        if self.replay is None:
            return Split(prompt_id, UNEXPLAINED, window[0] if window else None, (),
                         f"counts differ with identical outputs{where}; re-scoring was off (--no-rescore)")
        if records[0].params.spec_type in HEAD_SPEC_TYPES:
            return self._head_counters(prompt_id, labels, records, results, where)
        if any(record.pair.drafter is None for record in records):
            return Split(prompt_id, COUNTERS_UNEXPLAINED, None, (), f"counts differ with identical outputs{where}, "
                         "and the pair has no drafter model to re-score (n-gram drafting is exact)")
        rows = [self.replay.drafter_rows(record, result.prompt_ids, output) for record, result in zip(records, results)]
        positions = [p for p in (window or range(len(output))) if p < len(output)]
        tolerance = self._threshold(*records)
        # Both drafters' rows along the whole output are in hand: their noise is measured, not
        # assumed (a layer-skip drafter's uncalibrated logits move by more than the target's).
        noise = Noise.of(*gap_shifts(rows[0], rows[1]))
        same_drafter = records[0].pair.drafter.sha256 == records[1].pair.drafter.sha256
        # One drafter file on two kernels (flash attention on and off, say) computes one function,
        # however coarsely one kernel rounds; two files that far apart are two drafters.
        if noise is not None and noise.broadly_different and not same_drafter:
            return Split(prompt_id, COUNTERS_UNEXPLAINED, None, (), f"counts differ with identical outputs{where}, and "
                         f"the two drafters do not compute the same function (gap shifts of {noise.p90:.3g} against a "
                         f"typical margin of {noise.median_margin:.3g})")
        # And how far a drafter's own batch shapes move it: drafts are decoded one token at a time.
        decoded = min(len(output), DECODED_ROWS)
        shapes = [Noise.of(*gap_shifts(r[:decoded], self.replay.drafter_rows_decoded(record, result.prompt_ids,
                                                                                    output, decoded)))
                  for r, record, result in zip(rows, records, results)]
        measured = max((n.p90 for n in (noise, *shapes) if n is not None), default=0.0)
        # Near-ties only where that measured noise could flip a position; the class's bound is a
        # ceiling, never a floor (a fixed floor found a near-tie in every output).
        threshold = min(tolerance.near_tie_flip, NOISE_FACTOR * measured)
        reason = (f"{NOISE_FACTOR:g}x the drafters' measured noise p90 {measured:.3g} (between them, and one pass "
                  f"against one-token decodes), at most {tolerance.near_tie_flip:g} ({tolerance.reason})")
        differing = []
        for p in positions:
            top = [int(np.argmax(r[p])) for r in rows]
            if top[0] != top[1]:
                gaps = [rescored_gap(rows[0][p], top[0], top[1], f"{labels[0]} drafter"),
                        rescored_gap(rows[1][p], top[1], top[0], f"{labels[1]} drafter")]
                differing.append((p, top, judge(gaps, threshold, reason)))
        beyond = [d for d in differing if not d[2].near]
        if beyond:
            p, top, verdict = beyond[0]
            return Split(prompt_id, COUNTERS_UNEXPLAINED, p, (), f"counts differ with identical outputs{where}: the "
                         f"drafters propose {self._pair_text(top)} at output token {p}, beyond numerics "
                         f"({verdict.describe()})", verdict)
        if differing:
            p, top, verdict = max(differing, key=lambda d: d[2].flip)
            return Split(prompt_id, DRAFTER_NUMERICS, p, (), f"counts differ with identical outputs{where}: the two "
                         f"drafters' top candidates differ at output token(s) {', '.join(str(d[0]) for d in differing)}, "
                         f"each a near-tie (widest: {self._pair_text(top)} at {p}, {verdict.describe()})", verdict)
        if _same_computation(*records):
            return Split(prompt_id, COUNTERS_UNEXPLAINED, window[0] if window else None, (),
                         f"counts differ with identical outputs{where}, though both runs ran the same runtime, "
                         "files and numerics (drafts cannot differ by rounding): a schedule or counting bug")
        near = [(p, min(_margin(r[p]) for r in rows)) for p in positions]
        near = [(p, m) for p, m in near if m <= threshold]
        if near:
            p, margin = min(near, key=lambda n: n[1])
            return Split(prompt_id, DRAFTER_NUMERICS, p, (), f"counts differ with identical outputs{where}: "
                         f"re-scored in one pass the drafters agree, but their top two lie within "
                         f"{threshold:.3g} ({reason}) at output token(s) "
                         f"{', '.join(str(n[0]) for n in near)} (closest {margin:.3g} at {p}): a draft decoded in "
                         "another batch shape breaks such a tie either way")
        p_min = records[0].params.draft_p_min or 0.0
        at_rule = [p for p in positions if p_min > 0 and any(abs(_top_probability(r[p]) - p_min) <= P_MIN_BAND
                                                             for r in rows)]
        if at_rule:
            return Split(prompt_id, DRAFT_RULE, at_rule[0], (), f"counts differ with identical outputs{where}: the "
                         f"drafter's confidence lies within {P_MIN_BAND} of p_min = {p_min:g} at output token(s) "
                         f"{', '.join(map(str, at_rule))}, so a draft stops there in one run and not the other")
        return Split(prompt_id, COUNTERS_UNEXPLAINED, window[0] if window else None, (),
                     f"counts differ with identical outputs{where}, and the re-scored drafters show no near-tie there: "
                     "look for a drafter whose state is not rolled back after a rejection, or a counting bug")

    def _pair_text(self, tokens: Sequence[int]) -> str:
        texts = [self.detokenize([t]) for t in tokens]
        return " vs ".join(token_text(t, text) for t, text in zip(tokens, texts))


def _same_computation(a: RunRecord, b: RunRecord) -> bool:
    """Both runs computed the same drafts with the same kernels: one build (llama-server,
    llama-speculative-simple and crossrt's in-process llama.cpp at one commit share it: their
    scoring runtime, commit and kernels (system_info) agree), numerics and model files alike, so their drafts cannot
    differ by rounding."""
    def key(record: RunRecord) -> tuple:
        runtime = record.runtime
        try:
            kernels = scoring_runtime(runtime)
        except CrossrtError:  # no in-process sibling: only itself shares its kernels
            kernels = runtime.name
        return (kernels, runtime.build, runtime.device, runtime.kv_cache, runtime.flash_attn, runtime.system_info,
                record.pair.target.sha256, record.pair.drafter.sha256)
    return a.runtime.build is not None and key(a) == key(b)


def _margin(row: np.ndarray) -> float:
    top2 = np.partition(row, len(row) - 2)[-2:]
    return float(top2[1] - top2[0])


def _top_probability(row: np.ndarray) -> float:
    shifted = np.exp(row - row.max())
    return float(1.0 / shifted.sum())


def _draft_window(schedule: str, results: Sequence[PromptResult]) -> tuple[Optional[range], str]:
    """The output positions the first differing step drafted (both runs' steps agree before it),
    and its description; (None, "") when a run does not report its steps (native)."""
    steps = [(r.counters.step_drafted, r.counters.step_accepted) for r in results]
    if any(drafted is None or accepted is None for drafted, accepted in steps):
        return None, " (steps not reported by a run: every drafted position checked)"
    start = 1 if first_from_prompt(schedule) else 0  # its first token is unverified, from the prompt pass
    (drafted_a, accepted_a), (drafted_b, accepted_b) = steps
    for step, lengths in enumerate(zip(drafted_a, accepted_a, drafted_b, accepted_b)):
        if lengths[:2] != lengths[2:]:
            return (range(start, start + max(lengths[0], lengths[2]) + 1),
                    f" (first at step {step + 1}: drafted {lengths[0]} vs {lengths[2]}, accepted {lengths[1]} vs "
                    f"{lengths[3]}, from output token {start})")
        start += lengths[1] + 1
    return None, " (the steps agree; their number differs)"


def explain_record(label: str, record: RunRecord, explainer: Explainer) -> list[Split]:
    """Every tokenization split and lossless failure of one record, each with its cause."""
    splits = []
    for result in progress.each(record.results, f"explaining {label}"):
        for split in (own_tokenization(label, result, explainer.detokenize),
                      template_split(label, result, explainer.detokenize),
                      explainer.lossless(label, record, result)):
            if split is not None:
                splits.append(split)
    return splits


def _counts(counts: tuple[int, int, int]) -> str:
    steps, drafted, accepted = counts
    return f"{steps} steps, {drafted} drafted, {accepted} accepted"
