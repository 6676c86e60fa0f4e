"""Adaptive draft lengths and relaxed acceptance, measured (docs/ceiling.md).

    .venv/bin/python scripts/ceiling_bench.py --pair trained [--prompts categories] [--max-new 64]
        [--f32-kv-cache --no-flash-attn] [--n-ctx 256] [--limit N] [--out results.json]

Adaptive: mixed prompts (each code prompt of the source followed by a prose prompt, and each
prose prompt followed by a code prompt, so content changes inside a prompt) under fixed k = 1..8,
k per content type from the simulator's best k per category (code, prose) on the plain
prompts, online k, and drafter-confidence stops; measured decode tokens/s against plain greedy
beside the simulator's predicted speedup, and a check that every run's steps equal the
simulation's. Relaxed: per category, tau and drift (first divergence, differing share, mean
target log-probability against greedy's) at the pair's k for a few (top-m, delta).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from crossrt.speculative import loop
from crossrt.simulate.adaptive import simulate_policy
from crossrt.speculative.policies import DraftPolicy
from crossrt.speculative.strategies import Strategy
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import Prompt, load_prompts
from crossrt.speculative.relaxed import relaxed_run
from crossrt.run.runtime import DraftRules, RuntimeOptions, open_runtime
from crossrt.simulate.oracle import SimRun, build_oracle, measure_costs, simulate_suite
from crossrt.records.tables import format_table

REPO = Path(__file__).resolve().parents[1]
MAX_K = 8
RELAXED = ((2, 1.0), (2, 3.0), (4, 3.0), (8, 100.0))


def mixed(prompts: list[Prompt]) -> list[Prompt]:
    code = [p for p in prompts if p.category == "code"]
    prose = [p for p in prompts if p.category == "prose"]
    pairs = list(zip(code, prose))
    return ([Prompt(f"{p.id}+{c.id}", "prose>code", f"{p.text}\n\n{c.text}") for c, p in pairs]
            + [Prompt(f"{c.id}+{p.id}", "code>prose", f"{c.text}\n\n{p.text}") for c, p in pairs])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="trained")
    parser.add_argument("--prompts", default="categories")
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--limit", type=int, default=0, help="at most this many prompts per category")
    parser.add_argument("--f32-kv-cache", action="store_true")
    parser.add_argument("--no-flash-attn", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    pair_path = Path(args.pair) if Path(args.pair).is_file() else REPO / "models" / "pairs" / f"{args.pair}.toml"
    pair = load_pair(pair_path)
    options = RuntimeOptions(n_ctx=args.n_ctx, threads=1, f32_kv_cache=args.f32_kv_cache,
                             flash_attn=not args.no_flash_attn)
    runtime = open_runtime("llama-cpp", options)
    target, drafter = (runtime.load(pair.path(role, "gguf")) for role in ("target", "drafter"))
    prompts = [p for p in load_prompts(args.prompts) if p.category in ("code", "prose")]
    if args.limit:
        prompts = [p for c in ("code", "prose") for p in [q for q in prompts if q.category == c][:args.limit]]
    k_pair = int(pair.defaults.get("k", 4))

    def oracles_of(source):
        return [build_oracle(target, drafter, p.id, p.category, target.tokenize(p.text), args.max_new, MAX_K)
                for p in source]

    plain = oracles_of(prompts)
    typical = sorted(plain, key=lambda o: len(o.prompt_ids) + len(o.output))[len(plain) // 2]
    costs = measure_costs(target, drafter, typical.prompt_ids + typical.output[:len(typical.output) // 2], MAX_K + 1)
    best = {b.category: b.k for b in simulate_suite(plain, costs, MAX_K).best_k}
    mix = mixed(prompts)
    mix_oracles = oracles_of(mix)
    # (k, strategy): the loop runs each, simulate_policy replays the same DraftPolicy.
    policies = [(k, Strategy()) for k in range(1, MAX_K + 1)] + [
        (best["prose"], Strategy(k_policy="content", content_k=(("code", best["code"]), ("prose", best["prose"])))),
        (2, Strategy(k_policy="online", k_max=MAX_K)),
        (MAX_K, Strategy(k_policy="confidence", min_p1=0.5)),
        (MAX_K, Strategy(k_policy="confidence", min_p1=0.9)),
        (2, Strategy(k_policy="online", k_max=MAX_K, min_p1=0.5))]
    greedy_s = sum(loop.greedy_generate(target, o.prompt_ids, args.max_new).decode_s for o in mix_oracles)
    emitted = sum(len(o.output) for o in mix_oracles)
    rows = [["policy", "steps", "tau", "match sim", "tok/s", "greedy tok/s", "speedup", "predicted"]]
    adaptive = []
    for k, strategy in policies:
        policy = DraftPolicy.of(strategy, k)
        runs = [loop.speculative_generate(target, drafter, o.prompt_ids, DraftRules(k), args.max_new, strategy=strategy)
                for o in mix_oracles]
        sims = [simulate_policy(o, policy, target.detokenize) for o in mix_oracles]
        match = sum(SimRun.of(r, o.prompt_id, o.category) == s and r.output_ids == o.output
                    for r, s, o in zip(runs, sims, mix_oracles))
        spent = sum(r.decode_s for r in runs)
        steps = sum(len(r.step_accepted) for r in runs)
        predicted = costs.plain_s(emitted) / sum(costs.speculative_s(s) for s in sims)
        adaptive.append({"policy": policy.label, "steps": steps, "emitted": emitted, "match": match,
                         "prompts": len(runs), "decode_s": spent, "greedy_decode_s": greedy_s,
                         "predicted_speedup": predicted})
        rows.append([policy.label, str(steps), f"{emitted / steps:.2f}", f"{match}/{len(runs)}",
                     f"{emitted / spent:.1f}", f"{emitted / greedy_s:.1f}", f"{greedy_s / spent:.2f}",
                     f"{predicted:.2f}"])
    print(f"{pair.name}: {len(mix)} mixed prompts, {args.max_new} new tokens; cost model c = {costs.ratio:.2f}; "
          f"best k on the plain prompts: {best}")
    print(format_table(rows))

    relaxed = []
    rows = [["category", "top-m", "delta", "tau", "greedy tau", "lossless", "first split (median)",
             "differing", "logprob", "greedy logprob"]]
    for top_m, delta in RELAXED:
        for category in ("code", "prose"):
            group = [o for o in plain if o.category == category]
            results = [relaxed_run(target, drafter, o.prompt_id, o.category, o.prompt_ids, o.output, k_pair, top_m,
                                   delta, args.max_new) for o in group]
            chain = [loop.speculative_generate(target, drafter, o.prompt_ids, DraftRules(k_pair), args.max_new)
                     for o in group]
            greedy_tau = sum(len(g.output_ids) for g in chain) / sum(len(g.step_accepted) for g in chain)
            splits = [r.first_divergence for r in results if r.first_divergence is not None]
            relaxed += [dataclasses.asdict(r) for r in results]
            rows.append([category, str(top_m), f"{delta:g}",
                         f"{sum(r.emitted for r in results) / sum(r.steps for r in results):.2f}",
                         f"{greedy_tau:.2f}", f"{len(results) - len(splits)}/{len(results)}",
                         f"{statistics.median(splits):g}" if splits else "-",
                         f"{statistics.mean(r.differing_share for r in results):.3f}",
                         f"{statistics.mean(r.logprob for r in results):.3f}",
                         f"{statistics.mean(r.greedy_logprob for r in results):.3f}"])
    print(f"\nrelaxed acceptance at k={k_pair} (lossy):")
    print(format_table(rows))
    if args.out:
        args.out.write_text(json.dumps({"pair": pair.name, "max_new": args.max_new, "best_k": best,
                                        "adaptive": adaptive, "relaxed": relaxed}, indent=1) + "\n")
    return 0 if all(a["match"] == a["prompts"] for a in adaptive) else 1


if __name__ == "__main__":
    sys.exit(main())
