"""What `crossrt import` reads out of another runtime's own text, before it becomes a run
record (crossrt/importer.py): the counts, and the arithmetic that recovers counts from the
rounded rates a log prints. docs/import.md gives each source's fields and conventions.

Logs print some counts and round the rest into rates: vLLM prints accepted and drafted draft
tokens but not the number of drafts, only `1 + accepted / drafts` to 2 decimals; llama-server
prints the same mean length per request. The number of drafts is then the integer n whose
rates, formatted as the runtime formats them, give back the printed text. Counts are taken
only where that leaves a single answer (or, for vLLM, where every draft is k tokens long):
crossrt never rounds a rate into a count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from crossrt.errors import CrossrtError


class ImportFailure(CrossrtError, ValueError):
    """A file that is not in the named format, or whose numbers do not give counts."""


@dataclass(frozen=True)
class SourceCounts:
    """Counts a source gives, summed over everything it covers.

    emitted: tokens produced, where the source counts them; unverified: tokens produced
    outside verification steps, where the source tells them apart (llama-server's decode
    counter). accepted_per_pos[i]: steps that accepted at least i + 1 draft tokens, as vLLM's
    and llama.cpp's per-position counters count them. k, version, build: where the text says
    them. notes: how each count was read or derived, for the record."""

    steps: int
    drafted: int
    accepted: int
    accepted_per_pos: Optional[tuple[int, ...]]
    emitted: Optional[int] = None
    unverified: Optional[int] = None
    k: Optional[int] = None
    version: Optional[str] = None
    build: Optional[str] = None
    notes: tuple[str, ...] = ()

    def minus(self, before: "SourceCounts") -> "SourceCounts":
        """The counts between two scrapes of a counter endpoint (this one the later)."""
        def delta(now: Optional[int], then: Optional[int], name: str) -> Optional[int]:
            if now is None or then is None:
                return None
            if now < then:
                raise ImportFailure(f"{name} went down from {then} to {now} between the two scrapes: "
                                    "the server restarted in between, so the scrapes cannot be differenced")
            return now - then

        per_pos = None
        if self.accepted_per_pos is not None:  # positions print only once a step reached them
            then = padded(before.accepted_per_pos or (), len(self.accepted_per_pos))
            per_pos = tuple(delta(a, b, f"accepted at position {i}")
                            for i, (a, b) in enumerate(zip(self.accepted_per_pos, then)))
        return SourceCounts(
            delta(self.steps, before.steps, "drafts"), delta(self.drafted, before.drafted, "draft tokens"),
            delta(self.accepted, before.accepted, "accepted tokens"), per_pos,
            delta(self.emitted, before.emitted, "emitted tokens"),
            delta(self.unverified, before.unverified, "decodes outside steps"),
            self.k, self.version, self.build, self.notes)


def padded(counts: Sequence[int], width: int) -> tuple[int, ...]:
    """counts cut or extended with zeros to width: positions never reached print no counter."""
    return tuple(counts[:width]) + (0,) * (width - len(counts))


def shown(value: float, printed: str) -> bool:
    """Whether value, formatted with as many decimals as printed has, is printed ('%.2f' in
    Python and C's printf round the binary value the same way)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return f"{value:.{decimals}f}" == printed


def counts_of_rate(printed: str, denominator: int) -> range:
    """The integers c in 0 .. denominator with c / denominator shown as printed; contiguous,
    since c / denominator grows with c."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    unit = 10.0 ** -decimals
    low = max(0, math.floor((float(printed) - unit) * denominator))
    high = min(denominator, math.ceil((float(printed) + unit) * denominator))
    fitting = [c for c in range(low, high + 1) if shown(c / denominator, printed)]
    return range(fitting[0], fitting[-1] + 1) if fitting else range(0)


def position_counts(rates: Sequence[str], drafts: int, accepted: int) -> tuple[Optional[tuple[int, ...]], bool]:
    """(per-position counts behind rates printed as count / drafts, whether any counts fit).
    The counts are None when several sets fit (rates rounded finer than one count per draft)."""
    ranges = [counts_of_rate(rate, drafts) for rate in rates]
    if any(len(r) == 0 for r in ranges):
        return None, False
    low, high = sum(r.start for r in ranges), sum(r.stop - 1 for r in ranges)
    if not low <= accepted <= high:
        return None, False
    if low == accepted:
        return tuple(r.start for r in ranges), True
    if high == accepted:
        return tuple(r.stop - 1 for r in ranges), True
    return None, True


@dataclass(frozen=True)
class Drafts:
    """Drafts behind one printed line: the count, per-position counts where they follow, and
    how the count was chosen (None: the only one that fits)."""

    steps: int
    accepted_per_pos: Optional[tuple[int, ...]]
    assumption: Optional[str]


def drafts_behind(where: str, accepted: int, drafted: int, mean_length: str, rates: Sequence[str],
                  k: Optional[int]) -> Drafts:
    """The number of drafts n behind `mean_length` = 1 + accepted / n (and per-position rates
    count / n, where printed). Each draft holds 1 .. k tokens, so drafted / k <= n <= drafted.
    Where several n fit, n = drafted / k (every draft k tokens long) is taken if it is one of
    them; otherwise ImportFailure."""
    low, high = (max(1, math.ceil(drafted / k)) if k else 1), max(1, drafted)
    excess, unit = float(mean_length) - 1, 10.0 ** -len(mean_length.partition(".")[2])
    if accepted:  # n near accepted / (mean - 1): only a few candidates to format
        low = max(low, math.floor(accepted / (excess + unit)))
        high = min(high, math.ceil(accepted / (excess - unit)) if excess > unit else high)
    fitting = [n for n in range(low, high + 1) if shown(1 + accepted / n, mean_length)
               and (not rates or position_counts(rates, n, accepted)[1])]
    if not fitting:
        raise ImportFailure(f"{where}: no number of drafts gives mean length {mean_length} for {accepted} accepted "
                            f"of {drafted} drafted tokens" + (" and the per-position rates" if rates else ""))
    assumption = None
    if len(fitting) == 1:
        steps = fitting[0]
    elif k and drafted % k == 0 and drafted // k in fitting:
        steps = drafted // k
        assumption = (f"{where}: {len(fitting)} draft counts ({fitting[0]}-{fitting[-1]}) fit the printed rates; "
                      f"taken: drafted / k = {steps} (every draft {k} tokens long)")
    else:
        raise ImportFailure(f"{where}: the printed rates fit {fitting[0]} to {fitting[-1]} drafts and crossrt cannot "
                            "tell which; import the runtime's counters instead (its /metrics)")
    per_pos = position_counts(rates, steps, accepted)[0] if rates else None
    return Drafts(steps, per_pos, assumption)


def summed(parts: Sequence[Optional[tuple[int, ...]]]) -> Optional[tuple[int, ...]]:
    """Per-position counts summed over parts; None if any part lacks them."""
    if not parts or any(part is None for part in parts):
        return None
    width = max(len(part) for part in parts)
    return tuple(sum(column) for column in zip(*(padded(part, width) for part in parts)))
