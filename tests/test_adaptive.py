"""Adaptive draft lengths and relaxed acceptance on the tiny pair in real llama.cpp: policies
run for real equal their simulation on the chain oracle step for step; relaxed acceptance is
exact greedy at top-m 1 and measures its drift otherwise."""

import pytest

from crossrt.speculative import loop
from crossrt.simulate.adaptive import simulate_policy
from crossrt.inputs.prompts import load_prompts
from crossrt.speculative.policies import DraftPolicy, content_type
from crossrt.speculative.relaxed import drift, relaxed_run
from crossrt.run.runtime import DraftRules
from crossrt.simulate.oracle import Policy, SimRun, build_oracle, simulate
from crossrt.speculative.strategies import Strategy

PROMPTS = load_prompts("builtin")
MAX_NEW = 40
MAX_K = 6
# (k, strategy): what the loop runs; DraftPolicy.of gives the policy simulate_policy replays.
POLICIES = [(3, Strategy()), (2, Strategy(k_policy="content", content_k=(("code", 5), ("prose", 2)))),
            (2, Strategy(k_policy="online", k_max=6)), (6, Strategy(k_policy="confidence", min_p1=0.9)),
            (3, Strategy(k_policy="online", k_max=6, min_p1=0.5))]


@pytest.fixture(scope="module")
def oracles(tiny_sessions):
    target, drafter = tiny_sessions
    found = [build_oracle(target, drafter, p.id, p.category, target.tokenize(p.text), MAX_NEW, MAX_K) for p in PROMPTS]
    assert found, "no prompts: every loop over the oracles would pass vacuously"
    return found


def test_content_types():
    assert content_type("def f(x):\n    return x") == "code"
    assert content_type("The river ran past the mill and the children") == "prose"


@pytest.mark.parametrize("k, strategy", POLICIES, ids=lambda p: p.label() if isinstance(p, Strategy) else str(p))
def test_a_policy_run_equals_its_simulation(tiny_sessions, oracles, k, strategy):
    target, drafter = tiny_sessions
    policy = DraftPolicy.of(strategy, k)
    for oracle in oracles:
        real = loop.speculative_generate(target, drafter, oracle.prompt_ids, DraftRules(k), MAX_NEW, strategy=strategy)
        assert real.output_ids == oracle.output, oracle.prompt_id
        sim = simulate_policy(oracle, policy, target.detokenize)
        run = SimRun.of(real, oracle.prompt_id, oracle.category)
        assert (run.step_drafted, run.step_accepted, run.drafter_calls) == \
            (sim.step_drafted, sim.step_accepted, sim.drafter_calls), oracle.prompt_id


def test_fixed_and_confident_policies_are_the_chain_simulators(oracles, tiny_sessions):
    target, _ = tiny_sessions
    for oracle in oracles:
        for policy, chain in ((DraftPolicy("k4", 4), Policy(4)), (DraftPolicy("c", 6, min_p1=0.9), Policy(6, 0.9))):
            sim, expected = simulate_policy(oracle, policy, target.detokenize), simulate(oracle, chain)
            assert (sim.step_drafted, sim.step_accepted, sim.drafter_calls) == \
                (expected.step_drafted, expected.step_accepted, expected.drafter_calls)


def test_relaxed_acceptance_at_top_1_is_greedy_and_wider_is_measured_lossy(tiny_sessions, oracles):
    target, drafter = tiny_sessions
    exact = wide = 0
    for oracle in oracles:
        strict = relaxed_run(target, drafter, oracle.prompt_id, oracle.category, oracle.prompt_ids, oracle.output,
                             4, 1, 100.0, MAX_NEW)
        chain = simulate(oracle, Policy(4))
        assert strict.lossy and strict.first_divergence is None and strict.differing_share == 0.0
        assert (strict.steps, strict.accepted) == (chain.steps, chain.accepted)
        assert strict.logprob == pytest.approx(strict.greedy_logprob, abs=1e-6)
        loose = relaxed_run(target, drafter, oracle.prompt_id, oracle.category, oracle.prompt_ids, oracle.output,
                            4, 4, 100.0, MAX_NEW)
        assert (loose.first_divergence is None) == (loose.differing_share == 0.0)
        exact += strict.steps
        wide += loose.steps
        # An output that never left greedy's scores as greedy's.
        assert loose.first_divergence is not None or loose.logprob == pytest.approx(loose.greedy_logprob, abs=1e-6)
    assert wide < exact


def test_drift():
    assert drift((1, 2, 3), (1, 2, 3)) == (None, 0.0)
    assert drift((1, 5, 3, 4), (1, 2, 3)) == (1, 0.5)
