"""What `crossrt import` reads out of another runtime's own text, before it becomes a run
record (crossrt/imports/importer.py): the counts, and the arithmetic that recovers counts from the
rounded rates a log prints. docs/import.md gives each source's fields and conventions.

Logs print some counts and round the rest into rates: vLLM prints accepted and drafted draft
tokens but not the number of drafts, only `1 + accepted / drafts` to 2 decimals; llama-server
prints the same mean length per request. The number of drafts is then the integer n whose
rates, formatted as the runtime formats them, give back the printed text. Counts are taken
only where that leaves a single answer (or, for vLLM, where every draft is k tokens long):
crossrt never rounds a rate into a count.

Counts are read as exact integers (count(): decimal digits, at most MAX_COUNT) and the counts
that fit a printed rate are found by bisection, so no input, however large its numbers, makes
a reader's work grow with them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from crossrt.errors import CrossrtError

# Runtimes keep their counters in 64 bits: a larger number is not a count of anything they did.
MAX_COUNT = 2 ** 63 - 1
# Draft tokens per step: a position or window beyond this is not a draft (and per-position
# counts are a tuple of this length, so it bounds their memory too).
MAX_K = 4096
# Where more draft counts than this fit a printed mean length, crossrt does not test each
# against the per-position rates: drafted / k is taken if it fits, else the line is refused.
MAX_TRIED = 1_000
DIGITS = re.compile(r"[0-9]+")


class ImportFailure(CrossrtError, ValueError):
    """A file that is not in the named format, or whose numbers do not give counts."""


def count(text: str, what: str) -> int:
    """text as a count: decimal digits, kept exact, at most MAX_COUNT."""
    if not DIGITS.fullmatch(text):
        raise ImportFailure(f"{what} {text[:40]!r} is not a count (a whole number >= 0)")
    if len(text) > len(str(MAX_COUNT)) or int(text) > MAX_COUNT:
        raise ImportFailure(f"{what} {text[:40]}{'...' if len(text) > 40 else ''} is out of range: more than "
                            "2^63 - 1, which no runtime counts to")
    return int(text)


def json_count(value: Any, what: str) -> int:
    """A JSON value as a count: an int (not a bool, not a float) from 0 to MAX_COUNT."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ImportFailure(f"{what} is {str(value)[:40]!r}, not a count (a whole number >= 0)")
    if not 0 <= value <= MAX_COUNT:
        raise ImportFailure(f"{what} {str(value)[:40]} is " + ("negative" if value < 0 else "out of range (more than "
                                                               "2^63 - 1, which no runtime counts to)"))
    return value


def draft_length(k: int, what: str) -> int:
    if not 1 <= k <= MAX_K:
        raise ImportFailure(f"{what} {k} is not a draft length (1 to {MAX_K} tokens)")
    return k


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
    # One per request where the source keeps its requests apart (AIPerf's per-request export),
    # each counted as these are (their sums); empty: the counts are one aggregate.
    prompts: tuple["PromptCounts", ...] = ()
    missing: tuple[str, ...] = ()  # what the source lacks beyond the usual (counters, ids, timings), in words

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


@dataclass(frozen=True)
class PromptCounts:
    """One request of a source that keeps them apart: the prompt it ran (category None: the
    import's --category) and its counts, or None and why (a request that failed, or that has no
    speculative statistics)."""

    prompt_id: str
    category: Optional[str]
    counts: Optional[SourceCounts]
    error: Optional[str] = None


def padded(counts: Sequence[int], width: int) -> tuple[int, ...]:
    """counts cut or extended with zeros to width: positions never reached print no counter."""
    return tuple(counts[:width]) + (0,) * (width - len(counts))


def shown(value: float, printed: str) -> bool:
    """Whether value, formatted with as many decimals as printed has, is printed ('%.2f' in
    Python and C's printf round the binary value the same way)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return f"{value:.{decimals}f}" == printed


def fitting(value_of: Callable[[int], float], printed: str, low: int, high: int) -> range:
    """The integers n in low .. high with value_of(n) shown as printed, for value_of monotonic
    in n (either way): contiguous, found by bisection in O(log(high - low)) formats."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    target = float(printed)
    if low > high:
        return range(0)

    def rounded(n: int) -> float:
        return float(f"{value_of(n):.{decimals}f}")

    sign = 1 if rounded(high) >= rounded(low) else -1

    def first(past: Callable[[float], bool]) -> int:  # the first n in low .. high + 1 with past(rounded(n))
        start, end = low, high + 1
        while start < end:
            middle = (start + end) // 2
            if past(rounded(middle)):
                end = middle
            else:
                start = middle + 1
        return start

    return range(first(lambda v: sign * v >= sign * target), first(lambda v: sign * v > sign * target))


def counts_of_rate(printed: str, denominator: int) -> range:
    """The integers c in 0 .. denominator with c / denominator shown as printed; contiguous,
    since c / denominator grows with c."""
    return fitting(lambda c: c / denominator, printed, 0, denominator)


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
    if accepted > drafted:
        raise ImportFailure(f"{where}: {accepted} accepted of {drafted} drafted tokens: more than were drafted")
    low, high = (max(1, -(-drafted // k)) if k else 1), max(1, drafted)
    by_mean = fitting(lambda n: 1 + accepted / n, mean_length, low, high)

    def fits_rates(n: int) -> bool:
        return not rates or position_counts(rates, n, accepted)[1]

    found = [n for n in by_mean if fits_rates(n)] if len(by_mean) <= MAX_TRIED else None
    if found == []:
        raise ImportFailure(f"{where}: no number of drafts gives mean length {mean_length[:40]} for {accepted} accepted "
                            f"of {drafted} drafted tokens" + (" and the per-position rates" if rates else ""))
    candidates = found if found is not None else by_mean
    full = drafted // k if k and drafted % k == 0 else None
    assumption = None
    if found is not None and len(found) == 1:
        steps = found[0]
    elif full is not None and full in candidates and fits_rates(full):
        steps = full
        assumption = (f"{where}: {len(candidates)} draft counts ({candidates[0]}-{candidates[-1]}) fit the printed "
                      f"{'rates' if found is not None else 'mean length'}; taken: drafted / k = {steps} "
                      f"(every draft {k} tokens long)")
    else:
        raise ImportFailure(f"{where}: the printed rates fit {candidates[0]} to {candidates[-1]} drafts and crossrt "
                            "cannot tell which; import the runtime's counters instead (its /metrics)")
    per_pos = position_counts(rates, steps, accepted)[0] if rates else None
    return Drafts(steps, per_pos, assumption)


def summed(parts: Sequence[Optional[tuple[int, ...]]]) -> Optional[tuple[int, ...]]:
    """Per-position counts summed over parts; None if any part lacks them."""
    if not parts or any(part is None for part in parts):
        return None
    width = max(len(part) for part in parts)
    return tuple(sum(column) for column in zip(*(padded(part, width) for part in parts)))
