"""What keeping each finished prompt on disk costs, against the number of prompts a run holds.

    .venv/bin/python scripts/bench_records.py [--sizes 10,100,1000,10000] [--reps 3]
                                              [--max-new-tokens 1] [--trace]

Runs the tiny pair (llama-cpp, 1 thread, k = 4) over the built-in `categories` suite (110
prompts) with --max-new-tokens tokens, keeping each real PromptResult (and, with --trace, its
trace), then repeats them under distinct prompt ids up to the largest size: a 10,000-prompt run
takes too long on 2 shared cores, and saving does not look at what a result holds. Only the
saving path is timed, no generation. For each size n, medians over --reps:

- whole: how the driver saved before journals, after every prompt: `with_result` then
  `save_record` (validate and write the whole record) of the record holding n prompts, plus
  `save_traces` of n traces with --trace. The cost of saving the n-th prompt.
- journal: how it saves now (crossrt/run/run_writer.py). `add`: RunWriter.add of the n-th prompt,
  the writer holding n - 1 (median of the last min(5, n) adds of the run): the entry validated
  alone and appended to the journal(s). `per prompt in all`: the whole run's saving (start,
  n adds, the end's fold into the record) divided by n. `fold`: the end's fold alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from crossrt.run.prompt_run import run_prompt
from crossrt.inputs.pairs import load_pair, pair_info
from crossrt.inputs.prompts import load_prompts
from crossrt.run.run_writer import RunWriter
from crossrt.run.runtime import DraftRules, RuntimeOptions, open_runtime
from crossrt.records.schema import RunParams, RunRecord
from crossrt.records.record_json import save_record
from crossrt.records.trace import TraceRecorder, save_traces, trace_path

REPO = Path(__file__).resolve().parent.parent
K = 4


def real_prompts(max_new_tokens: int, traced: bool):
    """The empty record of a tiny-pair run, and (result, trace or None) per categories prompt."""
    pair = load_pair(REPO / "models" / "pairs" / "tiny.toml")
    runtime = open_runtime("llama-cpp", RuntimeOptions(n_ctx=512, threads=1))
    target, drafter = runtime.load(pair.path("target", "gguf")), runtime.load(pair.path("drafter", "gguf"))
    finished = []
    for prompt in load_prompts("categories"):
        recorder = TraceRecorder() if traced else None
        result = run_prompt(target, drafter, prompt, DraftRules(K), max_new_tokens, trace=recorder)
        finished.append((result, recorder.finish() if recorder and result.ok else None))
    params = RunParams(k=K, greedy=True, max_new_tokens=max_new_tokens, mode="driven", spec_type="draft",
                       schedule="crossrt", n_ctx=512, draft_n_min=K, draft_p_min=0.0)
    record = RunRecord(runtime.info(), pair_info(pair, "gguf"), params, trace="run.trace.npz" if traced else None)
    return record, finished


def repeated(finished, n: int):
    """n (result, trace) pairs: the real ones over and over, each copy under its own prompt id."""
    out = []
    for i in range(n):
        result, trace = finished[i % len(finished)]
        out.append((dataclasses.replace(result, prompt_id=f"{result.prompt_id}#{i // len(finished)}"), trace))
    return out


def whole_save(record: RunRecord, prompts, folder: Path, traced: bool) -> tuple[float, int]:
    """Seconds to save the last of prompts as the driver did before journals; record bytes."""
    path = folder / "run.json"
    held = record.with_results(result for result, _ in prompts[:-1])
    traces = {result.prompt_id: trace for result, trace in prompts if trace is not None}
    start = time.perf_counter()
    written = save_record(held.with_result(prompts[-1][0]), path)
    if traced:
        save_traces(traces, trace_path(path))
    return time.perf_counter() - start, len(written)


def journal_run(record: RunRecord, prompts, folder: Path, traced: bool) -> dict[str, float]:
    """One run's saving through RunWriter: the last adds, the fold, and the whole of it."""
    adds = []
    start = time.perf_counter()
    writer = RunWriter(record, folder / "run.json", {} if traced else None)
    for result, trace in prompts:
        before = time.perf_counter()
        writer.add(result, trace)
        adds.append(time.perf_counter() - before)
    before_fold = time.perf_counter()
    writer.close()
    end = time.perf_counter()
    return {"add": statistics.median(adds[-5:]), "fold": end - before_fold, "per_prompt": (end - start) / len(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,100,1000,10000", help="comma-separated prompt counts")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("--trace", action="store_true", help="a traced run: traces saved with the record")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    record, finished = real_prompts(args.max_new_tokens, args.trace)
    prompts = repeated(finished, max(sizes))
    print(f"tiny pair, {len(finished)} real prompts (categories suite, --max-new-tokens {args.max_new_tokens}"
          f"{', traced' if args.trace else ''}) repeated; medians of {args.reps} reps", file=sys.stderr)
    print(f"{'prompts':>8} {'record MB':>9} {'whole: save ms':>14} {'journal: add ms':>15} "
          f"{'per prompt in all ms':>20} {'fold s':>7}")
    for n in sizes:
        whole, runs, size = [], [], 0
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory() as folder:
                seconds, size = whole_save(record, prompts[:n], Path(folder), args.trace)
                whole.append(seconds)
            with tempfile.TemporaryDirectory() as folder:
                runs.append(journal_run(record, prompts[:n], Path(folder), args.trace))

        def median(name: str) -> float:
            return statistics.median(run[name] for run in runs)

        print(f"{n:8d} {size / 1e6:9.2f} {statistics.median(whole) * 1e3:14.2f} {median('add') * 1e3:15.2f} "
              f"{median('per_prompt') * 1e3:20.2f} {median('fold'):7.2f}", flush=True)


if __name__ == "__main__":
    main()
