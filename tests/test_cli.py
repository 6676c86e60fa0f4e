"""The crossrt commands, run in-process on the tiny pair with real llama.cpp."""

import json
import re
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.records.record_json import load_record

from conftest import TINY_PAIR, assert_clean_error


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in prompts))
    return path


PROMPTS = [("a", "code", "def add(a, b):\n    return"), ("b", "prose", "The old house at the end of the")]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def run_args(tmp_path, prompts, *extra):
    return ["run", "--pair", TINY_PAIR, "--k", 3, "--max-new-tokens", 16, "--prompts", prompts,
            "--out", tmp_path / "run.json", *extra]


def test_run_writes_a_record_and_show_summarizes_it(tmp_path):
    result = invoke(*run_args(tmp_path, write_prompts(tmp_path / "p.jsonl", PROMPTS)))
    assert result.exit_code == 0, result.output
    record = load_record(tmp_path / "run.json")
    assert [r.prompt_id for r in record.results] == ["a", "b"]
    assert all(r.ok and r.lossless for r in record.results)
    assert record.params.k == 3 and record.runtime.name == "llama-cpp" and record.runtime.threads == 1
    shown = invoke("show", tmp_path / "run.json")
    assert shown.exit_code == 0
    lines = shown.output.splitlines()  # the run's identity above the table, then a row per category and ALL
    identity = "; ".join(line.strip() for line in lines[:-5])  # wrapped between its items
    assert f"file: {tmp_path / 'run.json'}; pair: tiny; runtime: llama-cpp; mode: driven; schedule: crossrt; " \
        "drafting: model; k: 3; acceptance: greedy; lossy: no" == identity
    assert [line.split()[0] for line in lines[-3:]] == ["code", "prose", "ALL"]
    assert "2/2" in lines[-1]


def test_resume_keeps_finished_prompts_and_runs_the_rest(tmp_path):
    first = write_prompts(tmp_path / "first.jsonl", PROMPTS[:1])
    assert invoke(*run_args(tmp_path, first)).exit_code == 0
    before = load_record(tmp_path / "run.json").results[0]
    refused = invoke(*run_args(tmp_path, write_prompts(tmp_path / "all.jsonl", PROMPTS)))
    assert refused.exit_code == 1 and "--resume" in refused.output
    resumed = invoke(*run_args(tmp_path, tmp_path / "all.jsonl", "--resume"))
    assert resumed.exit_code == 0, resumed.output
    results = load_record(tmp_path / "run.json").results
    assert results[0] == before  # kept as it was, timings included: not re-run
    assert [r.prompt_id for r in results] == ["a", "b"]
    changed = invoke(*run_args(tmp_path, tmp_path / "all.jsonl", "--resume", "--f32-kv-cache"))
    assert changed.exit_code == 1 and "cannot resume" in changed.output
    mismatched = invoke("run", "--pair", TINY_PAIR, "--k", 2, "--max-new-tokens", 16, "--prompts",
                        tmp_path / "all.jsonl", "--out", tmp_path / "run.json", "--resume")
    assert mismatched.exit_code == 1 and "cannot resume" in mismatched.output


def test_prompt_too_long_for_the_context_fails_alone(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [("long", "prose", "word " * 200), PROMPTS[0]])
    result = invoke(*run_args(tmp_path, prompts, "--n-ctx", 64))
    assert result.exit_code == 0, result.output
    long, short = load_record(tmp_path / "run.json").results
    assert long.status == "failed" and "does not fit the context" in long.error
    assert short.ok and short.lossless
    assert "failed: long" in result.output


@pytest.mark.parametrize("args, message", [
    (["--target", "missing.gguf", "--drafter", "missing.gguf"], "not found: "),
    (["--pair", "no-such-pair.toml"], "pair manifest not found"),
    (["--pair", TINY_PAIR, "--prompts", "no-such-file.jsonl"], "prompt file not found"),
    (["--pair", TINY_PAIR, "--gpu-split", "1,x"], "not a comma-separated list"),
])
def test_bad_input_gives_a_clear_error_not_a_traceback(tmp_path, args, message):
    result = invoke("run", *args, "--out", tmp_path / "run.json")
    assert_clean_error(result, re.escape(message))


def test_community_manifest_asks_for_its_paths(tmp_path):
    from conftest import REPO

    manifest = REPO / "models" / "pairs" / "community-qwen3.8-27b-dflash2.toml"
    result = invoke("run", "--pair", manifest, "--out", tmp_path / "run.json")
    assert result.exit_code == 1
    assert "path is left empty" in result.output


def test_bad_prompt_file_names_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "category": "code", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n')
    result = invoke(*run_args(tmp_path, path))
    assert result.exit_code == 1 and "line 2" in result.output and "category" in result.output


def test_runtimes_lists_llama_cpp_as_usable():
    result = invoke("runtimes")
    assert result.exit_code == 0
    assert any(line.split()[:2] == ["llama-cpp", "yes"] for line in result.output.splitlines())
    assert "llama-cpp" in invoke("runtimes", "--usable").output.split()


def test_a_binding_without_a_library_says_how_to_get_one(tmp_path):
    """scripts/setup installs llama-cpp-python without a llama.cpp of its own: pointed at a
    directory with no libllama, llama-cpp is unavailable with the fix, not an import error."""
    done = subprocess.run([sys.executable, "-c", "from crossrt.cli import main; main()", "runtimes"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, LLAMA_CPP_LIB_PATH=str(tmp_path)))
    line = next(line for line in done.stdout.splitlines() if line.split()[:1] == ["llama-cpp"])
    assert done.returncode == 0 and line.split()[1] == "no", done.stdout + done.stderr
    assert "cannot load llama.cpp" in line and "scripts/build_llama_tools" in line
