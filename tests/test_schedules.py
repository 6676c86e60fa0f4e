"""llama.cpp's schedules in the driven loop, on real llama.cpp with the tiny pair.

Exact step lists below follow from the rules in crossrt/speculative/schedules.py; agreement with the native
tool itself is in test_llama_spec_cli.py. The tiny pair's drafter is very sure of itself (its
top-10 probability is below 0.9999 at about 10% of positions and below 0.5 at 0.1%), so a
p_min that stops drafts here has to be close to 1.
"""

import numpy as np
import pytest

from crossrt.errors import PromptRefused
from crossrt.speculative import loop, schedules
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules

PROMPTS = load_prompts("builtin")
RULES = [DraftRules(4), DraftRules(4, 0), DraftRules(3, 2), DraftRules(5, 1, 0.5), DraftRules(5, 1, 0.9999)]


@pytest.fixture(scope="module")
def twin(llama_runtime, tiny_pair):
    """The target as its own drafter: every draft token is accepted."""
    return llama_runtime.load(tiny_pair.path("target", "gguf"))


@pytest.mark.parametrize("schedule", schedules.LLAMA_SCHEDULES)
@pytest.mark.parametrize("rules", RULES, ids=lambda r: f"{r.k}-{r.n_min}-{r.p_min}")
def test_lossless_and_counters_add_up(tiny_sessions, schedule, rules):
    target, drafter = tiny_sessions
    for prompt in PROMPTS[::3]:
        ids = target.tokenize(prompt.text)
        baseline = loop.greedy_generate(target, ids, 40)
        generation = loop.speculative_generate(target, drafter, ids, rules, 40, schedule)
        assert generation.output_ids == baseline.output_ids
        assert generation.stop_reason == baseline.stop_reason
        generation.counters(rules.k)  # raises unless the identities hold
        # Drafts shorter than n_min are dropped. spec-simple still verifies [last] as a step with
        # 0 drafted; the server decodes it plainly, outside any step.
        empty_is_a_step = schedule == schedules.SPEC_SIMPLE
        assert all(max(rules.n_min, 1) <= n <= rules.k or (n == 0 and empty_is_a_step)
                   for n in generation.step_drafted)
        assert (generation.unverified == 0) == empty_is_a_step


def test_spec_simple_overshoots_and_cuts_what_passes_the_budget(tiny_sessions, twin):
    target, _ = tiny_sessions
    ids = target.tokenize(PROMPTS[0].text)
    # k=4, N=17: three full steps (15 tokens); with 2 tokens of budget left the per-call limit is
    # 1, so a 4-token n_min drops the draft (a plain step); then the limit is 0, i.e. none, and
    # the last step drafts 4 more: n_predict 21 > 17, 4 tokens cut.
    fixed = loop.speculative_generate(target, twin, ids, DraftRules(4), 17, schedules.SPEC_SIMPLE)
    assert fixed.step_drafted == fixed.step_accepted == (4, 4, 4, 0, 4)
    assert len(fixed.output_ids) == 17 and fixed.cut == 4 and fixed.unverified == 0
    # Without n_min the 1-token draft is kept; the next limit is max(-1, 0) = none again.
    short = loop.speculative_generate(target, twin, ids, DraftRules(4, 0), 17, schedules.SPEC_SIMPLE)
    assert short.step_drafted == (4, 4, 4, 1, 4) and short.cut == 5
    assert fixed.output_ids == short.output_ids == loop.greedy_generate(target, ids, 17).output_ids


def test_server_takes_its_first_token_from_the_prompt_and_never_overshoots(tiny_sessions, twin):
    target, _ = tiny_sessions
    ids = target.tokenize(PROMPTS[0].text)
    # First token from the prompt pass; steps of 4 + 1 while the limit N - n_gen - 1 allows 4;
    # at 16 tokens the limit is 0: no draft, a plain decode, also unverified.
    generation = loop.speculative_generate(target, twin, ids, DraftRules(4), 17, schedules.SERVER)
    assert generation.step_drafted == generation.step_accepted == (4, 4, 4)
    assert generation.unverified == 2 and generation.cut == 0
    assert generation.output_ids == loop.greedy_generate(target, ids, 17).output_ids
    # N=18: after 16 tokens the limit is 1, below n_min, so the draft is dropped (a plain
    # decode); then the limit is 0 (another plain decode).
    dropped = loop.speculative_generate(target, twin, ids, DraftRules(4), 18, schedules.SERVER)
    assert dropped.step_drafted == (4, 4, 4) and dropped.unverified == 3
    assert all(n > 0 for n in dropped.step_drafted)  # a step is a verification of a real draft


def test_drafting_rules_shape_the_drafts(tiny_sessions):
    target, drafter = tiny_sessions
    ids = target.tokenize(PROMPTS[1].text)
    dropped = loop.speculative_generate(target, drafter, ids, DraftRules(4, 4, 0.9999), 64, schedules.SPEC_SIMPLE)
    assert set(dropped.step_drafted) == {0, 4}  # p_min cut some drafts short; n_min dropped those
    stopped = loop.speculative_generate(target, drafter, ids, DraftRules(4, 1, 0.9999), 64, schedules.SPEC_SIMPLE)
    assert any(0 < n < 4 for n in stopped.step_drafted[:-2])  # short drafts far from the budget
    assert dropped.output_ids == stopped.output_ids


@pytest.mark.parametrize("schedule, k, text, output, steps, unverified, cut", [
    # EOS right after the prompt: spec-simple verifies a draft at once; a 1-token draft of EOS is
    # accepted in the last position, so the target's token after it is yielded and cut.
    (schedules.SPEC_SIMPLE, 1, "b.", (1,), ((1,), (1,)), 0, 1),
    # An EOS matched before the last draft position ends the step as its own token: nothing cut.
    (schedules.SPEC_SIMPLE, 2, "b.", (1,), ((2,), (0,)), 0, 0),
    # The server takes that EOS from the prompt pass and stops without a step.
    (schedules.SERVER, 2, "b.", (1,), ((), ()), 1, 0),
    # Mid-generation: EOS accepted in the last draft position; the server counts it accepted
    # before its stop check, and the bonus token after it is cut.
    (schedules.SERVER, 2, "is c", (39, 15, 1), ((2,), (2,)), 1, 1),
])
def test_eos(tiny_sessions, schedule, k, text, output, steps, unverified, cut):
    target, drafter = tiny_sessions
    ids = target.tokenize(text)
    generation = loop.speculative_generate(target, drafter, ids, DraftRules(k, 0), 24, schedule)
    assert generation.output_ids == output == loop.greedy_generate(target, ids, 24).output_ids
    assert generation.stop_reason == "eos"
    assert (generation.step_drafted, generation.step_accepted) == steps
    assert (generation.unverified, generation.cut) == (unverified, cut)
    assert generation.counters(k).emitted == len(output)  # counters() raises unless the identities hold


def test_spec_simple_keeps_room_for_its_overshoot(tiny_sessions):
    target, drafter = tiny_sessions
    prompt = [5] * 501  # 501 + 8 fits 512, but the last step may run k = 4 tokens further
    loop.speculative_generate(target, drafter, prompt, DraftRules(4), 8, loop.SCHEDULE)
    with pytest.raises(PromptRefused, match=r"\+ 8 new tokens \(\+ 4 the schedule may run past them\) does not fit"):
        loop.speculative_generate(target, drafter, prompt, DraftRules(4), 8, schedules.SPEC_SIMPLE)


def test_top_probability_is_a_softmax_over_the_ten_best_logits():
    logits = np.full(512, -50.0, dtype=np.float32)
    logits[:10] = 3.0
    assert schedules.top_probability(logits) == np.float32(0.1)  # ten equal: a tenth each
    logits[:10] = np.arange(10, dtype=np.float32)
    logits[10:] = -0.5  # 502 tokens a full softmax would count, and top-10 does not
    expected = 1.0 / np.exp(np.arange(10) - 9.0).sum()
    assert schedules.top_probability(logits) == pytest.approx(expected, rel=1e-6)


def test_the_first_token_from_the_prompt_pass_is_one_trait_that_diagnosis_reads_for_vllm_too():
    """llama-server and vLLM take their first token from the prompt pass (their baselines too);
    diagnosis once read it for llama-server only, so vLLM-schedule splits at token 0 were
    re-scored in the wrong pass shape (issue 59)."""
    from crossrt.compare.diagnosis import _plain_shape
    from crossrt.speculative.schedules import SCHEDULES, first_from_prompt

    assert {name for name in SCHEDULES if first_from_prompt(name)} == {"llama-server", "vllm"}
    assert not first_from_prompt("an imported runtime's own")

    class Params:
        schedule = "vllm"

    class Record:
        params = Params()

    class Result:
        prompt_ids = (1, 2, 3, 4)

    assert _plain_shape(Record(), Result(), 0) == 4 and _plain_shape(Record(), Result(), 1) == 1
