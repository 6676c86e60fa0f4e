"""Why tau differs between two records of the same pair and prompts: the gap in tau (and alpha
and steps) as a sum of named parts (counting, rendering, drafter algorithm, schedule and rules,
numerics, residual), each the difference of one quantity computed on two sets of per-prompt
counts that differ in one respect only: the runs' own, and simulations on each run's oracle
(crossrt/simulate/drafting.py). The sum telescopes in exact fractions, so the parts add up to
the gap exactly; the residual is shown, never folded in.
Each part's definition: docs/analysis.md, "Why tau differs: the tau gap".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from crossrt import progress
from crossrt.errors import ComparisonError, CrossrtError, SettingsError
from crossrt.run.isolation import begin_safely
from crossrt.run.runtime import ModelSession, RuntimeOptions, open_runtime
from crossrt.simulate.drafting import (HEAD_LABELS, MODEL, Drafting, check_drafting, per_run, record_drafting,
                                      simulate_sequence)
from crossrt.simulate.schedule_sims import record_rules
from crossrt.records.counts import Counts
from crossrt.records.metrics import ratio
from crossrt.records.schema import Counters, PromptResult, RunRecord
from crossrt.simulate.oracle import Oracle, build_oracle

PARTS = ("counting", "rendering", "drafter algorithm", "schedule and rules", "numerics", "residual")
# Schedules whose runtimes print tokens per step as emitted / steps (first token and cut tokens
# in): exllamav3's new_tokens / rounds, SGLang's completion_tokens / verify_ct (docs/schema.md).
# Every other runtime prints 1 + accepted / steps, as the record's tau.
EMITTED_PER_STEP = ("exllamav3", "sglang")
METRICS = ("tau", "alpha", "steps")

Figure = Optional[Fraction]


def exact_figures(counters: Sequence[Counters], native_schedule: Optional[str] = None) -> dict[str, Figure]:
    """tau, alpha and steps of a set of prompts' summed counters, by the metrics' own formulas
    (crossrt/records/counts.py) over Counts of exact fractions, so the parts of a gap add up to
    it exactly; native_schedule: tau as that schedule's runtime prints it."""
    summed = sum(counters, Counts())
    totals = Counts(**{name: Fraction(n) for name, n in summed.counted().items()})
    tau = ratio(totals.emitted, totals.steps) if native_schedule in EMITTED_PER_STEP else totals.tau
    return {"tau": tau, "alpha": totals.alpha, "steps": totals.steps}


def _minus(a: Figure, b: Figure) -> Figure:
    return None if a is None or b is None else a - b


@dataclass(frozen=True)
class Part:
    name: str
    value: dict[str, Figure]  # per metric: this part's share of the gap
    # per metric, the two runs' own shares (numerics and residual: A's, and B's subtracted)
    by_run: Optional[tuple[dict[str, Figure], dict[str, Figure]]] = None


@dataclass(frozen=True)
class TauGap:
    run_a: str
    run_b: str
    schedule_a: str
    schedule_b: str
    category: Optional[str]  # None: every common prompt
    prompts: int
    native_a: dict[str, Figure]
    native_b: dict[str, Figure]
    parts: tuple[Part, ...]
    drafting_a: str = "drafter model"  # Drafting.label
    drafting_b: str = "drafter model"

    def gap(self, metric: str) -> Figure:
        return _minus(self.native_a[metric], self.native_b[metric])

    def _run(self, schedule: str, drafting: str) -> str:
        """A run's schedule, and its drafting where it drafts without the drafter model."""
        return schedule if drafting == Drafting(MODEL).label else f"{schedule}, {drafting}"

    def lines(self, alpha_and_steps: bool = True) -> list[str]:
        """The gap, its parts and the residual: one line for tau, one for alpha and steps."""
        def said(metric: str, digits: int) -> str:
            sign = "{:+.%df}" % digits
            parts = " + ".join(f"{p.name} {_shown(p.value[metric], sign)}" for p in self.parts)
            return (f"{_shown(self.native_a[metric], '{:.%df}' % digits)} - "
                    f"{_shown(self.native_b[metric], '{:.%df}' % digits)} = {_shown(self.gap(metric), sign)} = {parts}")
        where = "ALL" if self.category is None else self.category
        lines = [f"tau gap {self.run_a} ({self._run(self.schedule_a, self.drafting_a)}) vs {self.run_b} "
                 f"({self._run(self.schedule_b, self.drafting_b)}), {where} "
                 f"({self.prompts} prompts): {said('tau', 2)}"]
        return lines + ([f"  alpha {said('alpha', 3)}; steps {said('steps', 0)}"] if alpha_and_steps else [])

    def as_json(self) -> dict:
        def figures(values: dict[str, Figure]) -> dict:
            return {metric: None if value is None else float(value) for metric, value in values.items()}
        return {"run_a": self.run_a, "run_b": self.run_b, "schedule_a": self.schedule_a,
                "schedule_b": self.schedule_b, "drafting_a": self.drafting_a, "drafting_b": self.drafting_b,
                "category": self.category, "prompts": self.prompts,
                "native_a": figures(self.native_a), "native_b": figures(self.native_b),
                "gap": {metric: None if self.gap(metric) is None else float(self.gap(metric)) for metric in METRICS},
                "parts": {p.name: {**figures(p.value), **({"a": figures(p.by_run[0]), "b": figures(p.by_run[1])}
                                                          if p.by_run else {})} for p in self.parts}}


def _shown(value: Figure, form: str) -> str:
    return "-" if value is None else form.format(float(value))


@dataclass(frozen=True)
class _Prompt:
    """One common prompt's counts, each under one set of conditions (module docstring)."""

    category: str
    real_a: Counters
    real_b: Counters
    hybrid_a: Counters
    hybrid_b: Counters
    sim_a: Counters  # A's schedule and drafting on A's oracle
    sim_b: Counters  # B's schedule and drafting on B's oracle
    sim_b_with_a: Counters  # B's schedule with A's drafting on A's oracle
    sim_b_on_a: Counters  # B's schedule and drafting on A's oracle


def _simulated(run: Sequence[tuple[PromptResult, Oracle]], record: RunRecord, drafting: Drafting,
               label: str) -> dict[str, Counters]:
    """record's schedule, rules and n_ctx with drafting on a run's oracles, one run through them
    in order, counted per prompt id of the run; a what-if that cannot be simulated (a drafting
    under a schedule or rules it has no simulation for) as one line."""
    rules = record_rules(record)
    try:
        sims = simulate_sequence([oracle for _, oracle in run], record.params.schedule, rules, drafting,
                                 record.params.n_ctx)
    except SettingsError as error:
        raise ComparisonError(f"{label}'s schedule with {drafting.label}: {error}") from None
    return {result.prompt_id: sim.counters(rules.k) for (result, _), sim in zip(run, sims, strict=True)}


def _finished(record: RunRecord, label: str, common: set[str], replayed: Sequence[tuple[Drafting, str]],
              oracles: Mapping[tuple[int, ...], Oracle]) -> list[tuple[PromptResult, Oracle]]:
    """record's finished prompts in its order, with their oracles; ComparisonError where a
    drafting replayed through them under a schedule (replayed) keeps its state from prompt to
    prompt and a failed prompt, whose output is unknown, comes before a prompt the gap compares."""
    kept = next((drafting for drafting, schedule in replayed if per_run(drafting, schedule)), None)
    failed = None
    for result in record.results:
        if kept is not None and failed is not None and result.ok and result.prompt_id in common:
            raise ComparisonError(f"{label}: prompt {failed} failed, and {kept.name} keeps its state from prompt to "
                                  f"prompt: the prompts after it cannot be replayed without its output")
        if not result.ok and failed is None:
            failed = result.prompt_id
    return [(result, _oracle(oracles, result, record.params.max_new_tokens)) for result in record.results if result.ok]


def _drafting(record: RunRecord, label: str) -> Drafting:
    """record's drafting, checked against its own schedule and rules; ComparisonError if it has no simulation."""
    if record.imported is not None:
        raise ComparisonError(f"{label}: an imported record holds no prompts to simulate")
    try:
        drafting = record_drafting(record)
        check_drafting(record.params.schedule, record_rules(record), drafting)
    except SettingsError as error:
        raise ComparisonError(f"{label}: {error}") from None
    return drafting


def tau_gap(a: RunRecord, b: RunRecord, oracles: Mapping[tuple[int, ...], Oracle], label_a: str = "A",
            label_b: str = "B") -> list[TauGap]:
    """The gap between a and b decomposed, per category (sorted) and then over every prompt
    both finished; oracles maps prompt ids to their oracle (build_oracles)."""
    drafting_a, drafting_b = _drafting(a, label_a), _drafting(b, label_b)
    if a.params.max_new_tokens != b.params.max_new_tokens:
        raise ComparisonError(f"{label_a} and {label_b} ran other token budgets "
                              f"({a.params.max_new_tokens} and {b.params.max_new_tokens})")
    b_results = {r.prompt_id: r for r in b.results if r.ok}
    common = {r.prompt_id for r in a.results if r.ok and r.prompt_id in b_results}
    # A's run carries sim A, sim B with A's drafting and sim B on A; B's, sim B alone.
    schedule_a, schedule_b = a.params.schedule, b.params.schedule
    on_a = _finished(a, label_a, common, ((drafting_a, schedule_a), (drafting_a, schedule_b), (drafting_b, schedule_b)),
                     oracles)
    on_b = _finished(b, label_b, common, ((drafting_b, schedule_b),), oracles)
    oracle_a, oracle_b = ({result.prompt_id: oracle for result, oracle in run} for run in (on_a, on_b))
    sim_a = _simulated(on_a, a, drafting_a, label_a)
    sim_b = _simulated(on_b, b, drafting_b, label_b)
    sim_b_with_a = _simulated(on_a, b, drafting_a, label_b)
    sim_b_on_a = sim_b_with_a if drafting_a == drafting_b else _simulated(on_a, b, drafting_b, label_b)
    prompts = []
    for result_a in a.results:
        if result_a.prompt_id not in common:
            continue
        result_b, key = b_results[result_a.prompt_id], result_a.prompt_id
        greedy_a = tuple(result_a.output_ids) == oracle_a[key].output
        greedy_b = tuple(result_b.output_ids) == oracle_b[key].output
        hybrid_a = sim_a[key] if greedy_a else result_a.counters
        hybrid_b = sim_b[key] if greedy_b else result_b.counters
        prompts.append(_Prompt(result_a.category, result_a.counters, result_b.counters, hybrid_a, hybrid_b,
                               sim_a[key], sim_b[key], sim_b_with_a[key], sim_b_on_a[key]))
    if not prompts:
        raise ComparisonError(f"{label_a} and {label_b} finished no prompt in common")
    categories = sorted({p.category for p in prompts})
    return [_decompose(a, b, label_a, label_b, (drafting_a.label, drafting_b.label), category,
                       [p for p in prompts if category is None or p.category == category])
            for category in [*categories, None]]


def _oracle(oracles: Mapping[tuple[int, ...], Oracle], result: PromptResult, budget: Optional[int]) -> Oracle:
    oracle = oracles.get(tuple(result.prompt_ids))
    if oracle is None or oracle.max_new_tokens != budget:
        raise ComparisonError(f"{result.prompt_id}: no oracle of these prompt ids and a budget of {budget}")
    return oracle


def _decompose(a: RunRecord, b: RunRecord, label_a: str, label_b: str, draftings: tuple[str, str],
               category: Optional[str], prompts: Sequence[_Prompt]) -> TauGap:
    def figures(pick: Callable[[_Prompt], Counters], native: Optional[str] = None) -> dict[str, Figure]:
        return exact_figures([pick(p) for p in prompts], native)

    def difference(x: dict[str, Figure], y: dict[str, Figure]) -> dict[str, Figure]:
        return {metric: _minus(x[metric], y[metric]) for metric in METRICS}

    real_a, real_b = figures(lambda p: p.real_a), figures(lambda p: p.real_b)
    native_a = figures(lambda p: p.real_a, a.params.schedule)
    native_b = figures(lambda p: p.real_b, b.params.schedule)
    hybrid_a, hybrid_b = figures(lambda p: p.hybrid_a), figures(lambda p: p.hybrid_b)
    sim_a, sim_b = figures(lambda p: p.sim_a), figures(lambda p: p.sim_b)
    sim_b_with_a, sim_b_on_a = figures(lambda p: p.sim_b_with_a), figures(lambda p: p.sim_b_on_a)
    numerics = (difference(hybrid_a, sim_a), difference(hybrid_b, sim_b))
    residual = (difference(real_a, hybrid_a), difference(real_b, hybrid_b))
    parts = (Part("counting", difference(difference(native_a, real_a), difference(native_b, real_b))),
             Part("rendering", difference(sim_b_on_a, sim_b)),
             Part("drafter algorithm", difference(sim_b_with_a, sim_b_on_a)),
             Part("schedule and rules", difference(sim_a, sim_b_with_a)),
             Part("numerics", difference(*numerics), numerics),
             Part("residual", difference(*residual), residual))
    return TauGap(label_a, label_b, a.params.schedule, b.params.schedule, category, len(prompts), native_a, native_b,
                  parts, *draftings)


def build_oracles(target: ModelSession, drafter: Optional[ModelSession], records: Sequence[RunRecord],
                  head: Optional[tuple[str, object]] = None) -> dict[tuple[int, ...], Oracle]:
    """One oracle per distinct prompt ids the records finished, at their common token budget,
    with drafts as long as the largest k among them (drafter None: no draft rows, for records
    that all draft by lookup; head: (spec type, loaded head) drafting instead) and as many of the
    target's tokens past the output, plus one."""
    budgets = {record.params.max_new_tokens for record in records}
    if len(budgets) != 1 or None in budgets:
        raise ComparisonError(f"the records ran other or unknown token budgets ({sorted(map(str, budgets))})")
    budget = budgets.pop()
    max_k = max(record.params.k for record in records)
    oracles: dict[tuple[int, ...], Oracle] = {}
    for record in records:
        for result in progress.each(record.results, "tau gap oracles"):
            ids = tuple(result.prompt_ids)
            if result.ok and ids not in oracles:
                oracles[ids] = build_oracle(target, drafter, result.prompt_id, result.category, ids, budget, max_k,
                                            head)
    return oracles


ORACLE_RUNTIME = "llama-cpp"


def _drafting_key(record: RunRecord) -> object:
    """What a gap's drafter algorithm part compares: the Drafting, else what the record states."""
    try:
        return record_drafting(record)
    except SettingsError:
        params = record.params
        return params.spec_type, params.drafting, params.tree


def gap_pairs(runs: Sequence[tuple[str, RunRecord]]) -> list[list[tuple[tuple[str, RunRecord], tuple[str, RunRecord]]]]:
    """The pairs of runs a tau gap is computed for, one list per pair of models: every two runs of
    one pair whose schedules or draftings differ (two runs of one schedule and drafting compare
    counters, in parity, instead)."""
    by_pair: dict[tuple, list[tuple[str, RunRecord]]] = {}
    for label, record in runs:
        by_pair.setdefault((record.pair.name, record.pair.target and record.pair.target.sha256), []).append(
            (label, record))
    groups = []
    for group in by_pair.values():
        pairs = [(a, b) for i, a in enumerate(group) for b in group[i + 1:]
                 if (a[1].params.schedule, _drafting_key(a[1])) != (b[1].params.schedule, _drafting_key(b[1]))]
        if pairs:
            groups.append(pairs)
    return groups


@dataclass(frozen=True)
class PairGap:
    """One pair of runs (labels as parity prints them): its gap per category and over every common
    prompt (last), or why it was not computed."""

    label_a: str
    label_b: str
    gaps: tuple[TauGap, ...]
    problem: Optional[str] = None

    def lines(self) -> list[str]:
        """`crossrt parity`'s lines: the gap overall (tau, then alpha and steps) and per category (tau)."""
        if self.problem is not None:
            return [f"tau gap {self.label_a} vs {self.label_b}: not computed ({self.problem})"]
        return self.gaps[-1].lines() + [line for gap in self.gaps[:-1] for line in gap.lines(alpha_and_steps=False)]


class GapBuild:
    """For every two runs of one pair whose schedules or draftings differ, their gap or why it was
    not computed; one build serves parity's lines and its page (crossrt/report/gaps.py). One oracle
    set per pair of models, built on llama.cpp from the records' GGUF files at the runs' context
    size (its default F16 KV cache and flash attention, as llama.cpp's tools run), where
    crossrt/run/isolation.py places that runtime: a crash there, as a model that does not load, is
    that pair's reason, and the verdict still follows.

    With beside=True the first pair's oracles start building at once, in their process, so that
    work done meanwhile (parity's verdict, in its own) runs beside it; gaps() waits for them."""

    def __init__(self, runs: Sequence[tuple[str, RunRecord]], threads: int = 1, beside: bool = False):
        self._threads = threads
        self._groups = []
        for pairs in gap_pairs(runs):
            records = list({id(record): record for pair in pairs for _, record in pair}.values())
            self._groups.append((pairs, [record for record in records if record.imported is None]))
        self._begun = self._begin(self._groups[0][1]) if beside and self._groups else None

    def _begin(self, records: list[RunRecord]):
        return begin_safely(ORACLE_RUNTIME, parity_oracles, records, self._threads)

    def gaps(self) -> list[PairGap]:
        found: list[PairGap] = []
        for index, (pairs, records) in enumerate(self._groups):
            try:
                oracles = (self._begun if index == 0 and self._begun is not None else self._begin(records)).wait()
            except CrossrtError as error:  # no model files, a model that does not load or crashes, a prompt too long
                found += [PairGap(a, b, (), str(error)) for (a, _), (b, _) in pairs]
                continue
            for (label_a, a), (label_b, b) in pairs:
                try:
                    found.append(PairGap(label_a, label_b, tuple(tau_gap(a, b, oracles, label_a, label_b))))
                except ComparisonError as error:
                    found.append(PairGap(label_a, label_b, (), str(error)))
        return found

    def close(self) -> None:
        """Give up on oracles begun and not waited for (their process killed)."""
        if self._begun is not None:
            self._begun.close()


def pair_gaps(runs: Sequence[tuple[str, RunRecord]], threads: int = 1) -> list[PairGap]:
    """GapBuild's gaps, each pair's oracles built in turn."""
    return GapBuild(runs, threads).gaps()


def parity_oracles(records: Sequence[RunRecord], threads: int) -> dict[tuple[int, ...], Oracle]:
    """The oracles of the records a gap can be computed for, from the records' GGUF files: the
    target's, and the drafter's where one of them drafts with it."""
    simulated = [r for r in records if _simulable(r)]
    if not simulated:
        return {}
    draftings = {record_drafting(r).name for r in simulated}
    heads = draftings & set(HEAD_LABELS)
    roles = ("target", "drafter") if heads or MODEL in draftings else ("target",)
    files = next((tuple(Path(getattr(r.pair, role).path) for role in roles) for r in records
                  if all(getattr(r.pair, role) and getattr(r.pair, role).format == "gguf"
                         and Path(getattr(r.pair, role).path).is_file() for role in roles)), None)
    if files is None:
        raise ComparisonError(f"no record names GGUF files of the pair's {' and '.join(roles)} to build oracles from")
    # The oracle drafts K tokens from one position past the output and checks them there.
    n_ctx = max(len(result.prompt_ids) + (r.params.max_new_tokens or 0) + r.params.k + 2
                for r in records for result in r.results)
    runtime = open_runtime(ORACLE_RUNTIME, RuntimeOptions(n_ctx=n_ctx, threads=threads))
    if heads:  # the head drafts from the target's features: files[1] names it, not a model to load
        spec_type = heads.pop()
        with runtime.load(files[0]) as target:
            return build_oracles(target, None, simulated, (spec_type, _load_head(spec_type, files[1], target)))
    with contextlib.ExitStack() as stack:
        target, *drafter = (stack.enter_context(runtime.load(path)) for path in files)
        return build_oracles(target, drafter[0] if drafter else None, simulated)


def _load_head(spec_type: str, path: Path, target: ModelSession):
    """The head whose GGUF is path, from the torch folder beside it, as crossrt's loop reads it."""
    from crossrt.speculative.head_drafter import head_folder, load_head

    folder = head_folder(path)
    if folder is None:
        raise ComparisonError(f"{path}: no head folder (config.json) beside it to replay the head from")
    return load_head(spec_type, folder, target)


def _simulable(record: RunRecord) -> bool:
    try:
        _drafting(record, "")
    except ComparisonError:
        return False
    return True
