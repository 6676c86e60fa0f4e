"""Relaxed acceptance, lossy by construction: a draft token is also accepted when it is among the
target's top-m at its position and within delta logits of the target's top-1 (m = 1 or
delta = 0 is exact greedy; the rule itself: crossrt/speculative/acceptance.py, Relaxed). Runs go through
crossrt's one loop (crossrt/speculative/loop.py) with that rule; their results are labelled lossy and
carry the drift from the target's greedy output: the first position that leaves it, the share
of positions whose token differs, and the target's mean log-probability per emitted token of
each output (each scored by one teacher-forced target pass over prompt + output, so both are
scored alike). docs/ceiling.md has the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from crossrt.records.counts import Counts
from crossrt.speculative.draft_rules import DraftRules
from crossrt.speculative.loop import speculative_generate
from crossrt.speculative.session import ModelSession, Rows
from crossrt.speculative.strategies import Strategy


def mean_logprob(target: ModelSession, prompt_ids: Sequence[int], output: Sequence[int]) -> float:
    """The target's mean log-probability of output's tokens after prompt_ids, one pass."""
    if not output:
        return float("nan")
    target.truncate(0)
    target.eval(prompt_ids[:-1], Rows.NONE)
    rows = np.asarray(target.eval([prompt_ids[-1], *output[:-1]], Rows.ALL), dtype=np.float64)
    top = rows.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(rows - top).sum(axis=1)) + top[:, 0]
    return float(np.mean(rows[np.arange(len(output)), list(output)] - log_z))


@dataclass(frozen=True, kw_only=True)
class RelaxedResult(Counts):
    """One prompt under relaxed acceptance (its counts, tau), against the target's greedy output."""

    prompt_id: str
    category: str
    top_m: int
    delta: float
    lossy: bool  # always True: the rule may leave greedy decoding, whether or not it did here
    first_divergence: Optional[int]  # first output position that differs from greedy, None if none
    differing_share: float  # positions whose token differs from greedy's, over the longer output
    logprob: float  # mean target log-probability per emitted token
    greedy_logprob: float
    decode_s: float


def drift(output: Sequence[int], greedy: Sequence[int]) -> tuple[Optional[int], float]:
    """(first differing position, share of differing positions over the longer length)."""
    n = max(len(output), len(greedy))
    differ = [i for i in range(n) if i >= len(output) or i >= len(greedy) or output[i] != greedy[i]]
    return (differ[0] if differ else None), (len(differ) / n if n else 0.0)


def relaxed_run(target: ModelSession, drafter: ModelSession, prompt_id: str, category: str,
                prompt_ids: Sequence[int], greedy: Sequence[int], k: int, top_m: int, delta: float,
                max_new_tokens: int) -> RelaxedResult:
    """One relaxed run at fixed k, with its drift from greedy (the target's greedy output)."""
    run = speculative_generate(target, drafter, prompt_ids, DraftRules(k), max_new_tokens,
                               strategy=Strategy(acceptance="relaxed", top_m=top_m, delta=delta))
    first, share = drift(run.output_ids, greedy)
    return RelaxedResult(steps=len(run.step_accepted), drafted=sum(run.step_drafted), accepted=sum(run.step_accepted),
                         emitted=len(run.output_ids), prompt_id=prompt_id, category=category, top_m=top_m, delta=delta,
                         lossy=True, first_divergence=first, differing_share=share,
                         logprob=mean_logprob(target, prompt_ids, run.output_ids),
                         greedy_logprob=mean_logprob(target, prompt_ids, greedy), decode_s=run.decode_s)
