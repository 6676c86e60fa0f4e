"""Content-adaptive drafting simulated exactly on the chain oracle (docs/ceiling.md): the k
policies of crossrt/speculative/policies.py run by the one loop itself on crossrt/simulate/oracle.py's
oracle (run_loop). Under the greedy rule a policy's decisions depend only on the target's
greedy output and the drafter's greedy drafts, so the simulation is a real run of the crossrt
schedule step for step, drafter passes included (a test checks).
"""

from __future__ import annotations

from typing import Callable, Sequence

from crossrt.errors import SettingsError
from crossrt.speculative.policies import DraftPolicy
from crossrt.run.runtime import DraftRules
from crossrt.speculative.schedules import SCHEDULE
from crossrt.simulate.oracle import Oracle, SimRun, run_loop


def simulate_policy(oracle: Oracle, policy: DraftPolicy, detokenize: Callable[[Sequence[int]], str]) -> SimRun:
    """The one loop's greedy steps under policy on the chain oracle, exactly."""
    if policy.largest_k > oracle.max_k:
        raise SettingsError(f"policy {policy.label} drafts up to {policy.largest_k}; the oracle holds {oracle.max_k}")
    return run_loop(oracle, SCHEDULE, DraftRules(policy.k), policy.k_strategy(), min_p1=policy.min_p1,
                    detokenize=detokenize)
