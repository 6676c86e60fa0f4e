"""Every schedule crossrt knows, simulated on one oracle (crossrt/simulate/oracle.py): the counts a
real greedy run of that schedule makes with its drafting rules, step for step. The one loop's
schedules (crossrt/speculative/schedules.py) are run by the loop itself on the oracle (run_loop), so a
change to one is simulated as written. Two are read from another runtime's source
(docs/analysis.md gives the lines):

- exllamav3 (exllamav3 1.6.5's Generator with a drafter model, dynamic_draft_tokens off, as
  crossrt's exllamav3 runtime runs it): prefill prompt[:-1], every round verifies a window of k
  (never cut to the budget); position by position the target's token is checked for a stop
  token and the budget first, then against the draft; a stop ends the round and the window's
  unresolved positions count as rejected.
- exllamav3-dynamic: the same with dynamic_draft_tokens on (draft_confidence 0.4, its default),
  so a draft stops once the running product of per-position acceptance estimates falls below
  0.4; the estimates come from an online calibrator of the drafter's top logit against the
  verified outcomes (DraftCalibration), new for each prompt, as crossrt's runtime starts a
  Generator per generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from crossrt.errors import ComparisonError, SettingsError
from crossrt.run.runtime import DraftRules
from crossrt.speculative.schedules import HF_SCHEDULE, LLAMA_SCHEDULES, SCHEDULE, SERVER, SPEC_SIMPLE, VLLM
from crossrt.records.counts import Counts
from crossrt.records.schema import Counters, RunRecord
from crossrt.simulate.oracle import Oracle, SimRun, by_category, run_loop

EXLLAMAV3 = "exllamav3"
EXLLAMAV3_DYNAMIC = "exllamav3-dynamic"
SIMULATED = (SCHEDULE, HF_SCHEDULE, SPEC_SIMPLE, SERVER, EXLLAMAV3, EXLLAMAV3_DYNAMIC, VLLM)
DRAFT_CONFIDENCE = 0.4  # exllamav3 1.6.5's Generator default (generator.py:67)


def check_rules(schedule: str, rules: DraftRules, oracle_k: Optional[int] = None) -> None:
    """SettingsError unless schedule is simulated with rules (on an oracle of oracle_k drafts)."""
    if schedule not in SIMULATED:
        raise SettingsError(f"schedule {schedule!r} is not simulated; simulated: {', '.join(SIMULATED)}")
    if schedule not in LLAMA_SCHEDULES and not rules.fixed:
        raise SettingsError(f"the {schedule} schedule drafts exactly k tokens: n_min and p_min are llama.cpp "
                            "drafting rules, for the llama-* schedules")
    if oracle_k is not None and rules.k > oracle_k:
        raise SettingsError(f"k={rules.k} is beyond the oracle's {oracle_k} draft tokens per position")


def simulate_schedule(oracle: Oracle, schedule: str, rules: DraftRules) -> SimRun:
    """schedule's run on oracle with rules (module docstring)."""
    check_rules(schedule, rules, oracle.max_k)
    if schedule in _SIMULATORS:
        return _SIMULATORS[schedule](oracle, rules)
    return run_loop(oracle, schedule, rules)


def _run(oracle: Oracle, output: Sequence[int], drafted: Sequence[int], accepted: Sequence[int]) -> SimRun:
    return SimRun(oracle.prompt_id, oracle.category, tuple(drafted), tuple(accepted), None, tuple(output))


def _exllamav3(oracle: Oracle, rules: DraftRules) -> SimRun:
    y, budget, eog, k = oracle.output, oracle.max_new_tokens, oracle.eog_ids, rules.k
    accepted = []
    e = 0
    while e < len(y):
        window = oracle.drafts[e]
        n = 0  # a stop token or the budget ends the round before the token is compared
        while n < k and y[e + n] not in eog and e + n + 1 < budget and window[n] == y[e + n]:
            n += 1
        accepted.append(n)
        e += n + 1
    return _run(oracle, y, [k] * len(accepted), accepted)


class DraftCalibration:
    """exllamav3 1.6.5's mapping from a drafter's confidence score to an acceptance estimate
    (generator/draft_confidence.py, DraftConfidenceCalibrator, at its defaults): scores fall in
    bins of width 1, each holding decayed (tested, accepted) counts; every count decays by
    0.995 per round. Before 64 labels in all, or with no bin of 8 tested, the estimate is 1; then
    it is the acceptance rate of the nearest bin of 8 or more at or below the score, else of the
    lowest such bin."""

    WIDTH, DECAY, MIN_COUNT, BURN_IN = 1.0, 0.995, 8.0, 64.0

    def __init__(self):
        self.bins: dict[int, list[float]] = {}
        self.total = 0.0

    def label(self, score: float, *, accepted: bool) -> None:
        counts = self.bins.setdefault(math.floor(score / self.WIDTH), [0.0, 0.0])
        counts[0] += 1.0
        counts[1] += float(accepted)
        self.total += 1.0

    def decay(self) -> None:
        for counts in self.bins.values():
            counts[0] *= self.DECAY
            counts[1] *= self.DECAY
        self.total *= self.DECAY

    def estimate(self, score: float) -> float:
        populated = sorted(b for b, (tested, _) in self.bins.items() if tested >= self.MIN_COUNT)
        if self.total < self.BURN_IN or not populated:
            return 1.0
        below = [b for b in populated if b <= math.floor(score / self.WIDTH)]
        tested, accepted = self.bins[below[-1] if below else populated[0]]
        return accepted / tested


def _exllamav3_dynamic(oracle: Oracle, rules: DraftRules) -> SimRun:
    """generator.py:1129-1145 cuts the window, 2018-2039 labels the verified positions."""
    y, budget, eog, k = oracle.output, oracle.max_new_tokens, oracle.eog_ids, rules.k
    calibration = DraftCalibration()
    drafted, accepted = [], []
    e = 0
    while e < len(y):
        scores = [float(score) for score in oracle.draft_top[e, :k]]
        window, reach = k, 1.0
        for index, score in enumerate(scores):
            reach *= calibration.estimate(score)
            if index + 1 < window and reach < DRAFT_CONFIDENCE:
                window = index + 1
                break
        draft = oracle.drafts[e, :window]
        n = 0  # as _exllamav3, in the cut window
        while n < window and y[e + n] not in eog and e + n + 1 < budget and draft[n] == y[e + n]:
            n += 1
        for score in scores[:n]:
            calibration.label(score, accepted=True)
        if n < window:  # the position that ended the round: its draft token against what was emitted there
            calibration.label(scores[n], accepted=draft[n] == y[e + n])
        calibration.decay()
        drafted.append(window)
        accepted.append(n)
        e += n + 1
    return _run(oracle, y, drafted, accepted)


_SIMULATORS = {EXLLAMAV3: _exllamav3, EXLLAMAV3_DYNAMIC: _exllamav3_dynamic}


def record_rules(record: RunRecord) -> DraftRules:
    """The drafting rules a record ran with (an unknown n_min or p_min: llama.cpp's fixed k)."""
    params = record.params
    return DraftRules(params.k, params.draft_n_min, params.draft_p_min or 0.0)


def compare_with_record(oracles: Sequence[Oracle], record: RunRecord) -> tuple[int, list[str]]:
    """(prompts compared, differences) between the simulation of the record's schedule and
    rules and the record's finished prompts: output ids, then the per-step lengths where the
    record has them, else its totals. The oracles must have the record's token budget."""
    try:
        rules = record_rules(record)
        check_rules(record.params.schedule, rules)
    except SettingsError as error:
        raise ComparisonError(f"cannot simulate this record: {error}") from None
    by_id = {oracle.prompt_id: oracle for oracle in oracles}
    compared, differences = 0, []
    for result in record.results:
        oracle = by_id.get(result.prompt_id)
        if not result.ok or oracle is None:
            continue
        if oracle.max_new_tokens != record.params.max_new_tokens or oracle.prompt_ids != tuple(result.prompt_ids):
            raise ComparisonError(f"{result.prompt_id}: the record ran another prompt or token budget than the oracle")
        compared += 1
        run = simulate_schedule(oracle, record.params.schedule, rules)
        difference = _difference(run.counters(rules.k), result.counters, tuple(result.output_ids) == run.output)
        if difference:
            differences.append(f"{result.prompt_id}: {difference}")
    return compared, differences


COMPARED = ("steps", "drafted", "accepted", "emitted", "unverified", "cut", "accepted_per_pos")


def _difference(simulated: Counters, measured: Counters, same_output: bool) -> Optional[str]:
    if not same_output:
        return "the record's output differs from the target's greedy output"
    names = COMPARED + (("step_drafted", "step_accepted") if measured.step_drafted is not None else ())
    differ = [name for name in names if getattr(simulated, name) != getattr(measured, name)]
    if not differ:
        return None
    return "simulated " + ", ".join(f"{name} {getattr(simulated, name)}" for name in differ) + "; measured " + \
        ", ".join(f"{name} {getattr(measured, name)}" for name in differ)


@dataclass(frozen=True, kw_only=True)
class ScheduleResult(Counts):
    """A schedule's summed counts at one k over one group of prompts (category None: all)."""

    schedule: str
    k: int
    n_min: int
    p_min: float
    category: Optional[str]
    prompts: int
    unverified: int
    cut: int

    def as_json(self) -> dict[str, Any]:
        """Flat, in the simulation JSON's order: the schedule and group, counts, then tau and alpha."""
        return {"schedule": self.schedule, "k": self.k, "n_min": self.n_min, "p_min": self.p_min,
                "category": self.category, "prompts": self.prompts, **self.counted(), "unverified": self.unverified,
                "cut": self.cut, "tau": self.tau, "alpha": self.alpha}


def summarize_schedule(oracles: Sequence[Oracle], schedule: str, rules: DraftRules) -> list[ScheduleResult]:
    """schedule with rules on every oracle: one result per category (sorted), then overall."""
    counted = [(oracle.category, simulate_schedule(oracle, schedule, rules).counters(rules.k)) for oracle in oracles]
    results = []
    for category, group in by_category(counted, lambda pair: pair[0]):
        counts = sum((c for _, c in group), Counts())
        results.append(ScheduleResult(**counts.counted(), schedule=schedule, k=rules.k, n_min=rules.n_min,
                                      p_min=rules.p_min, category=category, prompts=len(group),
                                      unverified=sum(c.unverified for _, c in group), cut=sum(c.cut for _, c in group)))
    return results
