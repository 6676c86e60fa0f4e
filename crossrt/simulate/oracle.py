"""The oracle of a prompt, the one loop run on it (run_loop), the what-ifs of the "crossrt"
schedule, and a measured cost model to turn counts into predicted speedups (docs/analysis.md).

The oracle is the target's greedy output and, from every position j of it (and the one after
its end), the drafter's greedy continuation of prompt + output[:j], K tokens, with the
target's greedy tokens past the output's end (schedules that verify drafts there count them).
Greedy decoding makes every schedule a function of these alone, so run_loop runs
loop.speculative_generate on them (crossrt/simulate/oracle_sessions.py) and counts what a
real run at any k <= K counts, exactly, as long as the oracle's passes pick the same argmax
as the run's (a near-tie could flip between batch shapes; tests check the tiny pair).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from statistics import median
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

import numpy as np

from crossrt.speculative import loop
from crossrt.errors import SettingsError
from crossrt.speculative.drafters import Drafter
from crossrt.run.runtime import DraftRules, ModelSession, Rows
from crossrt.speculative.schedules import Generation, check_prompt, top_probability
from crossrt.speculative.strategies import Strategy
from crossrt.records.counts import Counts
from crossrt.records.metrics import Totals
from crossrt.records.schema import Counters
from crossrt.records.trace import top1_probability
from crossrt.simulate.head_rows import head_rows
from crossrt.simulate.oracle_sessions import OracleDrafter, OracleTarget

CHUNK = 64  # tokens per drafter pass when the oracle scores the whole output at once


@dataclass(frozen=True, eq=False)
class Oracle:
    prompt_id: str
    category: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    output: tuple[int, ...]  # the target's greedy output, EOS included when it stopped on it
    drafts: np.ndarray  # int32 (len(output) + 1, K): row j drafts after prompt + output[:j]; K 0 without a drafter
    draft_p1: np.ndarray  # float32, same shape: the drafter's top-1 probability of each (full softmax)
    eog_ids: frozenset[int]
    # The target's greedy tokens after output, EOS or not (K + 1 of them): a step that overshoots
    # the budget (llama-spec-simple) or verifies past an EOS (vLLM) is judged on them.
    beyond: tuple[int, ...] = ()
    # float32, as drafts: llama.cpp's top-10 softmax probability of each (its p_min test)
    draft_p10: Optional[np.ndarray] = None
    # float32, as drafts: the drafter's top logit at each (exllamav3's draft confidence score)
    draft_top: Optional[np.ndarray] = None
    head: bool = False  # the drafts are a head's (simulate/head_rows.py), proposed under a head's rules

    @property
    def max_k(self) -> int:
        return self.drafts.shape[1]

    @property
    def extended(self) -> tuple[int, ...]:
        """The target's greedy choices from the first output position on, past the output too."""
        return self.output + self.beyond


def build_oracle(target: ModelSession, drafter: Optional[ModelSession], prompt_id: str, category: str,
                 prompt_ids: Sequence[int], max_new_tokens: int, max_k: int,
                 head: Optional[tuple[str, Any]] = None) -> Oracle:
    """The oracle of one prompt. The drafter scores prompt + output in one pass (the first
    draft token of every position), then, from the last position back so that each needs only
    a truncation, continues each position one token at a time, or takes the next position's
    row where its first token is the target's. Without a drafter, the target's part alone (no
    draft rows): what a lookup's replay reads (crossrt/simulate/drafting.py). head: (spec type,
    loaded head), drafting from the target's features instead (crossrt/simulate/head_rows.py)."""
    prompt_ids = tuple(prompt_ids)
    sessions = [target] if drafter is None else [target, drafter]
    # A draft from the row after the output reaches K tokens past it, and its check K + 1.
    check_prompt(prompt_ids, max_new_tokens, sessions, overrun=max_k + 1)
    output = loop.greedy_generate(target, prompt_ids, max_new_tokens).output_ids
    beyond = []
    for _ in range(max_k + 1):  # the target's cache holds prompt + output[:-1] after greedy_generate
        beyond.append(int(target.eval(((output + tuple(beyond))[-1],), Rows.LAST)[0].argmax()))
    n = len(output) + 1
    if head is not None:
        drafts, p1, p10 = head_rows(target, *head, prompt_ids, output, max_k)
        return Oracle(prompt_id, category, prompt_ids, max_new_tokens, output, drafts, p1, target.eog_ids,
                      tuple(beyond), p10, head=True)
    if drafter is None:
        return Oracle(prompt_id, category, prompt_ids, max_new_tokens, output, np.zeros((n, 0), dtype=np.int32),
                      np.zeros((n, 0), dtype=np.float32), target.eog_ids, tuple(beyond))
    drafts = np.full((n, max_k), -1, dtype=np.int32)
    draft_p1 = np.full((n, max_k), np.nan, dtype=np.float32)
    draft_p10 = np.full((n, max_k), np.nan, dtype=np.float32)
    draft_top = np.full((n, max_k), np.nan, dtype=np.float32)

    def keep(j: int, i: int, row: np.ndarray) -> int:
        drafts[j, i] = int(row.argmax())
        draft_p1[j, i] = top1_probability(row)
        draft_p10[j, i] = top_probability(row)
        draft_top[j, i] = row[drafts[j, i]]
        return int(drafts[j, i])

    base = len(prompt_ids) - 1
    drafter.truncate(0)
    drafter.eval(prompt_ids[:-1], Rows.NONE)
    lasts = (prompt_ids[-1],) + output  # the last token of each position's context
    for start in range(0, n, CHUNK):
        rows = drafter.eval(lasts[start:start + CHUNK], Rows.ALL)
        for offset, row in enumerate(rows):
            keep(start + offset, 0, row)
    for j in reversed(range(n)):
        if j + 1 < n and drafts[j, 0] == output[j]:
            # Its first token is the target's, so the rest continues prompt + output[:j + 1]:
            # the next row, already drafted (the drafter's passes shrink by its acceptance).
            for array in (drafts, draft_p1, draft_p10, draft_top):
                array[j, 1:] = array[j + 1, :-1]
            continue
        drafter.truncate(base + 1 + j)
        token = int(drafts[j, 0])
        for i in range(1, max_k):
            token = keep(j, i, drafter.eval((token,), Rows.LAST)[0])
    return Oracle(prompt_id, category, prompt_ids, max_new_tokens, output, drafts, draft_p1, target.eog_ids,
                  tuple(beyond), draft_p10, draft_top)


@dataclass(frozen=True)
class Policy:
    """Draft up to k tokens; with min_p1 > 0, stop before a token whose drafter top-1
    probability is below min_p1."""

    k: int
    min_p1: float = 0.0

    @property
    def label(self) -> str:
        return f"k={self.k}" + (f" p1>={self.min_p1:g}" if self.min_p1 > 0 else "")


@dataclass(frozen=True)
class SimRun:
    """One prompt simulated on the oracle (under a policy, a tree or a schedule and its rules):
    what a real run would count and, where known, emit."""

    prompt_id: str
    category: str
    step_drafted: tuple[int, ...]
    step_accepted: tuple[int, ...]
    # Drafter passes (lookups): one per draft token, plus one per confidence cut-off (None:
    # exllamav3's simulators, which do not count them).
    drafter_calls: Optional[int] = None
    output: Optional[tuple[int, ...]] = None  # the emitted ids (None: a tree's simulation)
    unverified: int = 0  # tokens emitted outside steps, and counted but dropped (schema.Counters)
    cut: int = 0

    @classmethod
    def of(cls, generation: Generation, prompt_id: str, category: str) -> "SimRun":
        """What a run of the one loop counted and emitted, real or on an oracle (run_loop)."""
        return cls(prompt_id, category, generation.step_drafted, generation.step_accepted, generation.drafter_calls,
                   generation.output_ids, generation.unverified, generation.cut)

    @property
    def steps(self) -> int:
        return len(self.step_drafted)

    @property
    def drafted(self) -> int:
        return sum(self.step_drafted)

    @property
    def accepted(self) -> int:
        return sum(self.step_accepted)

    @property
    def emitted(self) -> int:
        return self.steps + self.accepted + self.unverified - self.cut

    @property
    def counts(self) -> Counts:
        """The four counts of this run, to sum over a group."""
        return Counts(self.steps, self.drafted, self.accepted, self.emitted)

    def counters(self, k: int) -> Counters:
        """The record's counters of this run; CountsDoNotAddUp where a schedule simulator's
        output and its counts disagree (a bug in the simulator)."""
        emitted = len(self.output) if self.output is not None else self.emitted
        return Counters.from_steps(self.step_drafted, self.step_accepted, emitted, k, self.unverified, self.cut)


def run_loop(oracle: Oracle, schedule: str, rules: DraftRules, strategy: Strategy = Strategy(), *,
             min_p1: Optional[float] = None, n_ctx: Optional[int] = None, drafts: Optional[Drafter] = None,
             detokenize: Optional[Callable[[Sequence[int]], str]] = None) -> SimRun:
    """loop.speculative_generate run on oracle with schedule, rules and strategy: the target and a
    drafter model read from it (crossrt/simulate/oracle_sessions.py), a lookup built by the loop
    or handed to it (drafts: one serving a run's prompts); min_p1: the drafter's confidence stop,
    where not the strategy's (a what-if cut-off past 1 drafts nothing); n_ctx: the run's context,
    where the schedule cuts drafts at it; detokenize: the target's, for a content k policy."""
    target = OracleTarget(oracle.prompt_ids, oracle.extended, oracle.eog_ids, n_ctx, detokenize)
    if drafts is None and not strategy.looks_up:
        stops = loop.chain_stops(schedule, rules, strategy.min_p1 if min_p1 is None else min_p1, oracle.eog_ids)
        drafts = OracleDrafter(len(oracle.prompt_ids), oracle.drafts, oracle.draft_p10, oracle.draft_p1, stops,
                               (rules.k, rules.n_min) if oracle.head else None)
    run = loop.speculative_generate(target, None, oracle.prompt_ids, rules, oracle.max_new_tokens, schedule,
                                    strategy=strategy, drafts=drafts, what_if=True)
    return SimRun.of(run, oracle.prompt_id, oracle.category)


def simulate(oracle: Oracle, policy: Policy) -> SimRun:
    """The crossrt schedule's run on oracle under policy."""
    if policy.k > oracle.max_k:
        raise SettingsError(f"k={policy.k} is beyond the oracle's {oracle.max_k} draft tokens per position")
    return run_loop(oracle, loop.SCHEDULE, DraftRules(policy.k), min_p1=policy.min_p1)


@dataclass(frozen=True)
class CostModel:
    """Measured seconds: verify_s[r - 1] is one target pass over r tokens returning r rows
    (argmax included), draft_s one drafter pass over one token returning its row. A step
    drafting d tokens with c drafter passes costs c * draft_s + verify_s[d]; plain greedy
    decoding costs verify_s[0] per token."""

    verify_s: tuple[float, ...]
    draft_s: float

    @property
    def ratio(self) -> float:
        """Leviathan et al.'s c: a drafter pass over a one-row target pass."""
        return self.draft_s / self.verify_s[0]

    def speculative_s(self, run: SimRun) -> float:
        return run.drafter_calls * self.draft_s + sum(self.verify_s[d] for d in run.step_drafted)

    def plain_s(self, tokens: int) -> float:
        return tokens * self.verify_s[0]


def measure_costs(target: ModelSession, drafter: ModelSession, context: Sequence[int], max_rows: int,
                  rounds: int = 3, block: int = 5) -> CostModel:
    """Median times of passes right after context (attention cost grows with it), fed its
    last tokens. Each shape is timed in a block of repeated passes after one untimed pass:
    runtimes reuse their compute graph while the batch shape stays the same (llama.cpp does),
    as in the loop's steady state, and rebuild it when it changes. The blocks of all shapes
    repeat over rounds, so that load drifts hit them alike."""
    context = list(context)
    base = len(context)
    tokens = (context[-max_rows:] * max_rows)[:max_rows]
    verify: list[list[float]] = [[] for _ in range(max_rows)]
    draft: list[float] = []
    for session in (target, drafter):
        session.truncate(0)
        session.eval(context, Rows.NONE)
    for _ in range(rounds):
        for rows in range(1, max_rows + 1):
            verify[rows - 1] += _timed(target, tokens[:rows], Rows.ALL, base, block)
        draft += _timed(drafter, tokens[:1], Rows.LAST, base, block)
    return CostModel(tuple(median(times) for times in verify), median(draft))


def _timed(session: ModelSession, tokens: Sequence[int], rows: Rows, keep: int, block: int) -> list[float]:
    times = []
    for _ in range(block + 1):
        start = time.perf_counter()
        session.eval(tokens, rows).argmax(axis=1)
        times.append(time.perf_counter() - start)
        session.truncate(keep)
    return times[1:]


@dataclass(frozen=True, kw_only=True)
class PolicyResult(Counts):
    """A policy's summed counts over one group of prompts (category None: all of them), and
    the speedup the cost model predicts over plain greedy decoding."""

    policy: str
    category: Optional[str]
    prompts: int
    drafter_calls: int
    speedup: Optional[float]

    def as_json(self) -> dict[str, Any]:
        """Flat, in the simulation JSON's order: labels, counts, drafter calls, then the rates."""
        return {"policy": self.policy, "category": self.category, "prompts": self.prompts, **self.counted(),
                "drafter_calls": self.drafter_calls, "tau": self.tau, "alpha": self.alpha, "speedup": self.speedup}


T = TypeVar("T")


def by_category(items: Sequence[T], category: Callable[[T], str]) -> list[tuple[Optional[str], list[T]]]:
    """items per category (sorted), then all of them (category None): the groups of every
    per-category table the simulations sum."""
    return [(name, [item for item in items if name is None or category(item) == name])
            for name in [*sorted({category(item) for item in items}), None]]


def summarize(runs: Sequence[SimRun], costs: CostModel, label: str) -> list[PolicyResult]:
    """One result per category (sorted), then one over every run (category None)."""
    results = []
    for category, group in by_category(runs, lambda run: run.category):
        counts = sum((run.counts for run in group), Counts())
        # The record's metrics over the cost model's seconds: its speedup is the predicted one.
        totals = Totals(**counts.counted(), decode_s=sum(costs.speculative_s(run) for run in group),
                        baseline_tokens=counts.emitted, baseline_decode_s=costs.plain_s(counts.emitted))
        results.append(PolicyResult(**counts.counted(), policy=label, category=category, prompts=len(group),
                                    drafter_calls=sum(run.drafter_calls for run in group), speedup=totals.speedup))
    return results


@dataclass(frozen=True)
class BestK:
    category: Optional[str]
    k: int
    tau: Optional[float]
    speedup: Optional[float]


@dataclass(frozen=True)
class Simulation:
    costs: CostModel
    by_k: tuple[tuple[PolicyResult, ...], ...]  # [k - 1]: fixed k, per category then overall
    best_k: tuple[BestK, ...]  # per category then overall: the k of highest predicted speedup
    per_category_k: tuple[PolicyResult, ...]  # each category at its best k; then all of them
    thresholds: tuple[PolicyResult, ...]  # confidence cut-offs at k = K, per category then overall

    def as_json(self) -> dict[str, Any]:
        """Its fields as `crossrt simulate --out` writes them, each result flat (PolicyResult.as_json)."""
        return {"costs": dataclasses.asdict(self.costs), "by_k": [[r.as_json() for r in group] for group in self.by_k],
                "best_k": [dataclasses.asdict(b) for b in self.best_k],
                "per_category_k": [r.as_json() for r in self.per_category_k],
                "thresholds": [r.as_json() for r in self.thresholds]}


def simulate_suite(oracles: Sequence[Oracle], costs: CostModel, max_k: int,
                   thresholds: Sequence[float] = ()) -> Simulation:
    """Every k up to max_k, the best k per category, the per-category-k policy, and the
    confidence cut-offs at k = max_k."""
    def runs_of(policy_of: Callable[[str], Policy]) -> list[SimRun]:
        return [simulate(oracle, policy_of(oracle.category)) for oracle in oracles]

    by_k = {k: summarize(runs_of(lambda _, k=k: Policy(k)), costs, Policy(k).label) for k in range(1, max_k + 1)}
    best = []
    for index, result in enumerate(by_k[1]):
        # Highest predicted speedup; on a tie the smaller k (less drafter work for the same).
        k = max(by_k, key=lambda k: ((by_k[k][index].speedup or 0.0), -k))
        best.append(BestK(result.category, k, by_k[k][index].tau, by_k[k][index].speedup))
    chosen: Mapping[Optional[str], int] = {b.category: b.k for b in best}
    per_category = summarize(runs_of(lambda c: Policy(chosen[c])), costs, "best k per category")
    cut = [result for p in thresholds
           for result in summarize(runs_of(lambda _, p=p: Policy(max_k, p)), costs, Policy(max_k, p).label)]
    return Simulation(costs, tuple(tuple(by_k[k]) for k in by_k), tuple(best), tuple(per_category), tuple(cut))
