"""The one numerics verdict: were two different emitted tokens a near-tie?

Two passes that compute the same function (the same weights after the same tokens, in another
batch shape, on another runtime or CPU) can still emit different tokens when the candidates lie
within rounding of each other. Whether a split is numerics is decided here and nowhere else
(parity, diff, the report all call `judge`):

- each side of a split emitted its token from a pass; its *gap* is how far that pass put the
  other side's token below its own (0 <= gap where the pass chose by argmax);
- the split is a near-tie when the gaps of both sides sum to at most the threshold of what is
  compared (crossrt/compare/tolerance.py: `near_tie_flip`, measured per class of weights and cache),
  however many other candidates lie between them: a three-way near-tie is a near-tie.

Gaps come from what the run recorded (PassView's close candidates: every token within
CLOSE_WINDOW logits of each pass's choice, so any gap a threshold admits is known exactly) or,
for runs that recorded nothing (native runtimes), from a re-score of the same context in the
pass shapes the runtime used (crossrt/compare/replay.py), whose gap may come out negative: the
re-score ranks the two the other way; its size still bounds how far the numerics had to move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

# Logits below a pass's choice within which candidates are recorded. It must exceed every
# near_tie_flip in crossrt/compare/tolerance.py (the largest, quantized weights across runtimes, is 3.0),
# so that a gap any threshold could admit is read exactly, never bounded.
CLOSE_WINDOW = 4.0
CLOSE_MAX = 8  # candidates kept per pass, nearest first (a flat row would keep the vocabulary)


@dataclass(frozen=True)
class Choices:
    """What one target pass chose per row: the argmax, the runner-up and top-1 minus top-2
    margin, and the other candidates within CLOSE_WINDOW of the choice with their gaps below it."""

    best: np.ndarray
    second: np.ndarray
    margins: np.ndarray
    close_ids: tuple[tuple[int, ...], ...]
    close_gaps: tuple[tuple[float, ...], ...]

    def rows(self, index: Sequence[int]) -> "Choices":
        """These choices at the given rows, in that order (a tree's accepted walk)."""
        return Choices(self.best[index], self.second[index], self.margins[index],
                       tuple(self.close_ids[i] for i in index), tuple(self.close_gaps[i] for i in index))


def choose(rows: np.ndarray) -> Choices:
    """Per logits row: the argmax, the runner-up, their margin and the close candidates. Two
    argmax passes and one comparison against the window cost far less than sorting a
    262,144-token vocabulary; a read-only view is copied first."""
    work = rows if rows.flags.writeable else rows.copy()
    index = np.arange(len(work))
    best = work.argmax(axis=1)
    best_logits = work[index, best].copy()
    work[index, best] = -np.inf
    second = work.argmax(axis=1)
    margins = best_logits - work[index, second]
    work[index, best] = best_logits
    close_ids, close_gaps = [], []
    for row, chosen, top in zip(work, best, best_logits):
        near = np.flatnonzero(row >= top - CLOSE_WINDOW)
        near = near[near != chosen]
        gaps = top - row[near]
        order = np.lexsort((near, gaps))[:CLOSE_MAX]  # nearest first, ties to the lower id
        close_ids.append(tuple(int(t) for t in near[order]))
        close_gaps.append(tuple(float(g) for g in gaps[order]))
    return Choices(best, second, margins, tuple(close_ids), tuple(close_gaps))


@dataclass(frozen=True)
class Gap:
    """How far one pass put the other side's token below the token it emitted, in logits.
    at_least: only a lower bound is known (the token lay outside the recorded candidates)."""

    value: float
    at_least: bool
    source: str  # "recorded" (the run's own pass) or a re-scored pass shape, e.g. "re-scored 8-token batch"

    def describe(self) -> str:
        if self.at_least:
            return f"more than {self.value:.3g} below ({self.source})"
        if self.value < 0:
            return f"{-self.value:.3g} above ({self.source}: ranked the other way)"
        return f"{self.value:.3g} below ({self.source})"


def recorded_gap(margin: float, runner_up: int, close_ids: Optional[Sequence[int]],
                 close_gaps: Optional[Sequence[float]], emitted: int, other: int) -> Gap:
    """The gap of other below emitted in a recorded pass (schema.PassView's entry for it)."""
    if other == emitted:
        return Gap(0.0, False, "recorded")
    if close_ids is not None:
        if other in close_ids:
            return Gap(float(close_gaps[list(close_ids).index(other)]), False, "recorded")
        return Gap(CLOSE_WINDOW, True, "recorded")
    if other == runner_up:  # records written before close candidates: the runner-up alone
        return Gap(float(margin), False, "recorded")
    return Gap(float(margin), True, "recorded")


def rescored_gap(row: np.ndarray, emitted: int, other: int, source: str) -> Gap:
    """The gap of other below emitted in a re-scored row (negative: the row prefers other)."""
    return Gap(float(row[emitted] - row[other]), False, source)


@dataclass(frozen=True)
class NearTie:
    """The verdict on one split: the gaps both sides saw, their sum (the flip: how far the
    numerics moved the two candidates apart), and the threshold it was judged against."""

    gaps: tuple[Gap, ...]
    threshold: float
    threshold_reason: str

    @property
    def flip(self) -> float:
        return math.fsum(abs(gap.value) for gap in self.gaps)

    @property
    def near(self) -> bool:
        return not any(gap.at_least for gap in self.gaps) and self.flip <= self.threshold

    def describe(self) -> str:
        relation = "<=" if self.near else ">"
        bound = "at least " if any(gap.at_least for gap in self.gaps) else ""
        return f"flip {bound}{self.flip:.3g} {relation} {self.threshold:g} ({self.threshold_reason})"


def judge(gaps: Sequence[Gap], threshold: float, threshold_reason: str) -> NearTie:
    """The one near-tie verdict (module docstring)."""
    return NearTie(tuple(gaps), threshold, threshold_reason)


# How two runs' logits move against each other, measured where both scored the same rows: per
# row, how far the gap between A's top-2 tokens moves in B. Its 90th percentile is the noise (the
# max would let one outlier excuse everything); noise above a quarter of the median top-2 margin
# means the two do not compute the same function at all (another model, a convention bug).
NOISE_PERCENTILE = 90
NOISE_FACTOR = 3.0  # a flip within 3x the measured noise is numerics, where the noise is measured
BROAD_DISAGREEMENT = 0.25


def gap_shifts(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: A's top-2 margin, and how much that gap moves in B."""
    if len(a) == 0:
        return np.zeros(0), np.zeros(0)
    choices = choose(np.asarray(a, dtype=np.float64))
    rows = np.arange(len(a))
    gap_b = b[rows, choices.best] - b[rows, choices.second]
    return choices.margins, np.abs(choices.margins - gap_b)


@dataclass(frozen=True)
class Noise:
    """Gap shifts between two runs on rows both scored (gap_shifts), summarized."""

    p90: float
    max: float
    median_margin: float

    @classmethod
    def of(cls, margins: np.ndarray, shifts: np.ndarray) -> Optional["Noise"]:
        if not len(shifts):
            return None
        return cls(float(np.percentile(shifts, NOISE_PERCENTILE)), float(shifts.max()), float(np.median(margins)))

    @property
    def broadly_different(self) -> bool:
        return self.p90 > BROAD_DISAGREEMENT * self.median_margin

    def threshold(self, floor: float) -> float:
        """The near-tie threshold where this noise is measured: the class's, or 3x the noise."""
        return max(floor, NOISE_FACTOR * self.p90)

