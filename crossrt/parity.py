"""Parity between runs: do two records of the same pair agree, prompt by prompt?

Pure comparisons of records. Token ids are compared over their full length (a length
mismatch is a divergence at the shorter length: never a `zip` that drops the tail).
Counters are compared only between runs that followed the same schedule and draft rules:
two runtimes with different schedules legitimately count differently (docs/schema.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from crossrt.schema import PromptResult, RunRecord

OWN_BASELINE = "its baseline"  # run_b of a run's lossless check against its own greedy baseline
COMPARED_COUNTERS = ("steps", "drafted", "accepted", "emitted", "unverified", "cut")


def run_label(record: RunRecord) -> str:
    return f"{record.runtime.name}/{record.params.mode}"


def labelled(records: Sequence[RunRecord], sources: Sequence[str]) -> list[tuple[str, RunRecord]]:
    """Records named runtime/mode, with their source (e.g. file name) added where two would
    otherwise share a name."""
    names = [run_label(record) for record in records]
    return [(name if names.count(name) == 1 else f"{name} ({source})", record)
            for name, record, source in zip(names, records, sources, strict=True)]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where a and b differ, the shorter length when one is a
    strict prefix of the other, None when they are equal."""
    for index in range(min(len(a), len(b))):
        if a[index] != b[index]:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class CounterGap:
    name: str
    a: int
    b: int


@dataclass(frozen=True)
class PromptParity:
    """One prompt, two runs."""

    prompt_id: str
    run_a: str
    run_b: str
    problems: tuple[str, ...]
    divergence: Optional[int]  # index in output_ids where the runs part, None if equal
    counter_gaps: tuple[CounterGap, ...]
    counters_compared: bool

    @property
    def ok(self) -> bool:
        return not self.problems


def _counter_gaps(a: PromptResult, b: PromptResult, tolerance: float) -> tuple[CounterGap, ...]:
    gaps = []
    for name in COMPARED_COUNTERS:
        value_a, value_b = getattr(a.counters, name), getattr(b.counters, name)
        if abs(value_a - value_b) > tolerance * max(value_a, value_b):
            gaps.append(CounterGap(name, value_a, value_b))
    return tuple(gaps)


def _same_counting(a: RunRecord, b: RunRecord) -> bool:
    keys = ("k", "schedule", "draft_n_min", "draft_p_min", "max_new_tokens")
    return all(getattr(a.params, key) == getattr(b.params, key) for key in keys)


def compare_prompt(a: RunRecord, b: RunRecord, result_a: PromptResult, result_b: PromptResult,
                   counter_tolerance: float, labels: tuple[str, str]) -> PromptParity:
    problems = [f"{label} failed: {result.error}"
                for label, result in zip(labels, (result_a, result_b), strict=True) if not result.ok]
    if problems:
        return PromptParity(result_a.prompt_id, *labels, tuple(problems), None, (), False)
    if result_a.prompt_ids != result_b.prompt_ids:
        at = first_divergence(result_a.prompt_ids, result_b.prompt_ids)
        problems.append(f"prompt token ids differ at position {at}")
    divergence = first_divergence(result_a.output_ids, result_b.output_ids)
    if divergence is not None:
        problems.append(f"outputs part at token {divergence} (lengths {len(result_a.output_ids)} "
                        f"and {len(result_b.output_ids)})")
    compared = _same_counting(a, b)
    gaps = _counter_gaps(result_a, result_b, counter_tolerance) if compared else ()
    problems.extend(f"{gap.name}: {gap.a} vs {gap.b}" for gap in gaps)
    return PromptParity(result_a.prompt_id, *labels, tuple(problems), divergence, gaps, compared)


def compare_records(a: RunRecord, b: RunRecord, counter_tolerance: float = 0.0,
                    labels: Optional[tuple[str, str]] = None) -> list[PromptParity]:
    """Every prompt of either record, compared; a prompt only one record holds is a problem."""
    labels = labels or (run_label(a), run_label(b))
    if a.pair.target.vocab_fingerprint != b.pair.target.vocab_fingerprint:
        raise ValueError(f"{labels[0]} and {labels[1]} ran pairs with different vocabularies: "
                         "their token ids cannot be compared")
    results_b = {r.prompt_id: r for r in b.results}
    comparisons = []
    for result_a in a.results:
        result_b = results_b.pop(result_a.prompt_id, None)
        if result_b is None:
            comparisons.append(PromptParity(result_a.prompt_id, *labels, (f"missing from {labels[1]}",),
                                            None, (), False))
        else:
            comparisons.append(compare_prompt(a, b, result_a, result_b, counter_tolerance, labels))
    comparisons.extend(PromptParity(prompt_id, *labels, (f"missing from {labels[0]}",), None, (), False)
                       for prompt_id in results_b)
    return comparisons


def lossless_checks(label: str, record: RunRecord) -> list[PromptParity]:
    """Each finished prompt of one run against its own plain greedy baseline."""
    checks = []
    for result in record.results:
        problems = []
        if result.ok and not result.lossless:
            at = first_divergence(result.output_ids, result.baseline_ids)
            problems.append(f"not lossless: speculative output leaves the greedy baseline at token {at}")
        if result.own_prompt_ids is not None:
            at = first_divergence(result.own_prompt_ids, result.prompt_ids)
            problems.append(f"tokenizes the prompt text differently from the shared ids, from position {at}")
        checks.append(PromptParity(result.prompt_id, label, OWN_BASELINE, tuple(problems),
                                   None, (), False))
    return checks


def compare_all(runs: Sequence[tuple[str, RunRecord]], counter_tolerance: float = 0.0) -> list[PromptParity]:
    """Every (label, record) run against its own baseline, then every pair of runs, every prompt."""
    checks = [check for label, record in runs for check in lossless_checks(label, record)]
    return checks + [comparison
                     for i, (label_a, a) in enumerate(runs) for label_b, b in runs[i + 1:]
                     for comparison in compare_records(a, b, counter_tolerance, (label_a, label_b))]


def compare_against(runs: Sequence[tuple[str, RunRecord]], baselines: Sequence[RunRecord],
                    counter_tolerance: float = 0.0) -> list[PromptParity]:
    """Each record against the saved baseline of the same runtime, mode and k: a runtime
    upgrade that changes outputs or acceptance shows up here. A record with no baseline, or a
    baseline with no new record, is a problem too."""
    def key(record: RunRecord):
        return record.runtime.name, record.params.mode, record.params.k

    saved = {key(record): record for record in baselines}
    comparisons = []
    for label, record in runs:
        baseline = saved.pop(key(record), None)
        if baseline is None:
            comparisons.append(PromptParity("*", label, "saved baseline", ("no saved baseline for this run",),
                                            None, (), False))
            continue
        labels = (f"{run_label(baseline)} (saved)", label)
        comparisons.extend(compare_records(baseline, record, counter_tolerance, labels))
    comparisons.extend(PromptParity("*", f"{run_label(record)} (saved)", "new runs", ("not run this time",),
                                    None, (), False) for record in saved.values())
    return comparisons
