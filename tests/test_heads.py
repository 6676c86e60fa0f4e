"""EAGLE3 heads end to end on a real target: `crossrt drafter eagle3` makes one (speculators'
folder and GGUF), llama.cpp's own tools run it natively (llama-server, llama-speculative-simple),
crossrt's loop drafts with it on llama.cpp in-process (its layer inputs read as llama.cpp's EAGLE3
drafting reads them) under each tool's schedule, and parity compares them count for count. A head
whose GGUF states another norm_before_residual than its folder must fail, naming the setting.

The target is SmolLM2-135M-Instruct Q4_1 and the head the one scripts/setup makes
(scripts/fetch_head_pairs, models/pairs/smollm2-135m-eagle3.toml); skipped where they are missing.
"""

import dataclasses
import json
import re
import shutil

import gguf
import pytest
from click.testing import CliRunner

from crossrt.backends.llama_tools import refuse_unfed_head
from crossrt.builders.head_files import GGUF_NAME
from crossrt.cli import main
from crossrt.compare.head_check import folder_head_settings, gguf_head_settings
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record, save_record
from crossrt.errors import SettingsError
from crossrt.run.head_corpus import corpus_path, head_corpus
from crossrt.run.head_making import TargetStates
from crossrt.run.runtime import Rows, RuntimeOptions, availability, open_runtime
from crossrt.speculative.schedules import SERVER, SPEC_SIMPLE

from conftest import REAL_PAIR, REPO, assert_clean_error

PAIR = REPO / "models" / "pairs" / "smollm2-135m-eagle3.toml"
TARGET = REPO / ".cache" / "models" / "smollm2-135m-instruct-q4_1.gguf"
HEAD = REPO / ".cache" / "models" / "smollm2-135m-eagle3"
DFLASH_PAIR = REPO / "models" / "pairs" / "smollm2-135m-dflash.toml"
DFLASH = REPO / ".cache" / "models" / "smollm2-135m-dflash"
MISSING = [name for name in ("llama-cpp", "llama-server", "llama-spec-cli") if availability(name)]
pytestmark = [
    pytest.mark.skipif(not (HEAD / GGUF_NAME).is_file(), reason=f"{HEAD} missing: run scripts/setup"),
    pytest.mark.skipif(bool(MISSING), reason=f"runtimes not usable here: {', '.join(MISSING)}"),
]
# Long enough for the weak head to have drafts accepted on code (4 on code_prompts' 2 at 24), and one
# budget for every run here: the target's plain baselines (the store's key holds it) are decoded once.
MAX_NEW = 24


def invoke(*args, obj=None):
    return CliRunner().invoke(main, [str(a) for a in args], obj=obj)


@pytest.fixture(scope="module")
def target_states():
    """The target's hidden states over the test heads' corpus, kept between the module's head
    commands (click's obj): the EAGLE3 head's pass serves the DFlash drafter (run/head_making.py)."""
    return TargetStates()


def test_command_writes_one_head_in_every_format(tmp_path, target_states):
    """A small head (1 epoch over 8 tokens per prompt): both formats state the same settings and
    draft vocabulary, the non-default ones included; the same options again are the cached head."""
    out = tmp_path / "head"
    options = ["--epochs", 1, "--new-tokens", 8, "--draft-vocab", 512, "--layers", "3,14,26", "--norm-before-residual"]
    made = invoke("drafter", "eagle3", TARGET, out, *options, obj=target_states)
    assert made.exit_code == 0, made.output
    assert "(trained)" in made.output
    config = json.loads((out / "config.json").read_text())
    assert config["norm_before_residual"] is True and config["eagle_aux_hidden_state_layer_ids"] == [3, 14, 26]
    folder, gguf = folder_head_settings(out, "llama-cpp"), gguf_head_settings(out / GGUF_NAME)
    assert folder == gguf
    assert gguf["target_layers"] == [3, 14, 26] and gguf["norm_before_residual"] is True
    provenance = json.loads((out / "crossrt-head.json").read_text())
    assert provenance["settings"]["draft_vocab"] == 512 and provenance["steps"] == 9  # 66 prompts / 8 per step
    again = invoke("drafter", "eagle3", TARGET, tmp_path / "again", *options)
    assert again.exit_code == 0 and "(cached)" in again.output, again.output
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_shorter_corpus_is_cut_from_a_longer_one():
    """Greedy one-token decoding is prefix-consistent, so one corpus per target serves every
    length (setup's, of 64 new tokens, serves the tests' 8): the corpus of 8 decoded afresh on
    its first prompts equals the cached one cut at 8, and the corpus of 2 is that one cut at 2."""
    corpus = head_corpus(TARGET, 8)  # cut from a longer cached corpus, or written (then cached)
    assert json.loads(corpus_path(TARGET).read_text())["new_tokens"] >= 8
    with open_runtime("llama-cpp", RuntimeOptions(threads=1, n_ctx=512)).load(TARGET) as session:
        for sequence in corpus[:3]:  # as the corpus is decoded: a prompt pass, then one token at a time
            ids = list(sequence.ids[:sequence.n_prompt])
            session.truncate(0)
            row = session.eval(ids, Rows.LAST)[0]
            while len(ids) < sequence.n_prompt + 8 and (len(ids) == sequence.n_prompt or ids[-1] not in session.eog_ids):
                ids.append(int(row.argmax()))
                row = session.eval(ids[-1:], Rows.LAST)[0]
            assert tuple(ids) == sequence.ids
    assert head_corpus(TARGET, 2) == [type(s)(s.category, s.ids[:s.n_prompt + 2], s.n_prompt) for s in corpus]


def test_dflash_command_writes_one_drafter_in_both_formats(tmp_path, target_states):
    """z-lab's folder names layer outputs, the GGUF inputs of the next layer: the same layers.
    Outputs of 2 and 13 are hidden states 3 and 14, among the EAGLE3 head's above (inputs of 3, 14,
    26) on the same corpus: the target's pass over it for that head serves both (target_states)."""
    out = tmp_path / "dflash"
    made = invoke("drafter", "dflash", TARGET, out, "--epochs", 1, "--new-tokens", 8, "--layers", "2,13",
                  "--block-size", 5, "--depth", 1, obj=target_states)
    assert made.exit_code == 0, made.output
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [2, 13], "block_size": 5}
    folder, gguf = folder_head_settings(out, "llama-cpp"), gguf_head_settings(out / "dflash.gguf")
    assert folder == gguf == {"mask_token_id": 16, "target_layers": [3, 14], "block_size": 5}
    refused = invoke("drafter", "dflash", TARGET, tmp_path / "last", "--layers", "1,29")
    assert_clean_error(refused, r"--layers 1,29: a DFlash drafter reads outputs of layers 0 to 28")


def test_targets_no_runtime_can_feed_are_refused_before_loading(tmp_path):
    gemma = load_pair(REAL_PAIR).path("target", "gguf")
    if not gemma.is_file():
        pytest.skip(f"{gemma} missing: run scripts/setup")
    result = invoke("drafter", "eagle3", gemma, tmp_path / "head")
    assert_clean_error(result, r"gemma3 targets cannot feed a drafter head: llama.cpp's gemma3 graph")
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "head").exists()


def test_runtimes_refuse_a_head_on_a_target_they_cannot_feed():
    """Before a tool loads it (its graph would abort on a GGML_ASSERT), and before llama.cpp
    in-process decodes with the layer inputs asked for."""
    gemma = load_pair(REAL_PAIR).path("target", "gguf")
    if not gemma.is_file():
        pytest.skip(f"{gemma} missing: run scripts/setup")
    with pytest.raises(SettingsError, match=r"a gemma3 target cannot feed an EAGLE3 head on llama.cpp: .*t_layer_inp"):
        refuse_unfed_head(gemma, "eagle3", "runtime llama-server")
    refuse_unfed_head(gemma, "draft", "runtime llama-server")  # a drafter model needs nothing of the kind
    refuse_unfed_head(TARGET, "eagle3", "runtime llama-server")
    with open_runtime("llama-cpp", RuntimeOptions(threads=1, n_ctx=256)).load(gemma) as session:
        with pytest.raises(SettingsError, match="a gemma3 target cannot feed an EAGLE3 head on llama.cpp"):
            session.tap_layers((2, 9, 15), lambda *_: None)


@pytest.fixture(scope="module")
def code_prompts(tmp_path_factory):
    """Two of the four built-in code prompts (the heads never trained on them), code-fib first:
    at 24 tokens on llama-server the EAGLE3 head has 3 drafts accepted on code-fib and 1 on
    code-loop (2 on code-class, 0 on code-sort), the DFlash drafter 4 and 6 (2, 0). Every check
    here holds prompt by prompt or over ALL, so two prompts halve the runs, re-scoring and tau
    gap oracles, and one file for both heads decodes the target's baselines once."""
    path = tmp_path_factory.mktemp("eagle3-prompts") / "code.jsonl"
    path.write_text("".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n"
                            for p in load_prompts("builtin") if p.id in ("code-fib", "code-loop")))
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["code-fib", "code-loop"]
    return path


@pytest.fixture(scope="module")
def records(tmp_path_factory, code_prompts):
    """The head's native runs on both tools and their driven reproductions, on code prompts."""
    folder = tmp_path_factory.mktemp("eagle3-runs")
    same = ["--pair", PAIR, "--prompts", code_prompts, "--max-new-tokens", MAX_NEW, "--threads", 1]
    cells = {"server": ["--runtime", "llama-server", "--mode", "native"],
             "spec-cli": ["--runtime", "llama-spec-cli", "--mode", "native"],
             "driven-server": ["--runtime", "llama-cpp", "--schedule", SERVER],
             "driven-spec-cli": ["--runtime", "llama-cpp", "--schedule", SPEC_SIMPLE]}
    paths = {}
    for name, cell in cells.items():
        paths[name] = folder / f"{name}.json"
        result = invoke("run", *cell, *same, "--out", paths[name])
        assert result.exit_code == 0, result.output
    return paths


def test_driven_reproductions_match_each_tool_prompt_by_prompt(records):
    """Each tool against crossrt's reproduction of its schedule (the head's first draft after the
    prompt's last position on llama-server and its second-to-last on llama-speculative-simple,
    drafts of k cut to the budget only after n_min, unlike draft-simple): ids and counters
    compared prompt by prompt, and equal unless parity names the difference (a near-tie in the
    head's own arithmetic, replayed with float16 and float32 keys and values)."""
    result = invoke("parity", *records.values(), "--no-float-control")
    assert result.exit_code == 0, result.output
    assert result.output.count("counters compared") == 2  # each tool against its reproduction
    assert "head settings:" in result.output and "norm_before_residual false" in result.output
    # The two tools' schedules differ, so parity splits their tau gap, the head replayed on the oracle.
    assert re.search(r"tau gap llama-server/native \(llama-server, EAGLE3 head\) vs llama-spec-cli/native "
                     r"\(llama-spec-simple, EAGLE3 head\), ALL \(\d+ prompts\): .* schedule and rules", result.output)
    assert "EAGLE3 head), ALL" in result.output and "not computed" not in result.output
    for native, driven in (("server", "driven-server"), ("spec-cli", "driven-spec-cli")):
        ours, theirs = load_record(records[driven]), load_record(records[native])
        assert [r.prompt_id for r in ours.results] == [r.prompt_id for r in theirs.results]
    server = load_record(records["server"])
    assert server.params.spec_type == "eagle3"
    assert sum(r.counters.accepted for r in server.results) > 0  # the head drafts something right on code


def test_dflash_drafting_on_both_tools_is_reproduced(code_prompts, tmp_path):
    """The DFlash drafter setup makes, natively on llama-speculative-simple and llama-server and
    in crossrt's loop under each one's schedule: counters compared, every difference explained."""
    if not (DFLASH / "dflash.gguf").is_file():
        pytest.skip(f"{DFLASH} missing: run scripts/setup")
    same = ["--pair", DFLASH_PAIR, "--prompts", code_prompts, "--max-new-tokens", MAX_NEW, "--threads", 1]
    cells = {"server": ["--runtime", "llama-server", "--mode", "native"],
             "spec-cli": ["--runtime", "llama-spec-cli", "--mode", "native"],
             "driven-server": ["--runtime", "llama-cpp", "--schedule", SERVER],
             "driven-spec-cli": ["--runtime", "llama-cpp", "--schedule", SPEC_SIMPLE]}
    for name, cell in cells.items():
        result = invoke("run", *cell, *same, "--out", tmp_path / f"{name}.json")
        assert result.exit_code == 0, result.output
    parity = invoke("parity", *(tmp_path / f"{name}.json" for name in cells), "--no-float-control")
    assert parity.exit_code == 0, parity.output
    assert parity.output.count("counters compared") == 2
    assert "head settings:" in parity.output and "block_size 8" in parity.output
    assert re.search(r"tau gap llama-server/native \(llama-server, DFlash drafter\) vs llama-spec-cli/native "
                     r"\(llama-spec-simple, DFlash drafter\), ALL \(\d+ prompts\): .* schedule and rules", parity.output)
    assert "not computed" not in parity.output
    record = load_record(tmp_path / "server.json")
    assert record.params.spec_type == "dflash"
    assert all(r.counters.drafted <= 7 * r.counters.steps for r in record.results)  # a block of 8 drafts 7
    assert sum(r.counters.accepted for r in record.results) > 0  # the drafter drafts something right on code


def test_a_head_one_runtime_reads_with_a_setting_flipped_fails(code_prompts, records, tmp_path):
    """The head's GGUF with norm_before_residual flipped: llama-server drafts otherwise than the
    reproduction reading the folder, and parity names the setting (one prompt: the settings check
    reads the files, not the counts). The reproduction is the fixture's driven llama-server run
    cut to that prompt (a prompt's run reads no other). The key is flipped in a copy of the GGUF:
    the converter run on the folder with the setting flipped wrote the same bytes but general.name
    (checked), at 6 CPU-s against 2.6; test_command_writes_one_head_in_every_format converts a
    head with the setting true."""
    flipped = tmp_path / "flipped"
    flipped.mkdir()
    shutil.copyfile(HEAD / GGUF_NAME, flipped / GGUF_NAME)
    reader = gguf.GGUFReader(flipped / GGUF_NAME, "r+")  # a memory map of the file: the field is written in place
    field = reader.fields["eagle3.norm_before_residual"]
    assert bool(field.parts[field.data[0]][0]) is False
    field.parts[field.data[0]][0] = True
    del reader  # written back: parity must read true from the GGUF (below)
    pair = tmp_path / "flipped.toml"
    pair.write_text(f'name = "flipped"\ndescription = "the head, its GGUF flipped"\n[target]\ngguf = "{TARGET}"\n'
                    f'[drafter]\ngguf = "{flipped / GGUF_NAME}"\nhf = "{HEAD}"\n[defaults]\nk = 7\n'
                    'spec_type = "eagle3"\n')
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(code_prompts.read_text().splitlines(keepends=True)[0])
    same = ["--prompts", prompts, "--max-new-tokens", MAX_NEW, "--threads", 1]
    native, driven = tmp_path / "flipped-server.json", tmp_path / "driven.json"
    result = invoke("run", "--pair", pair, "--runtime", "llama-server", "--mode", "native", *same, "--out", native)
    assert result.exit_code == 0, result.output
    reproduction = load_record(records["driven-server"])
    assert reproduction.params.schedule == SERVER and reproduction.results[0].prompt_id == load_record(
        native).results[0].prompt_id
    save_record(dataclasses.replace(reproduction, results=reproduction.results[:1]), driven)
    parity = invoke("parity", native, driven, "--no-float-control")
    assert parity.exit_code == 1, parity.output
    assert re.search(r"read a head with norm_before_residual false \(smollm2-135m-eagle3\), llama-server/native "
                     r"true \(eagle3.gguf\)", parity.output), parity.output

