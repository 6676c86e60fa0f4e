"""The rates crossrt derives from stored counters and timings, in one list, each with its formula
(tau's and alpha's are the counts' own, crossrt/records/counts.py): a result's and a summary's
derived block (crossrt/records/record_json.py), `crossrt show`'s table (crossrt/records/tables.py),
the report (crossrt/report/build.py), the sweep index's columns and its `cells` view
(crossrt/sweep/store.py), claims (crossrt/analyze/claims.py) and the simulations' predicted rates
(crossrt/simulate/oracle.py, schedules.py, trees.py) all read it. Adding a metric is one entry
here and one line in docs/schema.md; records written before it still load (a derived block is
recomputed, and a key it lacks is not checked).

Convention (as vLLM's spec-decode metrics): counters are stored, rates are derived, always
as ratios of sums over finished prompts, never means of per-prompt ratios. tau counts the
bonus token: tau = 1 + accepted / steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from crossrt.records.counts import Counts


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    """numerator / denominator; None where either is missing or the denominator is 0."""
    return numerator / denominator if numerator is not None and denominator else None


@dataclass(frozen=True)
class Totals(Counts):
    """What a formula reads: one finished prompt's counts and seconds, or their sums over a
    group (so every rate is a ratio of sums). Seconds are 0 where nothing was timed (an
    imported record): a rate over them is None. Each metric of METRICS reads as an attribute
    (totals.tau), computed when read."""

    decode_s: float = 0.0  # the speculative run's decode (measured, or a cost model's prediction)
    baseline_tokens: int = 0  # tokens of the plain greedy baseline
    baseline_decode_s: float = 0.0

    def __add__(self, other: "Totals") -> "Totals":
        return Totals(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(Totals)))

    def __getattr__(self, name: str) -> Optional[float]:
        # Only names no field or method has reach here; dunders first, so that copy and pickle,
        # which look some up before the fields exist, get their AttributeError at once.
        if not name.startswith("_"):
            for metric in METRICS:
                if metric.name == name:
                    return metric.formula(self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


@dataclass(frozen=True)
class Metric:
    name: str  # its key in derived blocks and summaries, its sweep column, its claim name
    heading: str  # its column in tables
    digits: int  # decimals shown
    # Wall-clock numbers belong to the machine that measured them: compared across machines
    # only when the hardware matches (claims), shown in the report's speedup section.
    hardware_bound: bool
    formula: Callable[[Totals], Optional[float]]
    meaning: str

    def of(self, totals: Optional[Totals]) -> Optional[float]:
        """The metric of totals; None without them (a failed prompt)."""
        return None if totals is None else self.formula(totals)

    def format(self, value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.{self.digits}f}"


def _tokens_per_s(t: Totals) -> Optional[float]:
    return ratio(t.emitted, t.decode_s)


def _baseline_tokens_per_s(t: Totals) -> Optional[float]:
    return ratio(t.baseline_tokens, t.baseline_decode_s)


METRICS = (
    Metric("tau", "tau", 2, False, lambda t: t.tau,
           "tokens per verification step, bonus token included: 1 + accepted / steps"),
    Metric("alpha", "alpha", 3, False, lambda t: t.alpha,
           "draft tokens accepted per draft token verified: accepted / drafted"),
    Metric("tokens_per_s", "tok/s", 1, True, _tokens_per_s,
           "emitted tokens / decode seconds of the speculative run"),
    Metric("baseline_tokens_per_s", "base tok/s", 1, True, _baseline_tokens_per_s,
           "tokens / decode seconds of plain greedy decoding on the same runtime"),
    Metric("speedup", "speedup", 2, True, lambda t: ratio(_tokens_per_s(t), _baseline_tokens_per_s(t)),
           "tokens_per_s / baseline_tokens_per_s"),
)


# Read METRICS when called, never copied at import: every reader sees the one list as it is.
def named(name: str) -> Metric:
    for metric in METRICS:
        if metric.name == name:
            return metric
    raise KeyError(name)


def names() -> tuple[str, ...]:
    return tuple(metric.name for metric in METRICS)


def hardware_bound() -> tuple[str, ...]:
    return tuple(metric.name for metric in METRICS if metric.hardware_bound)


def values(totals: Optional[Totals]) -> dict[str, Optional[float]]:
    """Every metric of totals (None each without them), by name, in the list's order."""
    return {metric.name: metric.of(totals) for metric in METRICS}
