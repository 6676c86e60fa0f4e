"""The exllamav3 runtime. Without CUDA (this project's CI and developer machines): it is listed as
unusable with the reason and the fix, `crossrt run` says so without a traceback, exllamav3 is
never imported, and the pure parts (count translation, BOS rule, refused settings)
run. With a CUDA GPU and exllamav3 (scripts/gpu_check), the `gpu` tests run the tiny pair:
driven mode lossless and equal to llama.cpp on the same FP16 weights, the native Generator's
counts against their identities and the driven loop. What exllamav3 1.6.5's source says of the
calls crossrt makes is checked without a GPU in tests/test_exllamav3_source.py."""

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from crossrt.errors import SettingsError
from crossrt.speculative import loop
from crossrt.backends.exllamav3 import adds_bos, chunk_size, missing_requirements, page_round
from crossrt.backends.exllamav3_native import check_rules, counters_from_rounds, drafting_kind
from crossrt.cli import main
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import (DraftRules, RuntimeFailure, RuntimeOptions, RuntimeUnavailable, Rows, availability,
                             open_runtime, runtime_class)
from crossrt.records.record_json import load_record

from conftest import REPO

UNAVAILABLE = availability("exllamav3")
only_without_exllamav3 = pytest.mark.skipif(UNAVAILABLE is None, reason="exllamav3 runs here")
needs_exllamav3 = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"needs a CUDA GPU: {UNAVAILABLE}")

TINY = REPO / "models" / "tiny"
HF = {"target": TINY / "target-hf", "drafter": TINY / "drafter-hf"}
PROMPTS = load_prompts("builtin")
K = 4
MAX_NEW = 48


def crossrt_cli(*args):
    code = "import sys; from crossrt.cli import main; sys.argv[0] = 'crossrt'; main()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)


# ---- without CUDA ------------------------------------------------------------------------------

@only_without_exllamav3
def test_check_available_names_what_is_missing_and_imports_nothing():
    code = ("import sys; from crossrt.run.runtime import availability; print(availability('exllamav3')); "
            "print('exllamav3' in sys.modules)")
    reason, imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()
    assert reason.startswith("exllamav3 cannot run here: ")
    assert all(problem in reason for problem in missing_requirements())
    assert "pip install 'crossrt[exl3]'" in reason and "CUDA build of torch" in reason
    assert imported == "False"
    with pytest.raises(RuntimeUnavailable, match="exllamav3 cannot run here"):
        runtime_class("exllamav3").check_available()


def test_missing_torch_is_named_before_anything_is_imported():
    code = ("import sys; sys.modules['torch'] = None; from crossrt.run.runtime import availability; "
            "print(availability('exllamav3'))")
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "torch is not installed" in output


@only_without_exllamav3
def test_runtimes_lists_exllamav3_as_not_usable_with_the_reason():
    table = CliRunner().invoke(main, ["runtimes"]).output
    row = next(line for line in table.splitlines() if line.startswith("exllamav3 "))
    assert row.split()[1] == "no" and UNAVAILABLE in row
    assert "exllamav3" not in CliRunner().invoke(main, ["runtimes", "--usable"]).output.split()


@only_without_exllamav3
@pytest.mark.parametrize("mode", ["driven", "native"])
def test_run_says_why_it_cannot_run_without_a_traceback(tmp_path, mode):
    out = tmp_path / "run.json"
    result = crossrt_cli("run", "--runtime", "exllamav3", "--mode", mode, "--pair", "tiny", "--out", out)
    assert result.returncode == 1
    assert f"Error: {UNAVAILABLE}" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not out.exists()


# ---- pure parts, everywhere -------------------------------------------------------------------

def test_rounds_become_counters():
    """k = 4, budget 7: a full round (4 accepted + its own token), then a round whose second
    position reaches the budget: 1 accepted, its 3 unresolved positions counted as rejected."""
    counters = counters_from_rounds([(5, 4, 4), (7, 4, 1)], accepted_total=5, rejected_total=3, emitted=7, k=4)
    assert (counters.steps, counters.drafted, counters.accepted, counters.emitted) == (2, 8, 5, 7)
    assert (counters.unverified, counters.cut) == (0, 0)
    assert counters.accepted_per_pos == (2, 1, 1, 1)
    assert (counters.step_drafted, counters.step_accepted) == ((4, 4), (4, 1))


def test_a_stop_token_first_is_one_round_with_nothing_accepted():
    counters = counters_from_rounds([(1, 4, 0)], accepted_total=0, rejected_total=4, emitted=1, k=4)
    assert (counters.steps, counters.drafted, counters.accepted, counters.emitted) == (1, 4, 0, 1)


def test_tokens_of_rounds_without_a_draft_are_unverified():
    """Two plain decodes, a round accepting 2 (new_tokens 2 -> 5), one more plain decode."""
    counters = counters_from_rounds([(5, 4, 2)], accepted_total=2, rejected_total=2, emitted=6, k=4)
    assert (counters.steps, counters.accepted, counters.unverified) == (1, 2, 3)
    assert counters.identity_violations(4) == []


@pytest.mark.parametrize("rounds, accepted, rejected, emitted, message", [
    ([(5, 4, 4)], 3, 1, 5, "rounds accept 4, the job counts 3"),
    ([(5, 4, 4)], 4, 1, 5, "rounds draft 4, the job counts 4 accepted"),
    ([(3, 4, 4)], 4, 0, 3, "accepted 4 but emitted 3"),
])
def test_counts_that_do_not_add_up_stop_the_run(rounds, accepted, rejected, emitted, message):
    with pytest.raises(RuntimeFailure, match=message):
        counters_from_rounds(rounds, accepted, rejected, emitted, k=4)


def test_bos_follows_the_models_own_tokenizer(tmp_path):
    assert adds_bos(HF["target"])  # the tiny tokenizer's template puts <|bos|> first
    template = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}]}
    sequence = {"type": "Sequence", "processors": [{"type": "ByteLevel"}, template]}
    cases = {"sequence": ({"post_processor": sequence}, {}),
             "byte-level": ({"post_processor": {"type": "ByteLevel"}}, {}),
             "config-says-no": ({"post_processor": template}, {"add_bos_token": False})}
    for name, (tokenizer, config) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert adds_bos(tmp_path / "sequence")
    assert not adds_bos(tmp_path / "byte-level") and not adds_bos(tmp_path / "config-says-no")


def test_drafting_kind_and_cache_pages():
    assert drafting_kind({}, "LlamaForCausalLM") == "draft"
    assert drafting_kind({"dflash_draft": True}, "DFlash2DraftModel") == "dflash2"
    assert drafting_kind({"dflash_draft": True}, "DFlashDraftModel") == "dflash"
    assert drafting_kind({"mtp_draft": True}, "Qwen3_5ForCausalLM") == "mtp"
    assert drafting_kind({"mtp_draft": True}, "Gemma4AssistantForCausalLM") == "mtp"
    assert drafting_kind({"dflash_draft": True}, "DeepseekV4ForCausalLM", target_component=True) == "dspark"
    assert (page_round(1), page_round(256), page_round(2048 + 5)) == (256, 256, 2304)


def test_native_refuses_what_it_cannot_run_before_loading_anything(tmp_path):
    """Refused before exllamav3 is imported: without it installed, a later check would fail
    with ModuleNotFoundError instead."""
    runtime = runtime_class("exllamav3")(RuntimeOptions())
    refused = ((DraftRules(K, n_min=2), "no n_min or p_min"), (DraftRules(K, p_min=0.5), "no n_min or p_min"),
               (DraftRules(K, spec_type="ngram-simple"), "not 'ngram-simple'"),
               (DraftRules(K, spec_type="eagle3"), "not 'eagle3'"))
    for rules, message in refused:
        with pytest.raises(SettingsError, match=message):
            runtime.open_native(HF["target"], HF["drafter"], rules, tmp_path)
    check_rules(DraftRules(K))
    f32 = runtime_class("exllamav3")(RuntimeOptions(f32_kv_cache=True))
    with pytest.raises(SettingsError, match="no F32 KV cache"):
        f32.load(HF["target"])
    with pytest.raises(SettingsError, match="no F32 KV cache"):
        f32.open_native(HF["target"], HF["drafter"], DraftRules(K), tmp_path)


# ---- on a CUDA GPU (scripts/gpu_check) ---------------------------------------------------------

@pytest.fixture(scope="module")
def exl_runtime():
    return open_runtime("exllamav3", RuntimeOptions(n_ctx=512))


@pytest.fixture(scope="module")
def exl_sessions(exl_runtime):
    sessions = tuple(exl_runtime.load(HF[role]) for role in ("target", "drafter"))
    yield sessions
    for session in sessions:
        session.close()


@pytest.fixture(scope="module")
def llama_f16_sessions():
    """llama.cpp on the F16 GGUFs: the same FP16-rounded matrices exllamav3 makes of the HF folders."""
    runtime = open_runtime("llama-cpp", RuntimeOptions(n_ctx=512, threads=1))
    return tuple(runtime.load(TINY / f"{role}.f16.gguf") for role in ("target", "drafter"))


@pytest.fixture(scope="module")
def native(exl_runtime, tmp_path_factory):
    session = exl_runtime.open_native(HF["target"], HF["drafter"], DraftRules(K), tmp_path_factory.mktemp("native"))
    yield session
    session.close()


@pytest.mark.gpu
@needs_exllamav3
def test_tokenizer_matches_llama_cpp(exl_sessions, llama_f16_sessions):
    target = exl_sessions[0]
    for text in [p.text for p in PROMPTS] + ["b.", "x <|eos|> y", "  two  spaces\n\n", "é ü 😀"]:
        assert target.tokenize(text) == llama_f16_sessions[0].tokenize(text), text
    assert target.detokenize(target.tokenize("def add(a, b):")) == "def add(a, b):"


@pytest.mark.gpu
@needs_exllamav3
def test_session_describes_the_model(exl_runtime, exl_sessions):
    target, drafter = exl_sessions
    assert target.n_vocab == drafter.n_vocab == 512 and target.eog_ids == frozenset({1})
    info = exl_runtime.info()
    assert (info.name, info.version, info.device, info.kv_cache) == ("exllamav3", "1.6.5", "gpu", "f16")


@pytest.mark.gpu
@needs_exllamav3
def test_chunked_evaluation_equals_one_pass(exl_sessions):
    """Chunks continue at the right positions: a prompt in chunks of 4 gives one pass's logits."""
    target, _ = exl_sessions
    ids = target.tokenize(PROMPTS[0].text)
    target.truncate(0)
    whole = target.eval(ids, Rows.ALL).copy()
    target.truncate(0)
    target._chunk = 4
    try:
        chunked = target.eval(ids, Rows.ALL)
    finally:
        target._chunk = chunk_size(target._capacity)
    assert len(ids) > 8
    np.testing.assert_allclose(chunked, whole, atol=5e-2)
    assert (chunked.argmax(axis=1) == whole.argmax(axis=1)).all()


@pytest.mark.gpu
@needs_exllamav3
@pytest.mark.parametrize("prompt", PROMPTS, ids=[p.id for p in PROMPTS])
def test_driven_is_lossless_and_equals_llama_cpp_on_the_same_weights(exl_sessions, llama_f16_sessions, prompt):
    ids = exl_sessions[0].tokenize(prompt.text)
    baseline = loop.greedy_generate(exl_sessions[0], ids, MAX_NEW)
    ours = loop.speculative_generate(*exl_sessions, ids, DraftRules(K), MAX_NEW)
    theirs = loop.speculative_generate(*llama_f16_sessions, ids, DraftRules(K), MAX_NEW)
    assert ours.output_ids == baseline.output_ids == theirs.output_ids
    assert (ours.step_drafted, ours.step_accepted) == (theirs.step_drafted, theirs.step_accepted)


@pytest.mark.gpu
@needs_exllamav3
def test_logits_are_close_to_llama_cpp(exl_sessions, llama_f16_sessions):
    """FP16 activations in exllamav3, F32 ones in llama.cpp's CPU path: a bound for FP16
    rounding, to tighten once measured (docs/exllamav3.md)."""
    ours, theirs = exl_sessions[0], llama_f16_sessions[0]
    for prompt in PROMPTS:
        ids = ours.tokenize(prompt.text)
        ours.truncate(0)
        theirs.truncate(0)
        a, b = ours.eval(ids, Rows.ALL).copy(), theirs.eval(ids, Rows.ALL)
        print(f"{prompt.id}: max |logit difference| {np.abs(a - b).max():.2e}")
        assert (a.argmax(axis=1) == b.argmax(axis=1)).all()
        assert np.abs(a - b).max() < 0.1


@pytest.mark.gpu
@needs_exllamav3
@pytest.mark.parametrize("prompt", PROMPTS, ids=[p.id for p in PROMPTS])
def test_native_is_lossless_and_counts_like_the_driven_loop(native, exl_sessions, prompt):
    ids = native.tokenize(prompt.text)
    baseline = native.generate(ids, MAX_NEW, speculative=False)
    generated = native.generate(ids, MAX_NEW, speculative=True)
    assert baseline.counters is None
    driven = loop.speculative_generate(*exl_sessions, ids, DraftRules(K), MAX_NEW)
    assert generated.output_ids == baseline.output_ids == driven.output_ids
    counters = generated.counters
    assert counters.identity_violations(K) == []
    assert counters.emitted == counters.steps + counters.accepted and counters.unverified == counters.cut == 0
    # exllamav3 verifies a full window every round; what it accepts is crossrt's, step for step.
    assert counters.step_drafted == (K,) * counters.steps
    assert counters.step_accepted == driven.step_accepted
    assert generated.prefill_s > 0 and generated.decode_s > 0


@pytest.mark.gpu
@needs_exllamav3
def test_native_stop_token_ends_the_first_round(native):
    """After "b." the target's first token is EOS: one round, its k draft positions rejected."""
    generated = native.generate(native.tokenize("b."), MAX_NEW, speculative=True)
    assert (generated.output_ids, generated.stop_reason) == ((1,), "eos")
    assert (generated.counters.step_drafted, generated.counters.step_accepted) == ((K,), (0,))


@pytest.mark.gpu
@needs_exllamav3
def test_native_rounds_stop_at_the_budget(exl_runtime, tmp_path):
    """The target drafting for itself: every round accepts all k but the last, which ends where
    the budget does, (max_new - 1) mod (k + 1) tokens in."""
    session = exl_runtime.open_native(HF["target"], HF["target"], DraftRules(K), tmp_path)
    try:
        for max_new in (1, 2, 5, 7, 17):
            generated = session.generate(session.tokenize(PROMPTS[0].text), max_new, speculative=True)
            counters = generated.counters
            assert len(generated.output_ids) == max_new and generated.stop_reason == "max_new_tokens"
            assert counters.step_drafted == (K,) * counters.steps
            assert counters.step_accepted == (K,) * (counters.steps - 1) + ((max_new - 1) % (K + 1),)
    finally:
        session.close()


@pytest.mark.gpu
@needs_exllamav3
@pytest.mark.parametrize("mode, schedule", [("native", "exllamav3"), ("driven", "crossrt")])
def test_cli_runs_exllamav3(tmp_path, mode, schedule):
    manifest = tmp_path / "tiny-exl3.toml"
    manifest.write_text('name = "tiny-exl3"\n' + "".join(f'[{role}]\nexl3 = "{HF[role]}"\n' for role in HF))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "code", "prompt": "def add(a, b):\n    return"}) + "\n")
    result = CliRunner().invoke(main, ["run", "--runtime", "exllamav3", "--mode", mode, "--pair", str(manifest),
                                       "--k", "3", "--max-new-tokens", "16", "--prompts", str(prompts),
                                       "--out", str(tmp_path / "run.json")])
    assert result.exit_code == 0, result.output
    record = load_record(tmp_path / "run.json")
    assert (record.runtime.name, record.params.mode, record.params.schedule) == ("exllamav3", mode, schedule)
    assert record.pair.target.format == "hf" and record.pair.target.quantization == "float32"
    assert all(r.ok and r.lossless and r.counters.steps > 0 for r in record.results)
    assert bool(record.notes) == (mode == "native")
