"""transformers in half precision (--dtype, tiny pair): a GGUF's conversion cached per dtype,
half the size, and the same whether cast from the float32 conversion or made from the GGUF;
records that name the dtype (and a resume that refuses another); parity's bounds for
half-precision weights (crossrt/compare/tolerance.py) met against llama.cpp's F32 run. The real model
in bfloat16: tests/test_transformers_gguf.py. 1 thread."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors import safe_open

from crossrt.backends.transformers import dequantized_folder
from crossrt.cli import main
from crossrt.records.record_json import load_record
from crossrt.run.runtime import RuntimeOptions, Rows, open_runtime
from crossrt.compare.tolerance import HALF_WEIGHTS, tolerance_for

from conftest import REPO

TARGET = REPO / "models" / "tiny" / "target.f32.gguf"
TEXT = "def add(a, b):\n    return a + b\n"
PROMPTS = [("a", "code", "def add(a, b):\n    return"), ("b", "prose", "The old house at the end of the")]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def load(dtype: str, path: Path = TARGET):
    return open_runtime("transformers", RuntimeOptions(n_ctx=256, threads=1, dtype=dtype)).load(path)


def tensors(folder: Path) -> dict[str, np.ndarray]:
    with safe_open(folder / "model.safetensors", "pt") as weights:
        return {name: weights.get_tensor(name) for name in weights.keys()}


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in PROMPTS))
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_conversion_is_half_the_size_and_the_same_cast_or_converted(dtype, tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("CROSSRT_CACHE", str(tmp_path / "direct"))
    with load(dtype):  # from the GGUF: there is no float32 conversion to cast
        pass
    direct = dequantized_folder(TARGET, dtype)
    assert direct.name.endswith(f"-{dtype}") and not dequantized_folder(TARGET).exists()

    monkeypatch.setenv("CROSSRT_CACHE", str(tmp_path / "cast"))
    with load("float32"):
        pass
    float32, cast = dequantized_folder(TARGET), dequantized_folder(TARGET, dtype)
    with load(dtype) as session:  # cast from the float32 conversion, and cached
        assert Path(session._model.name_or_path) == float32
        logits = np.array(session.eval(session.tokenize(TEXT), Rows.ALL))
    with load(dtype) as session:  # read from its own conversion
        assert Path(session._model.name_or_path) == cast
        np.testing.assert_array_equal(session.eval(session.tokenize(TEXT), Rows.ALL), logits)

    ours, theirs = tensors(cast), tensors(direct)
    assert ours.keys() == theirs.keys() and {t.dtype for t in ours.values()} == {getattr(torch, dtype)}
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert json.loads((cast / "config.json").read_text())["dtype"] == dtype
    assert (cast / "tokenizer.json").read_bytes() == (direct / "tokenizer.json").read_bytes()
    ratio = (cast / "model.safetensors").stat().st_size / (float32 / "model.safetensors").stat().st_size
    assert abs(ratio - 0.5) < 0.01


def test_tiny_pair_in_bfloat16_meets_the_half_precision_bounds_against_llama_cpp(prompts, tmp_path):
    out = tmp_path / "parity"
    result = invoke("parity", "--pair", "tiny", "--runtimes", "llama-cpp,transformers", "--modes", "driven",
                    "--dtype", "bfloat16", "--f32-kv-cache", "--no-flash-attn", "--prompts", prompts,
                    "--max-new-tokens", 16, "--out-dir", out)
    llama, hf = (load_record(out / f"tiny-{name}-driven-k4.json") for name in ("llama-cpp", "transformers"))
    assert (hf.runtime.dtype, hf.runtime.kv_cache) == ("bfloat16", "bf16")
    assert llama.runtime.dtype is None  # llama.cpp runs the GGUF's own types
    assert "dtype" not in json.loads((out / "tiny-llama-cpp-driven-k4.json").read_text())["runtime"]
    assert tolerance_for(llama, hf) is HALF_WEIGHTS
    assert f"against {HALF_WEIGHTS.describe()}" in result.output, result.output
    assert "logits along common outputs: 2/2 within tolerance" in result.output, result.output


def test_a_run_in_one_dtype_is_not_resumed_in_another(prompts, tmp_path):
    out = tmp_path / "run.json"
    common = ("run", "--pair", "tiny", "--runtime", "transformers", "--prompts", prompts, "--max-new-tokens", 4,
              "--out", out)
    assert invoke(*common).exit_code == 0
    assert load_record(out).runtime.dtype == "float32"  # the CPU's default
    refused = CliRunner().invoke(main, [str(a) for a in common + ("--resume", "--dtype", "bfloat16")])
    assert refused.exit_code == 1 and "dtype: 'float32' in the record, 'bfloat16' now" in refused.output, refused.output
