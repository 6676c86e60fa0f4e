"""How a run drafted, replayed on an oracle (crossrt/simulate/oracle.py): with the pair's drafter
model, read from the oracle's draft rows (crossrt/simulate/schedules.py), or by lookup
(crossrt/run/lookup/), replayed step by step here.

A lookup proposes from the context alone, and some keep state between calls (llama.cpp's
hit-counted n-gram maps are told what was accepted), so its drafts cannot be read from rows made
ahead of time at every position: the replay builds its lookups as the run stage does (a fresh
one per prompt, or one for a run's prompts in order where its state outlives a prompt under the
schedule: Lookup.kept_across_prompts, as loop.run_lookup) and calls them as the loop calls them
(crossrt/run/loop.py: propose at the schedule's cap, or the schedule's stand-in draft, mirror
under llama.cpp's schedules, keep), with the run stage's own schedule (its start, each draft's
cap at the run's n_ctx, when it is done), Tally and greedy acceptance (a matched EOS accepted
where the schedule's verifier does so). The target's choices come from the oracle: after
prompt + output[:e] + a draft's first i tokens, while those match the greedy output, the target
chooses extended[e + i]; greedy verification reads nothing past the first mismatch. So the
replay is a real run's steps wherever the loop runs that lookup (tests/test_tau_gap_lookup.py
holds them against driven runs step for step, prompt by prompt through a run), and under a
schedule the loop does not run it with (llama-ngram-simple under hf-assisted) the same calls are
the what-if a tau gap's drafter algorithm part reads. n_min and p_min are draft-model rules: the
loop never applies them to a lookup, nor does the replay.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from crossrt.errors import SettingsError
from crossrt.records.schema import RunRecord
from crossrt.run.acceptance import Greedy, Proposal
from crossrt.run.lookup import LOOKUPS, LookupSettings
from crossrt.run.lookup.base import LookupDrafter
from crossrt.run.numerics import Choices
from crossrt.run.runtime import DraftRules, Rows
from crossrt.run.schedules import HF_SCHEDULE, SCHEDULE, SCHEDULE_TYPES, SERVER, SPEC_SIMPLE, VLLM, Tally
from crossrt.simulate.oracle import Oracle, SimRun
from crossrt.simulate.schedules import check_rules, record_rules, simulate_schedule

MODEL = "model"
# The schedules whose loop the replay follows: a lookup run under another (a runtime's own,
# added later) is refused rather than replayed as if it were one of these.
REPLAYED = (SCHEDULE, HF_SCHEDULE, SPEC_SIMPLE, SERVER, VLLM)


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


def per_run(drafting: Drafting, schedule: str) -> bool:
    """Whether one lookup serves a run's prompts under schedule (Lookup.kept_across_prompts, as
    loop.run_lookup), so such a run is replayed as a whole."""
    return drafting.name != MODEL and LOOKUPS[drafting.name].kept_across_prompts(schedule)


def simulate_drafting(oracle: Oracle, schedule: str, rules: DraftRules, drafting: Drafting,
                      n_ctx: Optional[int] = None) -> SimRun:
    """schedule's run of one prompt with rules and drafting on oracle (a lookup begun afresh);
    n_ctx: the run's context, where the schedule cuts drafts at it (None: it never binds)."""
    return simulate_sequence([oracle], schedule, rules, drafting, n_ctx)[0]


def simulate_sequence(oracles: Sequence[Oracle], schedule: str, rules: DraftRules, drafting: Drafting,
                      n_ctx: Optional[int] = None) -> list[SimRun]:
    """A run of the oracles' prompts in this order: each simulated as simulate_drafting does, but
    through one lookup where the run stage keeps one across prompts (per_run)."""
    if drafting.name == MODEL:
        return [simulate_schedule(oracle, schedule, rules) for oracle in oracles]
    check_drafting(schedule, rules, drafting)
    short = next((oracle for oracle in oracles if rules.k >= len(oracle.beyond)), None)
    if short is not None:
        raise SettingsError(f"k={rules.k} reaches past the oracle's {len(short.beyond)} tokens beyond its output")
    kept = _lookup(oracles[0], schedule, rules.k, drafting) if oracles and per_run(drafting, schedule) else None
    return [_replay(oracle, schedule, rules.k, kept or _lookup(oracle, schedule, rules.k, drafting), n_ctx)
            for oracle in oracles]


def simulate_record(record: RunRecord, oracles: Mapping[tuple[int, ...], Oracle]) -> list[SimRun]:
    """The record's finished prompts, in its results' order, replayed with its schedule, rules,
    drafting and n_ctx; oracles maps prompt ids to their oracle (compare/tau_gap.build_oracles)."""
    runs = [oracles[tuple(result.prompt_ids)] for result in record.results if result.ok]
    return simulate_sequence(runs, record.params.schedule, record_rules(record), record_drafting(record),
                             record.params.n_ctx)


def _lookup(oracle: Oracle, schedule: str, k: int, drafting: Drafting) -> LookupDrafter:
    """The lookup as the loop builds it (loop._drafter)."""
    eog = oracle.eog_ids
    ends = eog if SCHEDULE_TYPES[schedule].ends_at_eos else frozenset()
    return LOOKUPS[drafting.name].build(LookupSettings(drafting.ngram_max, drafting.ngram_min, k, eog, ends))


class _Replayed:
    """The target as the replay sees it: a position count and the run's n_ctx for the schedule's
    caps (vLLM's cut at max_model_len; under llama.cpp's schedules it never binds, since a real run
    refuses a prompt where it would) and its choices read from the oracle."""

    def __init__(self, oracle: Oracle, n_ctx: Optional[int]):
        self.oracle, self.n_past = oracle, 0
        self.n_ctx = sys.maxsize if n_ctx is None else n_ctx

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


def _replay(oracle: Oracle, schedule: str, k: int, lookup: LookupDrafter, n_ctx: Optional[int]) -> SimRun:
    """The one loop's steps at fixed k with greedy acceptance (crossrt/run/loop.py's
    speculative_generate), the lookup called as it calls it."""
    plan = SCHEDULE_TYPES[schedule]()
    eog = oracle.eog_ids
    target = _Replayed(oracle, n_ctx)
    tally = Tally(oracle.max_new_tokens, eog)
    accept = Greedy(frozenset() if plan.accepts_eos else eog, eos_last=plan.llama)
    context = plan.start(target, lookup, oracle.prompt_ids, tally)
    while not plan.done(tally):
        n_max = plan.n_max(target, tally, k)
        stand_in = plan.stand_in(k)
        if stand_in is not None:
            proposal = Proposal.chain(stand_in[:n_max])
        else:
            proposal = lookup.propose(context, k if lookup.past_budget and n_max > 0 else n_max)
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
