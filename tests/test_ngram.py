"""Runtimes' n-gram drafting, natively and reproduced (docs/ngram.md): HfPromptLookup proposes
what transformers' PromptLookupCandidateGenerator proposes, and the driven loop's hf-assisted
schedule with it on llama.cpp equals the transformers runtime's native prompt lookup; the
llama-server schedule with LlamaNgramSimple equals llama-server's own ngram-simple. Both id for
id and count for count on the tiny pair."""

import random

import pytest
import torch
from click.testing import CliRunner
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from crossrt.cli import main
from crossrt.records.record_json import load_record
from crossrt.speculative import loop
from crossrt.errors import SettingsError
from crossrt.speculative.lookup import HfPromptLookup, LlamaNgramCache, LlamaNgramMap, LlamaNgramMod, LlamaNgramSimple
from crossrt.run.runtime import DraftRules
from crossrt.speculative.strategies import Strategy
from crossrt.inputs.prompts import load_prompts
from crossrt.run.repeating import repeating, write_jsonl

from conftest import TINY_PAIR, assert_clean_error, assert_reproduced

EXACT = ["--f32-kv-cache", "--no-flash-attn"]
EOS = 0




def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _transformers(ids, k, ngram_max, budget_left):
    generator = PromptLookupCandidateGenerator(eos_token_id=torch.tensor([EOS]), num_output_tokens=k,
                                               max_matching_ngram_size=ngram_max,
                                               max_length=len(ids) + budget_left)
    candidates, _ = generator.get_candidates(torch.tensor([ids]))
    return tuple(candidates[0, len(ids):].tolist())


def test_the_proposer_is_transformers_own_on_random_contexts():
    """Short contexts over 5 tokens repeat often: earliest matches, overlapping ones, drafts
    ending where the context ends, an EOS cutting a draft to nothing, no draft at one token of
    budget left."""
    draws = random.Random(0)
    for _ in range(600):
        ids = [draws.randrange(5) for _ in range(draws.randrange(1, 14))]
        k, ngram_max, budget_left = draws.randrange(1, 6), draws.randrange(1, 4), draws.randrange(1, 4)
        n_max = min(k, budget_left - 1)  # what the hf-assisted schedule allows; the drafter takes k past it
        ours = HfPromptLookup(ngram_max, frozenset({EOS})).propose(ids, k if n_max > 0 else 0).tokens
        assert ours == _transformers(ids, k, ngram_max, budget_left), (ids, k, ngram_max, budget_left)


@pytest.fixture(scope="module")
def repeating_prompts(tiny_sessions, tmp_path_factory):
    """Built-in prompts followed by the target's own greedy continuation and the prompt again,
    so the output repeats earlier text and prompt lookup has something to find."""
    target, _ = tiny_sessions
    return write_jsonl(repeating(target, load_prompts("builtin")[::3], 24),
                       tmp_path_factory.mktemp("lookup") / "prompts.jsonl")


def test_driven_hf_prompt_lookup_on_llama_cpp_equals_transformers_native(repeating_prompts, tmp_path):
    # k 6 at a budget of 23 makes last steps draft past the budget, which transformers crops.
    common = ["--pair", TINY_PAIR, "--drafting", "hf-prompt-lookup", "--ngram-max", 2, "--k", 6,
              "--max-new-tokens", 23, "--prompts", repeating_prompts, *EXACT]
    native = invoke("run", "--runtime", "transformers", "--mode", "native", "--out", tmp_path / "hf.json", *common)
    assert native.exit_code == 0, native.output
    driven = invoke("run", "--runtime", "llama-cpp", "--schedule", "hf-assisted", "--out", tmp_path / "llama.json",
                    *common)
    assert driven.exit_code == 0, driven.output
    hf, llama = load_record(tmp_path / "hf.json"), load_record(tmp_path / "llama.json")
    for record in (hf, llama):  # transformers' settings under crossrt's names; it has no ngram_min
        params = record.params
        assert (params.drafting, params.ngram_max, params.ngram_min, params.k, params.schedule) == \
            ("hf-prompt-lookup", 2, None, 6, "hf-assisted")
        assert record.pair.drafter.loaded == ()  # no drafter model read
    assert any("PromptLookupCandidateGenerator" in note for note in hf.notes)
    for ours, theirs in zip(llama.results, hf.results, strict=True):
        assert ours.output_ids == theirs.output_ids == ours.baseline_ids, ours.prompt_id
        assert ours.counters == theirs.counters, ours.prompt_id  # per-step lists included
        assert ours.counters.cut == 0
    counters = [r.counters for r in hf.results]
    assert sum(c.accepted for c in counters) > 0
    # Steps whose draft ran past the budget: accepted counts only the tokens up to it.
    assert any(c.step_drafted[-1] >= 23 - (c.emitted - c.step_accepted[-1] - 1) for c in counters)


@pytest.mark.parametrize("args, message", [
    (["--runtime", "transformers", "--mode", "native", "--drafting", "prompt-lookup"],
     "runs --drafting hf-prompt-lookup natively"),
    (["--runtime", "transformers", "--mode", "native", "--drafting", "hf-prompt-lookup", "--draft-n-min", "1"],
     "no spec type, n_min or p_min"),
    (["--drafting", "hf-prompt-lookup", "--ngram-min", "2"], "--ngram-min is for --drafting prompt-lookup"),
])
def test_what_transformers_prompt_lookup_lacks_is_refused_in_one_line(args, message, tmp_path):
    result = invoke("run", "--pair", TINY_PAIR, "--out", tmp_path / "r.json", *args)
    assert_clean_error(result, message)
    assert result.output.strip().splitlines()[-1].startswith("Error: ") and result.output.count("Error") == 1
    assert not (tmp_path / "r.json").exists()  # refused before anything ran


def test_ngram_simple_follows_llama_cpps_rules():
    """size_n 2, size_m 3: the last two tokens (the slot's last one and the sampled one) looked up,
    the most recent match first, position 0 skipped."""
    lookup = LlamaNgramSimple(2, 3)
    context = [7, 1, 2, 3, 4, 5, 1, 2, 8, 9, 6, 1, 2]
    assert lookup.propose(context, 9).tokens == (8, 9, 6)  # the match at 6, not the older one at 1
    assert lookup.propose(context, 2).tokens == (8, 9)  # cut to the step's limit
    assert lookup.propose([1, 2, 3, 4, 5, 6, 9, 9, 1, 2], 9).tokens == ()  # only at position 0: skipped
    assert lookup.propose([5, 1, 2, 3, 4, 6, 6, 6, 6, 6, 1, 2], 9).tokens == (3, 4, 6)
    assert lookup.propose([5, 1, 2, 3, 1, 2], 9).tokens == ()  # 6 tokens <= size_n + size_m + 1 + 1
    # A match with fewer than size_n tokens after it in the slot gives no draft.
    assert lookup.propose([8, 8, 8, 8, 8, 8, 4, 7, 1, 2, 1, 2], 9).tokens == ()
    assert lookup.propose([8, 8, 8, 8, 8, 8, 4, 1, 2, 7, 1, 2], 9).tokens == (7, 1)  # size_n after it: enough


def test_driven_ngram_simple_on_llama_cpp_equals_llama_server_native(repeating_prompts, tmp_path):
    # crossrt's llama-server runs pass size_m = k and size_n = min(12, k): 4 and 4 here.
    common = ["--pair", TINY_PAIR, "--k", 4, "--max-new-tokens", 40, "--prompts", repeating_prompts]
    native = invoke("run", "--runtime", "llama-server", "--mode", "native", "--spec-type", "ngram-simple",
                    "--out", tmp_path / "server.json", *common)
    assert native.exit_code == 0, native.output
    driven = invoke("run", "--runtime", "llama-cpp", "--schedule", "llama-server", "--drafting", "llama-ngram-simple",
                    "--ngram-max", 4, "--out", tmp_path / "llama.json", *common)
    assert driven.exit_code == 0, driven.output
    server, llama = load_record(tmp_path / "server.json"), load_record(tmp_path / "llama.json")
    for record in (server, llama):  # llama.cpp's size_n under crossrt's name; it has no ngram_min
        assert (record.params.drafting, record.params.ngram_max, record.params.ngram_min) == \
            ("llama-ngram-simple", 4, None)
    assert_reproduced(llama, server)
    assert sum(r.counters.accepted for r in server.results) > 0
    parity = invoke("parity", tmp_path / "server.json", tmp_path / "llama.json")
    assert parity.exit_code == 0, parity.output
    assert "identical, 0 explained, 0 failed, 0 not comparable; counters compared" in parity.output


def test_one_drafting_runs_natively_on_llama_server_and_driven_on_llama_cpp(repeating_prompts, tmp_path):
    """--drafting llama-ngram-simple --ngram-max 3: llama-server's ngram-simple at size_n 3 (no
    drafter model loaded), and its reproduction, from the same options."""
    same = ["--pair", TINY_PAIR, "--k", 4, "--max-new-tokens", 40, "--prompts", repeating_prompts,
            "--drafting", "llama-ngram-simple", "--ngram-max", 3]
    assert invoke("run", "--runtime", "llama-server", "--mode", "native", "--out", tmp_path / "server.json",
                  *same).exit_code == 0
    assert invoke("run", "--runtime", "llama-cpp", "--schedule", "llama-server", "--out", tmp_path / "llama.json",
                  *same).exit_code == 0
    server, llama = load_record(tmp_path / "server.json"), load_record(tmp_path / "llama.json")
    assert (server.params.spec_type, server.params.ngram_max, server.pair.drafter.loaded) == ("ngram-simple", 3, ())
    assert any("--spec-ngram-simple-size-n 3" in note for note in server.notes)
    assert_reproduced(llama, server)


def test_ngram_map_k_draws_on_its_map_and_what_was_last_accepted():
    """size_n 2, size_m 3: the key (the slot's last token and the sampled one) is found by
    scanning back from size_n + size_m + 1 tokens before the end; the draft is what followed it,
    cut to what the key's last draft had accepted."""
    lookup = LlamaNgramMap(2, 3, key_only=True)
    prompt = [5, 1, 2, 3, 4, 6, 7, 8, 9, 1]
    lookup.prefill(prompt)
    assert lookup.propose([*prompt, 2], 9).tokens == (3, 4, 6)
    lookup.keep(len(prompt) + 1 + 1)  # one draft token accepted (and the bonus)
    assert lookup.propose([*prompt, 2], 9).tokens == (3,)  # the same key drafts what it had accepted
    assert lookup.propose([*prompt, 2], 0).tokens == ()  # no call at a limit of 0
    assert lookup.propose([*prompt, 7], 9).tokens == ()  # [1, 7] never seen


def test_ngram_map_k4v_drafts_only_a_value_twice_as_common_as_the_others():
    lookup = LlamaNgramMap(1, 2, key_only=False)
    tied = [9, 1, 2, 3, 1, 4, 5, 8, 8, 8, 8]  # after 1: [2, 3] once, [4, 5] once
    lookup.prefill(tied)
    assert lookup.propose([*tied, 1], 9).tokens == ()
    lookup = LlamaNgramMap(1, 2, key_only=False)
    common = [9, 1, 2, 3, 1, 2, 3, 1, 4, 5, 8, 8, 8, 8]  # [2, 3] twice, [4, 5] once
    lookup.prefill(common)
    assert lookup.propose([*common, 1], 9).tokens == (4, 5)  # the tokens after the match, as llama.cpp copies


def test_ngram_mod_chains_its_pool_and_drops_short_chains():
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    lookup = LlamaNgramMod(2, 3, 3)  # n_match 2, n_max 3, n_min 3
    lookup.prefill(prompt[:-1])
    assert lookup.propose(prompt, 9).tokens == (3, 4, 5)
    assert lookup.propose([*prompt, 9], 9).tokens == ()  # [2, 9] unknown
    for n_min, chain in ((3, ()), (2, (6, 7))):  # [1, 5] -> 6, [5, 6] -> 7, [6, 7] unknown: 2 tokens
        short = LlamaNgramMod(2, 3, n_min)
        short.prefill([1, 5, 6, 7])
        assert short.propose([1, 5, 6, 7, 1, 5], 9).tokens == chain
    # Nothing begun, nothing added yet: new n-grams go in 32 tokens at a time.
    assert LlamaNgramMod(2, 3, 2).propose([7, 1, 2, 3, 4, 1, 2, 3], 9).tokens == ()


def test_ngram_mod_empties_its_pool_after_five_poorly_accepted_drafts():
    prompt = [1, 2, 3, 4, 5, 6, 1, 2]
    lookup = LlamaNgramMod(2, 3, 1)
    lookup.prefill(prompt[:-1])
    for _ in range(4):
        assert lookup.propose(prompt, 9).tokens == (3, 4, 5)
        lookup.keep(len(prompt))  # nothing accepted
    assert lookup.propose(prompt, 9).tokens == (3, 4, 5)
    lookup.keep(len(prompt))
    assert lookup.propose(prompt, 9).tokens == ()


LLAMA_NGRAMS = [("llama-ngram-map-k", 4, 2, "--spec-ngram-map-k-size-n 2 --spec-ngram-map-k-size-m 4"),
                ("llama-ngram-map-k4v", 4, 2, "--spec-ngram-map-k4v-size-n 2 --spec-ngram-map-k4v-size-m 4 "
                 "--spec-ngram-map-k4v-min-hits 1"),
                ("llama-ngram-mod", 4, 2, "--spec-ngram-mod-n-match 2 --spec-ngram-mod-n-max 4 --spec-ngram-mod-n-min 4"),
                ("llama-ngram-cache", 8, 4, "its fixed sizes")]  # k 8, 1- to 4-grams: all it runs at


@pytest.mark.parametrize("drafting, k, ngram_max, flags", LLAMA_NGRAMS)
def test_each_llama_ngram_type_runs_natively_and_its_reproduction_equals_it(drafting, k, ngram_max, flags,
                                                                            repeating_prompts, tiny_sessions,
                                                                            tmp_path):
    """The server keeps its maps and pool from one request to the next: the reproduction serves
    the run's prompts in order from one drafter, and a drafter begun afresh on each prompt does not
    draft as the server does."""
    same = ["--pair", TINY_PAIR, "--k", k, "--max-new-tokens", 40, "--prompts", repeating_prompts,
            "--drafting", drafting, "--ngram-max", ngram_max]
    native = invoke("run", "--runtime", "llama-server", "--mode", "native", "--out", tmp_path / "server.json", *same)
    assert native.exit_code == 0, native.output
    driven = invoke("run", "--runtime", "llama-cpp", "--schedule", "llama-server", "--out", tmp_path / "llama.json",
                    *same)
    assert driven.exit_code == 0, driven.output
    server, llama = load_record(tmp_path / "server.json"), load_record(tmp_path / "llama.json")
    spec_type = drafting.removeprefix("llama-")
    assert (server.params.spec_type, server.params.drafting, server.params.ngram_max, server.pair.drafter.loaded) \
        == (spec_type, drafting, ngram_max, ())
    assert any(note.startswith(f"{spec_type}: {flags} ") for note in server.notes)
    assert (llama.params.drafting, llama.params.ngram_max, llama.params.ngram_min) == (drafting, ngram_max, None)
    assert_reproduced(llama, server)
    assert sum(r.counters.accepted for r in server.results) > 0
    # The same prompts on one target, the drafter kept across them or begun afresh on each.
    target, _ = tiny_sessions
    strategy, rules = Strategy(drafting=drafting, ngram_max=ngram_max), DraftRules(k)
    kept = loop.run_lookup(strategy, rules, "llama-server", target.eog_ids)
    counts = {name: [(run.drafted, run.accepted) for run in (
        loop.speculative_generate(target, None, r.prompt_ids, rules, 40, "llama-server", strategy=strategy,
                                  drafts=lookup).counters(k) for r in server.results)]
        for name, lookup in (("kept", kept), ("fresh", None))}
    assert counts["kept"][0] == counts["fresh"][0] and counts["kept"] != counts["fresh"]
    if drafting == "llama-ngram-mod":
        parity = invoke("parity", tmp_path / "server.json", tmp_path / "llama.json")
        assert parity.exit_code == 0, parity.output
        assert "identical, 0 explained, 0 failed, 0 not comparable; counters compared" in parity.output


def test_ngram_cache_gives_a_tie_to_the_newer_follower():
    """[1, 2] was followed by 3, then by 4: once each, a 50 % share, which passes the 2-gram
    threshold; llama.cpp takes the first in its unordered_map, which holds two keys newest first.
    The drafted 4 extends the suffix: [1, 2, 4] was followed by 9."""
    lookup = LlamaNgramCache(8, 4)
    lookup.prefill([7, 1, 2, 3, 8, 1, 2, 4, 9, 1])
    assert lookup.propose([7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2], 9).tokens[:2] == (4, 9)
    assert lookup.propose([7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2], 1).tokens == (4,)  # cut to the limit
    with pytest.raises(SettingsError, match="--k 8 --ngram-max 4"):
        LlamaNgramCache(7, 4)
