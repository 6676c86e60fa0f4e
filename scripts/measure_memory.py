"""Peak memory of a crossrt command and every process it starts (engines, servers, workers).

    .venv/bin/python scripts/measure_memory.py [--interval 0.25] [--json OUT] -- CROSSRT ARGS...
    .venv/bin/python scripts/measure_memory.py --vllm-real [--json OUT]

Runs `.venv/bin/crossrt ARGS...` and samples, every --interval seconds, the process tree under
it (found through /proc: children, their children, ...). What it reports, at the moment of
the peak of each:
- anonymous + shared-memory resident bytes, summed over the tree (RssAnon + RssShmem of
  /proc/PID/status): memory the kernel cannot reclaim, what a memory check must find free
  and what the OOM killer counts (its "anon-rss");
- resident bytes summed over the tree (VmRSS; counts pages of shared files once per process);
- the fall of the machine's MemAvailable from before the command started (includes whatever
  else ran on the machine meanwhile: a rough cross-check only).
Each process's own peak, by name (its /proc/PID/comm, e.g. VLLM::Worker), is listed too.

--vllm-real measures what docs/vllm.md quotes: the vllm runtime on the real model
(gemma3-270m pair, k = 7, one prompt of models/real/prompts.jsonl, 32 tokens, one thread), once
with both engines together and once one after the other (CROSSRT_MEMORY_LIMIT set above both
engines' need, then between one engine's and both engines', as backends/vllm_memory.py counts
them), each with a fresh baseline (--fresh-baseline), so both ways load and run both engines.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CROSSRT = REPO / ".venv" / "bin" / "crossrt"
GIB = 2 ** 30


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _tree(root: int) -> list[int]:
    children, found, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _status(pid: int) -> tuple[str, int, int]:
    """(name, anonymous + shmem bytes, resident bytes) of pid; zeros once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "", 0, 0
    fields = dict(re.findall(r"^(\w+):\s+(\S+)", text, re.MULTILINE))
    kb = {name: int(fields.get(name, 0)) * 1024 for name in ("RssAnon", "RssShmem", "VmRSS")}
    return fields.get("Name", "?"), kb["RssAnon"] + kb["RssShmem"], kb["VmRSS"]


def mem_available() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024


def measure(argv: list[str], interval: float, env: dict | None = None) -> dict:
    """Run argv and sample its process tree until it exits; the peaks, its exit code and time."""
    before = mem_available()
    start = time.monotonic()
    process = subprocess.Popen(argv, env=env)
    peak_anon = peak_rss = 0
    lowest_available = before
    per_process: dict[tuple[int, str], int] = {}
    at_peak: list[tuple[str, int]] = []
    while process.poll() is None:
        samples = [(pid, *_status(pid)) for pid in _tree(process.pid)]
        anon = sum(s[2] for s in samples)
        peak_rss = max(peak_rss, sum(s[3] for s in samples))
        if anon > peak_anon:
            peak_anon, at_peak = anon, [(name, a) for _, name, a, _ in samples if a]
        for pid, name, a, _ in samples:
            if name:
                per_process[(pid, name)] = max(per_process.get((pid, name), 0), a)
        lowest_available = min(lowest_available, mem_available())
        time.sleep(interval)
    return {"command": argv, "exit_code": process.returncode, "seconds": round(time.monotonic() - start, 1),
            "peak_anon_gib": round(peak_anon / GIB, 3), "peak_rss_gib": round(peak_rss / GIB, 3),
            "memavailable_fall_gib": round((before - lowest_available) / GIB, 3),
            "at_peak": [(name, round(a / GIB, 3)) for name, a in sorted(at_peak, key=lambda x: -x[1])],
            "per_process_peak_gib": sorted(([name, pid, round(a / GIB, 3)] for (pid, name), a in per_process.items()
                                            if a > 50 * 2 ** 20), key=lambda x: -x[2])}


def vllm_real(interval: float) -> list[dict]:
    sys.path.insert(0, str(REPO))
    from crossrt.backends.vllm_memory import engine_needs
    from crossrt.inputs.pairs import load_pair
    from crossrt.run.runtime import RuntimeOptions

    pair = load_pair(REPO / "models" / "pairs" / "gemma3-270m.toml")
    options = RuntimeOptions(threads=1)
    baseline, speculative = engine_needs(pair.path("target", ("hf", "gguf")), pair.path("drafter", ("hf", "gguf")),
                                         options)
    prompts = Path(tempfile.mkdtemp()) / "prompt.jsonl"
    first = (REPO / "models" / "real" / "prompts.jsonl").read_text().splitlines()[0]
    prompts.write_text(first + "\n")
    results = []
    # CROSSRT_MEMORY_LIMIT forces each way whatever else the machine runs meanwhile: well above
    # both engines' need for together, between one engine's and both engines' for the other.
    for way, limit in (("together", 2 * (baseline + speculative)),
                       ("one after the other", (max(baseline, speculative) + baseline + speculative) // 2)):
        env = {**os.environ, "CROSSRT_MEMORY_LIMIT": str(limit)}
        out = prompts.with_name(f"vllm-{way.replace(' ', '-')}.json")
        argv = [str(CROSSRT), "run", "--pair", "gemma3-270m", "--runtime", "vllm", "--mode", "native", "--k", "7",
                "--max-new-tokens", "32", "--threads", "1", "--prompts", str(prompts), "--fresh-baseline",
                "--out", str(out)]
        result = measure(argv, interval, env)
        result.update(way=way, memory_limit=limit, record=str(out),
                      planned_gib=[round(baseline / GIB, 2), round(speculative / GIB, 2)])
        results.append(result)
        print(json.dumps(result, indent=1), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between samples")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--vllm-real", action="store_true", help="the vllm runtime on gemma3-270m, both ways")
    parser.add_argument("args", nargs="*", help="crossrt's arguments (after --)")
    options = parser.parse_args()
    if options.vllm_real:
        results = vllm_real(options.interval)
    else:
        results = [measure([str(CROSSRT), *options.args], options.interval)]
        print(json.dumps(results[0], indent=1))
    if options.json:
        options.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
