"""The four counts of speculative decoding, declared once: a record's counters, the metrics'
totals, the simulators' and the analysis' summed rows all extend Counts, so each count has one
meaning and tau and alpha one formula (crossrt/records/metrics.py lists them among the metrics,
each a ratio of sums).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Counts:
    """What speculative decoding counts, over one prompt or summed over a group; all 0: nothing
    counted (the start of a sum). A type that carries these extends Counts: its fields stay flat
    (a record's JSON, the sweep index's columns) and every reader reads r.steps and r.tau alike."""

    steps: int = 0  # verification passes of the target (each yields accepted-in-step + 1 tokens)
    drafted: int = 0  # draft tokens the target verified
    accepted: int = 0  # draft tokens it kept (the bonus token excluded)
    emitted: int = 0  # tokens produced

    def __add__(self, other: Counts) -> Counts:
        """The counts of both, as plain Counts (whatever else either carries is not summed here)."""
        return Counts(**{name: value + getattr(other, name) for name, value in self.counted().items()})

    def counted(self) -> dict[str, int]:
        """The four counts by name, a subclass's other fields left out: to build another type
        that carries them (Totals over a record's Counters, a summed row)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(Counts)}

    @property
    def tau(self) -> Optional[float]:
        """Tokens per verification step, bonus included: 1 + accepted / steps; None without steps."""
        return 1 + self.accepted / self.steps if self.steps else None

    @property
    def alpha(self) -> Optional[float]:
        """Draft tokens accepted per draft token verified: accepted / drafted; None without drafts."""
        return self.accepted / self.drafted if self.drafted else None
