"""How a run drafted, replayed on an oracle (crossrt/simulate/oracle.py): with the pair's drafter
model, read from the oracle's draft rows (crossrt/simulate/schedules.py), or by lookup
(crossrt/run/lookup/), replayed step by step here.

A lookup proposes from the context alone, and some keep state between calls (llama.cpp's
hit-counted n-gram maps are told what was accepted), so its drafts cannot be read from rows made
ahead of time at every position: the replay builds a fresh lookup per prompt, as the one loop
does, and calls it as the loop calls it (crossrt/run/loop.py: propose at the schedule's cap,
mirror under llama.cpp's schedules, keep), with the run stage's own schedule (its start, each
draft's cap, when it is done), Tally and greedy acceptance. The target's choices come from the
oracle: after prompt + output[:e] + a draft's first i tokens, while those match the greedy
output, the target chooses extended[e + i]; greedy verification reads nothing past the first
mismatch. So the replay is a real run's steps wherever the loop runs that lookup
(tests/test_tau_gap_lookup.py holds them against driven runs step for step), and under a schedule
the loop does not run it with (llama-ngram-simple under hf-assisted) the same calls are the
what-if a tau gap's drafter algorithm part reads. n_min and p_min are draft-model rules: the
loop never applies them to a lookup, nor does the replay.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from crossrt.errors import SettingsError
from crossrt.records.schema import RunRecord
from crossrt.run.acceptance import Greedy, Proposal
from crossrt.run.lookup import LOOKUPS, LookupSettings
from crossrt.run.numerics import Choices
from crossrt.run.runtime import DraftRules, Rows
from crossrt.run.schedules import HF_SCHEDULE, SCHEDULE, SCHEDULE_TYPES, SERVER, SPEC_SIMPLE, Tally
from crossrt.simulate.oracle import Oracle, SimRun
from crossrt.simulate.schedules import check_rules, record_rules, simulate_schedule

MODEL = "model"
# The schedules whose loop the replay follows: a lookup run under another (a runtime's own,
# added later) is refused rather than replayed as if it were one of these.
REPLAYED = (SCHEDULE, HF_SCHEDULE, SPEC_SIMPLE, SERVER)


@dataclass(frozen=True)
class Drafting:
    """What proposed a run's drafts: the pair's drafter model (MODEL), or a lookup of LOOKUPS with
    its n-gram lengths (k is the rules', so a part of the schedule and rules)."""

    name: str
    ngram_max: Optional[int] = None
    ngram_min: int = 1

    @property
    def label(self) -> str:
        if self.name == MODEL:
            return "drafter model"
        return LOOKUPS[self.name].label.format(ngram_max=self.ngram_max, ngram_min=self.ngram_min)


def record_drafting(record: RunRecord) -> Drafting:
    """How record drafted, or SettingsError naming a drafting that has no replay: a tree, a native
    spec type with no lookup of LOOKUPS that reproduces it (the record states a reproduced one as
    its drafting, as llama-server's ngram-simple record states llama-ngram-simple)."""
    params = record.params
    if params.drafting in LOOKUPS:
        if params.ngram_max is None:
            raise SettingsError(f"drafts by {params.drafting} without a stated ngram_max")
        return Drafting(params.drafting, params.ngram_max, params.ngram_min or 1)
    if params.drafting == "tree":
        raise SettingsError(f"drafts a tree ({params.tree}), which the simulation does not replay")
    if params.spec_type != "draft":
        raise SettingsError(f"drafts by spec type {params.spec_type}, which no lookup of crossrt/run/lookup "
                            "reproduces")
    return Drafting(MODEL)


def check_drafting(schedule: str, rules: DraftRules, drafting: Drafting) -> None:
    """SettingsError unless drafting is simulated under schedule with rules."""
    if drafting.name == MODEL:
        check_rules(schedule, rules)
    elif schedule not in REPLAYED:
        raise SettingsError(f"schedule {schedule!r}: a lookup's run is replayed under {', '.join(REPLAYED)} only")
    elif getattr(LOOKUPS[drafting.name], "per_run", False):  # Lookup.per_run, where the table has it
        raise SettingsError(f"{drafting.name} keeps its state from prompt to prompt, and a run is replayed prompt "
                            "by prompt")


def simulate_drafting(oracle: Oracle, schedule: str, rules: DraftRules, drafting: Drafting) -> SimRun:
    """schedule's run with rules and drafting on oracle."""
    if drafting.name == MODEL:
        return simulate_schedule(oracle, schedule, rules)
    check_drafting(schedule, rules, drafting)
    if rules.k >= len(oracle.beyond):
        raise SettingsError(f"k={rules.k} reaches past the oracle's {len(oracle.beyond)} tokens beyond its output")
    return _replay(oracle, schedule, rules.k, drafting)


def simulate_record(oracle: Oracle, record: RunRecord) -> SimRun:
    """The record's schedule, rules and drafting on oracle."""
    return simulate_drafting(oracle, record.params.schedule, record_rules(record), record_drafting(record))


class _Replayed:
    """The target as the replay sees it: a position count for the schedule's caps (n_ctx never
    binds: a real run refuses a prompt where it would) and its choices read from the oracle."""

    n_ctx = sys.maxsize

    def __init__(self, oracle: Oracle):
        self.oracle, self.n_past = oracle, 0

    def truncate(self, n_keep: int) -> None:
        self.n_past = min(self.n_past, n_keep)

    def eval(self, tokens: Sequence[int], rows: Rows) -> np.ndarray:
        """A schedule's prefill: llama-server's first token from the prompt pass, one row."""
        self.n_past += len(tokens)
        if rows == Rows.NONE:
            return np.empty((0, 0), dtype=np.float32)
        first = self.oracle.extended[0]
        row = np.zeros((1, max(first + 1, 2)), dtype=np.float32)
        row[0, first] = 1.0
        return row

    def verify(self, context: Sequence[int], draft: Sequence[int]) -> Choices:
        """The target's choice at each position of [last] + draft (-1 past a mismatch, never read)."""
        self.n_past = len(context) + len(draft)
        e, y = len(context) - len(self.oracle.prompt_ids), self.oracle.extended
        matched = next((i for i, token in enumerate(draft) if token != y[e + i]), len(draft))
        best = np.array([y[e + i] for i in range(matched + 1)] + [-1] * (len(draft) - matched))
        n = len(best)
        return Choices(best, np.full(n, -1), np.zeros(n, dtype=np.float32), ((),) * n, ((),) * n)


def _replay(oracle: Oracle, schedule: str, k: int, drafting: Drafting) -> SimRun:
    """The one loop's steps at fixed k with greedy acceptance (crossrt/run/loop.py's
    speculative_generate), the lookup called as it calls it."""
    plan = SCHEDULE_TYPES[schedule]()
    eog = oracle.eog_ids
    lookup = LOOKUPS[drafting.name].build(LookupSettings(drafting.ngram_max, drafting.ngram_min, k, eog,
                                                         eog if plan.ends_at_eos else frozenset()))
    target = _Replayed(oracle)
    tally = Tally(oracle.max_new_tokens, eog)
    accept = Greedy(eog, eos_last=plan.llama)
    context = plan.start(target, lookup, oracle.prompt_ids, tally)
    while not plan.done(tally):
        n_max = plan.n_max(target, tally, k)
        proposal: Proposal = lookup.propose(context, k if lookup.past_budget and n_max > 0 else n_max)
        n_past = len(context) - 1
        batch = [context[-1], *proposal.tokens]
        if plan.llama:
            lookup.mirror(n_past, batch)
        choices = target.verify(context, proposal.tokens)
        walk = accept.walk(np.empty(0), choices, proposal)
        kept = proposal.kept(walk, choices.best)
        target.truncate(n_past + len(walk))
        lookup.keep(n_past + len(walk))
        if plan.crops_at_budget:
            kept = kept[:tally.max_new_tokens - len(tally.output)]
        tally.observe(len(proposal), kept, choices, len(batch), step=bool(proposal.tokens) or plan.empty_is_step)
        context += kept
    run = tally.generation(0.0, 0.0, lookup.calls)
    return SimRun(oracle.prompt_id, oracle.category, run.step_drafted, run.step_accepted, None, run.output_ids,
                  run.unverified, run.cut)
