"""The commands that explain acceptance: `crossrt analyze` (records and their traces) and
`crossrt simulate` (what-if runs of every schedule from an oracle trace)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

import click

from crossrt.analyze import analysis
from crossrt.report.ceiling import load_ceilings
from crossrt.cli.common import PROMPTS_HELP, refuse_inputs_as_outputs, user_errors
from crossrt.cli.compare import distinct_records
from crossrt.cli.options import pair_options, runtime_options, strategy_options
from crossrt.cli.trees import max_tree_rows, render_ceiling, render_section, run_trees, tree_section
from crossrt.errors import PromptRefused, SettingsError
from crossrt.records.journal import write_atomically
from crossrt.inputs.pairs import ROLES, pair_info, run_k
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record
from crossrt.simulate.adaptive import simulate_policy
from crossrt.run.policies import DraftPolicy
from crossrt.run.isolation import call_isolated, isolated
from crossrt.run.runtime import DraftRules, open_runtime, runtime_names
from crossrt.records.schema import RunRecord
from crossrt.simulate.schedules import LLAMA, SIMULATED, ScheduleResult, compare_with_record, summarize_schedule
from crossrt.simulate.oracle import (Oracle, Policy, PolicyResult, Simulation, build_oracle, measure_costs, simulate,
                                  simulate_suite, summarize)
from crossrt.run.strategies import Strategy
from crossrt.records.tables import format_table

ALL = "ALL"


def _number(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _signed(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _name(category: Optional[str]) -> str:
    return ALL if category is None else category


class Increasing(click.ParamType):
    """Comma-separated increasing numbers (bucket edges, thresholds); `inf` allowed."""

    name = "NUMBERS"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            edges = tuple(float(part) for part in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers", param, ctx)
        if any(b <= a for a, b in zip(edges, edges[1:])):
            self.fail(f"{value!r}: give increasing numbers", param, ctx)
        return edges


def render_record(path: Path, record: RunRecord, trace: dict, entropy_edges: Sequence[float]) -> str:
    params = record.params
    traced = f"trace {record.trace} ({len(trace)} prompts)" if trace else "no trace (run with --trace)"
    blocks = [f"{path}: {record.pair.name} on {record.runtime.name}, {params.mode} {params.schedule}, "
              f"k={params.k}, {params.max_new_tokens or 'unknown'} new tokens; {traced}"]  # unknown: imported
    fits = {fit.category: fit for fit in analysis.iid_fit(record)}
    rows = [["category", "prompts", "steps", "tau", "alpha", "P(acc|reached)", "iid tau a=alpha", "error",
             "iid tau a=P, own lengths", "error"]]
    for stats in analysis.category_stats(record):
        fit = fits[stats.category]
        rows.append([_name(stats.category), str(stats.prompts), str(stats.steps), _number(stats.tau),
                     _number(stats.alpha, 3), _number(stats.accept_rate, 3), _number(fit.predicted_tau),
                     _signed(fit.error), _number(fit.predicted_tau_reached), _signed(fit.error_reached)])
    blocks.append(format_table(rows))
    rows = [["category"] + [f"pos {i + 1}" for i in range(params.k)]]
    for category in [*record.categories(), None]:
        rows.append([_name(category)] + [f"{_number(p.rate)} ({p.reached})"
                                         for p in analysis.position_acceptance(record, category)])
    blocks.append("acceptance by draft position, P(accept i | reached i) (steps reaching i):\n" + format_table(rows))
    if trace:
        rows = [["entropy (nats)", "exp(entropy)", "tokens", "accepted", "rate", "mean entropy"]]
        for b in analysis.entropy_acceptance(record, trace, entropy_edges):
            if b.tokens:
                rows.append([f"[{b.low:g}, {b.high:g})", f"{b.branching_low:.4g}-{b.branching_high:.4g}",
                             str(b.tokens), str(b.accepted), _number(b.rate, 3), f"{b.mean_entropy:.3g}"])
        blocks.append("acceptance of reached draft positions by the target's entropy there:\n" + format_table(rows))
        rows = [["drafter p1", "tokens", "accepted", "rate", "mean p1"]]
        for b in analysis.confidence_acceptance(record, trace):
            if b.tokens:
                rows.append([f"[{b.low:g}, {min(b.high, 1.0):g}{']' if b.high > 1 else ')'}", str(b.tokens),
                             str(b.accepted), _number(b.rate, 3), f"{b.mean_p1:.4f}"])
        blocks.append("acceptance of reached draft positions by the drafter's top-1 probability:\n"
                      + format_table(rows))
    return "\n\n".join(blocks)


@click.command()
@user_errors
@click.argument("records", nargs=-1, required=True, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--entropy-buckets", type=Increasing(), default=",".join(f"{e:g}" for e in analysis.ENTROPY_BUCKETS),
              show_default=True, help="Edges of the target-entropy buckets, in nats.")
@click.option("--ceiling", "ceiling_path", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="A `crossrt simulate --tree ... --out` result of the same pair and prompts: print its "
              "per-category ceiling table beside each record's measured tau (docs/ceiling.md).")
@click.option("--by", "grouping", type=click.Choice(analysis.GROUPINGS), default="category", show_default=True,
              help="Group prompts by their own category (a benchmark's, e.g. Spec-Bench's coding) or by "
              "crossrt's content type of it (code, prose, structured, math, chat; docs/prompts.md).")
def analyze(records: Sequence[Path], entropy_buckets, ceiling_path, grouping) -> None:
    """Acceptance in run records: per category tau, alpha and per-token acceptance where the
    target judged a draft token; acceptance per draft position; how well the i.i.d. model
    E = (1 - a^(k+1)) / (1 - a) predicts tau; and, for records run with --trace, acceptance
    by the target's entropy and by the drafter's confidence (docs/analysis.md)."""
    distinct_records(records)  # one record twice would print, and count, the same run twice
    loaded = [(path, analysis.grouped(load_record(path), grouping)) for path in records]
    blocks = [render_record(path, record, analysis.load_trace(path, record), entropy_buckets)
              for path, record in loaded]
    if ceiling_path:
        table = load_ceilings(ceiling_path)
        blocks += [f"{path} against {ceiling_path}:\n" + render_ceiling(
            table, {stats.category: stats.tau for stats in analysis.category_stats(record)})
            for path, record in loaded]
    click.echo("\n\n".join(blocks))


def render_simulation(sim: Simulation, k_policy: Sequence[PolicyResult] = ()) -> str:
    costs = sim.costs
    verify = ", ".join(f"{r + 1}: {t * 1e3:.3f}" for r, t in enumerate(costs.verify_s))
    blocks = [f"cost model (median, ms): target pass by tokens {verify}; drafter pass {costs.draft_s * 1e3:.3f} "
              f"(c = {costs.ratio:.2f})"]
    rows = [["k"] + [_name(r.category) for r in sim.by_k[0]]]
    for k, group in enumerate(sim.by_k, start=1):
        rows.append([str(k)] + [f"{_number(r.tau)} ({_number(r.speedup)}x)" for r in group])
    blocks.append("simulated tau by k (predicted speedup over plain greedy):\n" + format_table(rows))
    rows = [["category", "best k", "tau", "speedup"]]
    rows += [[_name(b.category), str(b.k), _number(b.tau), _number(b.speedup)] for b in sim.best_k]
    blocks.append(format_table(rows))
    rows = [["policy", "category", "steps", "drafted/step", "tau", "alpha", "speedup"]]
    rows += [[r.policy, _name(r.category), str(r.steps), _number(r.drafted / r.steps if r.steps else None),
              _number(r.tau), _number(r.alpha, 3), _number(r.speedup)]
             for r in (*sim.per_category_k, *sim.thresholds, *k_policy)]
    blocks.append("policies (p1>=x: stop drafting before a token the drafter gives top-1 probability below x):\n"
                  + format_table(rows))
    return "\n\n".join(blocks)


def render_schedules(results: Sequence[ScheduleResult]) -> str:
    """One table per schedule: tau (alpha, steps) per k and category."""
    blocks = []
    for schedule in dict.fromkeys(r.schedule for r in results):
        group = [r for r in results if r.schedule == schedule]
        n_mins = {r.n_min for r in group}
        rules = (f"n_min {min(n_mins)}" if len(n_mins) == 1 and any(r.k != r.n_min for r in group) else "n_min = k")
        rows = [["k"] + [_name(r.category) for r in group if r.k == group[0].k]]
        for k in sorted({r.k for r in group}):
            rows.append([str(k)] + [f"{_number(r.tau)} ({_number(r.alpha, 3)}, {r.steps})" for r in group if r.k == k])
        blocks.append(f"schedule {schedule} ({rules}, p_min {group[0].p_min:g}): simulated tau (alpha, steps) by k:\n"
                      + format_table(rows))
    return "\n\n".join(blocks)


def schedule_results(oracles: Sequence[Oracle], schedules: Sequence[str], n_min: Optional[int], p_min: float,
                     max_k: int) -> list[ScheduleResult]:
    """Each schedule at every k up to max_k; the llama-* ones with n_min and p_min (from k = n_min
    on), the others drafting k tokens, as they do."""
    if (n_min is not None or p_min > 0) and not set(schedules) & set(LLAMA):
        raise SettingsError(f"--draft-n-min and --draft-p-min are drafting rules of the {' and '.join(LLAMA)} "
                            "schedules: name one with --schedule")
    results = []
    for schedule in schedules:
        llama = schedule in LLAMA
        for k in range(max(1, n_min or 1) if llama else 1, max_k + 1):
            rules = DraftRules(k, k if n_min is None or not llama else n_min, p_min if llama else 0.0)
            results += summarize_schedule(oracles, schedule, rules)
    return results


def check_simulated(strategy: Strategy, drafting: str, tree_specs: Sequence[str]) -> None:
    """SettingsError for a strategy the oracle cannot replay: it holds a drafter model's greedy
    drafts and the target's greedy output, so chains and trees of that drafter under any k
    policy, accepted greedily."""
    if drafting == "prompt-lookup":
        raise SettingsError("--drafting prompt-lookup: crossrt simulate replays a drafter model's drafts; run "
                            "prompt lookup with crossrt run --drafting prompt-lookup")
    if drafting == "tree" and not tree_specs:
        raise SettingsError("--drafting tree: name the trees to simulate with --tree (WxD, best:N or a file)")
    if strategy.acceptance != "greedy":
        raise SettingsError("--acceptance relaxed: crossrt simulate's oracle holds greedy steps only; run relaxed "
                            "acceptance with crossrt run --acceptance relaxed")


def _per_prompt(oracles: Sequence[Oracle], max_k: int) -> list[dict]:
    result = []
    for oracle in oracles:
        runs = [simulate(oracle, Policy(k)) for k in range(1, max_k + 1)]
        result.append({"prompt_id": oracle.prompt_id, "category": oracle.category, "output_tokens": len(oracle.output),
                       "by_k": [{"k": k + 1, "steps": run.steps, "drafted": run.drafted, "accepted": run.accepted}
                                for k, run in enumerate(runs)]})
    return result


def _simulation(pair, runtime_name, options, prompts, max_k, max_new_tokens, thresholds, records, schedules,
                draft_n_min, draft_p_min, strategy, tree_specs, ceiling_k, tree_budget, top_b, run_trees_too):
    """What simulate computes with the models loaded: the oracles and everything read from them,
    with the pair's and runtime's info (run in a process of its own for an in-process runtime)."""
    with contextlib.ExitStack() as stack:  # the sessions, freed however the block ends
        runtime = open_runtime(runtime_name, options)
        info = pair_info(pair, runtime.model_format)
        sessions = {role: stack.enter_context(runtime.load(pair.path(role, runtime.model_format)))
                    for role in ROLES}
        oracles = []
        for prompt in prompts:
            try:
                oracles.append(build_oracle(sessions["target"], sessions["drafter"], prompt.id, prompt.category,
                                            sessions["target"].tokenize(prompt.text), max_new_tokens, max_k))
            except PromptRefused as error:
                click.echo(f"skipped {prompt.id}: {error}", err=True)
        if not oracles:
            raise PromptRefused("no prompt could run")
        # Passes are timed at the average decoding position of the median prompt.
        typical = sorted(oracles, key=lambda o: len(o.prompt_ids) + len(o.output))[len(oracles) // 2]
        context = typical.prompt_ids + typical.output[:len(typical.output) // 2]
        rows = max(max_k + 1, max_tree_rows(tree_specs, tree_budget)) if tree_specs else max_k + 1
        costs = measure_costs(sessions["target"], sessions["drafter"], context, rows)
        sim = simulate_suite(oracles, costs, max_k, thresholds)
        k = run_k(pair, ceiling_k)
        k_policy = [] if strategy.k_policy == "fixed" else summarize(
            [simulate_policy(oracle, DraftPolicy.of(strategy, k), sessions["target"].detokenize)
             for oracle in oracles], costs, strategy.label())
        section = None
        if tree_specs:
            section = tree_section(sessions["drafter"], oracles, sim, tree_specs, k, tree_budget, top_b, max_k)
        if run_trees_too:
            if section is None:
                raise SettingsError("--run-trees runs the --tree trees: name one")
            section = run_trees(section, runtime, pair.path("target", runtime.model_format), sessions["target"],
                                sessions["drafter"])
        checks = [(path, *compare_with_record(oracles, load_record(path))) for path in records]
        what_if = schedule_results(oracles, schedules, draft_n_min, draft_p_min, max_k)
    return info, runtime.info(), oracles, sim, k_policy, section, checks, what_if


@click.command(name="simulate")
@user_errors
@pair_options
@click.option("--runtime", "runtime_name", type=click.Choice(runtime_names()), default="llama-cpp",
              show_default=True, help="A runtime with a driven mode, to compute the oracle and time passes.")
@click.option("--prompts", "prompt_source", default="builtin", show_default=True,
              help=PROMPTS_HELP)
@click.option("--max-k", type=click.IntRange(min=1), default=8, show_default=True,
              help="Simulate every k up to this (the oracle's draft length).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--thresholds", type=Increasing(), default="0.5,0.9,0.99,0.999,0.9999", show_default=True,
              help="Drafter-confidence cut-offs to simulate at k = --max-k.")
@click.option("--against", "records", multiple=True, type=click.Path(path_type=Path, dir_okay=False),
              help="A run record (driven or native, of any simulated schedule) to check against its "
              "schedule's simulation with its drafting rules, step for step where it has per-step lengths "
              "(same prompts and token budget); repeatable. Exit code 1 on a difference.")
@click.option("--schedule", "schedules", multiple=True, type=click.Choice(SIMULATED),
              help="Also simulate this schedule at every k up to --max-k (tau, alpha and steps per category), "
              "with the drafting rules below; repeatable. exllamav3 and vllm are read from their sources "
              "(docs/analysis.md).")
@click.option("--draft-n-min", type=click.IntRange(min=0),
              help="n_min for the llama-* --schedule simulations: drafts shorter than this are dropped. "
              "Default: k, as crossrt runs llama.cpp's tools (a draft the budget cuts short is dropped).")
@click.option("--draft-p-min", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="p_min for the llama-* --schedule simulations: drafting stops before a token whose "
              "top-10 softmax probability is below it.")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), help="Write the results as JSON.")
@runtime_options
@strategy_options(own_trees=True)
@click.option("--tree", "tree_specs", multiple=True,
              help="A draft tree to simulate (--drafting tree): WxD (the full tree of width W and depth D), best:N "
              "(the best tree of at most N nodes on these prompts) or a JSON choice-list file ([[0], [0, 0], [1]]); "
              "repeatable. Adds the per-category ceiling table (docs/ceiling.md).")
@click.option("--k", "ceiling_k", type=click.IntRange(min=1),
              help="The ceiling table's chain k, and a --k-policy's k as in crossrt run (online: the first "
              "step's; content: the k of a type --content-k leaves out); at most --max-k. Default: the pair's "
              "k, else 4.")
@click.option("--tree-budget", type=click.IntRange(min=1, max=255), default=16, show_default=True,
              help="The ceiling table's node budget for the best tree.")
@click.option("--top-b", type=click.IntRange(min=1, max=1000), default=8, show_default=True,
              help="Drafter ranks are stored up to this; the ceiling table's top-b.")
@click.option("--run-trees", "run_trees_too", is_flag=True,
              help="Also run each --tree for real on llama-cpp, step for step against the simulator and timed "
              "against plain greedy. Exit code 1 where a lossless run's steps differ from the simulation.")
def simulate_command(pair, runtime_name, prompt_source, max_k, max_new_tokens, thresholds, records,
                     schedules, draft_n_min, draft_p_min, out, options, drafting, strategy, tree_specs, ceiling_k,
                     tree_budget, top_b, run_trees_too) -> None:
    """What-if runs of the crossrt schedule: tau at every k up to --max-k per category, the
    best k per category, drafter-confidence cut-offs, and speedups predicted from measured
    pass times; with --schedule, any other schedule and its drafting rules (crossrt simulate
    --schedule llama-server --draft-n-min 2). Computed exactly (greedy) from an oracle: the
    target's greedy output and the drafter's greedy continuation from every position of it
    (docs/analysis.md). --against checks a record of any simulated schedule, step for step.
    --k-policy adds a k policy's steps on the same oracle, exactly as crossrt run takes them."""
    check_simulated(strategy, drafting, tree_specs)
    if out:  # before the models load; a --tree may name a choice-list file
        refuse_inputs_as_outputs({"--out": out}, [*records, *(Path(s) for s in tree_specs if Path(s).is_file())])
    prompts = load_prompts(prompt_source)
    args = (pair, runtime_name, options, prompts, max_k, max_new_tokens, thresholds, records, schedules, draft_n_min,
            draft_p_min, strategy, tree_specs, ceiling_k, tree_budget, top_b, run_trees_too)
    # The models load and run in a process of their own where the runtime runs in-process: a crash is one line.
    info, runtime_info, oracles, sim, k_policy, section, checks, what_if = (
        call_isolated(runtime_name, _simulation, *args) if isolated(runtime_name) else _simulation(*args))
    click.echo(f"{info.name} on {runtime_name}: {len(oracles)} prompts, {max_new_tokens} new tokens, "
               f"oracle drafts of {max_k}\n")
    click.echo(render_simulation(sim, k_policy))
    if section is not None:
        click.echo("\n" + render_section(section))
    if what_if:
        click.echo("\n" + render_schedules(what_if))
    if checks:
        click.echo("")
    for path, compared, differences in checks:
        verdict = "differ" if differences else "match step for step"
        if not compared:  # a check of nothing passes nothing (issue 40)
            click.echo(f"against {path}: nothing compared: none of its finished prompts is among the "
                       f"{len(oracles)} simulated (--prompts)")
            continue
        click.echo(f"against {path}: {compared} prompts compared, {len(differences) or compared} {verdict}")
        for line in differences:
            click.echo(f"  {line}")
    if out:
        results = json.dumps({
            "pair": dataclasses.asdict(info), "runtime": dataclasses.asdict(runtime_info),
            "prompts": prompt_source, "max_new_tokens": max_new_tokens, "max_k": max_k,
            "thresholds": list(thresholds), **dataclasses.asdict(sim),
            "k_policy": [dataclasses.asdict(r) for r in k_policy],
            "per_prompt": _per_prompt(oracles, max_k), **(section.as_json() if section else {}),
            "schedules": [{**dataclasses.asdict(r), "tau": r.tau, "alpha": r.alpha} for r in what_if],
        }, indent=1) + "\n"
        # Whole or not at all; a full disk or a read-only folder is a one-line error (user_errors).
        write_atomically(out, results.encode())
        click.echo(f"\nresults: {out}")
    if any(differences or not compared for _, compared, differences in checks) or \
            (section is not None and any(run.as_simulated < run.lossless for run in section.runs)):
        sys.exit(1)
