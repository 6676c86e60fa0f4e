"""The what-if simulator against real driven runs of the tiny pair in llama.cpp."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from crossrt.errors import ComparisonError
from crossrt import loop
from crossrt.cli.analysis import simulate_command
from crossrt.driver import RunRequest, run_pair
from crossrt.prompts import load_prompts
from crossrt.runtime import DraftRules, RuntimeOptions
from crossrt.simulate import (CostModel, Policy, build_oracle, compare_with_record, measure_costs, simulate,
                              simulate_suite)

from conftest import TINY_PAIR

PROMPTS = load_prompts("builtin")
MAX_K = 8
MAX_NEW = 40


@pytest.fixture(scope="module")
def oracles(tiny_sessions):
    target, drafter = tiny_sessions
    return [build_oracle(target, drafter, p.id, p.category, target.tokenize(p.text), MAX_NEW, MAX_K) for p in PROMPTS]


@pytest.mark.parametrize("k", range(1, MAX_K + 1))
def test_simulation_equals_a_real_run_step_for_step(tiny_sessions, oracles, k):
    target, drafter = tiny_sessions
    for oracle in oracles:
        real = loop.speculative_generate(target, drafter, oracle.prompt_ids, DraftRules(k), MAX_NEW)
        assert real.output_ids == oracle.output
        run = simulate(oracle, Policy(k))
        assert (run.step_drafted, run.step_accepted) == (real.step_drafted, real.step_accepted), oracle.prompt_id
        assert run.drafter_calls == run.drafted  # fixed k: one drafter pass per draft token


def test_simulation_follows_eos(tiny_sessions):
    """The prompt "b." is followed by EOS at once (models/tiny/README.md)."""
    target, drafter = tiny_sessions
    oracle = build_oracle(target, drafter, "eos", "eos", target.tokenize("b."), MAX_NEW, 4)
    real = loop.speculative_generate(target, drafter, oracle.prompt_ids, DraftRules(4), MAX_NEW)
    assert real.stop_reason == "eos" and oracle.output == real.output_ids
    assert simulate(oracle, Policy(4)).step_accepted == real.step_accepted


def test_oracle_rows_stop_at_the_budget(oracles):
    for oracle in oracles:
        for j in range(len(oracle.output)):
            allowed = min(MAX_K, MAX_NEW - j - 1)
            assert np.all(oracle.drafts[j, :allowed] >= 0) and np.all(oracle.drafts[j, allowed:] == -1)
            assert np.all(np.isnan(oracle.draft_p1[j, allowed:])) and np.all(oracle.draft_p1[j, :allowed] > 0)


def test_confidence_cutoff_drafts_only_confident_tokens(oracles):
    for oracle in oracles:
        assert simulate(oracle, Policy(MAX_K, 0.0)) == simulate(oracle, Policy(MAX_K))
        nothing = simulate(oracle, Policy(MAX_K, 1.0 + 1e-6))
        assert nothing.drafted == 0 and nothing.steps == len(oracle.output)
        # Every step but a last one with one token of budget left tried one token and refused it.
        assert nothing.drafter_calls == sum(1 for j in range(len(oracle.output)) if MAX_NEW - j - 1 > 0)
        threshold = float(np.nanpercentile(oracle.draft_p1, 30))
        run = simulate(oracle, Policy(MAX_K, threshold))
        emitted = 0
        for drafted, accepted in zip(run.step_drafted, run.step_accepted):
            p1 = oracle.draft_p1[emitted]
            assert np.all(p1[:drafted] >= threshold)
            assert drafted == min(MAX_K, MAX_NEW - emitted - 1) or p1[drafted] < threshold
            emitted += accepted + 1
        assert emitted == len(oracle.output)


def test_speedup_is_tau_when_drafting_is_free_and_verifying_flat(oracles):
    flat = CostModel(verify_s=(1.0,) * (MAX_K + 1), draft_s=0.0)
    sim = simulate_suite(oracles, flat, MAX_K)
    for group in sim.by_k:
        for result in group:
            assert result.speedup == pytest.approx(result.tau)
    # With free drafting, the longest drafts give the most tokens per step here.
    assert all(best.k >= MAX_K - 2 for best in sim.best_k)


def test_best_k_and_policies(tiny_sessions, oracles):
    target, drafter = tiny_sessions
    context = oracles[0].prompt_ids + oracles[0].output
    costs = measure_costs(target, drafter, context, MAX_K + 1, rounds=1, block=2)
    assert len(costs.verify_s) == MAX_K + 1 and costs.draft_s > 0 and all(t > 0 for t in costs.verify_s)
    sim = simulate_suite(oracles, costs, MAX_K, thresholds=(0.9, 0.999))
    for index, best in enumerate(sim.best_k):
        assert best.speedup == max(group[index].speedup for group in sim.by_k)
        assert sim.by_k[best.k - 1][index].category == best.category
    categories = [b.category for b in sim.best_k]
    assert [r.category for r in sim.per_category_k] == categories
    for best, result in zip(sim.best_k[:-1], sim.per_category_k[:-1]):
        assert result.speedup == pytest.approx(best.speedup)
    # Every category emits the same tokens whatever k: its best k minimizes its time, so the
    # mixture is at least as fast as the best single k.
    assert sim.per_category_k[-1].speedup >= sim.best_k[-1].speedup - 1e-12
    assert [r.policy for r in sim.thresholds] == ["k=8 p1>=0.9"] * 4 + ["k=8 p1>=0.999"] * 4


def test_compare_with_a_recorded_run(tiny_pair, oracles, tmp_path):
    request = RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=512, threads=1), DraftRules(3), MAX_NEW,
                         tmp_path / "run.json")
    record = run_pair(request, PROMPTS)
    assert compare_with_record(oracles, record) == (len(PROMPTS), [])
    other_budget = run_pair(RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=512, threads=1), DraftRules(3),
                                       MAX_NEW - 1, tmp_path / "short.json"), PROMPTS[:1])
    with pytest.raises(ComparisonError, match="another prompt or token budget"):
        compare_with_record(oracles, other_budget)


def test_simulate_command(tiny_pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    chosen = PROMPTS[::3]
    prompts.write_text("".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n"
                               for p in chosen))
    options = RuntimeOptions(n_ctx=256, threads=1)
    run_pair(RunRequest(tiny_pair, "llama-cpp", options, DraftRules(3), 24, tmp_path / "run.json"), chosen)
    run_pair(RunRequest(tiny_pair, "llama-cpp", options, DraftRules(3), 24, tmp_path / "simple.json",
                        schedule="llama-spec-simple"), chosen[:1])
    args = ["--pair", str(TINY_PAIR), "--prompts", str(prompts), "--max-k", "4", "--max-new-tokens", "24",
            "--n-ctx", "256"]
    result = CliRunner().invoke(simulate_command, args + ["--out", str(tmp_path / "sim.json"),
                                                          "--against", str(tmp_path / "run.json")])
    assert result.exit_code == 0, result.output
    assert "simulated tau by k" in result.output and "best k" in result.output and "c = " in result.output
    assert f"{len(chosen)} prompts compared, {len(chosen)} match step for step" in result.output
    saved = json.loads((tmp_path / "sim.json").read_text())
    assert len(saved["by_k"]) == 4 and saved["max_k"] == 4 and len(saved["per_prompt"]) == len(chosen)
    refused = CliRunner().invoke(simulate_command, args + ["--against", str(tmp_path / "simple.json")])
    assert refused.exit_code == 1 and "mirrors the driven crossrt schedule" in refused.output
