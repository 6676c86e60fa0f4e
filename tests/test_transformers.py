"""The transformers runtime on real torch/transformers with the tiny pair (1 thread): driven
mode through crossrt's loop against llama.cpp, HF's own assisted generation with its step
counts, GGUF loading, and the CLI end to end."""

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from crossrt.errors import ModelError, PromptRefused, SettingsError
from crossrt.speculative import loop
from crossrt.cli import main
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules, RuntimeOptions, Rows, open_runtime
from crossrt.records.record_json import load_record

from conftest import REPO, TINY_PAIR

PROMPTS = load_prompts("builtin")
K = 4
MAX_NEW = 48
ROLES = ("target", "drafter")
CLI_PROMPTS = [("a", "code", "def add(a, b):\n    return"), ("b", "prose", "The old house at the end of the")]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def hf_runtime():
    return open_runtime("transformers", RuntimeOptions(n_ctx=512, threads=1))


@pytest.fixture(scope="module")
def hf_sessions(hf_runtime, tiny_pair):
    return tuple(hf_runtime.load(tiny_pair.path(role, "hf")) for role in ROLES)


@pytest.fixture(scope="module")
def llama_f32_sessions(tiny_pair):
    """llama.cpp with an F32 KV cache, as --f32-kv-cache gives."""
    runtime = open_runtime("llama-cpp", RuntimeOptions(n_ctx=512, threads=1, f32_kv_cache=True))
    return tuple(runtime.load(tiny_pair.path(role, "gguf")) for role in ROLES)


@pytest.fixture(scope="module")
def native(hf_runtime, tiny_pair, tmp_path_factory):
    session = hf_runtime.open_native(tiny_pair.path("target", "hf"), tiny_pair.path("drafter", "hf"),
                                     DraftRules(K), tmp_path_factory.mktemp("native"))
    yield session
    session.close()


def test_tokenizer_matches_llama_cpp(hf_sessions, llama_f32_sessions):
    target, _ = hf_sessions
    texts = [p.text for p in PROMPTS] + ["b.", "x <|eos|> y", "  two  spaces\n\n", "é ü 😀"]
    for text in texts:
        ids = target.tokenize(text)
        assert ids == llama_f32_sessions[0].tokenize(text), text
        assert ids[0] == 0  # the tiny tokenizer's BOS, added by the tokenizer itself
    assert target.detokenize(target.tokenize("def add(a, b):")) == "def add(a, b):"


def test_a_tokenizer_file_is_parsed_once_and_each_read_gets_what_a_parse_gives(tiny_pair, monkeypatch):
    """transformers parses Gemma 3's 33 MB tokenizer.json twice while loading its tokenizer;
    crossrt serves the second read from the first parse (backends/transformers.py,
    _parsed_once). Its first reader pops the added tokens and their ids: a later read must still
    get what a parse of the file gives. The tiny pair's file has the same layout; other files
    and json.load after the load are untouched."""
    from crossrt.backends.transformers import _parsed_once

    folder = tiny_pair.path("target", "hf")
    tokenizer, config = folder / "tokenizer.json", folder / "config.json"
    expected = json.loads(tokenizer.read_text())
    assert expected["added_tokens"] and all("id" in token for token in expected["added_tokens"])
    parsed, parse = [], json.load
    monkeypatch.setattr(json, "load", lambda handle, **options: parsed.append(handle.name) or parse(handle, **options))
    counting = json.load
    with _parsed_once(tokenizer):
        for _ in range(3):
            with tokenizer.open(encoding="utf-8") as handle:
                read = json.load(handle)
            assert read == expected
            for token in read.pop("added_tokens"):  # as transformers' first reader does
                token.pop("id")
        with config.open() as handle:
            assert json.load(handle) == json.loads(config.read_text())
    assert json.load is counting
    assert parsed == [str(tokenizer), str(config)]


def test_session_describes_the_model(hf_runtime, hf_sessions):
    target, drafter = hf_sessions
    assert target.n_vocab == drafter.n_vocab == 512
    assert target.eog_ids == frozenset({1})
    info = hf_runtime.info()
    assert (info.name, info.device, info.threads, info.kv_cache) == ("transformers", "cpu", 1, "f32")
    assert info.version.startswith("5.") and info.build.startswith("torch 2.")


@pytest.mark.parametrize("role", ROLES)
def test_logits_agree_with_llama_cpp(hf_sessions, tiny_pair, role):
    """F32 weights both sides, F32 KV cache and no flash attention in llama.cpp: its CPU flash
    attention alone moves logits by ~5e-3 on this pair, even with an F32 cache."""
    llama = open_runtime("llama-cpp", RuntimeOptions(n_ctx=512, threads=1, f32_kv_cache=True, flash_attn=False))
    theirs = llama.load(tiny_pair.path(role, "gguf"))
    ours = hf_sessions[ROLES.index(role)]
    worst = 0.0
    for prompt in PROMPTS:
        ids = ours.tokenize(prompt.text)
        ours.truncate(0)
        theirs.truncate(0)
        worst = max(worst, float(np.abs(ours.eval(ids, Rows.ALL) - theirs.eval(ids, Rows.ALL)).max()))
    theirs.close()
    assert worst < 1e-4


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p.id for p in PROMPTS])
def test_driven_is_lossless_and_equals_llama_cpp(hf_sessions, llama_f32_sessions, prompt):
    target, drafter = hf_sessions
    ids = target.tokenize(prompt.text)
    baseline = loop.greedy_generate(target, ids, MAX_NEW)
    ours = loop.speculative_generate(target, drafter, ids, DraftRules(K), MAX_NEW)
    theirs = loop.speculative_generate(*llama_f32_sessions, ids, DraftRules(K), MAX_NEW)
    assert ours.output_ids == baseline.output_ids == theirs.output_ids
    assert (ours.step_drafted, ours.step_accepted) == (theirs.step_drafted, theirs.step_accepted)


@pytest.mark.parametrize("prompt", PROMPTS, ids=[p.id for p in PROMPTS])
def test_native_is_lossless_and_counts_like_the_driven_loop(native, hf_sessions, prompt):
    ids = native.tokenize(prompt.text)
    baseline = native.generate(ids, MAX_NEW, speculative=False)
    assisted = native.generate(ids, MAX_NEW, speculative=True)
    assert baseline.counters is None
    assert assisted.output_ids == baseline.output_ids and len(assisted.output_ids) == MAX_NEW
    assert assisted.stop_reason == baseline.stop_reason == "max_new_tokens"
    counters = assisted.counters
    assert counters.identity_violations(K) == []
    assert counters.emitted == counters.steps + counters.accepted and counters.unverified == counters.cut == 0
    assert 0 < counters.accepted < counters.drafted
    assert assisted.prefill_s > 0 and assisted.decode_s > 0
    # No draft on these prompts reaches an EOS, so HF's schedule is crossrt's, step for step.
    driven = loop.speculative_generate(*hf_sessions, ids, DraftRules(K), MAX_NEW)
    assert (counters.step_drafted, counters.step_accepted) == (driven.step_drafted, driven.step_accepted)


def test_native_drafter_stops_its_draft_at_eos(native, hf_sessions):
    """After "b." both models predict EOS at once: HF's drafter ends its draft there (1 token),
    crossrt's drafts k; the target's EOS is the step's own token in both."""
    ids = native.tokenize("b.")
    assisted = native.generate(ids, MAX_NEW, speculative=True)
    assert assisted.output_ids == native.generate(ids, MAX_NEW, speculative=False).output_ids == (1,)
    assert assisted.stop_reason == "eos"
    assert (assisted.counters.step_drafted, assisted.counters.step_accepted) == ((1,), (0,))
    driven = loop.speculative_generate(*hf_sessions, ids, DraftRules(K), MAX_NEW)
    assert (driven.step_drafted, driven.step_accepted) == ((K,), (0,))


@pytest.mark.parametrize("max_new", [1, 2, 5, 17])
def test_native_drafts_are_cut_to_the_budget(hf_runtime, tiny_pair, tmp_path, max_new):
    """The target assisting itself accepts every draft: each step drafts k but the last,
    which drafts what the budget leaves minus the step's own token (0 with 1 left)."""
    target = tiny_pair.path("target", "hf")
    session = hf_runtime.open_native(target, target, DraftRules(K), tmp_path)
    assisted = session.generate(session.tokenize(PROMPTS[0].text), max_new, speculative=True)
    counters = assisted.counters
    assert len(assisted.output_ids) == max_new
    assert counters.step_accepted == counters.step_drafted
    assert all(n == K for n in counters.step_drafted[:-1])
    assert counters.step_drafted[-1] == (max_new - 1) % (K + 1)
    assert counters.identity_violations(K) == []


def test_native_refuses_llama_cpp_drafting_rules(hf_runtime, tiny_pair, tmp_path):
    paths = (tiny_pair.path("target", "hf"), tiny_pair.path("drafter", "hf"))
    for rules in (DraftRules(K, n_min=2), DraftRules(K, p_min=0.5)):
        with pytest.raises(SettingsError, match="no n_min or p_min drafting rules"):
            hf_runtime.open_native(*paths, rules, tmp_path)


def test_native_refuses_a_prompt_that_does_not_fit(native):
    with pytest.raises(PromptRefused, match="does not fit the context"):
        native.generate([5] * 500, 64, speculative=True)


def test_gguf_loads_through_transformers(hf_runtime, hf_sessions):
    """transformers dequantizes the GGUF and undoes llama.cpp's rope permutation of q/k."""
    from_gguf = hf_runtime.load(REPO / "models" / "tiny" / "target.f32.gguf")
    target, _ = hf_sessions
    ids = target.tokenize(PROMPTS[1].text)
    assert from_gguf.tokenize(PROMPTS[1].text) == ids and from_gguf.eog_ids == target.eog_ids
    target.truncate(0)
    np.testing.assert_allclose(from_gguf.eval(ids, Rows.ALL), target.eval(ids, Rows.ALL), atol=1e-5)


def test_load_errors_are_clear(hf_runtime, tmp_path):
    with pytest.raises(FileNotFoundError, match="model not found"):
        hf_runtime.load(tmp_path / "missing")
    with pytest.raises(ModelError, match="expected a transformers folder"):
        hf_runtime.load(tmp_path)


def test_missing_transformers_names_the_install_command():
    code = ("import sys; sys.modules['transformers'] = None; "
            "from crossrt.run.runtime import availability; print(availability('transformers'))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'crossrt[hf]'" in output


@pytest.mark.parametrize("mode, schedule", [("native", "hf-assisted"), ("driven", "crossrt")])
def test_cli_runs_the_transformers_runtime(tmp_path, mode, schedule):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in CLI_PROMPTS))
    result = invoke("run", "--runtime", "transformers", "--mode", mode, "--pair", TINY_PAIR, "--k", 3,
                    "--max-new-tokens", 16, "--prompts", prompts, "--out", tmp_path / "run.json")
    assert result.exit_code == 0, result.output
    record = load_record(tmp_path / "run.json")
    assert (record.runtime.name, record.params.mode, record.params.schedule) == ("transformers", mode, schedule)
    assert record.pair.target.format == "hf"
    assert [r.prompt_id for r in record.results] == ["a", "b"]
    assert all(r.ok and r.lossless and r.counters.steps > 0 for r in record.results)
    assert bool(record.notes) == (mode == "native")


def test_cli_native_reports_refused_drafting_rules(tmp_path):
    result = invoke("run", "--runtime", "transformers", "--mode", "native", "--pair", TINY_PAIR,
                    "--draft-n-min", 1, "--out", tmp_path / "run.json")
    assert result.exit_code == 1 and "no n_min or p_min" in result.output


def test_listing_runtimes_imports_no_torch_and_a_missing_torch_is_one_reason():
    """Listing the usable runtimes reads the transformers and exllamav3 runtimes' classes without
    importing torch (~3.5 CPU-s, paid by every such command before); with torch absent (the
    module finder made to find none, as on a machine without it) the transformers runtime is
    unusable and says why and what fixes it."""
    script = """
import importlib.util, sys
from crossrt.run.runtime import availability, usable_runtimes
usable_runtimes()
print("torch imported:", "torch" in sys.modules)
found = importlib.util.find_spec
importlib.util.find_spec = lambda name, *rest: None if name == "torch" else found(name, *rest)
print("reason:", availability("transformers"))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch imported: False" in done.stdout
    assert "reason: torch is not installed: run scripts/setup, or pip install 'crossrt[hf]'" in done.stdout
