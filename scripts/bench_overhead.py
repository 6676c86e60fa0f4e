"""crossrt's driven loop against llama.cpp's own `llama-speculative-simple`, same pair, k, commit.

    .venv/bin/python scripts/bench_overhead.py [--k 4] [--tokens 128] [--reps 5]

Builds (once, into .cache/) a random ~60M-parameter target and ~10M-parameter drafter sharing a
vocabulary, and the native tool from the pinned llama-cpp-python's vendored llama.cpp. Then, with
one thread, interleaves repetitions of: the native tool; the driven loop with llama.cpp's default
context (outputs up to n_batch); the driven loop mirroring native's target context
(n_outputs_max = 1 + k). Prints medians of decode tokens/s, the counters of each, and the
Python overhead per step of the driven loop: the decode time spent outside llama_decode.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from crossrt import loop
from crossrt.backends import llama_cpp as backend
from crossrt.runtime import DraftRules, RuntimeOptions, open_runtime
from crossrt.tinypair import build_pair

REPO = Path(__file__).resolve().parent.parent
PAIR_DIR = REPO / ".cache" / "bench-pair"
TOOL = REPO / ".cache" / "llama-tools" / "build" / "bin" / "llama-speculative-simple"
PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in "
          "Mainz combined movable metal type with an oil-based ink and a screw press. Within fifty years")
STATS = {name: re.compile(rf"{name}\s*=\s*(\d+)") for name in ("n_predict", "n_drafted", "n_accept")}
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def ensure_inputs() -> tuple[Path, Path]:
    target, drafter = PAIR_DIR / "target.f32.gguf", PAIR_DIR / "drafter.f32.gguf"
    if not (target.is_file() and drafter.is_file()):
        build_pair(PAIR_DIR, preset="bench", seed=0)
    if not TOOL.is_file():
        subprocess.run([str(REPO / "scripts" / "build_llama_tools")], check=True)
    return target, drafter


def run_native(target: Path, drafter: Path, k: int, tokens: int, log: Path) -> dict[str, float]:
    """One native run; its final statistics are sometimes lost at exit, so retry (never zero)."""
    command = [str(TOOL), "-m", str(target), "-md", str(drafter), "--spec-type", "draft-simple",
               "--spec-draft-n-max", str(k), "--spec-draft-n-min", str(k), "--spec-draft-p-min", "0",
               "-n", str(tokens), "-t", "1", "-tb", "1", "-td", "1", "-c", "2048", "--temp", "0", "--seed", "0",
               "-ngl", "0", "-p", PROMPT]
    for _ in range(5):
        with log.open("w") as handle:
            subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=True)
        text = log.read_text(errors="replace")
        found = {name: pattern.search(text) for name, pattern in STATS.items()}
        decoded = DECODED.search(text)
        if decoded and all(found.values()):
            result = {name: int(match.group(1)) for name, match in found.items()}
            result["tokens_per_s"] = int(decoded.group(1)) / float(decoded.group(2))
            return result
    raise RuntimeError(f"llama-speculative-simple printed no statistics in 5 runs; see {log}")


class DecodeTimer:
    """Wraps llama_decode in the backend module to add up the time spent inside it."""

    def __init__(self):
        self.inside_s = 0.0
        self.original = backend.llama_cpp.llama_decode

    def __enter__(self):
        def timed(ctx, batch):
            start = time.perf_counter()
            code = self.original(ctx, batch)
            self.inside_s += time.perf_counter() - start
            return code

        backend.llama_cpp.llama_decode = timed
        return self

    def __exit__(self, *exc):
        backend.llama_cpp.llama_decode = self.original


def run_driven(sessions, prompt_ids, k: int, tokens: int, schedule: str = loop.SCHEDULE) -> dict[str, float]:
    target, drafter = sessions
    generation = loop.speculative_generate(target, drafter, prompt_ids, DraftRules(k), tokens, schedule)
    # Tokens produced, as native's "decoded N tokens" counts them: its overshoot past the
    # budget (cut, in the llama-spec-simple schedule) included.
    produced = len(generation.output_ids) + generation.cut
    return {"n_predict": produced, "n_drafted": sum(generation.step_drafted),
            "n_accept": sum(generation.step_accepted), "steps": len(generation.step_accepted),
            "tokens_per_s": produced / generation.decode_s,
            "total_s": generation.prefill_s + generation.decode_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    target_path, drafter_path = ensure_inputs()
    runtime = open_runtime("llama-cpp", RuntimeOptions(n_ctx=2048, threads=1))
    drafter = runtime.load(drafter_path)
    mirrored = runtime.load(target_path, n_outputs_max=1 + args.k)
    # name -> (target, drafter, schedule). The llama-spec-simple schedule does native's exact
    # work (its drafter re-decodes each verified batch); the crossrt schedule does less.
    variants = {"crossrt schedule, default ctx": (runtime.load(target_path), drafter, loop.SCHEDULE),
                f"crossrt schedule, n_outputs_max={1 + args.k}": (mirrored, drafter, loop.SCHEDULE),
                f"llama-spec-simple schedule, n_outputs_max={1 + args.k}": (mirrored, drafter, "llama-spec-simple")}
    prompt_ids = drafter.tokenize(PROMPT)
    log = REPO / ".cache" / "bench-native.log"
    results: dict[str, list[dict[str, float]]] = {"native llama-speculative-simple": []}
    results.update({name: [] for name in variants})
    for target, drafter_session, schedule in variants.values():  # warm-up: first decodes allocate buffers
        run_driven((target, drafter_session), prompt_ids, args.k, 16, schedule)
    for rep in range(args.reps):
        results["native llama-speculative-simple"].append(run_native(target_path, drafter_path, args.k, args.tokens, log))
        for name, (target, drafter_session, schedule) in variants.items():
            results[name].append(run_driven((target, drafter_session), prompt_ids, args.k, args.tokens, schedule))
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)

    overhead_variant = f"llama-spec-simple schedule, n_outputs_max={1 + args.k}"
    target, drafter_session, schedule = variants[overhead_variant]
    with DecodeTimer() as timer:
        overhead = run_driven((target, drafter_session), prompt_ids, args.k, args.tokens, schedule)
    # Prefill and decode together, as the timer sees both; the prefill adds one llama_decode
    # call per model, so this slightly overstates the per-step overhead.
    outside_s = overhead["total_s"] - timer.inside_s

    print(f"pair: {target_path.name} ({target_path.stat().st_size / 1e6:.0f} MB) + {drafter_path.name} "
          f"({drafter_path.stat().st_size / 1e6:.0f} MB), k={args.k}, {args.tokens} tokens, 1 thread, "
          f"{args.reps} interleaved reps, llama-cpp-python {backend.llama_cpp.__version__}")
    native_tps = statistics.median(r["tokens_per_s"] for r in results["native llama-speculative-simple"])
    print(f"{'variant':48} {'tok/s median':>12} {'min':>8} {'max':>8} {'vs native':>9}  counts (predict/drafted/accepted)")
    for name, runs in results.items():
        speeds = [r["tokens_per_s"] for r in runs]
        counts = {(r["n_predict"], r["n_drafted"], r["n_accept"]) for r in runs}
        print(f"{name:48} {statistics.median(speeds):12.1f} {min(speeds):8.1f} {max(speeds):8.1f} "
              f"{statistics.median(speeds) / native_tps:9.3f}  {sorted(counts)}")
    print(f"python overhead of the {overhead_variant} run (time outside llama_decode): "
          f"{outside_s / overhead['steps'] * 1e6:.0f} us per step, "
          f"{100 * outside_s / overhead['total_s']:.2f}% of the run ({overhead['steps']} steps)")


if __name__ == "__main__":
    main()
