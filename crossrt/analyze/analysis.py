"""What a run record (and its trace) says about acceptance: the numbers `crossrt analyze`
prints, and the public API the report builds on (category_stats, position_acceptance,
entropy_acceptance, confidence_acceptance, iid_fit, expected_tokens, load_trace,
acceptance_table; frozen dataclasses, None where a denominator is 0).

Formulas, rules and the API's signatures: docs/analysis.md, "`crossrt analyze`" and "Python API".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from crossrt.inputs.prompts import content_type
from crossrt.records.counts import Counts
from crossrt.records.metrics import ratio
from crossrt.records.schema import PromptResult, RunRecord, accepted_per_position
from crossrt.records.tables import IDENTITY, Column, Table, cell, identity, number
from crossrt.records.trace import PromptTrace, load_trace

__all__ = ["CategoryStats", "PositionAcceptance", "EntropyBucket", "ConfidenceBucket", "IidFit",
           "ENTROPY_BUCKETS", "CONFIDENCE_BUCKETS", "category_stats", "position_acceptance",
           "entropy_acceptance", "confidence_acceptance", "iid_fit", "expected_tokens", "load_trace",
           "acceptance_table"]

# Bucket edges, lower edge included. Entropy in nats: exp(H) is the effective number of
# choices, so 0.001 nats is a near-certain target and 2 nats about 7 equally likely tokens.
ENTROPY_BUCKETS = (0.0, 0.001, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, math.inf)
CONFIDENCE_BUCKETS = (0.0, 0.5, 0.8, 0.9, 0.99, 0.999, 1.0 + 1e-6)


def _finished(record: RunRecord, category: Optional[str]) -> list[PromptResult]:
    return [r for r in record.results if r.ok and (category is None or r.category == category)]


def _reached(result: PromptResult, k: int) -> Optional[list[int]]:
    """Steps that reached each draft position, from the per-step lists (None without them)."""
    counters = result.counters
    if counters.step_drafted is None or counters.step_accepted is None:
        return None
    drafted = np.asarray(counters.step_drafted)
    accepted = np.asarray(counters.step_accepted)
    return [int(np.sum((accepted >= i) & (drafted > i))) for i in range(k)]



GROUPINGS = ("category", "content-type")


def grouped(record: RunRecord, by: str = "category") -> RunRecord:
    """The record with its results filed by their own category, or by crossrt's content type of
    it (code, prose, structured, math, chat: prompts.CONTENT_TYPES maps benchmark categories such
    as Spec-Bench's `coding` or SPEED-Bench's `rag`; a category it does not know stays itself)."""
    if by == "category":
        return record
    return dataclasses.replace(record, results=tuple(
        dataclasses.replace(r, category=content_type(r.category) or r.category) for r in record.results))

@dataclass(frozen=True)
class PositionAcceptance:
    position: int  # 0-based draft position
    reached: int  # steps whose draft reached it
    accepted: int  # steps that accepted the draft token there
    rate: Optional[float]  # accepted / reached


def position_acceptance(record: RunRecord, category: Optional[str] = None) -> list[PositionAcceptance]:
    """P(accept position i | reached i) for i in 0 .. k-1. Reached counts come from the
    per-step lists; a result without them counts steps that accepted at least i tokens
    (accepted_per_pos[i - 1], all steps at i = 0), which overcounts drafts cut short. A result
    reporting neither per-step lists nor accepted_per_pos is left out."""
    k = record.params.k
    reached = [0] * k
    accepted = [0] * k
    for result in _finished(record, category):
        counters = result.counters
        per_pos = counters.accepted_per_pos
        if per_pos is None and counters.step_accepted is not None:
            per_pos = accepted_per_position(counters.step_accepted, k)
        if per_pos is None:
            continue
        exact = _reached(result, k)
        for i in range(k):
            accepted[i] += per_pos[i]
            reached[i] += exact[i] if exact is not None else (counters.steps if i == 0 else per_pos[i - 1])
    return [PositionAcceptance(i, reached[i], accepted[i], ratio(accepted[i], reached[i])) for i in range(k)]


@dataclass(frozen=True, kw_only=True)
class CategoryStats(Counts):
    """One group's finished prompts: their summed counts (tau, alpha), and per-token acceptance."""

    category: Optional[str]  # None: every finished prompt
    prompts: int  # finished prompts
    reached: int  # draft positions reached (accepted + first rejections)
    # accepted / reached (over the results that report positions): per-token acceptance where
    # the target judged a draft token on its own context, the i.i.d. model's a
    accept_rate: Optional[float]


def _category_stats(record: RunRecord, category: Optional[str]) -> CategoryStats:
    summary = record.summary(category)
    positions = position_acceptance(record, category)
    reached = sum(p.reached for p in positions)
    return CategoryStats(**summary.counted(), category=category, prompts=summary.prompts - summary.failed,
                         reached=reached, accept_rate=ratio(sum(p.accepted for p in positions), reached))


def _groups(record: RunRecord) -> list[Optional[str]]:
    return [*record.categories(), None]


def category_stats(record: RunRecord) -> list[CategoryStats]:
    return [_category_stats(record, category) for category in _groups(record)]


def expected_tokens(a: float, k: int) -> float:
    """Leviathan et al.'s expected tokens per step, bonus included: sum of a^i, i = 0 .. k."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


@dataclass(frozen=True)
class IidFit:
    """The i.i.d. model against one group's measured tau.

    predicted_tau: expected_tokens(alpha, k), the model as usually applied (a = alpha).
    predicted_tau_reached: with a = accept_rate (the maximum-likelihood a of the model given
    the steps) and each step's own draft length (budget-cut and EOS-cut drafts included), the
    mean over steps of expected_tokens(a, drafted_s); it isolates the i.i.d. assumption.
    Errors are predicted minus measured."""

    category: Optional[str]
    k: int
    measured_tau: Optional[float]
    alpha: Optional[float]
    predicted_tau: Optional[float]
    error: Optional[float]
    accept_rate: Optional[float]
    predicted_tau_reached: Optional[float]
    error_reached: Optional[float]


def _fit(record: RunRecord, stats: CategoryStats) -> IidFit:
    k = record.params.k
    measured = stats.tau
    predicted = expected_tokens(stats.alpha, k) if stats.alpha is not None else None
    lengths = [n for r in _finished(record, stats.category) for n in (r.counters.step_drafted or ())]
    reached = None
    if stats.accept_rate is not None and len(lengths) == stats.steps and lengths:
        reached = sum(expected_tokens(stats.accept_rate, n) for n in lengths) / len(lengths)

    def error(value: Optional[float]) -> Optional[float]:
        return value - measured if value is not None and measured is not None else None

    return IidFit(stats.category, k, measured, stats.alpha, predicted, error(predicted), stats.accept_rate,
                  reached, error(reached))


def iid_fit(record: RunRecord) -> list[IidFit]:
    return [_fit(record, stats) for stats in category_stats(record)]


ACCEPTANCE_COLUMNS = (Column("category", "category"), Column("prompts", "prompts"), Column("steps", "steps"),
                      Column("tau", "tau"), Column("alpha", "alpha"), Column("accept_rate", "P(acc|reached)"),
                      Column("iid_tau", "iid tau a=alpha"), Column("iid_error", "error"),
                      Column("iid_tau_reached", "iid tau a=P, own lengths"), Column("iid_error_reached", "error"))


def acceptance_table(runs: Sequence[tuple[Path, RunRecord]], positions: bool = True) -> Table:
    """Per run (its path and record) and category, then overall (ALL): acceptance and the i.i.d.
    fit; with positions, P(accept i | reached i) and the steps reaching i at every draft position
    up to the largest k of the runs (none past a run's own)."""
    depth = max(record.params.k for _, record in runs) if positions and runs else 0
    columns = (*IDENTITY, *ACCEPTANCE_COLUMNS, *(column for i in range(1, depth + 1) for column in (
        Column(f"pos_{i}", f"pos {i}"), Column(f"pos_{i}_reached", f"pos {i} reached"))))
    rows = []
    for path, record in runs:
        fits = {fit.category: fit for fit in iid_fit(record)}
        for stats in category_stats(record):
            fit = fits[stats.category]
            reached = position_acceptance(record, stats.category) if positions else []
            by_position = [c for p in reached for c in (number(p.rate), cell(p.reached))]
            rows.append((*identity(path, record), cell(stats.category or "ALL"), cell(stats.prompts),
                         cell(stats.steps), number(stats.tau), number(stats.alpha, ".3f"),
                         number(stats.accept_rate, ".3f"), number(fit.predicted_tau), number(fit.error, "+.2f"),
                         number(fit.predicted_tau_reached), number(fit.error_reached, "+.2f"), *by_position,
                         *[cell(None)] * (2 * depth - len(by_position))))
    return Table(columns, tuple(rows))


@dataclass(frozen=True)
class EntropyBucket:
    low: float  # nats, included
    high: float  # nats, excluded
    tokens: int  # reached draft positions whose target entropy falls here
    accepted: int
    rate: Optional[float]
    mean_entropy: Optional[float]

    @property
    def branching_low(self) -> float:
        """exp(low): the effective number of choices at the bucket's lower edge."""
        return math.exp(self.low)

    @property
    def branching_high(self) -> float:
        return math.exp(self.high)


@dataclass(frozen=True)
class ConfidenceBucket:
    low: float  # drafter top-1 probability, included
    high: float  # excluded
    tokens: int
    accepted: int
    rate: Optional[float]
    mean_p1: Optional[float]


def _reached_tokens(record: RunRecord, trace: Mapping[str, PromptTrace], category: Optional[str],
                    field: str) -> tuple[np.ndarray, np.ndarray]:
    """(value of field, accepted) for every reached draft position of the traced prompts: the
    emitted tokens the drafter proposed a token for."""
    values, accepted = [np.empty(0, np.float32)], [np.empty(0, bool)]
    for result in _finished(record, category):
        prompt_trace = trace.get(result.prompt_id)
        if prompt_trace is not None:
            proposed = prompt_trace.proposed()
            values.append(getattr(prompt_trace, field)[proposed])
            accepted.append(prompt_trace.accepted()[proposed])
    return np.concatenate(values), np.concatenate(accepted)


def _bucketed(values: np.ndarray, accepted: np.ndarray, edges: Sequence[float]) -> list[tuple]:
    rows = []
    for low, high in zip(edges, edges[1:]):
        inside = (values >= low) & (values < high)
        n = int(inside.sum())
        hits = int(accepted[inside].sum())
        rows.append((low, high, n, hits, ratio(hits, n), float(values[inside].mean()) if n else None))
    return rows


def entropy_acceptance(record: RunRecord, trace: Mapping[str, PromptTrace],
                       buckets: Sequence[float] = ENTROPY_BUCKETS,
                       category: Optional[str] = None) -> list[EntropyBucket]:
    """Acceptance of reached draft positions by the target's entropy there (trace needed);
    buckets are edges in nats, lower edge included."""
    values, accepted = _reached_tokens(record, trace, category, "target_entropy")
    return [EntropyBucket(*row) for row in _bucketed(values, accepted, buckets)]


def confidence_acceptance(record: RunRecord, trace: Mapping[str, PromptTrace],
                          buckets: Sequence[float] = CONFIDENCE_BUCKETS,
                          category: Optional[str] = None) -> list[ConfidenceBucket]:
    """Acceptance of reached draft positions by the drafter's top-1 probability there."""
    values, accepted = _reached_tokens(record, trace, category, "drafter_p1")
    return [ConfidenceBucket(*row) for row in _bucketed(values, accepted, buckets)]
