"""The memory check before loading (crossrt/run/memory.py): its counts are what the runtimes hold
(llama.cpp's own model size, transformers' parameters and KV cache), a model too big for the
machine is refused before it loads on every runtime that has the check, in one line that says
what would fit, and each suggestion does fit. Too big honestly: a context whose KV cache
exceeds this machine's MemAvailable, or CROSSRT_MEMORY_LIMIT, the documented override of the
free memory crossrt measures. Tiny pair and the real model's GGUF, 1 thread."""

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.errors import CrossrtError
from crossrt.run.memory import LIMIT_ENV, Device, MemoryShort, check_fits, footprint, parse_size
from crossrt.inputs.pairs import gguf_metadata
from crossrt.run.runtime import RuntimeOptions, Rows, open_runtime

from conftest import REPO, assert_clean_error

TINY = REPO / "models" / "tiny"
TARGET, DRAFTER = TINY / "target.f32.gguf", TINY / "drafter.f32.gguf"
TEXT = "def add(a, b):\n    return a + b\n"


def mem_available() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024


def kv_bytes_per_position(path: Path, element_bytes: int) -> int:
    """From the GGUF's metadata, as llama.cpp sizes its cache: layers x KV heads x (K + V head size)."""
    meta = gguf_metadata(path)
    arch = meta["general.architecture"]
    head = meta[f"{arch}.embedding_length"] // meta[f"{arch}.attention.head_count"]
    return meta[f"{arch}.block_count"] * meta[f"{arch}.attention.head_count_kv"] * 2 * head * element_bytes


def too_big_ctx(path: Path) -> int:
    """A context whose F16 KV cache alone is twice the RAM available now."""
    return 2 * mem_available() // kv_bytes_per_position(path, 2)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("path", [TARGET, REPO / ".cache" / "models" / "gemma3-270m-q4_k_m.gguf"],
                         ids=["tiny-f32", "gemma3-q4_k_m"])
@pytest.mark.parametrize("f32_kv_cache", [False, True], ids=["f16-cache", "f32-cache"])
def test_gguf_weights_and_kv_cache_are_what_llama_cpp_holds(path, f32_kv_cache):
    """Weights: llama.cpp's own model size. KV cache: the growth of a sequence's saved state per
    position, which also holds each cell's position and sequence id (12 bytes per cache; Gemma 3
    has two, its sliding-window and global layers')."""
    import llama_cpp

    if not path.is_file():
        pytest.fail(f"{path} missing: run scripts/setup to fetch the real model", pytrace=False)
    counted = footprint(path, None, "f32" if f32_kv_cache else "f16")
    with open_runtime("llama-cpp", RuntimeOptions(n_ctx=512, threads=1, f32_kv_cache=f32_kv_cache)).load(path) as session:
        assert counted.weights == llama_cpp.llama_model_size(session._model.model)
        state = []
        for n in (10, 30):
            session.truncate(0)
            session.eval(list(range(5, 5 + n)), Rows.NONE)
            state.append(llama_cpp.llama_state_seq_get_size(session._ctx, 0))
    assert 0 <= (state[1] - state[0]) / 20 - counted.kv_per_token <= 24


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_weights_and_kv_cache_are_what_it_holds(dtype):
    import torch

    runtime = open_runtime("transformers", RuntimeOptions(n_ctx=512, threads=1, dtype=dtype))
    for path in (TINY / "target-hf", TINY / "drafter-hf"):
        with runtime.load(path) as session:
            params = list(session._model.parameters())
            assert {p.dtype for p in params} == {getattr(torch, dtype)}
            ids = session.tokenize(TEXT)
            session.eval(ids, Rows.NONE)
            cache = sum(t.nbytes for layer in session._cache.layers for t in (layer.keys, layer.values))
        counted = footprint(path, dtype, {"float32": "f32", "bfloat16": "bf16"}[dtype])
        assert counted.weights == sum(p.numel() * p.element_size() for p in params)
        assert counted.kv_per_token * len(ids) == cache


def test_a_context_too_big_for_ram_is_refused_before_llama_cpp_loads(tmp_path):
    n_ctx = too_big_ctx(TARGET)
    runtime = open_runtime("llama-cpp", RuntimeOptions(n_ctx=n_ctx, threads=1))
    with pytest.raises(MemoryShort) as refused:
        runtime.load(TARGET)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("not enough memory for target.f32.gguf on llama-cpp: ")
    assert f"for n_ctx {n_ctx}" in message and "free (MemAvailable)" in message
    fit = int(re.search(r"would fit: --n-ctx (\d+) or less", message).group(1))
    assert n_ctx * 0.4 < fit < n_ctx * 0.6  # the weights are small: about half the context fits
    with open_runtime("llama-cpp", RuntimeOptions(n_ctx=512, threads=1)).load(TARGET):
        pass  # the same model at a context that fits loads


def test_a_conversion_too_big_is_refused_before_transformers_reads_the_gguf(tmp_path, monkeypatch):
    """Dequantizing a GGUF peaks at CONVERSION_PEAK float32 copies of the weights: a limit the
    conversion passes but its cached result fits is refused the first time only."""
    monkeypatch.setenv("CROSSRT_CACHE", str(tmp_path / "cache"))
    loaded, converting = (footprint(TARGET, "float32", "f32", c).need(256) for c in (False, True))
    assert converting > 2 * loaded
    options = RuntimeOptions(n_ctx=256, threads=1)
    monkeypatch.setenv(LIMIT_ENV, str((loaded + converting) // 2))
    with pytest.raises(MemoryShort, match=r"^not enough memory for target.f32.gguf on transformers in float32, "
                                          r"converting the GGUF: .* short; nothing smaller"):
        open_runtime("transformers", options).load(TARGET)
    assert not (tmp_path / "cache" / "hf-from-gguf").exists()  # nothing converted
    monkeypatch.delenv(LIMIT_ENV)
    with open_runtime("transformers", options).load(TARGET):
        pass
    monkeypatch.setenv(LIMIT_ENV, str((loaded + converting) // 2))
    with open_runtime("transformers", options).load(TARGET):  # from its conversion: fits
        pass


@pytest.mark.parametrize("runtime_name", ["llama-cpp", "llama-server", "llama-spec-cli", "transformers"])
def test_a_too_big_run_is_one_line_from_the_cli_and_starts_nothing(runtime_name, tmp_path):
    mode = "native" if runtime_name in ("llama-server", "llama-spec-cli") else "driven"
    out = tmp_path / "run.json"
    result = run("run", "--pair", "tiny", "--runtime", runtime_name, "--mode", mode, "--n-ctx", too_big_ctx(TARGET),
                 "--prompts", "code", "--max-new-tokens", 4, "--out", out)
    assert_clean_error(result, r"not enough memory for target")
    lines = [line for line in result.output.splitlines() if "not enough memory" in line]
    assert len(lines) == 1 and "short; would fit: " in lines[0], result.output
    assert not out.exists()  # no record: nothing ran
    logs = tmp_path / "run.logs"
    assert not logs.exists() or not any(logs.iterdir())  # no server or tool was started


def test_the_limit_override_replaces_measured_memory_and_each_suggestion_fits(monkeypatch):
    """Target and drafter together at a context the limit cannot hold: the suggested context
    fits, 256 positions more does not; in float32, the suggested bfloat16 fits too."""
    n_ctx = 1 << 16
    need = sum(footprint(path, None, "f16").need(n_ctx) for path in (TARGET, DRAFTER))
    monkeypatch.setenv(LIMIT_ENV, str(need // 2))
    with pytest.raises(MemoryShort) as refused:
        check_fits([TARGET, DRAFTER], n_ctx, runtime="llama-cpp", kv_cache="f16")
    assert f"free ({LIMIT_ENV})" in str(refused.value)
    fit = int(re.search(r"--n-ctx (\d+) or less", str(refused.value)).group(1))
    check_fits([TARGET, DRAFTER], fit, runtime="llama-cpp", kv_cache="f16")
    with pytest.raises(MemoryShort):
        check_fits([TARGET, DRAFTER], fit + 256, runtime="llama-cpp", kv_cache="f16")

    f32 = footprint(TARGET, "float32", "f32").need(512)
    monkeypatch.setenv(LIMIT_ENV, str(int(f32 * 0.6)))
    with pytest.raises(MemoryShort, match=r"would fit: --dtype bfloat16"):
        check_fits([TARGET], 512, runtime="transformers", kv_cache="f32", dtype="float32")
    check_fits([TARGET], 512, runtime="transformers", kv_cache="bf16", dtype="bfloat16")


def test_gpu_shares_are_checked_per_gpu_and_a_split_by_free_memory_is_suggested(monkeypatch):
    """This machine has no GPU, so the GPUs' free memory is given (crossrt.run.memory.gpus, the
    one function that reads it); the arithmetic per GPU is what is tested. RAM is not short."""
    import crossrt.run.memory as memory

    need = footprint(TARGET, None, "f16").need(4096)
    monkeypatch.setattr(memory, "gpus", lambda: [Device("GPU 0", int(need * 0.7), "given"),
                                                 Device("GPU 1", int(need * 0.35), "given")])
    with pytest.raises(MemoryShort, match=r"on GPU 1 .* would fit: .*--gpu-split 2,1$"):
        check_fits([TARGET], 4096, runtime="llama-cpp", kv_cache="f16", gpu_layers=99, gpu_split=(1, 1))
    check_fits([TARGET], 4096, runtime="llama-cpp", kv_cache="f16", gpu_layers=99)  # llama.cpp's default split
    check_fits([TARGET], 4096, runtime="llama-cpp", kv_cache="f16", gpu_layers=99, gpu_split=(2, 1))
    # Half the blocks offloaded: the other half stays in RAM, and each GPU holds less.
    check_fits([TARGET], 4096, runtime="llama-cpp", kv_cache="f16", gpu_layers=2, gpu_split=(1, 1))


def test_sizes_are_read_with_binary_suffixes_and_a_bad_one_is_one_line():
    assert parse_size("4G") == 4 * 2 ** 30 and parse_size("512MiB") == 512 * 2 ** 20 and parse_size("100") == 100
    with pytest.raises(CrossrtError, match=f"{LIMIT_ENV}='lots' is not a size"):
        parse_size("lots")
