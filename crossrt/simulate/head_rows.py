"""A head's draft rows for an oracle: what an EAGLE3 head or a DFlash drafter proposes after
prompt + output[:j], for every j, so a head's run replays on the oracle as a drafter model's does.

A head's draft depends only on its context: it reads the target's features of the positions
before the newest token and that token (speculative/head_drafter.py seeds at len(context) - 2 on every
schedule). So one tapped target pass over prompt + output gives every position's features, and
the head drafts at each j through the Drafter protocol (keep, then propose), from the last j back,
since keep drops what lies past it. The features come from one pass, not the run's batches: a
draft whose argmax is a near-tie between batch shapes may differ (the tau gap's residual).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from crossrt.records.trace import top1_probability
from crossrt.speculative.head_drafter import head_drafter
from crossrt.run.runtime import ModelSession, Rows
from crossrt.speculative.schedules import top_probability


def head_rows(target: ModelSession, spec_type: str, head, prompt_ids: Sequence[int], output: Sequence[int],
              max_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(drafts, p1, p10), each [len(output) + 1, max_k] as Oracle holds them: row j is the head's
    draft after prompt + output[:j], max_k tokens, each with its full-softmax and top-10
    probabilities (the rules' p_min stop is applied when the row is read)."""
    n = len(output) + 1
    drafts = np.full((n, max_k), -1, dtype=np.int32)
    p1 = np.full((n, max_k), np.nan, dtype=np.float32)
    p10 = np.full((n, max_k), np.nan, dtype=np.float32)
    rows: list[np.ndarray] = []

    def read(row: np.ndarray) -> bool:
        rows.append(row)
        return False  # never stop here: every row is kept

    drafter = head_drafter(spec_type, head, target, max_k, 0, read)
    try:
        sequence = tuple(prompt_ids) + tuple(output)
        target.truncate(0)
        target.eval(sequence[:-1], Rows.NONE)  # tapped: the head holds every position's features
        for j in reversed(range(n)):
            context = sequence[:len(prompt_ids) + j]
            rows.clear()
            drafter.keep(len(context) - 1)
            draft = drafter.propose(context, max_k).tokens
            for i, (token, row) in enumerate(zip(draft, rows)):
                drafts[j, i], p1[j, i], p10[j, i] = token, top1_probability(row), top_probability(row)
    finally:
        drafter.close()
    return drafts, p1, p10
