"""Timings a user can quote, as llama-bench and vLLM's bench give them: with `run --repeat N`
each prompt ran N times, plain baseline then speculative, interleaved, so every speedup divides
by a baseline timed beside it.

- tok/s and speedup per repetition (all of a group's prompts' tokens over their seconds in that
  repetition), then mean ± sample standard deviation over the repetitions;
- TTFT: the prompt pass of target and drafter, which yields the first token (PromptResult's
  prefill_s), per prompt and repetition; TPOT: the rest of the time over the tokens after the
  first, (decode_s) / (emitted - 1), as vLLM's bench defines it; both as p50 and p90 in ms.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from crossrt.records.schema import PromptResult, RunRecord, Timings
from crossrt.records.tables import IDENTITY, Column, Table, cell, identity, number


@dataclass(frozen=True)
class Spread:
    """A figure over repetitions: its mean, sample standard deviation (0 for one) and count."""

    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Optional["Spread"]:
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            return None
        return cls(statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0, len(finite))


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Optional["Percentiles"]:
        if not values:
            return None
        p50, p90 = np.percentile(np.asarray(values, dtype=float), [50, 90])
        return cls(float(p50), float(p90))


def _timed(results: Sequence[PromptResult]) -> list[PromptResult]:
    return [r for r in results if r.ok and r.timings is not None and r.output_ids]


def repetitions(result: PromptResult) -> tuple[Timings, ...]:
    """Every timing of the prompt: its repetitions, or its one run."""
    return result.repeats or ((result.timings,) if result.timings is not None else ())


def repetition_count(results: Sequence[PromptResult]) -> int:
    """How many times the group's prompts ran (1 without --repeat; the fewest where they differ)."""
    timed = _timed(results)
    return min((len(repetitions(r)) for r in timed), default=0)


def _rates(results: Sequence[PromptResult]) -> tuple[list[float], list[float]]:
    """(tok/s, speedup) per repetition over the group's prompts."""
    timed = _timed(results)
    rates, speedups = [], []
    for i in range(repetition_count(timed)):
        tokens = sum(len(r.output_ids) for r in timed)
        baseline_tokens = sum(len(r.baseline_ids) for r in timed)
        decode = sum(repetitions(r)[i].decode_s for r in timed)
        baseline_decode = sum(repetitions(r)[i].baseline_decode_s for r in timed)
        if decode > 0 and baseline_decode > 0:
            rates.append(tokens / decode)
            speedups.append(tokens / decode / (baseline_tokens / baseline_decode))
    return rates, speedups


def tokens_per_s(results: Sequence[PromptResult]) -> Optional[Spread]:
    return Spread.of(_rates(results)[0])


def speedup(results: Sequence[PromptResult]) -> Optional[Spread]:
    return Spread.of(_rates(results)[1])


def ttft_ms(results: Sequence[PromptResult]) -> Optional[Percentiles]:
    return Percentiles.of([1000 * t.prefill_s for r in _timed(results) for t in repetitions(r)])


def tpot_ms(results: Sequence[PromptResult]) -> Optional[Percentiles]:
    return Percentiles.of([1000 * t.decode_s / (len(r.output_ids) - 1)
                           for r in _timed(results) if len(r.output_ids) > 1 for t in repetitions(r)])


TIMING_COLUMNS = (Column("category", "category"), Column("repetitions", "runs"),
                  Column("tokens_per_s", "tok/s"), Column("tokens_per_s_std", "± tok/s"),
                  Column("speedup", "speedup"), Column("speedup_std", "± speedup"),
                  Column("ttft_p50_ms", "TTFT p50 ms"), Column("ttft_p90_ms", "TTFT p90 ms"),
                  Column("tpot_p50_ms", "TPOT p50 ms"), Column("tpot_p90_ms", "TPOT p90 ms"))


def timing_table(runs: Sequence[tuple[Path, RunRecord]]) -> Table:
    """Per record and category (and ALL): repetitions, tok/s and speedup mean and std over them,
    TTFT and TPOT p50 and p90 over prompts and repetitions."""
    rows = []
    for path, record in runs:
        for category in (*record.categories(), None):
            results = [r for r in record.results if category is None or r.category == category]
            rate, gain, ttft, tpot = tokens_per_s(results), speedup(results), ttft_ms(results), tpot_ms(results)
            rows.append((*identity(path, record), cell(category or "ALL"), cell(repetition_count(results)),
                         number(rate and rate.mean, ".1f"), number(rate and rate.std, ".1f"),
                         number(gain and gain.mean), number(gain and gain.std),
                         number(ttft and ttft.p50, ".1f"), number(ttft and ttft.p90, ".1f"),
                         number(tpot and tpot.p50, ".1f"), number(tpot and tpot.p90, ".1f")))
    return Table((*IDENTITY, *TIMING_COLUMNS), tuple(rows))
