"""Which draft tokens the target accepts: the acceptance rules of crossrt's one loop
(crossrt/speculative/loop.py), which the simulator runs on an oracle too (crossrt/simulate/oracle.py).

- Greedy: the longest run of draft tokens equal to the target's argmax after what came before;
  on a tree, from the root, the child holding the target's argmax while there is one. An EOS is
  never accepted as a draft token (it ends the step as the target's own token), except that
  llama.cpp's verification (common/sampling.cpp, sample-and-accept-n) accepts a matched EOS in
  the draft's last position: eos_last.
- Relaxed (lossy): a draft token is also accepted when it is among the target's top-m at its
  position and within delta logits of the target's top-1; never an EOS. top-m 1 or delta 0 is
  exact greedy.
After the accepted tokens the target's own next token is emitted (the bonus), whatever the rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from crossrt.errors import SettingsError
from crossrt.speculative.numerics import Choices


@dataclass(frozen=True)
class Proposal:
    """A step's draft: node i + 1 holds tokens[i], its parent parents[i + 1] (node 0 is the root,
    the context's last token, parents[0] = -1). A chain is the tree whose node i's parent is i - 1."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "Proposal":
        return cls(tuple(tokens), tuple(range(-1, len(tokens))))

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens)))

    def __len__(self) -> int:
        return len(self.tokens)

    def kept(self, walk: Sequence[int], best: np.ndarray) -> list[int]:
        """The tokens a step emits: the accepted nodes' tokens along walk, then the target's own."""
        return [self.tokens[node - 1] for node in walk[1:]] + [int(best[walk[-1]])]


def greedy_length(draft: Sequence[int], best: Sequence[int], eog: frozenset[int], eos_last: bool = False) -> int:
    """How many tokens of draft greedy verification accepts, best[i] being the target's
    argmax at draft position i; eos_last: a matched EOS in the last position is accepted."""
    n = 0
    while n < len(draft) and draft[n] == best[n] and (draft[n] not in eog or (eos_last and n + 1 == len(draft))):
        n += 1
    return n


class AcceptanceRule(Protocol):
    lossy: bool

    def walk(self, rows: np.ndarray, choices: Choices, proposal: Proposal) -> list[int]:
        """The accepted nodes from the root (walk[0] == 0), rows: the target's logits per node."""


@dataclass(frozen=True)
class Greedy:
    eog: frozenset[int]
    eos_last: bool = False  # llama.cpp's verification
    lossy = False

    def walk(self, rows: np.ndarray, choices: Choices, proposal: Proposal) -> list[int]:
        if proposal.is_chain:
            return list(range(greedy_length(proposal.tokens, choices.best, self.eog, self.eos_last) + 1))
        child = {(parent, token): node for node, (parent, token)
                 in enumerate(zip(proposal.parents[1:], proposal.tokens), start=1)}
        walk = [0]
        while True:
            choice = int(choices.best[walk[-1]])
            node = child.get((walk[-1], choice))
            if node is None or choice in self.eog:
                return walk
            walk.append(node)


@dataclass(frozen=True)
class Relaxed:
    """Accept draft token i while it is the target's choice, or among its top_m with a logit
    within delta of the choice's; never an EOS. Chains only."""

    top_m: int
    delta: float
    eog: frozenset[int]

    def __post_init__(self):
        if self.top_m < 1 or self.delta < 0:
            raise SettingsError(f"relaxed acceptance needs top-m >= 1 and delta >= 0, got {self.top_m}, {self.delta}")

    @property
    def lossy(self) -> bool:
        return self.top_m > 1 and self.delta > 0

    def walk(self, rows: np.ndarray, choices: Choices, proposal: Proposal) -> list[int]:
        if not proposal.is_chain:
            raise SettingsError("relaxed acceptance verifies chains, not trees")
        draft, best = proposal.tokens, choices.best
        n = 0
        while n < len(draft) and draft[n] not in self.eog:
            row, token = rows[n], draft[n]
            if token != best[n]:
                gap = float(row[best[n]] - row[token])
                if gap > self.delta or int(np.count_nonzero(row > row[token])) >= self.top_m:
                    break
            n += 1
        return list(range(n + 1))
