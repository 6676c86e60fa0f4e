"""How long crossrt simulate's simulations take, apart from loading models and building oracles
(docs/performance.md): the crossrt schedule at every k with the default cut-offs, each driven
schedule at every k, the online k policy, and lookup replays, on oracles built once.

    .venv/bin/python scripts/simulate_bench.py [--pair tiny] [--prompts categories] [--max-k 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from crossrt.inputs.pairs import resolve_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.speculative.policies import DraftPolicy
from crossrt.run.runtime import DraftRules, RuntimeOptions, open_runtime
from crossrt.speculative.schedules import SCHEDULES
from crossrt.speculative.strategies import Strategy
from crossrt.simulate.adaptive import simulate_policy
from crossrt.simulate.drafting import Drafting, simulate_sequence
from crossrt.simulate.oracle import CostModel, build_oracle, simulate_suite
from crossrt.simulate.schedule_sims import summarize_schedule

THRESHOLDS = (0.5, 0.9, 0.99, 0.999, 0.9999)  # crossrt simulate's default cut-offs
LOOKUPS = (("crossrt", "prompt-lookup"), ("llama-server", "llama-ngram-map-k"), ("vllm", "vllm-ngram"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="tiny")
    parser.add_argument("--prompts", default="categories")
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    pair, max_k = resolve_pair(args.pair), args.max_k
    runtime = open_runtime("llama-cpp", RuntimeOptions(n_ctx=512, threads=1))
    with runtime.load(pair.path("target", "gguf")) as target, runtime.load(pair.path("drafter", "gguf")) as drafter:
        oracles = [build_oracle(target, drafter, p.id, p.category, target.tokenize(p.text), args.max_new_tokens, max_k)
                   for p in load_prompts(args.prompts)]
        detokenize = target.detokenize
    costs = CostModel((1.0,) * (max_k + 1), 0.5)
    online = DraftPolicy.of(Strategy(k_policy="online"), 4)
    parts = {
        "suite (crossrt, every k, cut-offs)": lambda: simulate_suite(oracles, costs, max_k, THRESHOLDS),
        **{f"schedule {name}, every k": (lambda name=name: [summarize_schedule(oracles, name, DraftRules(k))
                                                             for k in range(1, max_k + 1)]) for name in SCHEDULES},
        "online k policy": lambda: [simulate_policy(oracle, online, detokenize) for oracle in oracles],
        **{f"lookup {drafting} under {schedule}, k 1-{max_k - 1}": (
            lambda schedule=schedule, drafting=drafting: [
                simulate_sequence(oracles, schedule, DraftRules(k), Drafting(drafting, 3)) for k in range(1, max_k)])
           for schedule, drafting in LOOKUPS},
    }
    print(f"{args.pair}, {len(oracles)} prompts of {args.prompts}, {args.max_new_tokens} new tokens, "
          f"k up to {max_k}: median of {args.repeat} (s)")
    total = 0.0
    for name, part in parts.items():
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            part()
            times.append(time.perf_counter() - start)
        total += statistics.median(times)
        print(f"  {name:<45} {statistics.median(times):.3f}")
    print(f"  {'all':<45} {total:.3f}")


if __name__ == "__main__":
    main()
