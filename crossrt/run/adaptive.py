"""Content-adaptive drafting: the crossrt schedule with a draft length chosen per step, run for
real and simulated exactly on the chain oracle (docs/ceiling.md).

A policy picks each step's k from what the loop knows before drafting: fixed; per content type
(code or prose, judged from the text of the last tokens, with a k per type, e.g. the
simulator's best k per category); online from recent acceptance (after a step that accepted its
whole draft, one more, else the accepted length plus one, within 1..k_max); and optionally
a drafter-confidence stop (stop before a token whose drafter top-1 probability is below min_p1;
the pass that found it still costs, as in crossrt/run/simulate.py). Everything else is the crossrt
schedule (crossrt/run/loop.py): drafts capped at budget - emitted - 1, the longest matching prefix
accepted, no EOS accepted as a draft token, the target's token after it emitted.

The acceptance rule is a parameter: exact greedy here; crossrt/run/relaxed.py gives a lossy one.
Under the greedy rule a policy's decisions depend only on the target's greedy output and the
drafter's greedy drafts, so simulate_policy reproduces a real run step for step (a test checks).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from crossrt.errors import SettingsError
from crossrt.run.runtime import ModelSession, Rows
from crossrt.run.schedules import Generation, check_prompt, prefill_pair
from crossrt.run.simulate import Oracle, SimRun, oracle_step
from crossrt.records.trace import top1_probability

CONTENT_WINDOW = 24  # tokens of context whose text decides the content type
# Code: an indented line, a line ending in ":" or a bracket, or code punctuation and keywords.
_CODE = re.compile(r"(^|\n)( {2,}|\t)\S|[:(\[{,]\s*$|[=(){}\[\];]|\b(def|return|class|import|self)\b")
# (rows, draft, greedy choices) -> draft tokens accepted
AcceptRule = Callable[[np.ndarray, Sequence[int], np.ndarray], int]


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


def greedy_rule(eog: frozenset[int]) -> AcceptRule:
    def accept(rows: np.ndarray, draft: Sequence[int], choices: np.ndarray) -> int:
        n = 0
        while n < len(draft) and draft[n] == choices[n] and draft[n] not in eog:
            n += 1
        return n
    return accept


@dataclass(frozen=True)
class PolicyRun:
    generation: Generation
    drafter_calls: int

    def sim_run(self, prompt_id: str, category: str) -> SimRun:
        g = self.generation
        return SimRun(prompt_id, category, g.step_drafted, g.step_accepted, self.drafter_calls)


def policy_generate(target: ModelSession, drafter: ModelSession, prompt_ids: Sequence[int], policy: DraftPolicy,
                    max_new_tokens: int, accept: Optional[AcceptRule] = None) -> PolicyRun:
    """Speculative decoding under policy (module docstring); accept: the acceptance rule,
    greedy by default."""
    check_prompt(prompt_ids, max_new_tokens, [target, drafter])
    accept = accept or greedy_rule(target.eog_ids)
    start = time.perf_counter()
    context = prefill_pair(target, drafter, prompt_ids)
    prefilled = time.perf_counter()
    eog = target.eog_ids
    step_drafted: list[int] = []
    step_accepted: list[int] = []
    calls = n_emitted = 0
    previous = None
    stop_reason = "max_new_tokens"
    while n_emitted < max_new_tokens:
        k = policy.next_k(previous, lambda: target.detokenize(context[-CONTENT_WINDOW:]))
        cap = min(k, max_new_tokens - n_emitted - 1)
        draft: list[int] = []
        pending = context[drafter.n_past:]
        while len(draft) < cap:
            row = drafter.eval(pending, Rows.LAST)[0]
            calls += 1
            if policy.min_p1 > 0 and top1_probability(row) < policy.min_p1:
                break
            draft.append(int(row.argmax()))
            pending = (draft[-1],)
        rows = target.eval([context[-1]] + draft, Rows.ALL)
        choices = rows.argmax(axis=1)
        n_accepted = accept(rows, draft, choices)
        kept = draft[:n_accepted] + [int(choices[n_accepted])]
        target.truncate(len(context) + n_accepted)
        drafter.truncate(min(drafter.n_past, len(context) + n_accepted))
        context += kept
        n_emitted += len(kept)
        step_drafted.append(len(draft))
        step_accepted.append(n_accepted)
        previous = (len(draft), n_accepted)
        if kept[-1] in eog:
            stop_reason = "eos"
            break
    generation = Generation(tuple(context[len(prompt_ids):]), stop_reason, prefilled - start,
                            time.perf_counter() - prefilled, tuple(step_drafted), tuple(step_accepted))
    return PolicyRun(generation, calls)


def simulate_policy(oracle: Oracle, policy: DraftPolicy, detokenize: Callable[[Sequence[int]], str]) -> SimRun:
    """policy_generate's greedy steps on the chain oracle, exactly."""
    if policy.largest_k > oracle.max_k:
        raise SettingsError(f"policy {policy.label} drafts up to {policy.largest_k}; the oracle holds {oracle.max_k}")
    context = oracle.prompt_ids + oracle.output
    step_drafted, step_accepted = [], []
    calls = emitted = 0
    previous = None
    while emitted < len(oracle.output):
        end = len(oracle.prompt_ids) + emitted
        k = policy.next_k(previous, lambda: detokenize(context[max(0, end - CONTENT_WINDOW):end]))
        n_draft, n_accepted, passes = oracle_step(oracle, emitted, k, policy.min_p1)
        calls += passes
        step_drafted.append(n_draft)
        step_accepted.append(n_accepted)
        previous = (n_draft, n_accepted)
        emitted += n_accepted + 1
    return SimRun(oracle.prompt_id, oracle.category, tuple(step_drafted), tuple(step_accepted), calls)
