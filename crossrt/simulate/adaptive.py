"""Content-adaptive drafting simulated exactly on the chain oracle (docs/ceiling.md): the k
policies of crossrt/run/policies.py, the same DraftPolicy objects the one loop
(crossrt/run/loop.py) runs for real, replayed step for step on crossrt/simulate/oracle.py's oracle.

Under the greedy rule a policy's decisions depend only on the target's greedy output and the
drafter's greedy drafts, so simulate_policy reproduces a real run of the crossrt schedule step
for step, drafter passes included (a test checks).
"""

from __future__ import annotations

from typing import Callable, Sequence

from crossrt.errors import SettingsError
from crossrt.run.policies import CONTENT_WINDOW, DraftPolicy
from crossrt.simulate.oracle import Oracle, SimRun, oracle_step


def simulate_policy(oracle: Oracle, policy: DraftPolicy, detokenize: Callable[[Sequence[int]], str]) -> SimRun:
    """The one loop's greedy steps under policy on the chain oracle, exactly."""
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
