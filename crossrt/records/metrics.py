"""The rates crossrt derives from stored counters and timings, in one list: the summary tables
(crossrt/records/tables.py), the report (crossrt/report/build.py) and claims (crossrt/analyze/claims.py) read their
names, headings, digits and hardware-dependence from here. Each name is a field of
schema.Summary and of a result's derived block; tests/test_metrics.py holds the list, the
dataclasses, the JSON Schema and docs/schema.md to each other.

Convention (as vLLM's spec-decode metrics): counters are stored, rates are derived, always
as ratios of sums over finished prompts, never means of per-prompt ratios. tau counts the
bonus token: tau = 1 + accepted / steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Metric:
    name: str  # the field of schema.Summary (and of a result's derived block)
    heading: str  # its column in tables
    digits: int  # decimals shown
    # Wall-clock numbers belong to the machine that measured them: compared across machines
    # only when the hardware matches (claims).
    hardware_bound: bool
    meaning: str

    def format(self, value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.{self.digits}f}"


METRICS = (
    Metric("tau", "tau", 2, False, "tokens per verification step, bonus token included: 1 + accepted / steps"),
    Metric("alpha", "alpha", 3, False, "draft tokens accepted per draft token verified: accepted / drafted"),
    Metric("tokens_per_s", "tok/s", 1, True, "emitted tokens / decode seconds of the speculative run"),
    Metric("baseline_tokens_per_s", "base tok/s", 1, True,
           "tokens / decode seconds of plain greedy decoding on the same runtime"),
    Metric("speedup", "speedup", 2, True, "tokens_per_s / baseline_tokens_per_s"),
)
BY_NAME = {metric.name: metric for metric in METRICS}
NAMES = tuple(BY_NAME)
HARDWARE_BOUND = tuple(metric.name for metric in METRICS if metric.hardware_bound)
SPEED = tuple(BY_NAME[name] for name in HARDWARE_BOUND)  # the speedup section's columns
