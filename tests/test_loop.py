"""The shared speculative loop on real llama.cpp with the tiny pair."""

import pytest

from crossrt.errors import PromptRefused, SettingsError
from crossrt.speculative import loop
from crossrt.run.runtime import DraftRules
from crossrt.inputs.prompts import load_prompts

PROMPTS = load_prompts("builtin")
K = 4
MAX_NEW = 48


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p.id for p in PROMPTS])
def test_speculative_output_equals_greedy(tiny_sessions, prompt):
    target, drafter = tiny_sessions
    ids = target.tokenize(prompt.text)
    baseline = loop.greedy_generate(target, ids, MAX_NEW)
    speculative = loop.speculative_generate(target, drafter, ids, DraftRules(K), MAX_NEW)
    assert list(speculative.output_ids) == list(baseline.output_ids)
    assert speculative.stop_reason == baseline.stop_reason
    counters = speculative.counters(K)
    assert counters.emitted == counters.steps + counters.accepted
    assert counters.accepted <= counters.drafted <= K * counters.steps
    per_pos = counters.accepted_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert per_pos[0] <= counters.steps and sum(per_pos) == counters.accepted


def test_acceptance_is_neither_zero_nor_one(tiny_sessions):
    """The tiny pair's successor-bigram knob is set so the drafter is useful but imperfect."""
    target, drafter = tiny_sessions
    drafted = accepted = 0
    for prompt in PROMPTS:
        generation = loop.speculative_generate(target, drafter, target.tokenize(prompt.text), DraftRules(K), MAX_NEW)
        drafted += sum(generation.step_drafted)
        accepted += sum(generation.step_accepted)
    assert 0.2 < accepted / drafted < 0.95


@pytest.mark.parametrize("max_new", [1, 2, 5, 17])
def test_drafter_identical_to_target_accepts_every_draft(tiny_sessions, llama_runtime, tiny_pair, max_new):
    target, _ = tiny_sessions
    twin = llama_runtime.load(tiny_pair.path("target", "gguf"))
    ids = target.tokenize(PROMPTS[0].text)
    generation = loop.speculative_generate(target, twin, ids, DraftRules(K), max_new)
    # Every step but the last drafts k and accepts all: tau = k + 1; the last step is cut to
    # the token budget, so it drafts what is left minus its own bonus token.
    assert generation.step_accepted == generation.step_drafted
    assert all(n == K for n in generation.step_drafted[:-1])
    assert len(generation.output_ids) == max_new
    assert generation.step_drafted[-1] == (max_new - 1) % (K + 1)
    assert list(generation.output_ids) == list(loop.greedy_generate(target, ids, max_new).output_ids)


def test_prompt_that_does_not_fit_the_context_is_refused(tiny_sessions):
    target, drafter = tiny_sessions
    with pytest.raises(PromptRefused, match="does not fit the context"):
        loop.speculative_generate(target, drafter, [5] * 500, DraftRules(K), 64)


def test_draft_rules_are_validated(tiny_sessions):
    target, drafter = tiny_sessions
    with pytest.raises(SettingsError, match="k must be at least 1"):
        DraftRules(0)
    with pytest.raises(SettingsError, match="n_min must be between 0 and k=4"):
        DraftRules(4, n_min=5)
    with pytest.raises(SettingsError, match="crossrt schedule drafts exactly k tokens"):
        loop.speculative_generate(target, drafter, [5, 6], DraftRules(4, p_min=0.5), 8)


def test_eos_stops_both_runs_and_counts_as_the_steps_own_token(tiny_sessions):
    """The tiny pair's grammar puts EOS right after the prompt "b." (models/tiny/README.md)."""
    target, drafter = tiny_sessions
    ids = target.tokenize("b.")
    baseline = loop.greedy_generate(target, ids, MAX_NEW)
    speculative = loop.speculative_generate(target, drafter, ids, DraftRules(K), MAX_NEW)
    assert baseline.stop_reason == speculative.stop_reason == "eos"
    assert speculative.output_ids == baseline.output_ids and speculative.output_ids[-1] in target.eog_ids
    counters = speculative.counters(K)  # raises unless the identities hold
    assert counters.emitted == counters.steps + counters.accepted and counters.unverified == 0
