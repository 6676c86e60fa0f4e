"""crossrt's driven loop against llama.cpp's own `llama-speculative-simple`, same pair, k, commit.

    .venv/bin/python scripts/bench_overhead.py [--k 4] [--tokens 128] [--reps 5]

Builds (once, into .cache/) a random ~60M-parameter target and ~10M-parameter drafter sharing a
vocabulary, and the native tool from the pinned llama-cpp-python's vendored llama.cpp. Then, with
one thread, interleaves repetitions of: the native tool; the driven loop with llama.cpp's default
context (outputs up to n_batch); the driven loop mirroring native's target context
(n_outputs_max = 1 + k). Prints medians of decode tokens/s, the counters of each, and the
Python overhead per step of the driven loop: the decode time spent outside llama_decode.

    .venv/bin/python scripts/bench_overhead.py --pair gemma3-270m[,gemma3-270m-blocks15]
        [--prompts models/real/prompts.jsonl] [--k 7] [--tokens 64] [--reps 5]

With --pair, a real pair instead (models/pairs/NAME.toml): the driven loop under the
llama-spec-simple schedule against llama-speculative-simple run as the llama-spec-cli runtime
runs it (its flags, minus debug logging for the timed runs), on each prompt, interleaved. The
counts (steps, drafted, accepted, emitted, cut, per-step lengths, output ids) are checked equal
once per prompt against a debug-logged native run, and (n_predict, n_drafted, n_accept) at every
timed repetition. Then the Python overhead per step (time outside llama_decode), and choose
(argmax + runner-up + margin) and ViewRecorder timed on real verification rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from crossrt.speculative import loop
from crossrt.backends import llama_cpp as backend
from crossrt.inputs.pairs import load_pair
from crossrt.run.runtime import DraftRules, Rows, RuntimeOptions, open_runtime
from crossrt.speculative.numerics import choose
from crossrt.speculative.schedules import SPEC_SIMPLE, ViewRecorder
from crossrt.builders.tinypair import build_pair

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
    parser.add_argument("--k", type=int, default=None, help="default 4; 7 (the pair's) with --pair")
    parser.add_argument("--tokens", type=int, default=None, help="default 128; 64 with --pair")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--pair", help="comma-separated pair names (models/pairs) or manifests: a real pair")
    parser.add_argument("--prompts", type=Path, default=REPO / "models" / "real" / "prompts.jsonl")
    parser.add_argument("--n-prompts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.pair:
        args.k = 7 if args.k is None else args.k
        args.tokens = 64 if args.tokens is None else args.tokens
        real_main(args)
        return
    args.k = 4 if args.k is None else args.k
    args.tokens = 128 if args.tokens is None else args.tokens
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


# ---- a real pair ----------------------------------------------------------------------------

def _median_range(values) -> str:
    values = list(values)
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def _time_us(function, repeat: int) -> float:
    """Median wall time of function() in microseconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


class NativeTool:
    """llama-speculative-simple with the llama-spec-cli runtime's flags; debug logging off for
    the timed runs (the open_native session, with it on, checks the counts step by step)."""

    def __init__(self, options: RuntimeOptions, target: Path, drafter: Path, rules: DraftRules, work: Path):
        from crossrt.backends import llama_spec_cli as cli

        self.cli = cli
        self.runtime = cli.LlamaSpecCliRuntime(options)
        command = self.runtime.command(target, drafter, rules)
        at = command.index("-lv")
        self.command = command[:at] + command[at + 2:]
        self.session = self.runtime.open_native(target, drafter, rules, work / "checked")
        self.prompt_file = work / "prompt.txt"
        self.log = work / "native.log"
        self.env = dict(os.environ)
        if cli.LOG_FLUSH_SHIM.is_file():
            self.env["LD_PRELOAD"] = " ".join(filter(None, [str(cli.LOG_FLUSH_SHIM), os.environ.get("LD_PRELOAD")]))

    def timed(self, text: str, tokens: int):
        self.prompt_file.write_bytes(text.encode("utf-8") + b"\n")  # -f drops one trailing newline
        command = self.command + ["-n", str(tokens), "-f", str(self.prompt_file)]
        for _ in range(self.cli.ATTEMPTS):
            with self.log.open("wb") as handle:
                subprocess.run(command, stdout=subprocess.DEVNULL, stderr=handle, stdin=subprocess.DEVNULL,
                               env=self.env, check=True)
            run = self.cli.parse_log(self.log.read_bytes())
            if run is not None:
                return run
        raise RuntimeError(f"llama-speculative-simple printed no statistics; see {self.log}")


def driven_counts(generation) -> dict:
    return {"steps": len(generation.step_accepted), "drafted": sum(generation.step_drafted),
            "accepted": sum(generation.step_accepted), "emitted": len(generation.output_ids),
            "cut": generation.cut, "step_drafted": tuple(generation.step_drafted),
            "step_accepted": tuple(generation.step_accepted), "output_ids": tuple(generation.output_ids)}


def real_pair(name: str, args, prompts: list[dict]) -> None:
    manifest = Path(name) if name.endswith(".toml") else REPO / "models" / "pairs" / f"{name}.toml"
    pair = load_pair(manifest)
    target_path, drafter_path = pair.path("target", "gguf"), pair.path("drafter", "gguf")
    rules = DraftRules(args.k)
    options = RuntimeOptions(n_ctx=2048, threads=args.threads)
    work = REPO / ".cache" / "bench-real" / pair.name
    work.mkdir(parents=True, exist_ok=True)
    native = NativeTool(options, target_path, drafter_path, rules, work)
    runtime = open_runtime("llama-cpp", options)
    # native's target context: outputs capped at 1 + n_max; its drafter context the default
    target = runtime.load(target_path, n_outputs_max=1 + args.k)
    drafter = runtime.load(drafter_path)

    def driven(ids):
        return loop.speculative_generate(target, drafter, ids, rules, args.tokens, SPEC_SIMPLE)

    print(f"\n== pair {pair.name}: {target_path.name} + {drafter_path.name}, n_vocab {target.n_vocab}, "
          f"k={args.k}, {args.tokens} tokens, {args.threads} thread(s), {args.reps} interleaved reps, "
          f"{len(prompts)} prompts; uptime at start: {os.getloadavg()}", flush=True)
    # Once per prompt: the debug-logged native run, step by step, against the driven run.
    ids_of = {}
    expected = {}
    for prompt in prompts:
        ids = native.session.tokenize(prompt["prompt"])
        ids_of[prompt["id"]] = ids
        checked = native.session.generate(ids, args.tokens, True)
        c = checked.counters
        native_counts = {"steps": c.steps, "drafted": c.drafted, "accepted": c.accepted, "emitted": c.emitted,
                         "cut": c.cut, "step_drafted": tuple(c.step_drafted),
                         "step_accepted": tuple(c.step_accepted), "output_ids": tuple(checked.output_ids)}
        mine = driven_counts(driven(ids))  # also the warm-up
        if mine != native_counts:
            diff = {key: (mine[key], native_counts[key]) for key in mine if mine[key] != native_counts[key]}
            raise SystemExit(f"{pair.name} / {prompt['id']}: driven and native counts differ: {diff}")
        expected[prompt["id"]] = (c.emitted + c.cut, c.drafted, c.accepted, c.steps)
        print(f"  {prompt['id']}: counts equal (steps {c.steps}, drafted {c.drafted}, accepted {c.accepted}, "
              f"emitted {c.emitted}, cut {c.cut}; per-step lengths and output ids too)", flush=True)
    native.session.close()

    # Interleaved repetitions: per rep, each prompt native then driven (order alternating by rep).
    runs = {"native": [], "driven": []}  # per rep: [(tokens, decode_s)] per prompt
    for rep in range(args.reps):
        rep_runs = {"native": [], "driven": []}
        for prompt in prompts:
            ids = ids_of[prompt["id"]]
            order = ("native", "driven") if rep % 2 == 0 else ("driven", "native")
            for side in order:
                if side == "native":
                    run = native.timed(prompt["prompt"], args.tokens)
                    counts = (run.n_predict, run.n_drafted, run.n_accept, run.n_predict - run.n_accept)
                    rep_runs["native"].append((run.n_predict, run.decode_s))
                else:
                    generation = driven(ids)
                    mine = driven_counts(generation)
                    counts = (mine["emitted"] + mine["cut"], mine["drafted"], mine["accepted"], mine["steps"])
                    rep_runs["driven"].append((counts[0], generation.decode_s))
                if counts != expected[prompt["id"]]:
                    raise SystemExit(f"{pair.name} / {prompt['id']} rep {rep + 1}: {side} counts {counts} "
                                     f"!= {expected[prompt['id']]} (n_predict, drafted, accepted, steps)")
        for side in runs:
            runs[side].append(rep_runs[side])
        print(f"  rep {rep + 1}/{args.reps} done, load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)

    def rate(rep_list, index=None):
        chosen = rep_list if index is None else [rep_list[index]]
        return sum(t for t, _ in chosen) / sum(s for _, s in chosen)

    print(f"  decode tokens/s, median (min-max) over {args.reps} reps; counts equal at every rep")
    print(f"  {'prompt':10} {'native':>22} {'driven':>22} {'driven/native':>24}")
    for index, prompt in enumerate(prompts + [{"id": "all"}]):
        pick = None if prompt["id"] == "all" else index
        nat = [rate(rep, pick) for rep in runs["native"]]
        drv = [rate(rep, pick) for rep in runs["driven"]]
        ratios = [d / n for d, n in zip(drv, nat)]  # same rep, so the same machine load
        print(f"  {prompt['id']:10} {_median_range(nat):>22} {_median_range(drv):>22} "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    nat_all = statistics.median(rate(rep) for rep in runs["native"])
    drv_all = statistics.median(rate(rep) for rep in runs["driven"])
    print(f"  all prompts: ratio of medians {drv_all / nat_all:.3f}")

    # Python overhead: time outside llama_decode during the driven runs (prefill included).
    outside = steps = total = decode = 0.0
    for prompt in prompts:
        with DecodeTimer() as timer:
            generation = driven(ids_of[prompt["id"]])
        total += generation.prefill_s + generation.decode_s
        decode += generation.decode_s
        outside += generation.prefill_s + generation.decode_s - timer.inside_s
        steps += len(generation.step_accepted)
    step_s = decode / steps
    print(f"  python overhead (time outside llama_decode, {int(steps)} steps over the prompts): "
          f"{outside / steps * 1e6:.0f} us per step, {100 * outside / total:.2f}% of the run; "
          f"a step takes {step_s * 1e3:.1f} ms")

    # choose and ViewRecorder on real verification rows (1 + k rows of the target's logits), on
    # the prompt with the longest output: one may end at EOS before k + 1 tokens.
    generations = [(ids_of[p["id"]], driven(ids_of[p["id"]])) for p in prompts]
    prompt_ids, generation = max(generations, key=lambda pair: len(pair[1].output_ids))
    context = list(prompt_ids) + list(generation.output_ids)
    target.truncate(0)
    target.eval(context[:len(prompt_ids) - 1], Rows.NONE)
    rows = target.eval(context[len(prompt_ids) - 1:len(prompt_ids) + args.k], Rows.ALL)  # a view, as in the loop
    assert rows.shape == (1 + args.k, target.n_vocab) and rows.dtype == np.float32, rows.shape
    kept = 1 + sum(generation.step_accepted) / len(generation.step_accepted)
    repeat = 300
    costs = {
        "choose (the loop's argmax, runner-up, margins, close ids)": _time_us(lambda: choose(rows), repeat),
        "argmax alone (what choosing needs)": _time_us(lambda: rows.argmax(axis=1), repeat),
    }
    choices = choose(rows)
    n_kept = int(round(kept))

    def record():
        recorder = ViewRecorder()
        recorder.add(choices, n_kept, 1 + args.k)

    costs[f"ViewRecorder.add ({n_kept} tokens)"] = _time_us(record, repeat)
    costs["logits read (llama_get_logits + NumPy view)"] = _time_us(
        lambda: np.ctypeslib.as_array(backend.llama_cpp.llama_get_logits(target._ctx), shape=rows.shape), repeat)
    margin_us = (costs["choose (the loop's argmax, runner-up, margins, close ids)"]
                 - costs["argmax alone (what choosing needs)"] + costs[f"ViewRecorder.add ({n_kept} tokens)"])
    print(f"  per step, on real ({1 + args.k}, {target.n_vocab}) float32 rows (median of {repeat}):")
    for what, us in costs.items():
        print(f"    {what:52} {us:8.0f} us  {100 * us * 1e-6 / step_s:5.2f}% of a step")
    print(f"    {'margin recording (choose - argmax + ViewRecorder)':52} {margin_us:8.0f} us  "
          f"{100 * margin_us * 1e-6 / step_s:5.2f}% of a step")
    target.close()
    drafter.close()


def real_main(args) -> None:
    prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()][:args.n_prompts]
    started = time.perf_counter()
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}; "
          f"llama-cpp-python {backend.llama_cpp.__version__}")
    for name in args.pair.split(","):
        real_pair(name.strip(), args, prompts)
    print(f"\nuptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}; "
          f"bench wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
