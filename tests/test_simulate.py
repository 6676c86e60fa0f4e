"""The what-if simulator against real driven runs of the tiny pair in llama.cpp."""

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from crossrt.errors import ComparisonError
from crossrt.speculative import loop
from crossrt.cli.analysis import simulate_command
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules, Rows, RuntimeOptions, availability, open_runtime
from crossrt.simulate.schedule_sims import (EXLLAMAV3, EXLLAMAV3_DYNAMIC, LLAMA_SCHEDULES, VLLM, DraftCalibration,
                                            compare_with_record, simulate_schedule)
from crossrt.simulate.oracle import CostModel, Policy, build_oracle, measure_costs, simulate, simulate_suite
from crossrt.speculative.schedules import top_probability

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


def test_oracle_rows_are_full_and_continue_past_the_output(tiny_sessions, oracles):
    target, drafter = tiny_sessions
    for oracle in oracles:
        assert oracle.drafts.shape == (len(oracle.output) + 1, MAX_K) and np.all(oracle.drafts >= 0)
        assert np.all(oracle.draft_p1 > 0) and np.all(oracle.draft_p10 >= oracle.draft_p1)
        # The target's greedy tokens go on past the budget: the first of them is what a
        # budget of one more token gives.
        longer = loop.greedy_generate(target, oracle.prompt_ids, MAX_NEW + 2).output_ids
        assert len(oracle.beyond) == MAX_K + 1 and oracle.extended[:len(longer)] == longer[:len(oracle.extended)]
    oracle = oracles[0]
    drafter.truncate(0)
    row = drafter.eval(oracle.prompt_ids + oracle.output[:4], Rows.LAST)[0]
    assert oracle.drafts[4, 0] == row.argmax() and oracle.draft_p10[4, 0] == pytest.approx(top_probability(row))


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
    simple = CliRunner().invoke(simulate_command, args + ["--against", str(tmp_path / "simple.json")])
    assert simple.exit_code == 0 and "1 prompts compared, 1 match step for step" in simple.output
    run_pair(RunRequest(tiny_pair, "llama-cpp", options, DraftRules(3), 23, tmp_path / "short.json"), chosen[:1])
    refused = CliRunner().invoke(simulate_command, args + ["--against", str(tmp_path / "short.json")])
    assert refused.exit_code == 1 and "another prompt or token budget" in refused.output


def test_simulate_command_what_if_schedules(tiny_pair, tmp_path):
    args = ["--pair", str(TINY_PAIR), "--prompts", "code", "--max-k", "3", "--max-new-tokens", "16", "--n-ctx", "256",
            "--thresholds", "0.9"]
    result = CliRunner().invoke(simulate_command, args + ["--schedule", "llama-server", "--schedule", "exllamav3",
                                                          "--draft-n-min", "2", "--out", str(tmp_path / "sim.json")])
    assert result.exit_code == 0, result.output
    assert "schedule llama-server (n_min 2, p_min 0)" in result.output
    assert "schedule exllamav3 (n_min = k, p_min 0)" in result.output
    saved = json.loads((tmp_path / "sim.json").read_text())["schedules"]
    # llama-server from k = n_min = 2, exllamav3 (fixed windows) from k = 1; per category, then overall
    assert sorted({(r["schedule"], r["k"], r["n_min"]) for r in saved}) == [
        ("exllamav3", 1, 1), ("exllamav3", 2, 2), ("exllamav3", 3, 3), ("llama-server", 2, 2), ("llama-server", 3, 2)]
    for r in saved:
        assert r["tau"] == pytest.approx(1 + r["accepted"] / r["steps"])
    refused = CliRunner().invoke(simulate_command, args + ["--schedule", "vllm", "--draft-p-min", "0.5"])
    assert refused.exit_code == 1 and "drafting rules of the llama-spec-simple and llama-server" in refused.output


# Drafting rules (k, n_min, p_min): fixed drafts, variable drafts, dropped short drafts, and
# p_min cut-offs, 0.9999 where the tiny pair's very sure drafter stops now and then.
LLAMA_RULES = [DraftRules(4, 0), DraftRules(3, 2), DraftRules(5, 1, 0.5), DraftRules(7, 0, 0.9999)]


def generated_prompts(tokenizer, count: int = 12, seed: int = 29) -> list[tuple[int, ...]]:
    """Prompt ids cut at random from the built-in prompts (seeded), and "b.", whose greedy
    output is EOS at once: the cases do not depend on which prompt does what."""
    rng = np.random.default_rng(seed)
    pool = [tokenizer(p.text) for p in PROMPTS]
    cases = [tokenizer("b.")]
    for _ in range(count):
        ids = pool[rng.integers(len(pool))]
        start = int(rng.integers(0, len(ids) - 1))
        cases.append(tuple(ids[start:start + int(rng.integers(1, 12))]))
    return cases


@pytest.fixture(scope="module")
def generated(tiny_sessions):
    target, drafter = tiny_sessions
    return [build_oracle(target, drafter, f"case-{i}", "generated", ids, budget, MAX_K)
            for i, ids in enumerate(generated_prompts(target.tokenize)) for budget in (9, MAX_NEW)]


def assert_simulated(oracle, schedule, rules, output, step_drafted, step_accepted, unverified, cut):
    run = simulate_schedule(oracle, schedule, rules)
    assert run.output == tuple(output), (schedule, rules, oracle.prompt_ids)
    assert (run.step_drafted, run.step_accepted, run.unverified, run.cut) == (
        tuple(step_drafted), tuple(step_accepted), unverified, cut), (schedule, rules, oracle.prompt_ids)
    return run


@pytest.mark.parametrize("schedule", loop.SCHEDULES)
def test_every_driven_schedule_equals_its_simulation_step_for_step(tiny_sessions, generated, schedule):
    target, drafter = tiny_sessions
    rules_list = [DraftRules(k) for k in (1, 4, MAX_K)] + (LLAMA_RULES if schedule in LLAMA_SCHEDULES else [])
    runs = []
    for rules in rules_list:
        for oracle in generated:
            real = loop.speculative_generate(target, drafter, oracle.prompt_ids, rules, oracle.max_new_tokens, schedule)
            runs.append(assert_simulated(oracle, schedule, rules, real.output_ids, real.step_drafted,
                                         real.step_accepted, real.unverified, real.cut))
    # The cases reach the rules that set each schedule apart.
    if schedule == loop.SCHEDULE:
        assert any(0 in run.step_drafted for run in runs)  # a last step with one token left
    if schedule == "llama-spec-simple":
        assert any(run.cut > 0 for run in runs)  # the overshoot past the budget
    if schedule == "llama-server":
        assert any(run.unverified > 1 for run in runs)  # a dropped draft is a plain decode
    if schedule in LLAMA_SCHEDULES:
        assert any(0 < d < rules.k for run, rules in zip(runs, [r for r in rules_list for _ in generated])
                   for d in run.step_drafted)  # a draft cut by p_min or the limit, kept by n_min


def test_exllamav3_verifies_full_windows_and_accepts_as_crossrt(generated):
    """docs/exllamav3.md: same outputs and step_accepted as crossrt's schedule, every window k."""
    for oracle in generated:
        for k in (1, 4, MAX_K):
            crossrt = simulate(oracle, Policy(k))
            assert_simulated(oracle, EXLLAMAV3, DraftRules(k), oracle.output, [k] * crossrt.steps,
                             crossrt.step_accepted, 0, 0)


def test_draft_calibration_estimates_from_decayed_bins():
    calibration = DraftCalibration()
    for accepted in [True] * 10 + [False] * 30:
        calibration.label(2.2, accepted=accepted)
    assert calibration.estimate(2.0) == 1.0  # 40 labels: under the burn-in of 64
    for _ in range(40):
        calibration.label(5.5, accepted=True)
    calibration.decay()
    assert calibration.total == pytest.approx(80 * 0.995)
    assert calibration.estimate(5.9) == 1.0 and calibration.estimate(9.0) == 1.0  # bin 5, and the nearest below
    assert calibration.estimate(3.0) == pytest.approx(0.25)  # bin 3 is empty: bin 2 below it
    assert calibration.estimate(-4.0) == pytest.approx(0.25)  # nothing below: the lowest populated bin
    for _ in range(45):
        calibration.decay()
    assert calibration.total < 64 and calibration.estimate(3.0) == 1.0  # decayed under the burn-in again


def test_exllamav3_dynamic_cuts_windows_once_calibrated(tiny_sessions):
    """Until 64 labels the estimates are 1 and every window is k; then windows shrink, and each
    round accepts what the fixed window would, up to its cut."""
    target, drafter = tiny_sessions
    cut = 0
    for ids in generated_prompts(target.tokenize, count=3):
        oracle = build_oracle(target, drafter, "long", "generated", ids, 200, MAX_K)
        run = simulate_schedule(oracle, EXLLAMAV3_DYNAMIC, DraftRules(MAX_K))
        assert run.output == oracle.output and run.counters(MAX_K).identity_violations(MAX_K) == []
        emitted, labels = 0, 0.0
        for window, accepted in zip(run.step_drafted, run.step_accepted):
            rest = dataclasses.replace(oracle, output=oracle.output[emitted:], drafts=oracle.drafts[emitted:],
                                       max_new_tokens=oracle.max_new_tokens - emitted)
            full = simulate_schedule(rest, EXLLAMAV3, DraftRules(MAX_K))
            assert 1 <= window <= MAX_K and accepted == min(full.step_accepted[0], window)
            if labels < DraftCalibration.BURN_IN:
                assert window == MAX_K
            labels = (labels + accepted + (accepted < window)) * DraftCalibration.DECAY
            cut += window < MAX_K
            emitted += accepted + 1
    assert cut > 0


def test_vllm_drafts_k_after_the_prefill_token_and_counts_before_the_stop(generated):
    """vLLM's steps are llama-server's (n_min 0) wherever neither the budget nor an EOS is in
    reach of a draft; there it drafts k all the same, and counts what it accepted before the
    stop check trims it."""
    for oracle in generated:
        for k in (1, 4, MAX_K):
            vllm = simulate_schedule(oracle, VLLM, DraftRules(k))
            server = simulate_schedule(oracle, "llama-server", DraftRules(k, 0))
            assert vllm.output == oracle.output and set(vllm.step_drafted) <= {k} and vllm.unverified == 1
            emitted, y = 1, oracle.extended
            for step, accepted in enumerate(vllm.step_accepted):
                assert 0 <= accepted <= k
                assert list(oracle.drafts[emitted, :accepted]) == list(y[emitted:emitted + accepted])
                if emitted + k + 1 < oracle.max_new_tokens and not set(y[emitted:emitted + k + 1]) & oracle.eog_ids:
                    assert server.step_accepted[step] == accepted and server.step_drafted[step] == k
                emitted += accepted + 1
            assert vllm.counters(k).identity_violations(k) == []


NATIVE_RULES = [DraftRules(4), DraftRules(4, 0), DraftRules(3, 2), DraftRules(5, 1, 0.9999)]


@pytest.mark.parametrize("runtime_name", ["llama-server", "llama-spec-cli"])
def test_native_llama_tools_equal_their_simulation(tiny_pair, tiny_sessions, tmp_path, runtime_name):
    if availability(runtime_name) is not None:
        pytest.skip(f"{runtime_name} not usable: {availability(runtime_name)}")
    target, drafter = tiny_sessions
    runtime = open_runtime(runtime_name, RuntimeOptions(n_ctx=512, threads=1))
    schedule = "llama-server" if runtime_name == "llama-server" else "llama-spec-simple"
    # The CLI tool takes text: the generated cases as text, each tokenized by the session.
    texts = [target.detokenize(ids) for ids in generated_prompts(target.tokenize, count=4)] + ["river"]
    for rules in NATIVE_RULES:
        session = runtime.open_native(tiny_pair.path("target", "gguf"), tiny_pair.path("drafter", "gguf"), rules,
                                      tmp_path / f"logs-{rules.k}-{rules.n_min}")
        try:
            for ids in map(session.tokenize, texts):
                oracle = build_oracle(target, drafter, "case", "generated", ids, 24, MAX_K)
                native = session.generate(list(ids), 24, speculative=True)
                run = simulate_schedule(oracle, schedule, rules)
                counters = native.counters
                assert native.output_ids == run.output, (rules, ids)
                simulated = run.counters(rules.k)
                names = ["steps", "drafted", "accepted", "emitted", "unverified", "cut", "accepted_per_pos"]
                if counters.step_drafted is not None:
                    names += ["step_drafted", "step_accepted"]
                assert {n: getattr(counters, n) for n in names} == {n: getattr(simulated, n) for n in names}, \
                    (rules, ids)
        finally:
            session.close()
