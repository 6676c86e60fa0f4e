"""What `crossrt simulate` computes with a pair's models loaded once: the oracles, the what-if
runs of the crossrt schedule at every k and cut-off with their predicted speedups, a k policy's
steps, the tree study (crossrt/simulate/tree_section.py), every other schedule's what-ifs, and
records checked step for step against their schedule's simulation. crossrt/cli/analysis.py
parses the command line, calls study and prints.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from crossrt import progress
from crossrt.errors import PromptRefused, SettingsError
from crossrt.inputs.pairs import ROLES, Pair, PairInfo, pair_info, run_k
from crossrt.inputs.prompts import Prompt
from crossrt.records.record_json import load_record
from crossrt.run.isolation import call_safely
from crossrt.speculative.policies import DraftPolicy
from crossrt.run.runtime import DraftRules, RuntimeInfo, RuntimeOptions, open_runtime
from crossrt.speculative.schedules import LLAMA_SCHEDULES
from crossrt.speculative.lookup import LOOKUPS
from crossrt.speculative.strategies import Strategy
from crossrt.simulate.adaptive import simulate_policy
from crossrt.simulate.oracle import (Oracle, Policy, PolicyResult, Simulation, build_oracle, measure_costs, simulate,
                                     simulate_suite, summarize)
from crossrt.simulate.schedule_sims import ScheduleResult, compare_with_record, summarize_schedule
from crossrt.simulate.tree_section import TreeSection, max_tree_rows, run_trees, tree_section


@dataclass(frozen=True)
class StudyRequest:
    """What to simulate: the pair on a runtime with a driven mode (to compute the oracle and time
    passes), its prompts, and what to read from the oracle."""

    pair: Pair
    runtime: str
    options: RuntimeOptions
    prompts: Sequence[Prompt]
    max_k: int  # the oracle's draft length: every k up to it is simulated
    max_new_tokens: int
    thresholds: Sequence[float]  # drafter-confidence cut-offs at k = max_k
    records: Sequence[Path]  # checked against their schedule's simulation
    schedules: Sequence[str]  # other schedules simulated at every k
    draft_n_min: Optional[int]  # the llama-* schedules' drafting rules
    draft_p_min: float
    strategy: Strategy  # a k policy other than fixed adds its steps
    tree_specs: Sequence[str]  # the trees of the tree study, if any
    ceiling_k: Optional[int]  # the ceiling's chain k and the k policy's k (None: the pair's)
    tree_budget: int
    top_b: int
    run_trees: bool  # each tree also run for real


@dataclass(frozen=True)
class Study:
    """What simulate computed, with the pair's and the runtime's info."""

    pair: PairInfo
    runtime: RuntimeInfo
    oracles: list[Oracle]
    sim: Simulation
    k_policy: list[PolicyResult]  # none for the fixed k policy
    section: Optional[TreeSection]  # with --tree
    checks: list[tuple[Path, int, list[str]]]  # each --against record: prompts compared, differences
    what_if: list[ScheduleResult]  # each --schedule at every k


def schedule_results(oracles: Sequence[Oracle], schedules: Sequence[str], n_min: Optional[int], p_min: float,
                     max_k: int) -> list[ScheduleResult]:
    """Each schedule at every k up to max_k; the llama-* ones with n_min and p_min (from k = n_min
    on), the others drafting k tokens, as they do."""
    if (n_min is not None or p_min > 0) and not set(schedules) & set(LLAMA_SCHEDULES):
        raise SettingsError("--draft-n-min and --draft-p-min are drafting rules of the "
                            f"{' and '.join(LLAMA_SCHEDULES)} schedules: name one with --schedule")
    results = []
    for schedule in schedules:
        llama = schedule in LLAMA_SCHEDULES
        for k in range(max(1, n_min or 1) if llama else 1, max_k + 1):
            rules = DraftRules(k, k if n_min is None or not llama else n_min, p_min if llama else 0.0)
            results += summarize_schedule(oracles, schedule, rules)
    return results


def check_simulated(strategy: Strategy, drafting: str, tree_specs: Sequence[str]) -> None:
    """SettingsError for a strategy the oracle cannot replay: it holds a drafter model's greedy
    drafts and the target's greedy output, so chains and trees of that drafter under any k
    policy, accepted greedily."""
    if drafting in LOOKUPS:
        raise SettingsError(f"--drafting {drafting}: crossrt simulate replays a drafter model's drafts; run "
                            f"prompt lookup with crossrt run --drafting {drafting}")
    if drafting == "tree" and not tree_specs:
        raise SettingsError("--drafting tree: name the trees to simulate with --tree (WxD, best:N or a file)")
    if strategy.acceptance != "greedy":
        raise SettingsError("--acceptance relaxed: crossrt simulate's oracle holds greedy steps only; run relaxed "
                            "acceptance with crossrt run --acceptance relaxed")


def per_prompt(oracles: Sequence[Oracle], max_k: int) -> list[dict]:
    """Each prompt's steps, drafted and accepted tokens at every k up to max_k (`--out`'s per_prompt)."""
    result = []
    for oracle in oracles:
        runs = [simulate(oracle, Policy(k)) for k in range(1, max_k + 1)]
        result.append({"prompt_id": oracle.prompt_id, "category": oracle.category, "output_tokens": len(oracle.output),
                       "by_k": [{"k": k + 1, "steps": run.steps, "drafted": run.drafted, "accepted": run.accepted}
                                for k, run in enumerate(runs)]})
    return result


def _study(request: StudyRequest, say: Callable[[str], None]) -> Study:
    """The study with the models loaded in this process."""
    pair, max_k, specs = request.pair, request.max_k, request.tree_specs
    with contextlib.ExitStack() as stack:  # the sessions, freed however the block ends
        runtime = open_runtime(request.runtime, request.options)
        info = pair_info(pair, runtime.model_format)
        target, drafter = (stack.enter_context(runtime.load(pair.path(role, runtime.model_format))) for role in ROLES)
        oracles = []
        for prompt in progress.each(request.prompts, "oracles"):
            try:
                oracles.append(build_oracle(target, drafter, prompt.id, prompt.category, target.tokenize(prompt.text),
                                            request.max_new_tokens, max_k))
            except PromptRefused as error:
                say(f"skipped {prompt.id}: {error}")
        if not oracles:
            raise PromptRefused("no prompt could run")
        # Passes are timed at the average decoding position of the median prompt.
        typical = sorted(oracles, key=lambda o: len(o.prompt_ids) + len(o.output))[len(oracles) // 2]
        context = typical.prompt_ids + typical.output[:len(typical.output) // 2]
        rows = max(max_k + 1, max_tree_rows(specs, request.tree_budget)) if specs else max_k + 1
        costs = measure_costs(target, drafter, context, rows)
        sim = simulate_suite(oracles, costs, max_k, request.thresholds)
        k = run_k(pair, request.ceiling_k)
        strategy = request.strategy
        k_policy = [] if strategy.k_policy == "fixed" else summarize(
            [simulate_policy(oracle, DraftPolicy.of(strategy, k), target.detokenize) for oracle in oracles], costs,
            strategy.label())
        section = None
        if specs:
            section = tree_section(drafter, oracles, sim, specs, k, request.tree_budget, request.top_b, max_k)
        if request.run_trees:
            if section is None:
                raise SettingsError("--run-trees runs the --tree trees: name one")
            section = run_trees(section, runtime, pair.path("target", runtime.model_format), target, drafter)
        checks = [(path, *compare_with_record(oracles, load_record(path))) for path in request.records]
        what_if = schedule_results(oracles, request.schedules, request.draft_n_min, request.draft_p_min, max_k)
    return Study(info, runtime.info(), oracles, sim, k_policy, section, checks, what_if)


def study(request: StudyRequest, say: Callable[[str], None]) -> Study:
    """What `crossrt simulate` computes: the oracles and everything read from them (module
    docstring); say: where a prompt that cannot run is named (it must pickle)."""
    # The models load and run where crossrt/run/isolation.py places the runtime: a crash is one line.
    return call_safely(request.runtime, _study, request, say)
