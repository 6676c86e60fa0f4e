"""The commands that explain acceptance: `crossrt analyze` (records and their traces) and
`crossrt simulate` (what-if runs of every schedule from an oracle trace, and the tree study).
They parse, call crossrt/analyze/analysis.py and crossrt/simulate/study.py, and print."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

import click

from crossrt.analyze import analysis
from crossrt.cli.common import (PROMPTS_HELP, Increasing, distinct_records, echo_table, format_option,
                                refuse_inputs_as_outputs, user_errors)
from crossrt.cli.options import pair_options, runtime_options, strategy_options
from crossrt.inputs.prompts import load_prompts
from crossrt.records.journal import write_atomically
from crossrt.records.record_json import load_record
from crossrt.records.schema import RunRecord
from crossrt.records.tables import format_table, render
from crossrt.run.runtime import runtime_names
from crossrt.simulate.ceiling import Ceiling, load_ceilings
from crossrt.simulate.oracle import PolicyResult, Simulation
from crossrt.simulate.schedule_sims import SIMULATED, ScheduleResult
from crossrt.simulate.study import StudyRequest, check_simulated, per_prompt, study
from crossrt.simulate.tree_section import TreeSection

ALL = "ALL"


def _number(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _name(category: Optional[str]) -> str:
    return ALL if category is None else category


def render_record(path: Path, record: RunRecord, trace: dict, entropy_edges: Sequence[float]) -> str:
    params = record.params
    traced = f"trace {record.trace} ({len(trace)} prompts)" if trace else "no trace (run with --trace)"
    blocks = [render(analysis.acceptance_table([(path, record)], positions=False), "table") + "\n"
              f"{params.max_new_tokens or 'unknown'} new tokens; {traced}"]  # unknown: imported
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
@format_option
def analyze(records: Sequence[Path], entropy_buckets, ceiling_path, grouping, output_format) -> None:
    """Acceptance in run records: per category tau, alpha and per-token acceptance where the
    target judged a draft token; acceptance per draft position; how well the i.i.d. model
    E = (1 - a^(k+1)) / (1 - a) predicts tau; and, for records run with --trace, acceptance
    by the target's entropy and by the drafter's confidence (docs/analysis.md). --format csv,
    json or md gives the first of these, draft positions as columns, one row per record and category."""
    distinct_records(records)  # one record twice would print, and count, the same run twice
    if ceiling_path and output_format != "table":
        raise click.UsageError("--ceiling prints its own table beside each record's: --format table only")
    loaded = [(path, analysis.grouped(load_record(path), grouping)) for path in records]
    if output_format != "table":
        echo_table(analysis.acceptance_table(loaded), output_format)
        return
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


def render_section(section: TreeSection) -> str:
    """The tree study: each tree's simulated tau per category, the ceiling table, real tree runs."""
    trees = {t.label: t for t in section.trees}
    categories = [_name(r.category) for r in section.results if r.tree == section.trees[0].label]
    rows = [["tree", "nodes", "depth", "tokens/pass"] + categories]
    for tree in section.trees:
        group = [r for r in section.results if r.tree == tree.label]
        rows.append([tree.label, str(tree.n_nodes), str(tree.depth), _number(group[-1].verify_tokens, 1)]
                    + [f"{_number(r.tau)} ({_number(r.speedup)}x)" for r in group])
    blocks = ["simulated tree verification, tau (predicted speedup over plain greedy); tokens/pass: target "
              "tokens per verify pass:\n" + format_table(rows)]
    for label, tree in trees.items():
        if label.startswith("best"):
            blocks.append(f"{label}: {[list(p) for p in tree.paths]}")
    blocks.append(render_ceiling(section.ceiling))
    if section.chain_mismatch:
        blocks.append("width-1 tree and chain simulator differ (a near-tie scored differently by the two "
                      f"oracles' drafter passes): {', '.join(section.chain_mismatch)}")
    if section.runs:
        rows = [["tree", "prompts", "lossless", "as simulated", "steps", "tau", "tok/s", "greedy tok/s", "speedup"]]
        for run in section.runs:
            t = run.totals
            rows.append([run.tree, str(run.prompts), str(run.lossless), str(run.as_simulated), str(run.steps),
                         _number(t.tau), _number(t.tokens_per_s, 1), _number(t.baseline_tokens_per_s, 1),
                         _number(t.speedup)])
        blocks.append("real tree verification on llama.cpp (lossless: the greedy output; as simulated: of "
                      "those, the simulator's steps exactly):\n" + format_table(rows))
    return "\n\n".join(blocks)


def render_ceiling(rows: Sequence[Ceiling], measured: Optional[Mapping[Optional[str], Optional[float]]] = None) -> str:
    """The ceiling table; measured: a record's tau per category, shown first when given."""
    if not rows:
        return "no ceiling table"
    first = rows[0]
    head = ["category"] + (["measured tau"] if measured is not None else []) + [
        f"chain k={first.k}", "best chain k", f"best tree <= {first.tree_budget} nodes", "held out",
        f"top-{first.top_b} ceiling (depth {first.top_b_depth})"]
    table = [head]
    for c in rows:
        table.append([_name(c.category)] + ([_number(measured.get(c.category))] if measured is not None else []) + [
            _number(c.chain_tau), f"k={c.best_k}: {_number(c.best_k_tau)} ({_number(c.best_k_speedup)}x)",
            f"{c.tree_nodes}n d{c.tree_depth}: {_number(c.tree_tau)} ({_number(c.tree_speedup)}x)",
            _number(c.tree_heldout_tau), _number(c.top_b_tau)])
    return ("ceiling per category, tau with the bonus token (predicted speedup); best tree fitted on these "
            "prompts (in-sample; held out: fitted on the other half of them); top-b: the target's token always among the drafter's b best:\n"
            + format_table(table))


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
    request = StudyRequest(pair=pair, runtime=runtime_name, options=options, prompts=load_prompts(prompt_source),
                           max_k=max_k, max_new_tokens=max_new_tokens, thresholds=thresholds, records=records,
                           schedules=schedules, draft_n_min=draft_n_min, draft_p_min=draft_p_min, strategy=strategy,
                           tree_specs=tree_specs, ceiling_k=ceiling_k, tree_budget=tree_budget, top_b=top_b,
                           run_trees=run_trees_too)
    result = study(request, functools.partial(click.echo, err=True))
    info, oracles, sim, section, checks, what_if = (result.pair, result.oracles, result.sim, result.section,
                                                    result.checks, result.what_if)
    click.echo(f"{info.name} on {runtime_name}: {len(oracles)} prompts, {max_new_tokens} new tokens, "
               f"oracle drafts of {max_k}\n")
    click.echo(render_simulation(sim, result.k_policy))
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
            "pair": dataclasses.asdict(info), "runtime": dataclasses.asdict(result.runtime),
            "prompts": prompt_source, "max_new_tokens": max_new_tokens, "max_k": max_k,
            "thresholds": list(thresholds), **sim.as_json(),
            "k_policy": [r.as_json() for r in result.k_policy],
            "per_prompt": per_prompt(oracles, max_k), **(section.as_json() if section else {}),
            "schedules": [r.as_json() for r in what_if],
        }, indent=1) + "\n"
        # Whole or not at all; a full disk or a read-only folder is a one-line error (user_errors).
        write_atomically(out, results.encode())
        click.echo(f"\nresults: {out}")
    for run in section.runs if section is not None else ():
        if run.not_lossless:
            click.echo(f"tree {run.tree}: {len(run.not_lossless)} prompts left the greedy output (a tree "
                       f"verification batch breaking a near-tie otherwise; not a failure): "
                       f"{', '.join(run.not_lossless[:8])}", err=True)
        if run.not_as_simulated:
            click.echo(f"tree {run.tree}: {len(run.not_as_simulated)} lossless prompts took other steps than "
                       f"simulated (exit 1): {', '.join(run.not_as_simulated[:8])}", err=True)
    if any(differences or not compared for _, compared, differences in checks) or \
            (section is not None and any(run.not_as_simulated for run in section.runs)):
        sys.exit(1)
