"""How a run drafted, replayed on an oracle (crossrt/simulate/oracle.py): with the pair's drafter
model or its head, read from the oracle's draft rows, or by lookup (crossrt/speculative/lookup/), run by the one loop
on the oracle's target (oracle.run_loop) as a driven run builds and calls it: a fresh lookup per
prompt, or one for a run's prompts in order where its state outlives a prompt under the schedule
(Lookup.kept_across_prompts, loop.run_lookup). So the replay is a real run's steps wherever the
loop runs that lookup (tests/test_tau_gap_lookup.py holds them against driven runs, prompt by
prompt through a run), and under a schedule the loop does not run it with (llama-ngram-simple
under hf-assisted) the same calls are the what-if a tau gap's drafter algorithm part reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from crossrt.errors import SettingsError
from crossrt.records.schema import RunRecord
from crossrt.speculative import loop
from crossrt.speculative.lookup import LOOKUPS
from crossrt.run.runtime import DraftRules
from crossrt.speculative.schedules import SCHEDULES
from crossrt.speculative.strategies import Strategy
from crossrt.simulate.oracle import Oracle, SimRun, run_loop
from crossrt.simulate.schedule_sims import check_rules, record_rules, simulate_schedule

MODEL = "model"
HEAD_LABELS = {"eagle3": "EAGLE3 head", "dflash": "DFlash drafter"}  # HEAD_SPEC_TYPES, replayed from head rows


@dataclass(frozen=True)
class Drafting:
    """What proposed a run's drafts: the pair's drafter model (MODEL), its head (a spec type of
    HEAD_LABELS), or a lookup of LOOKUPS with its n-gram lengths (k is the rules', so a part of the
    schedule and rules)."""

    name: str
    ngram_max: Optional[int] = None
    ngram_min: int = 1

    @property
    def label(self) -> str:
        if self.name == MODEL:
            return "drafter model"
        if self.name in HEAD_LABELS:
            return HEAD_LABELS[self.name]
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
    if params.spec_type in HEAD_LABELS:
        return Drafting(params.spec_type)
    if params.spec_type != "draft":
        raise SettingsError(f"drafts by spec type {params.spec_type}, which no lookup of crossrt/speculative/lookup "
                            "reproduces")
    return Drafting(MODEL)


def check_drafting(schedule: str, rules: DraftRules, drafting: Drafting) -> None:
    """SettingsError unless drafting is simulated under schedule with rules."""
    if drafting.name == MODEL:
        check_rules(schedule, rules)
    elif drafting.name in HEAD_LABELS:
        if schedule not in SCHEDULES:
            raise SettingsError(f"schedule {schedule!r}: a head's run is replayed under {', '.join(SCHEDULES)} only")
        check_rules(schedule, rules)
    elif schedule not in SCHEDULES:
        raise SettingsError(f"schedule {schedule!r}: a lookup's run is replayed under {', '.join(SCHEDULES)} only")


def per_run(drafting: Drafting, schedule: str) -> bool:
    """Whether one lookup serves a run's prompts under schedule (Lookup.kept_across_prompts, as
    loop.run_lookup), so such a run is replayed as a whole."""
    return drafting.name in LOOKUPS and LOOKUPS[drafting.name].kept_across_prompts(schedule)


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
    if drafting.name in HEAD_LABELS:
        unheaded = next((oracle for oracle in oracles if not oracle.head or rules.k > oracle.max_k), None)
        if unheaded is not None:
            raise SettingsError(f"the oracle of {unheaded.prompt_id} holds no {drafting.label}'s {rules.k}-token drafts")
        return [run_loop(oracle, schedule, rules, n_ctx=n_ctx) for oracle in oracles]
    short = next((oracle for oracle in oracles if rules.k >= len(oracle.beyond)), None)
    if short is not None:
        raise SettingsError(f"k={rules.k} reaches past the oracle's {len(short.beyond)} tokens beyond its output")
    strategy = Strategy(drafting.name, ngram_max=drafting.ngram_max, ngram_min=drafting.ngram_min)
    kept = loop.run_lookup(strategy, rules, schedule, oracles[0].eog_ids) if oracles else None
    return [run_loop(oracle, schedule, rules, strategy, n_ctx=n_ctx, drafts=kept) for oracle in oracles]


def simulate_record(record: RunRecord, oracles: Mapping[tuple[int, ...], Oracle]) -> list[SimRun]:
    """The record's finished prompts, in its results' order, replayed with its schedule, rules,
    drafting and n_ctx; oracles maps prompt ids to their oracle (compare/tau_gap.build_oracles)."""
    runs = [oracles[tuple(result.prompt_ids)] for result in record.results if result.ok]
    return simulate_sequence(runs, record.params.schedule, record_rules(record), record_drafting(record),
                             record.params.n_ctx)
