"""Each strategy of the one loop (crossrt/speculative/strategies.py) through the real loop on the tiny
pair in llama.cpp: prompt lookup proposes tokens, never logits; the content, online and
confidence policies size drafts by their rules and stay lossless; relaxed acceptance is
labelled lossy in the record and parity refuses to compare it; bad combinations are refused in
one line."""

import pytest

from crossrt.compare.parity import compare_all, compare_records
from crossrt.errors import ComparisonError, SettingsError
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record
from crossrt.speculative import loop
from crossrt.speculative.acceptance import Proposal
from crossrt.run.driver import RunRequest, run_pair
from crossrt.speculative.lookup import PromptLookup
from crossrt.speculative.policies import content_type
from crossrt.run.runtime import DraftRules, RuntimeOptions
from crossrt.speculative.strategies import Strategy, parse_content_k

PROMPTS = load_prompts("builtin")
MAX_NEW = 40


def _run(sessions, prompt, k, strategy, max_new=MAX_NEW, schedule=loop.SCHEDULE):
    target, drafter = sessions
    ids = target.tokenize(prompt.text)
    lookup = strategy.drafting == "prompt-lookup"
    return ids, loop.speculative_generate(target, None if lookup else drafter, ids, DraftRules(k), max_new, schedule,
                                          strategy=strategy)


def _greedy(target, ids, max_new=MAX_NEW):
    return loop.greedy_generate(target, ids, max_new).output_ids


def test_prompt_lookup_proposes_tokens_from_the_context_and_no_logits():
    lookup = PromptLookup(ngram_max=2)
    proposal = lookup.propose([4, 5, 6, 7, 4, 5], 3)
    # [4, 5] recurs: 6 follows it, then [5, 6] gives 7, then [6, 7] gives 4.
    assert proposal == Proposal.chain((6, 7, 4)) and all(isinstance(t, int) for t in proposal.tokens)
    assert lookup.propose([1, 2, 3], 3).tokens == ()  # nothing recurs: no draft, not a guess
    assert lookup.calls == 4 and lookup.sessions == ()  # one lookup per token and per miss; no model


def test_a_prompt_lookup_run_is_lossless_and_drafts_only_what_it_found(tiny_sessions):
    target, _ = tiny_sessions
    drafted = 0
    for prompt in PROMPTS:
        ids, run = _run(tiny_sessions, prompt, 4, Strategy(drafting="prompt-lookup"))
        assert run.output_ids == _greedy(target, ids), prompt.id
        # A step drafts only while lookups find a match: each step made its drafted tokens'
        # lookups, plus one that found nothing when it stopped short of the cap.
        assert sum(run.step_drafted) <= run.drafter_calls <= sum(run.step_drafted) + len(run.step_drafted)
        drafted += sum(run.step_drafted)
    assert drafted > 0


def test_the_content_policy_drafts_each_content_types_k(tiny_sessions):
    target, _ = tiny_sessions
    strategy = Strategy(k_policy="content", content_k=parse_content_k("code=5,prose=1"))
    seen = set()
    for prompt in PROMPTS[:6]:
        ids, run = _run(tiny_sessions, prompt, 3, strategy)
        assert run.output_ids == _greedy(target, ids), prompt.id
        context = list(ids)
        for drafted, accepted in zip(run.step_drafted, run.step_accepted):
            kind = content_type(target.detokenize(context[-24:]))
            cap = MAX_NEW - (len(context) - len(ids)) - 1
            assert drafted == min({"code": 5, "prose": 1}[kind], cap), prompt.id
            seen.add(kind)
            context += run.output_ids[len(context) - len(ids):][:accepted + 1]
    assert seen == {"code", "prose"}


def test_the_online_policy_grows_after_full_acceptance_and_shrinks_after_a_miss(tiny_sessions):
    target, _ = tiny_sessions
    for prompt in PROMPTS[:4]:
        ids, run = _run(tiny_sessions, prompt, 2, Strategy(k_policy="online", k_max=6))
        assert run.output_ids == _greedy(target, ids), prompt.id
        emitted = 0
        previous = None
        for drafted, accepted in zip(run.step_drafted, run.step_accepted):
            want = 2 if previous is None else min(6, previous[0] + 1 if previous[1] == previous[0] else previous[1] + 1)
            assert drafted == min(want, MAX_NEW - emitted - 1), prompt.id
            previous, emitted = (drafted, accepted), emitted + accepted + 1


def test_the_confidence_policy_stops_early_and_stays_lossless(tiny_sessions):
    target, _ = tiny_sessions
    fixed = confident = 0
    for prompt in PROMPTS[:4]:
        ids, run = _run(tiny_sessions, prompt, 6, Strategy(k_policy="confidence", min_p1=0.99))
        assert run.output_ids == _greedy(target, ids), prompt.id
        assert max(run.step_drafted) <= 6
        confident += sum(run.step_drafted)
        fixed += sum(_run(tiny_sessions, prompt, 6, Strategy())[1].step_drafted)
    assert confident < fixed


@pytest.fixture(scope="module")
def relaxed_record(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("relaxed") / "relaxed.json"
    strategy = Strategy(acceptance="relaxed", top_m=4, delta=100.0)
    run_pair(RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(4), 24, out,
                        strategy=strategy), PROMPTS[:3])
    return load_record(out)


def test_a_relaxed_run_is_labelled_lossy_and_never_counted_lossless(relaxed_record):
    params = relaxed_record.params
    assert (params.lossy, params.acceptance, params.top_m, params.delta) == (True, "relaxed", 4, 100.0)
    assert (params.drafting, params.k_policy) == ("model", "fixed")
    assert all(r.ok and r.lossy and r.lossless is None for r in relaxed_record.results)
    assert relaxed_record.summary().lossless == 0


def test_parity_refuses_to_compare_a_lossy_run_as_greedy(relaxed_record):
    with pytest.raises(ComparisonError, match="lossy acceptance rule"):
        compare_all([("relaxed", relaxed_record)])
    with pytest.raises(ComparisonError, match="lossy acceptance rule"):
        compare_records(relaxed_record, relaxed_record)


def test_a_tree_run_through_the_driver_records_its_strategy(tiny_pair, tmp_path):
    out = tmp_path / "tree.json"
    record = run_pair(RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(2), 24, out,
                                 strategy=Strategy(drafting="tree", tree="2x2")), PROMPTS[:2])
    assert (record.params.drafting, record.params.tree, record.params.lossy) == ("tree", "2x2", False)
    assert record.params.k == 6  # a step drafts the tree's 6 nodes: the counters are checked against them
    assert all(r.ok and r.lossless for r in record.results)
    assert load_record(out).params == record.params


@pytest.mark.parametrize("fields, message", [
    (dict(drafting="tree"), "tree drafting needs a tree"),
    (dict(tree="2x2"), "a tree goes with tree drafting"),
    (dict(drafting="tree", tree="best:8"), "best:N is found by"),
    (dict(drafting="tree", tree="2x2", k_policy="online"), "tree drafting verifies its whole static tree"),
    (dict(k_policy="confidence"), "give min_p1 > 0"),
    (dict(drafting="prompt-lookup", k_policy="confidence", min_p1=0.5), "without probabilities"),
    (dict(k_policy="content"), "content_k"),
    (dict(content_k=(("code", 3),)), "content_k"),
    (dict(ngram_min=4), "ngram_min <= ngram_max"),
    (dict(acceptance="relaxed", top_m=0), "top-m >= 1"),
    (dict(drafting="medusa"), "unknown drafting"),
])
def test_bad_strategies_are_refused_in_one_line(fields, message):
    with pytest.raises(SettingsError, match=message) as refused:
        Strategy(**fields)
    assert "\n" not in str(refused.value)


def test_strategy_labels_and_content_k():
    assert Strategy().label() == "model/fixed/greedy" and Strategy().is_default and not Strategy().lossy
    assert parse_content_k("code=7, prose=3") == (("code", 7), ("prose", 3))
    relaxed = Strategy(k_policy="online", k_max=6, min_p1=0.5, acceptance="relaxed")
    assert relaxed.label() == "model/online(k_max=6)+p1>=0.5/relaxed(m=2,delta=1)" and relaxed.lossy
    assert not Strategy(acceptance="relaxed", top_m=1).lossy  # top-1 within any delta is greedy
    for text in ("code", "code=x", "poetry=3", "code=3,code=4"):
        with pytest.raises(SettingsError):
            parse_content_k(text)


def test_the_llama_schedules_and_traces_refuse_other_strategies(tiny_sessions):
    target, drafter = tiny_sessions
    for schedule in ("llama-spec-simple", "llama-server"):
        with pytest.raises(SettingsError, match="drafts as llama.cpp does"):
            loop.speculative_generate(target, drafter, [5, 6], DraftRules(4), 8, schedule,
                                      strategy=Strategy(k_policy="online"))
    with pytest.raises(SettingsError, match="tree session"):
        loop.speculative_generate(target, drafter, [5, 6], DraftRules(4), 8,
                                  strategy=Strategy(drafting="tree", tree="2x2"))
    with pytest.raises(SettingsError, match="needs a drafter model"):
        loop.speculative_generate(target, None, [5, 6], DraftRules(4), 8)
