"""The parity matrix across two real runtimes: llama.cpp in-process and transformers, on the
tiny pair in F32 with an F32 KV cache and flash attention off (the closest numerics)."""

import json

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record

from conftest import REPO, TINY_PAIR

EXACT = ["--f32-kv-cache", "--no-flash-attn"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    result = invoke("parity", "--pair", TINY_PAIR, "--runtimes", "llama-cpp,transformers", "--modes", "driven,native",
                    "--max-new-tokens", 32, "--out-dir", out, "--logit-tolerance", "1e-4",
                    "--markdown", out / "parity.md", "--junit", out / "parity.xml", *EXACT)
    return result, out


def test_llama_cpp_and_transformers_agree_token_for_token_and_in_logits(matrix):
    result, out = matrix
    assert result.exit_code == 0, result.output
    assert "llama-cpp/driven vs transformers/driven: 10 prompts: 10 identical, 0 explained, 0 failed, 0 not comparable; counters compared" in result.output
    assert "transformers/driven vs transformers/native: 10 prompts: 10 identical, 0 explained, 0 failed" in result.output
    assert "logits along common outputs: 30/30 within tolerance" in result.output
    records = {path.name: load_record(path) for path in out.glob("*.json")}
    assert set(records) == {"tiny-llama-cpp-driven-k4.json", "tiny-transformers-driven-k4.json",
                            "tiny-transformers-native-k4.json"}
    native = records["tiny-transformers-native-k4.json"]
    assert native.params.schedule == "hf-assisted" and native.summary().lossless == 10


def test_forced_divergence_fails_parity_and_diff_explains_it(matrix, tmp_path):
    _, out = matrix
    models = REPO / "models" / "tiny"
    swapped = tmp_path / "swapped.json"
    assert invoke("run", "--runtime", "transformers", "--target", models / "drafter-hf", "--drafter", models / "drafter-hf",
                  "--max-new-tokens", 32, "--out", swapped).exit_code == 0
    result = invoke("parity", out / "tiny-llama-cpp-driven-k4.json", swapped, "--junit", tmp_path / "p.xml")
    assert result.exit_code == 1 and "outputs part at token" in result.output
    explained = invoke("diff", out / "tiny-llama-cpp-driven-k4.json", swapped)
    assert "verdict: disagreement" in explained.output and "verdict: near-tie" not in explained.output
    assert explained.exit_code == 1  # parity's verdict on the same records


def test_ci_reports_are_written(matrix):
    _, out = matrix
    assert (out / "parity.md").read_text().startswith("## crossrt parity: passed")
    assert 'failures="0"' in (out / "parity.xml").read_text()


def test_default_numerics_differ_in_logits_not_tokens(tmp_path):
    """llama.cpp's default F16 cache and flash attention move logits ~5e-3 from transformers':
    tokens agree, the strict logit check does not, and says so. Three of the built-in prompts:
    a shift 50 times the tolerance shows on any of them, and each prompt more is two more runs."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n"
                               for p in load_prompts("builtin")[:3]))
    result = invoke("parity", "--pair", TINY_PAIR, "--runtimes", "llama-cpp,transformers", "--modes", "driven",
                    "--prompts", prompts, "--max-new-tokens", 16, "--out-dir", tmp_path / "runs",
                    "--logit-tolerance", "1e-4")
    assert result.exit_code == 1
    assert "3 prompts: 3 identical, 0 explained, 0 failed, 0 not comparable; counters compared" in result.output
    assert "logits: max abs logit diff" in result.output and "(tolerance for --logit-tolerance)" in result.output


def test_cells_run_at_once_give_the_same_records(matrix, tmp_path):
    """--jobs 2: after the first cell, the others run in processes of their own; the records are
    the sequential matrix's, token for token and count for count, in matrix order."""
    _, sequential = matrix
    result = invoke("parity", "--pair", TINY_PAIR, "--runtimes", "llama-cpp,transformers", "--modes", "driven,native",
                    "--max-new-tokens", 32, "--out-dir", tmp_path, "--logit-tolerance", "1e-4", "--jobs", 2, *EXACT)
    assert result.exit_code == 0, result.output
    assert "logits along common outputs: 30/30 within tolerance" in result.output
    assert result.output.index("llama-cpp/driven vs transformers/driven") < result.output.index(
        "transformers/driven vs transformers/native")
    for path in sequential.glob("*.json"):
        ran, alone = load_record(tmp_path / path.name), load_record(path)
        assert [(r.prompt_id, r.prompt_ids, r.output_ids, r.baseline_ids, r.counters) for r in ran.results] == \
            [(r.prompt_id, r.prompt_ids, r.output_ids, r.baseline_ids, r.counters) for r in alone.results]
