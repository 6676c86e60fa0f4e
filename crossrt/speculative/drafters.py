"""What proposes a step's draft in crossrt's one loop (crossrt/speculative/loop.py): a chain from a draft
model (a ModelSession: a smaller model or a layer-skip drafter), a chain from a lookup
(crossrt/speculative/lookup/), or a static tree from a draft model. A drafter keeps its own cache in step
with the context; the loop tells it what the target kept.

- ModelDrafter: the drafter decodes the context's uncached tail, then its own argmax one token
  at a time, up to the step's length, ended early by its ChainStops (draft_chain: the walk an
  oracle's drafter shares, crossrt/simulate/oracle_sessions.py). It never decodes its own last
  draft token, which it would only need if every draft token were kept. Under llama.cpp's
  schedules it mirrors the target: cut back to the target's cache and fed the batch the target
  verifies, so its numerics are those of the native tools.
- Lookups (crossrt/speculative/lookup/): copied from the context, no model; crossrt's own, transformers'
  and llama.cpp's proposers, each in a module of its own.
- TreeDrafter: a static tree (crossrt/speculative/tree.py) cut to the step's depth, built depth first:
  one pass over the context's tail gives the root's candidates, one single-token pass per inner
  node gives that node's; a node of rank path p + [r] is the r-th candidate (candidates)
  after p's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from crossrt.records.trace import TraceRecorder, top1_probability
from crossrt.speculative.acceptance import Proposal
from crossrt.speculative.schedules import top_probability
from crossrt.speculative.session import ModelSession, Rows
from crossrt.speculative.tree import Tree


def candidates(row: np.ndarray, width: int) -> list[int]:
    """The drafter's width best tokens in tree.token_rank's order (a stable descending sort)."""
    top = np.argpartition(-row, width - 1)[:width] if width < row.size else np.arange(row.size)
    return sorted((int(t) for t in top), key=lambda t: (-row[t], t))[:width]


class Drafter(Protocol):
    calls: int  # drafter passes (lookups for prompt lookup) made so far
    sessions: tuple[ModelSession, ...]  # the caches it holds, whose contexts must fit the run
    # Its drafts run past the token budget (up to k tokens whenever the schedule allows any),
    # as transformers' prompt lookup does; the schedule crops what a step yields past it.
    past_budget: bool
    # It drafts to k, drops a draft shorter than n_min and only then cuts it to the step's
    # limit, as llama.cpp's heads do; else the loop drops a short draft (llama-* schedules).
    own_n_min: bool

    def prefill(self, ids: Sequence[int]) -> None:
        """Start from an empty cache holding ids."""

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        """A draft of at most n_max tokens (a tree: of depth at most n_max) after context."""

    def mirror(self, n_keep: int, batch: Sequence[int]) -> None:
        """Cut back to n_keep tokens and decode batch, as the target verifies it."""

    def keep(self, n_keep: int) -> None:
        """The target kept n_keep tokens of context: drop anything cached past them."""


class _SessionDrafter:
    """The cache handling of a drafter that is a ModelSession."""

    past_budget = False
    own_n_min = False

    def __init__(self, session: ModelSession):
        self.session = session
        self.sessions = (session,)
        self.calls = 0

    def prefill(self, ids: Sequence[int]) -> None:
        self.session.truncate(0)
        self.session.eval(ids, Rows.NONE)

    def mirror(self, n_keep: int, batch: Sequence[int]) -> None:
        self.session.truncate(n_keep)
        self.session.eval(batch, Rows.NONE)

    def keep(self, n_keep: int) -> None:
        self.session.truncate(min(self.session.n_past, n_keep))

    def _row(self, tokens: Sequence[int]) -> np.ndarray:
        self.calls += 1
        return self.session.eval(tokens, Rows.LAST)[0]


@dataclass(frozen=True)
class ChainStops:
    """Where a chain ends short of the step's length: before a token whose probability is below
    floor (llama.cpp's p_min on its top-10 softmax in float32, top10; else the confidence
    policy's min_p1 on the full softmax), the pass that found it still counted; after a token of
    ends (transformers' assisted generation stops at EOS)."""

    floor: float = 0.0
    top10: bool = False
    ends: frozenset[int] = frozenset()

    def unsure(self, row: np.ndarray) -> bool:
        """Stop before the token of this row of drafter logits."""
        return self.floor > 0 and self.below(top_probability(row) if self.top10 else top1_probability(row))

    def below(self, probability) -> bool:
        """A token of this probability (top-10 or full softmax, as top10 says) is one to stop before."""
        return self.floor > 0 and probability < (np.float32(self.floor) if self.top10 else self.floor)


def draft_chain(n_max: int, ends: frozenset[int], read: Callable[[Sequence[int]], Optional[int]]) -> Proposal:
    """A chain of at most n_max tokens: read(draft) gives the drafter's token after draft, or None
    where it is unsure of it; the chain ends after a token of ends."""
    draft: list[int] = []
    while len(draft) < n_max:
        token = read(draft)
        if token is None:
            break
        draft.append(token)
        if token in ends:
            break
    return Proposal.chain(draft)


class ModelDrafter(_SessionDrafter):
    """A draft model's greedy chain (module docstring); trace: records the drafter's row of every
    draft token."""

    def __init__(self, session: ModelSession, stops: ChainStops = ChainStops(),
                 trace: Optional[TraceRecorder] = None):
        super().__init__(session)
        self.stops, self.trace = stops, trace

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        def read(draft: Sequence[int]) -> Optional[int]:
            row = self._row(draft[-1:] if draft else context[self.session.n_past:])
            if self.stops.unsure(row):
                return None
            if self.trace is not None:
                self.trace.drafted(row)
            return int(row.argmax())

        return draft_chain(n_max, self.stops.ends, read)


class TreeDrafter(_SessionDrafter):
    """A static tree from a draft model (module docstring)."""

    def __init__(self, session: ModelSession, tree: Tree):
        super().__init__(session)
        self.cuts = tree.cuts
        self.depth = tree.depth

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        tree = self.cuts[min(self.depth, n_max)]
        if tree is None:
            return Proposal.chain(())
        children: dict[tuple, list[int]] = {}
        for path in tree.paths:
            children.setdefault(path[:-1], []).append(path[-1])
        tokens: dict[tuple, int] = {}
        base = len(context)

        def expand(path: tuple, row: np.ndarray) -> None:
            ranks = children[path]
            best = candidates(row, max(ranks) + 1)  # taken before the next pass reuses row's buffer
            for rank in ranks:
                tokens[path + (rank,)] = best[rank]
            for rank in ranks:
                child = path + (rank,)
                if child in children:
                    expand(child, self._row((tokens[child],)))
                    self.session.truncate(base + len(path))

        expand((), self._row(context[self.session.n_past:]))
        self.session.truncate(base)
        return Proposal(tuple(tokens[path] for path in tree.paths), tree.parents)
