"""The driven loop's hf-assisted schedule on llama.cpp reproduces transformers' own assisted
generation count for count, step for step: the same pair, two runtimes, one schedule."""

import json

from click.testing import CliRunner

from crossrt.cli import main
from crossrt.records.record_json import load_record

from conftest import TINY_PAIR

EXACT = ["--f32-kv-cache", "--no-flash-attn"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_hf_assisted_driven_on_llama_cpp_matches_transformers_native(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    texts = {"eos-first": "b.", "code": "def fibonacci(n):\n", "prose": "The river ran slowly past the old mill"}
    prompts.write_text("".join(json.dumps({"id": i, "category": "x", "prompt": t}) + "\n" for i, t in texts.items()))
    common = ["--pair", TINY_PAIR, "--k", 3, "--max-new-tokens", 17, "--prompts", prompts, *EXACT]
    assert invoke("run", "--runtime", "transformers", "--mode", "native", "--out", tmp_path / "hf.json",
                  *common).exit_code == 0
    assert invoke("run", "--runtime", "llama-cpp", "--schedule", "hf-assisted", "--out", tmp_path / "llama.json",
                  *common).exit_code == 0
    hf, llama = load_record(tmp_path / "hf.json"), load_record(tmp_path / "llama.json")
    assert hf.params.schedule == llama.params.schedule == "hf-assisted"
    for native, driven in zip(hf.results, llama.results, strict=True):
        assert native.output_ids == driven.output_ids
        assert native.counters == driven.counters  # per-step lists included
    eos_first = {r.prompt_id: r for r in llama.results}["eos-first"]
    assert eos_first.stop_reason == "eos" and eos_first.counters.step_drafted == (1,)
    result = invoke("parity", tmp_path / "hf.json", tmp_path / "llama.json", "--logit-tolerance", "1e-4")
    assert result.exit_code == 0, result.output
    assert "3 prompts: 3 identical, 0 explained, 0 failed, 0 not comparable; counters compared" in result.output
