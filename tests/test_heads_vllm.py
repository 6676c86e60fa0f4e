"""The EAGLE3 head on vLLM's CPU build (speculative_config method "eagle3", the head's
speculators folder), beside llama-server reading its GGUF: one head, two formats, two runtimes.
vLLM's per-request counters go into the schema as for its draft-model runs; parity compares the
outputs and checks both runs read the same head settings (counts are not compared: vLLM's
schedule is its own). Skipped where vLLM or the head (scripts/setup) is missing."""

import json

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record
from crossrt.run.runtime import availability

from conftest import REPO

PAIR = REPO / "models" / "pairs" / "smollm2-135m-eagle3.toml"
HEAD = REPO / ".cache" / "models" / "smollm2-135m-eagle3"
MISSING = [name for name in ("vllm", "llama-server") if availability(name)]
pytestmark = [
    pytest.mark.skipif(not (HEAD / "config.json").is_file(), reason=f"{HEAD} missing: run scripts/setup"),
    pytest.mark.skipif(bool(MISSING), reason=f"runtimes not usable here: {', '.join(MISSING)}"),
]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_vllm_runs_the_head_natively_and_reads_what_llama_server_reads(tmp_path):
    prompts = tmp_path / "code.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n"
                               for p in [p for p in load_prompts("builtin") if p.category == "code"][:2]))
    same = ["--pair", PAIR, "--prompts", prompts, "--max-new-tokens", 16, "--threads", 1, "--mode", "native"]
    for runtime in ("vllm", "llama-server"):
        result = invoke("run", "--runtime", runtime, *same, "--out", tmp_path / f"{runtime}.json")
        assert result.exit_code == 0, result.output
    record = load_record(tmp_path / "vllm.json")
    assert record.params.spec_type == "eagle3" and record.params.schedule == "vllm"
    assert any("EAGLE3 speculative decoding (method eagle3" in note for note in record.notes)
    for result in record.results:
        assert result.output_ids == result.baseline_ids and result.counters.steps > 0
        assert result.counters.drafted == result.counters.steps * record.params.k  # vLLM drafts k a step
    parity = invoke("parity", tmp_path / "vllm.json", tmp_path / "llama-server.json", "--no-float-control")
    assert parity.exit_code == 0, parity.output
    assert "head settings:" in parity.output and "2 runs, 2 files" in parity.output
