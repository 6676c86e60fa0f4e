"""crossrt's one speculative loop ("driven" mode) and the plain greedy baseline.

Pure logic over the ModelSession contract, identical whatever the runtime: every driven run goes
through speculative_generate, composed of a schedule (speculative/schedules.py), a drafter
(speculative/drafters.py), a k policy (speculative/policies.py) and an acceptance rule (speculative/acceptance.py), and
the simulator runs the same function on an oracle. The baseline prefills as the schedule does,
so decode timings compare like for like. A step, the strategies and the baseline:
docs/design.md, "The loop".
"""

from __future__ import annotations

import time
from typing import Optional, Protocol, Sequence

import numpy as np

from crossrt.errors import SettingsError
from crossrt.records.trace import TraceRecorder
from crossrt.speculative.acceptance import AcceptanceRule, Greedy, Proposal, Relaxed
from crossrt.speculative.draft_rules import HEAD_SPEC_TYPES, DraftRules
from crossrt.speculative.drafters import ChainStops, Drafter, ModelDrafter, TreeDrafter
from crossrt.speculative.head_drafter import head_drafter
from crossrt.speculative.lookup import LOOKUPS, LookupSettings
from crossrt.speculative.numerics import Choices, choose
from crossrt.speculative.policies import CONTENT_WINDOW, DraftPolicy
from crossrt.speculative.schedules import (HF_SCHEDULE, LLAMA_SCHEDULES, SCHEDULE, SCHEDULE_TYPES, SCHEDULES,
                                           TRACED_SCHEDULES, Generation, Schedule, Tally, ViewRecorder, check_prompt)
from crossrt.speculative.session import ModelSession, Rows
from crossrt.speculative.strategies import Strategy, tree_spec
from crossrt.speculative.tree import Tree

__all__ = ["HF_SCHEDULE", "SCHEDULE", "SCHEDULES", "TRACED_SCHEDULES", "greedy_generate", "speculative_generate"]


def greedy_generate(target: ModelSession, prompt_ids: Sequence[int], max_new_tokens: int,
                    whole_prompt: bool = False) -> Generation:
    """Plain greedy decoding, one token per target pass: the reference output. whole_prompt:
    the first token comes from a pass over the whole prompt, as llama-server decodes (its
    "llama-server" schedule's baseline), instead of prompt[:-1] then a one-token decode."""
    check_prompt(prompt_ids, max_new_tokens, [target])
    start = time.perf_counter()
    target.truncate(0)
    views = ViewRecorder()
    output: list[int] = []
    if whole_prompt:
        choices = choose(target.eval(prompt_ids, Rows.LAST))
        views.add(choices, 1, len(prompt_ids))
        output.append(int(choices.best[0]))
    else:
        target.eval(prompt_ids[:-1], Rows.NONE)
    prefilled = time.perf_counter()
    last = output[-1] if output else prompt_ids[-1]
    stop_reason = "eos" if output and last in target.eog_ids else "max_new_tokens"
    while len(output) < max_new_tokens and stop_reason != "eos":
        choices = choose(target.eval((last,), Rows.LAST))
        views.add(choices, 1, 1)
        last = int(choices.best[0])
        output.append(last)
        if last in target.eog_ids:
            stop_reason = "eos"
    return Generation(tuple(output), stop_reason, prefilled - start, time.perf_counter() - prefilled,
                      view=views.view(len(output)))


class TreeSession(Protocol):
    """A target session that evaluates a tree in one batch (backends/llama_cpp_tree.py)."""

    n_past: int
    eog_ids: frozenset[int]

    def eval(self, tokens: Sequence[int], rows: Rows) -> np.ndarray: ...

    def truncate(self, n_keep: int) -> None: ...

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray: ...

    def keep_path(self, nodes: Sequence[int]) -> None: ...


def verify_tree(target: TreeSession, tokens: Sequence[int], parents: Sequence[int]) -> tuple[np.ndarray, Choices]:
    """eval_tree and what each row chooses. An oracle knows its choices without logits
    (crossrt/simulate/oracle_sessions.py): it answers eval_tree_choices, as eval_choices for chains."""
    if hasattr(target, "eval_tree_choices"):
        return target.eval_tree_choices(tokens, parents)
    rows = target.eval_tree(tokens, parents)
    return rows, choose(rows)


def check_strategy(strategy: Strategy, schedule: str, rules: DraftRules, traced: bool = False,
                   tree_given: bool = False) -> None:
    """Refuse, in one line, a strategy the schedule, the drafting rules or a trace cannot run with;
    tree_given: the loop drafts a Tree given as such."""
    drafting = "tree" if tree_given else strategy.drafting
    if schedule not in SCHEDULES:
        raise SettingsError(f"unknown schedule {schedule!r}; schedules: {', '.join(SCHEDULES)}")
    if rules.spec_type in HEAD_SPEC_TYPES:
        if schedule not in LLAMA_SCHEDULES or not strategy.is_default or traced:
            raise SettingsError(f"crossrt's loop drafts with a head ({', '.join(HEAD_SPEC_TYPES)}) under the "
                                f"{' or '.join(LLAMA_SCHEDULES)} schedule at fixed k, greedy, untraced, "
                                f"not under {schedule}")
    else:
        rules.require_drafter_model("crossrt's driven loop")
    if traced and schedule not in TRACED_SCHEDULES:
        raise SettingsError(f"traces are recorded by the {' and '.join(TRACED_SCHEDULES)} schedules, not {schedule}")
    if traced and drafting != "model":
        raise SettingsError(f"traces record a draft model's chain, not {drafting} drafting")
    lookup = LOOKUPS.get(strategy.drafting)
    if lookup is not None and lookup.schedules:
        if (schedule not in lookup.schedules or strategy.k_policy != "fixed" or strategy.acceptance != "greedy"
                or not rules.fixed):
            raise SettingsError(f"--drafting {lookup.name} is reproduced under the {' or '.join(lookup.schedules)} "
                                "schedule, at fixed k, greedy, without n_min or p_min (draft-model rules)")
    elif SCHEDULE_TYPES[schedule].llama:
        if not strategy.is_default:
            raise SettingsError(f"the {schedule} schedule drafts as llama.cpp does (a draft model, fixed k, greedy), "
                                f"not {strategy.label()}: use the crossrt schedule")
    elif not rules.fixed:
        raise SettingsError(f"the {schedule} schedule drafts exactly k tokens: n_min and p_min are "
                            "llama.cpp drafting rules, for the llama-* schedules")
    if drafting == "tree" and schedule != SCHEDULE:
        raise SettingsError(f"tree drafting runs under the {SCHEDULE} schedule, not {schedule}")


def draft_bound(strategy: Strategy, k: int) -> int:
    """The most tokens one step of this strategy drafts at k: a tree's nodes, a policy's largest k."""
    if strategy.drafting == "tree":
        return tree_spec(strategy.tree).n_nodes
    return DraftPolicy.of(strategy, k).largest_k


def chain_stops(schedule: str, rules: DraftRules, min_p1: float, eog: frozenset[int]) -> ChainStops:
    """Where a draft model's chain ends short of its length: llama.cpp's p_min under its
    schedules, else the confidence stop min_p1 (Strategy.min_p1); at EOS where the schedule ends
    drafts there. The loop's drafters and the simulator's drafter on an oracle stop so alike."""
    plan = SCHEDULE_TYPES[schedule]
    ends = eog if plan.ends_at_eos else frozenset()
    if plan.llama and rules.p_min > 0:
        return ChainStops(rules.p_min, top10=True, ends=ends)
    return ChainStops(min_p1, ends=ends)


def _drafter(strategy: Strategy, session, rules: DraftRules, schedule: str,
             eog: frozenset[int], trace: Optional[TraceRecorder], tree: Optional[Tree],
             target: Optional[ModelSession] = None) -> Drafter:
    """session: the drafter model's session, or an EAGLE3 head (spec type eagle3) reading target."""
    stops = chain_stops(schedule, rules, strategy.min_p1, eog)
    if strategy.looks_up:
        return LOOKUPS[strategy.drafting].build(LookupSettings(strategy.ngram_max, strategy.ngram_min, rules.k,
                                                               eog, stops.ends))
    if session is None:
        raise SettingsError(f"{strategy.drafting} drafting needs a drafter model")
    if tree is not None:
        return TreeDrafter(session, tree)
    if rules.spec_type in HEAD_SPEC_TYPES:
        return head_drafter(rules.spec_type, session, target, rules.k, rules.n_min,
                            stops.unsure if stops.floor > 0 else None)
    return ModelDrafter(session, stops, trace)


def run_lookup(strategy: Strategy, rules: DraftRules, schedule: str, eog: frozenset[int]) -> Optional[Drafter]:
    """One lookup drafter for a run's prompts, in order, where its state outlives a prompt as
    llama-server keeps its n-gram maps and pool across requests (Lookup.kept_across_prompts);
    else None: each prompt begins afresh, as llama-speculative-simple's process per prompt."""
    lookup = LOOKUPS.get(strategy.drafting)
    if lookup is None or not lookup.kept_across_prompts(schedule):
        return None
    return _drafter(strategy, None, rules, schedule, eog, None, None)


def _acceptance(strategy: Strategy, eog: frozenset[int], schedule: Schedule) -> AcceptanceRule:
    if strategy.acceptance == "relaxed":
        return Relaxed(strategy.top_m, strategy.delta, eog)
    # vLLM's rejection sampler knows no EOS: the stop check drops what follows one, after counting.
    return Greedy(frozenset() if schedule.accepts_eos else eog, eos_last=schedule.llama)


def speculative_generate(target: ModelSession, drafter: Optional[ModelSession], prompt_ids: Sequence[int],
                         rules: DraftRules, max_new_tokens: int, schedule: str = SCHEDULE,
                         trace: Optional[TraceRecorder] = None, strategy: Strategy = Strategy(),
                         tree: Optional[Tree] = None, *, drafts: Optional[Drafter] = None,
                         what_if: bool = False) -> Generation:
    """Speculative decoding with the named schedule and strategy (module docstring): the one loop
    of every driven run, and of the simulator's chain and tree runs on an oracle (crossrt/simulate/).
    drafter: None for prompt lookup; tree drafting (strategy.tree, or a tree given as such,
    e.g. simulate's best:N) needs a target that evaluates trees (TreeSession); trace, when
    given, records the run's per-token trace; drafts: a drafter handed to the loop (a run's
    lookup whose state outlives a prompt, run_lookup; an oracle's), else one is built here;
    what_if: a run no runtime makes but the simulator reads (a lookup under a schedule it is
    not exact under, a prompt past the run's context), so neither strategy nor prompt is refused."""
    if tree is not None and not strategy.is_default:
        raise SettingsError(f"a tree given to the loop is its drafting, at fixed k, greedy: not {strategy.label()}")
    if tree is None and strategy.drafting == "tree":
        tree = tree_spec(strategy.tree)
    if not what_if:
        check_strategy(strategy, schedule, rules, trace is not None, tree_given=tree is not None)
    plan = SCHEDULE_TYPES[schedule]()
    eog = target.eog_ids
    if drafts is None:
        drafts = _drafter(strategy, drafter, rules, schedule, eog, trace, tree, target)
    try:
        return _steps(target, drafts, prompt_ids, rules, max_new_tokens, plan, strategy, trace, tree, eog, what_if)
    finally:
        close = getattr(drafts, "close", None)  # a head's: the target's decodes are no longer the head's
        if close is not None:
            close()


def _steps(target: ModelSession, drafts: Drafter, prompt_ids: Sequence[int], rules: DraftRules, max_new_tokens: int,
           plan: Schedule, strategy: Strategy, trace: Optional[TraceRecorder], tree: Optional[Tree],
           eog: frozenset[int], what_if: bool) -> Generation:
    """speculative_generate's steps, from the prefill to the last verification."""
    is_tree = tree is not None
    policy = DraftPolicy.of(strategy, tree.depth if is_tree else rules.k)  # a tree is cut to its depth, not k
    accept = _acceptance(strategy, eog, plan)
    if is_tree and not hasattr(target, "eval_tree"):
        raise SettingsError("tree drafting verifies a tree in one batch: it needs the llama-cpp runtime's tree session")
    overrun = tree.n_nodes if is_tree else max(plan.overrun(rules.k), policy.largest_k if drafts.past_budget else 0)
    if not what_if:
        check_prompt(prompt_ids, max_new_tokens, [target, *drafts.sessions], overrun)
    start = time.perf_counter()
    tally = Tally(max_new_tokens, eog)
    context = plan.start(target, drafts, prompt_ids, tally)
    prefilled = time.perf_counter()

    previous = None
    while not plan.done(tally):
        k = policy.next_k(previous, lambda: target.detokenize(context[-CONTENT_WINDOW:]))
        n_max = plan.n_max(target, tally, k)
        stand_in = plan.stand_in(k)
        if stand_in is not None:  # the runtime schedules it without asking the drafter (vLLM's zeros)
            proposal = Proposal.chain(stand_in[:n_max])
        else:
            proposal = drafts.propose(context, k if drafts.past_budget and n_max > 0 else n_max)
        if plan.llama and not strategy.looks_up and not drafts.own_n_min \
                and not rules.kept(len(proposal)):
            proposal = Proposal.chain(())  # llama.cpp throws a short draft model's draft away (a head's: itself)
        # What the target should hold: the context but its last token, which this step verifies.
        # Taken from the context, not from target.n_past, so a runtime whose cache keeps a stale
        # position shows as a disagreement in its outputs rather than drifting the drafter too.
        n_past = len(context) - 1
        batch = [context[-1], *proposal.tokens]
        if plan.llama:
            drafts.mirror(n_past, batch)
        if is_tree:
            rows, choices = verify_tree(target, batch, proposal.parents)
        else:
            rows, choices = target.eval_choices(batch, Rows.ALL)
        walk = accept.walk(rows, choices, proposal)
        kept = proposal.kept(walk, choices.best)
        if trace is not None:
            trace.verified(rows[:len(walk)], len(proposal), len(walk) - 1)
        if is_tree:
            target.keep_path(walk)
        else:
            target.truncate(n_past + len(walk))
        drafts.keep(n_past + len(walk))
        if plan.crops_at_budget:
            kept = kept[:tally.max_new_tokens - len(tally.output)]
        tally.observe(len(proposal), kept, choices.rows(walk) if is_tree else choices, len(batch),
                      step=bool(proposal.tokens) or plan.empty_is_step)
        context += kept
        previous = (len(proposal), len(walk) - 1)
    return tally.generation(start, prefilled, drafts.calls)
