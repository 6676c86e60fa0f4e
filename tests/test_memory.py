"""The memory check before loading (crossrt/run/memory.py): its counts are what the runtimes hold
(llama.cpp's own model size, transformers' parameters and KV cache), a model too big for the
machine is refused before it loads on every runtime that has the check, in one line that says
what would fit, and each suggestion does fit. Too big honestly: a context whose KV cache
exceeds this machine's MemAvailable, or CROSSRT_MEMORY_LIMIT, the documented override of the
free memory crossrt measures. Tiny pair and the real model's GGUF, 1 thread."""

import os
import re
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.errors import CrossrtError
from crossrt.run.memory import LIMIT_ENV, Device, MemoryShort, check_fits, footprint, loading, parse_size
from crossrt.inputs.gguf_file import gguf_metadata
from crossrt.backends.llama_server import ONE_AT_A_TIME
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.run.driver import RunRequest, run_pair
from crossrt.run.runtime import DraftRules, RuntimeOptions, Rows, open_runtime

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


def llama_servers() -> int:
    """Live llama-server processes this test process started."""
    count = 0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            name = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        count += int(fields[1]) == os.getpid() and fields[0] != "Z" and name.endswith(b"llama-server")
    return count


def test_servers_that_do_not_fit_together_run_one_after_the_other_with_the_same_record(monkeypatch, capsys,
                                                                                      tmp_path):
    """llama-server's baseline server holds the target, its speculative server target and drafter.
    A limit between the speculative server's need and both servers' makes crossrt run them one
    after the other (every baseline first, then the speculative server alone), says so once, and
    the record has the ids and counters of the run with both servers at once."""
    n_ctx, prompts = 512, load_prompts("builtin")[:3]
    baseline = footprint(TARGET, None, "f16").need(n_ctx)
    speculative = baseline + footprint(DRAFTER, None, "f16").need(n_ctx)
    servers = []

    def run_with(name: str):
        request = RunRequest(load_pair(REPO / "models" / "pairs" / "tiny.toml"), "llama-server", RuntimeOptions(n_ctx=n_ctx, threads=1),
                             DraftRules(3), 16, tmp_path / name, mode="native")
        return run_pair(request, prompts, on_prompt=lambda prompt, result: servers.append(llama_servers()))

    together = run_with("together.json")
    assert servers == [2, 2, 2] and "do not fit" not in capsys.readouterr().err
    servers.clear()
    monkeypatch.setenv(LIMIT_ENV, str((speculative + baseline + speculative) // 2))
    apart = run_with("apart.json")
    assert servers == [1, 1, 1]  # only the speculative server, at every prompt
    said = [line for line in capsys.readouterr().err.splitlines() if "do not fit in memory together" in line]
    assert len(said) == 1 and said[0].startswith("note: llama-server's baseline server and speculative server")
    assert ONE_AT_A_TIME in apart.notes and ONE_AT_A_TIME not in together.notes
    assert [r.prompt_id for r in apart.results] == [p.id for p in prompts]
    for ours, theirs in zip(apart.results, together.results):
        assert ours.ok and theirs.ok
        assert (ours.prompt_ids, ours.baseline_ids, ours.output_ids) == \
            (theirs.prompt_ids, theirs.baseline_ids, theirs.output_ids)
        assert ours.counters == theirs.counters

    monkeypatch.setenv(LIMIT_ENV, str(speculative - 1))  # the speculative server alone does not fit
    with pytest.raises(MemoryShort, match=r"^not enough memory for target.f32.gguf \+ drafter.f32.gguf on "
                                          r"llama-server: .* short; would fit: --n-ctx \d+ or less$"):
        run_with("refused.json")


def blocked_on_a_lock(root: int) -> bool:
    """root or a process under it waits for a flock (/proc/locks lists waiters as '-> FLOCK ... pid')."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue

    def under_root(pid: int) -> bool:
        while pid not in (root, 0, 1) and pid in parents:
            pid = parents[pid]
        return pid == root

    return any(fields[1:3] == ["->", "FLOCK"] and under_root(int(fields[5]))
               for fields in map(str.split, Path("/proc/locks").read_text().splitlines()))


def test_runs_sharing_a_loading_lock_check_and_load_one_at_a_time(tmp_path):
    """parity --jobs starts its runs at once, each checking against memory free now: runs that
    share RunRequest.loading_lock hold it from their check until their models are in memory.
    Held here, a run in another thread waits at it, then loads and runs once let go."""
    lock = tmp_path / "loading.lock"
    request = RunRequest(load_pair(REPO / "models" / "pairs" / "tiny.toml"), "llama-cpp",
                         RuntimeOptions(n_ctx=512, threads=1), DraftRules(3), 4, tmp_path / "run.json",
                         loading_lock=lock)
    outcome = {}
    runner = threading.Thread(target=lambda: outcome.update(record=run_pair(request, load_prompts("code")[:1])))
    with loading(lock):
        runner.start()
        deadline = time.monotonic() + 120
        while not blocked_on_a_lock(os.getpid()) and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert blocked_on_a_lock(os.getpid()) and not outcome
    runner.join(300)
    assert outcome["record"].results[0].ok
