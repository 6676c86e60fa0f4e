"""How long each step's draft is: the k policies of crossrt's one loop (crossrt/speculative/loop.py),
run for real and simulated exactly on the chain oracle (crossrt/simulate/adaptive.py, docs/ceiling.md).

A policy picks each step's k from what the loop knows before drafting: fixed; per content type
(code or prose, judged from the text of the last tokens, with a k per type, e.g. the
simulator's best k per category); online from recent acceptance (after a step that accepted its
whole draft, one more, else the accepted length plus one, within 1..k_max); and a
drafter-confidence stop (stop before a token whose drafter top-1 probability is below min_p1;
the pass that found it still costs, as in crossrt/simulate/oracle.py). The schedule then caps the
length at the budget. Under greedy acceptance a policy's decisions depend only on the target's
greedy output and the drafter's greedy drafts, so the simulation reproduces a real run step for
step (a test checks).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from crossrt.errors import SettingsError
from crossrt.speculative.strategies import Strategy

CONTENT_WINDOW = 24  # tokens of context whose text decides the content type
# Code: an indented line, a line ending in ":" or a bracket, or code punctuation and keywords.
_CODE = re.compile(r"(^|\n)( {2,}|\t)\S|[:(\[{,]\s*$|[=(){}\[\];]|\b(def|return|class|import|self)\b")


def content_type(text: str) -> str:
    """"code" or "prose", from the last two lines of text."""
    return "code" if _CODE.search("\n".join(text.split("\n")[-2:])) else "prose"


@dataclass(frozen=True)
class DraftPolicy:
    """How long each step's draft is. k: the fixed k, the start of the online rule, or the k
    of content types by_content does not name; k_max: the online rule's ceiling."""

    label: str
    k: int
    by_content: Optional[Mapping[str, int]] = None
    online: bool = False
    k_max: int = 8
    min_p1: float = 0.0

    def __post_init__(self):
        ks = [self.k, self.k_max, *(self.by_content or {}).values()]
        if min(ks) < 1:
            raise SettingsError(f"policy {self.label}: every k must be at least 1")

    @classmethod
    def of(cls, strategy: Strategy, k: int) -> "DraftPolicy":
        """The policy of a run's strategy, k being the run's k (DraftRules.k)."""
        return cls(strategy.label(), k, dict(strategy.content_k) if strategy.k_policy == "content" else None,
                   strategy.k_policy == "online", strategy.k_max, strategy.min_p1)

    def k_strategy(self) -> Strategy:
        """The strategy whose k rule this policy's is at k = self.k (DraftPolicy.of's inverse, the
        min_p1 stop apart: the drafter's, loop.chain_stops), for the loop run on an oracle."""
        if self.online:
            return Strategy(k_policy="online", k_max=self.k_max)
        if self.by_content:
            return Strategy(k_policy="content", content_k=tuple(self.by_content.items()))
        return Strategy()

    @property
    def largest_k(self) -> int:
        return max(self.k, self.k_max if self.online else 0, *(self.by_content or {}).values())

    def next_k(self, previous: Optional[tuple[int, int]], text: Callable[[], str]) -> int:
        """The k of the next step; previous: the last step's (drafted, accepted), None at first."""
        if self.online:
            if previous is None:
                return self.k
            drafted, accepted = previous
            return min(self.k_max, drafted + 1 if accepted == drafted else accepted + 1)
        if self.by_content:
            return self.by_content.get(content_type(text()), self.k)
        return self.k
