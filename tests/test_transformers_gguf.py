"""The transformers runtime on GGUF files: it loads a pair's GGUF file when the pair names no
transformers folder, and caches the dequantized model by the file's sha256, so the real model
(Gemma 3 270M Q4_K_M, from scripts/setup) loads in seconds the second time, with the same
logits. Runs in a fresh cache folder ($CROSSRT_CACHE), 1 thread."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open
from transformers import AutoConfig

from crossrt.backends.transformers import dequantized_folder
from crossrt.backends.transformers_conversion import each_gguf_read_once
from crossrt.builders.layer_skip import layer_skip_folder
from crossrt.cli import main
from crossrt.errors import ModelError
from crossrt.inputs.pairs import Pair, PairError, pair_from_paths
from crossrt.run.runtime import RuntimeOptions, Rows, open_runtime
from crossrt.records.record_json import load_record
from crossrt.compare.tolerance import QUANTIZED_HALF, tolerance_for

from conftest import REPO

TEXT = "The capital of France is"
PROMPTS = [("code", "code", "def fibonacci(n):\n"), ("prose", "prose", "Once upon a time, in a small village,")]
TINY = REPO / "models" / "tiny"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("crossrt-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CROSSRT_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="module")
def hf_runtime():
    return open_runtime("transformers", RuntimeOptions(n_ctx=512, threads=1))


def test_pairs_give_a_runtime_its_first_format_filled_in(tiny_pair):
    preferred = ("hf", "gguf")
    assert tiny_pair.path("target", preferred) == tiny_pair.path("target", "hf")
    gguf_only = pair_from_paths(TINY / "target.f32.gguf", TINY / "drafter.f32.gguf")
    assert gguf_only.path("drafter", preferred) == (TINY / "drafter.f32.gguf").resolve()
    left_empty = Pair("p", {"target": {"hf": "", "gguf": str(TINY / "target.f32.gguf")}})
    assert left_empty.path("target", preferred) == TINY / "target.f32.gguf"
    with pytest.raises(PairError, match="the target's hf path is left empty"):
        Pair("p", {"target": {"hf": ""}}).path("target", preferred)
    with pytest.raises(PairError, match="names no exl3 or hf file for the drafter"):
        gguf_only.path("drafter", ("exl3", "hf"))


def test_real_model_loads_from_its_dequantized_cache(real_pair, cache, hf_runtime):
    path = real_pair.path("target", "gguf")
    folder = dequantized_folder(path)
    assert folder.parent.parent == cache / "hf-from-gguf" and not folder.exists()
    first = hf_runtime.load(path)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "crossrt-digests.json", "generation_config.json",
                                                        "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    second = hf_runtime.load(path)
    # Read from the conversion, not from the GGUF again (timings: docs/real-models.md), which
    # is left as it was.
    assert Path(second._model.name_or_path) == folder and Path(first._model.name_or_path) == path.parent
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written
    ids = first.tokenize(TEXT)
    assert second.tokenize(TEXT) == ids == [2, 818, 5279, 529, 7001, 563]
    assert first.eog_ids == second.eog_ids == frozenset({1}) and second.n_vocab == 262144
    np.testing.assert_array_equal(first.eval(ids, Rows.ALL), second.eval(ids, Rows.ALL))


def test_cli_runs_real_gguf_files_on_transformers(real_pair, cache, tmp_path):
    """The target drafts for itself: its conversion is cached by the test above, and a second
    real model would add ~40 s of GGUF conversion for no other check."""
    target = real_pair.path("target", "gguf")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in PROMPTS))
    result = CliRunner().invoke(main, [str(a) for a in (
        "run", "--runtime", "transformers", "--target", target, "--drafter", target, "--k", 7,
        "--max-new-tokens", 8, "--prompts", prompts, "--out", tmp_path / "run.json")])
    assert result.exit_code == 0, result.output
    record = load_record(tmp_path / "run.json")
    assert record.runtime.name == "transformers"
    assert (record.pair.target.format, record.pair.drafter.format) == ("gguf", "gguf")
    assert record.pair.target.quantization == "Q4_K_M" and record.pair.target.n_vocab == 262144
    assert [r.prompt_id for r in record.results] == ["code", "prose"]
    assert all(r.ok and r.lossless and len(r.output_ids) == 8 for r in record.results)
    assert sum(r.counters.accepted for r in record.results) > 0
    assert [p.name for p in (cache / "hf-from-gguf").glob("*/*")] == [record.pair.target.sha256]  # converted once


def _config_as_transformers_reads_it(source, **extra) -> dict:
    config = AutoConfig.from_pretrained(source, local_files_only=True, **extra).to_dict()
    config.pop("quantization_config", None)  # a GGUF's; its conversion drops it (save_dequantized)
    # dtype: what load_model loads in (float32), which a GGUF's config leaves unset.
    return {key: value for key, value in config.items()
            if key not in ("_name_or_path", "transformers_version", "dtype")}


def test_a_drafter_cut_from_the_targets_conversion_is_transformers_conversion_of_its_gguf(real_pair, cache,
                                                                                          hf_runtime, tmp_path):
    """What scripts/fetch_real_model does instead of converting the drafter's GGUF (~55 CPU-s):
    the drafter GGUF's metadata and tensor bytes are the target's but for the block count and
    the last block (tests/test_layer_skip.py), so only the config can differ: it must be the one
    transformers reads from the drafter's GGUF, through the reader the runtime converts with
    (each_gguf_read_once: gguf-py's reader on a plain view of the file, ~10 CPU-s less)."""
    target, drafter = (real_pair.path(role, "gguf") for role in ("target", "drafter"))
    if not dequantized_folder(target).is_dir():  # this test run alone
        hf_runtime.load(target)
    cut = tmp_path / "blocks17"
    assert layer_skip_folder(dequantized_folder(target), cut, 17) == 13  # the last block's 13 tensors
    with each_gguf_read_once():
        from_gguf = _config_as_transformers_reads_it(drafter.parent, gguf_file=drafter.name)
    assert _config_as_transformers_reads_it(cut) == from_gguf
    config = json.loads((cut / "config.json").read_text())
    assert config["layer_types"][-1] == "sliding_attention" and config["dtype"] == "float32"
    loaded = hf_runtime.load(cut)
    assert loaded.n_vocab == 262144 and loaded.tokenize(TEXT) == [2, 818, 5279, 529, 7001, 563]


def test_real_model_runs_in_bfloat16_from_a_half_size_conversion_within_its_parity_bounds(real_pair, cache,
                                                                                          hf_runtime, tmp_path):
    """The bfloat16 conversion is cast from the float32 one (made above, or here when this test
    runs alone); the target drafts for itself, as in the CLI test above. Its logits along
    llama.cpp's outputs meet the bounds stated for half-precision weights against a quantized
    GGUF. Lossless is not asserted: which prompt splits where is a fact about one CPU. 4 new
    tokens, not 8: the bounds hold along whatever outputs the runs share, while each token costs
    bfloat16 forwards on the CPU in the run and again in parity's checks of it."""
    target = real_pair.path("target", "gguf")
    if not dequantized_folder(target).is_dir():
        hf_runtime.load(target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in PROMPTS))
    runs = {}
    for runtime in ("transformers", "llama-cpp"):
        runs[runtime] = tmp_path / f"{runtime}.json"
        result = CliRunner().invoke(main, [str(a) for a in (
            "run", "--runtime", runtime, "--target", target, "--drafter", target, "--k", 4, "--dtype", "bfloat16",
            "--max-new-tokens", 4, "--prompts", prompts, "--out", runs[runtime])])
        assert result.exit_code == 0, result.output
    record = load_record(runs["transformers"])
    assert (record.runtime.dtype, record.runtime.kv_cache) == ("bfloat16", "bf16")
    assert all(r.ok and len(r.output_ids) == 4 for r in record.results)
    half, full = dequantized_folder(target, "bfloat16"), dequantized_folder(target)
    assert abs((half / "model.safetensors").stat().st_size / (full / "model.safetensors").stat().st_size - 0.5) < 0.01
    with safe_open(half / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}

    assert tolerance_for(load_record(runs["llama-cpp"]), record) is QUANTIZED_HALF
    # --no-float-control: what is asserted is the QUANTIZED_HALF bounds; the float control (a
    # 1.08 GB float twin written into this module's fresh cache and F32 scorings, ~13 CPU-s) is
    # asserted on the real model by tests/test_planted.py (the clean pair's float control passes).
    parity = CliRunner().invoke(main, ["parity", str(runs["llama-cpp"]), str(runs["transformers"]),
                                       "--no-float-control"])
    assert f"against {QUANTIZED_HALF.describe()}" in parity.output, parity.output
    assert "logits along common outputs: 2/2 within tolerance" in parity.output, parity.output


def test_a_model_that_overflows_float16_is_refused_at_load(real_pair, cache, hf_runtime):
    """Gemma 3's activations pass float16's range: its logits would be NaN, every token id 0."""
    target = real_pair.path("target", "gguf")
    if not dequantized_folder(target).is_dir():
        hf_runtime.load(target)
    runtime = open_runtime("transformers", RuntimeOptions(n_ctx=512, threads=1, dtype="float16"))
    with pytest.raises(ModelError, match=r"overflows float16 .* use --dtype bfloat16, or float32$"):
        runtime.load(target)
    assert not dequantized_folder(target, "float16").exists()  # a conversion that cannot run is not kept
