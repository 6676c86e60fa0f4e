"""Splits generated on purpose, and every one given a cause (crossrt/compare/census.py).

No prompt here is "the one that splits": which prompts split, and where, changes with the CPU,
threads and kernels. Generated prompts run through llama.cpp under numerics variants (F16 and
F32 KV cache, flash attention off, llama-server natively and its schedule driven) until splits
have been seen in numbers, and every one must be explained as numerics:
- the random pair (grammar-free, flat distributions) quantized to Q4_0 as llama.cpp quantizes,
  so its kernels quantize activations as on a real model: near-ties part the variants by the
  dozen (cross-run, at least 20), and now and then a run from its own baseline;
- the real model (Gemma 3 270M Q4_K_M), where batch shapes break near-ties inside llama.cpp and
  llama-server (batch-shape, native): a few prompts (one thread), a cause for every split; that
  census is in tests/test_real_model.py, where three of its ten runs are that module's own.
On tiny F32 pairs the KV cache type and flash attention move logits by ~1e-3, too little to
split anything in a few thousand tokens (docs/real-models.md has the census of each).
Constructed disagreements (another target, a cache truncated one position short, a run
claiming another schedule) must still fail."""

import ctypes
import dataclasses
import json

import pytest
from click.testing import CliRunner

from crossrt.backends.llama_cpp import LlamaCppSession
from crossrt.builders.tinypair import build_pair
from crossrt.compare.census import NUMERICS_VARIANTS, SERVER_TWIN, generated_prompts, take_census
from crossrt.cli import main
from crossrt.compare.splits import COUNTERS_UNEXPLAINED, INSIDE_DISAGREEMENT, NUMERICS
from crossrt.records.record_json import load_record, save_record

from conftest import REPO

TRAINED = REPO / "models" / "pairs" / "trained.toml"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def runner(models, max_new_tokens):
    def run_one(variant, prompts, out):
        result = run("run", *(variant.models or models), "--runtime", variant.runtime, "--mode", variant.mode, "--prompts", prompts,
                     "--max-new-tokens", max_new_tokens, "--out", out, *variant.options)
        assert result.exit_code == 0, result.output
        return load_record(out)
    return run_one


@pytest.fixture(scope="module")
def quantized_random_pair(tmp_path_factory):
    """The random pair's F32 GGUFs quantized to Q4_0 by llama.cpp itself (llama_model_quantize)."""
    import llama_cpp  # the binding crossrt's llama-cpp backend loads, pointed at the one build
    folder = tmp_path_factory.mktemp("random-q4_0")
    build_pair(folder, preset="random", seed=0)
    for role in ("target", "drafter"):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, 1
        assert llama_cpp.llama_model_quantize(str(folder / f"{role}.f32.gguf").encode(),
                                              str(folder / f"{role}.q4_0.gguf").encode(), ctypes.byref(params)) == 0
    return ("--target", folder / "target.q4_0.gguf", "--drafter", folder / "drafter.q4_0.gguf")


def _check(census):
    print("\n" + census.render())  # pytest -s: this machine's census
    assert census.failures == [], "\n".join(census.failures[:5])
    assert census.unexplained() == 0
    assert all(cause in NUMERICS for (_, cause) in census.causes)


def test_every_generated_split_has_a_numerics_cause(quantized_random_pair, tmp_path):
    census = take_census(runner(quantized_random_pair, 64), tmp_path, NUMERICS_VARIANTS + (SERVER_TWIN,),
                         batch=20, max_batches=4, kinds=("cross-run",))
    _check(census)
    assert census.kinds["cross-run"] >= 20, census.render()


def _prompts(tmp_path, count=8):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in generated_prompts(99, count)))
    return path


NUMERICS_FLAGS = ("--f32-kv-cache", "--no-flash-attn")


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory):
    """The trained pair on the generated prompts under the crossrt and the llama-server schedule,
    same runtime, files and numerics: run once for the two tests below that compare against them."""
    folder = tmp_path_factory.mktemp("schedules")
    prompts = _prompts(folder)
    for name, schedule in (("claimed", "crossrt"), ("server", "llama-server")):
        assert run("run", "--pair", TRAINED, "--prompts", prompts, "--max-new-tokens", 24, "--schedule", schedule,
                   "--out", folder / f"{name}.json", *NUMERICS_FLAGS).exit_code == 0
    return prompts, folder / "claimed.json", folder / "server.json"


def test_another_target_fails(schedule_runs, tmp_path):
    # The trained pair's crossrt-schedule run against the drafter run as its own target, in the
    # same numerics: only the target differs.
    prompts, ours, _ = schedule_runs
    drafter = REPO / "models" / "trained" / "drafter.f32.gguf"
    assert run("run", "--target", drafter, "--drafter", drafter, "--prompts", prompts, "--max-new-tokens", 24,
               "--out", tmp_path / "b.json", *NUMERICS_FLAGS).exit_code == 0
    report = run("parity", ours, tmp_path / "b.json", "--no-logits")
    assert report.exit_code == 1
    cross = [line for line in report.output.splitlines() if line.startswith(("FAIL", "NOTE")) and " vs llama-cpp" in line]
    failed = [line for line in cross if line.startswith("FAIL")]
    assert failed and len(failed) >= 0.75 * len(cross), report.output
    assert "disagreement" in report.output


def test_a_cache_truncated_one_position_short_is_a_disagreement(tmp_path, monkeypatch):
    """A constructed cache bug: every cut of the cache keeps one stale position (the first
    rejected draft token), as an off-by-one in a runtime's truncation would. The baseline
    decodes from an empty cache and is untouched; the speculative output must fail, never be
    excused as a near-tie."""
    prompts = _prompts(tmp_path)
    init, truncate = LlamaCppSession.__init__, LlamaCppSession.truncate

    def load(self, path, *args, **kwargs):
        init(self, path, *args, **kwargs)
        self.broken = path.name.startswith("target")  # the target's cache only: the drafter drafts as before

    def cut(self, n_keep):
        truncate(self, n_keep + 1 if self.broken and n_keep > 0 else n_keep)

    monkeypatch.setattr(LlamaCppSession, "__init__", load)
    monkeypatch.setattr(LlamaCppSession, "truncate", cut)
    monkeypatch.setenv("CROSSRT_IN_PROCESS", "1")  # the run in this process, where the patches are
    assert run("run", "--pair", TRAINED, "--prompts", prompts, "--max-new-tokens", 24,
               "--out", tmp_path / "broken.json").exit_code == 0
    monkeypatch.undo()
    record = load_record(tmp_path / "broken.json")
    assert any(not r.lossless for r in record.results)
    report = run("parity", tmp_path / "broken.json", "--no-logits")
    assert report.exit_code == 1
    assert INSIDE_DISAGREEMENT in report.output and "FAIL" in report.output


def test_a_run_claiming_another_schedule_fails(schedule_runs, tmp_path):
    """The crossrt schedule's counts filed as llama-server's, against a real run of the
    llama-server schedule: same runtime, files and numerics, so no rounding can excuse the
    counts; with identical outputs the counters differ and must fail."""
    _, ours, server = schedule_runs
    claimed = load_record(ours)
    relabelled = dataclasses.replace(claimed, params=dataclasses.replace(claimed.params, schedule="llama-server"))
    save_record(relabelled, tmp_path / "claimed.json")
    report = run("parity", tmp_path / "claimed.json", server, "--no-logits")
    assert report.exit_code == 1
    assert COUNTERS_UNEXPLAINED in report.output
