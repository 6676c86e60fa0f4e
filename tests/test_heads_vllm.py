"""Drafter heads on vLLM's CPU build, beside llama-server reading their GGUFs: one head, two
formats, two runtimes. The EAGLE3 head (speculative_config method "eagle3", its speculators
folder) and the DFlash drafter (method "dflash", z-lab's DFlashDraftModel folder). vLLM's
per-request counters go into the schema as for its draft-model runs; parity compares the
outputs and checks both runs read the same head settings (counts are not compared: vLLM's
schedule is its own, and its CPU build normalizes every DFlash layer's context keys with layer
0's k_norm, backends/vllm_heads.py). Skipped where vLLM or a head (scripts/setup) is missing."""

import json
import re

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record
from crossrt.run.runtime import availability

from conftest import REPO

PAIRS = REPO / "models" / "pairs"
MODELS = REPO / ".cache" / "models"
MISSING = [name for name in ("vllm", "llama-server") if availability(name)]
RUNTIMES = pytest.mark.skipif(bool(MISSING), reason=f"runtimes not usable here: {', '.join(MISSING)}")


def needs(folder):
    return pytest.mark.skipif(not (folder / "config.json").is_file(), reason=f"{folder} missing: run scripts/setup")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_both(tmp_path, pair: str):
    """vLLM and llama-server natively with pair on the first built-in code prompt x 16 tokens: vLLM's
    record, and parity's result over the two. One prompt: what is asserted (the head read alike by
    both runtimes, vLLM's counts per step, lossless outputs) holds prompt by prompt, and parity's
    re-scoring and tau gap cost ~6.5 CPU-s a prompt (27.5 CPU-s at 2 prompts, 21 at 1).
    --no-tau-gap: the two schedules differ, so parity would add tau gap lines, whose oracle (the
    prompt decoded again by the target and the head in llama.cpp: 8.8 s wall for EAGLE3, 3.3 for
    DFlash, of that cost) no test here reads: they assert the verdict and the head settings, which
    the gap lines never change. Tau gaps of heads are asserted in tests/test_heads.py, parity's in
    tests/test_tau_gap.py."""
    prompts = tmp_path / "code.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n"
                               for p in [p for p in load_prompts("builtin") if p.category == "code"][:1]))
    same = ["--pair", PAIRS / f"{pair}.toml", "--prompts", prompts, "--max-new-tokens", 16, "--threads", 1,
            "--mode", "native"]
    for runtime in ("vllm", "llama-server"):
        result = invoke("run", "--runtime", runtime, *same, "--out", tmp_path / f"{runtime}.json")
        assert result.exit_code == 0, result.output
    return load_record(tmp_path / "vllm.json"), invoke("parity", tmp_path / "vllm.json",
                                                       tmp_path / "llama-server.json", "--no-float-control",
                                                       "--no-tau-gap")


def check_vllm_run(record, spec_type: str, note: str):
    assert record.params.spec_type == spec_type and record.params.schedule == "vllm"
    assert any(note in line for line in record.notes)
    assert len(record.results) == 1  # the loop below checks the one prompt, not nothing
    for result in record.results:
        assert result.output_ids == result.baseline_ids and result.counters.steps > 0
        assert result.counters.drafted == result.counters.steps * record.params.k  # vLLM drafts k a step


@RUNTIMES
@needs(MODELS / "smollm2-135m-eagle3")
def test_vllm_runs_the_head_natively_and_reads_what_llama_server_reads(tmp_path):
    record, parity = run_both(tmp_path, "smollm2-135m-eagle3")
    check_vllm_run(record, "eagle3", "EAGLE3 speculative decoding (method eagle3")
    assert parity.exit_code == 0, parity.output
    assert "head settings:" in parity.output and "2 runs, 2 files" in parity.output


@RUNTIMES
@needs(MODELS / "smollm2-135m-dflash")
def test_vllm_runs_the_dflash_drafter_natively_and_reads_what_llama_server_reads(tmp_path):
    record, parity = run_both(tmp_path, "smollm2-135m-dflash")
    check_vllm_run(record, "dflash", "DFlash speculative decoding (method dflash")
    assert any("layer 0's k_norm" in line for line in record.notes)
    assert parity.exit_code == 0, parity.output
    dflash = json.loads((MODELS / "smollm2-135m-dflash" / "config.json").read_text())["dflash_config"]
    assert "head settings:" in parity.output and "2 runs, 2 files" in parity.output
    # vLLM reads the folder's z-lab ids + 1 (its log: "auxiliary layers ... (2, 11, 19, 28)"), as the GGUF states them.
    assert f"target_layers {json.dumps([i + 1 for i in dflash['target_layer_ids']])}" in parity.output


DFLASH_CONFIG = {"architectures": ["DFlashDraftModel"], "num_hidden_layers": 2,
                 "dflash_config": {"mask_token_id": 16, "target_layer_ids": [1, 10, 18, 27], "block_size": 8}}


def test_dflash_drafters_vllm_cannot_run_as_asked_are_refused_before_it_starts():
    from crossrt.backends.vllm_heads import check_head
    from crossrt.errors import CrossrtError

    llama, folder = {"model_type": "llama", "num_hidden_layers": 30}, MODELS / "drafter"
    check_head("dflash", llama, folder, DFLASH_CONFIG, 7)
    refusals = [
        (("dflash", llama, folder, DFLASH_CONFIG, 8), "block_size 8: k=8"),
        (("dflash", llama, folder, {"architectures": ["DFlashDraftModel"]}, 7), "dflash_config's mask_token_id"),
        (("dflash", {"model_type": "llama", "num_hidden_layers": 20}, folder, DFLASH_CONFIG, 7), "the target's 20"),
        (("dflash", {"model_type": "gemma3"}, folder, DFLASH_CONFIG, 7), "SupportsEagle3"),
        (("eagle3", llama, folder, DFLASH_CONFIG, 7), "is a DFlash drafter"),
    ]
    for args, message in refusals:
        with pytest.raises(CrossrtError, match=re.escape(message)):
            check_head(*args)
