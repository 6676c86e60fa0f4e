"""Parity between runs: do two records of the same pair agree, prompt by prompt?

Pure comparisons of records. Token ids are compared over their full length (a length
mismatch is a divergence at the shorter length: never a `zip` that drops the tail).
Counters are compared only between runs that followed the same schedule and draft rules:
two runtimes with different schedules legitimately count differently (docs/schema.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from crossrt.compare.diagnosis import Explainer, twins_of
from crossrt.compare.splits import COUNTS_UNFIT, OWN_TOKENIZATION, Split, first_divergence, template_split
from crossrt.errors import ComparisonError
from crossrt.imports.importer import AGGREGATE, UNKNOWN
from crossrt.records.schema import PromptResult, RunRecord

OWN_BASELINE = "its baseline"  # run_b of a run's lossless check against its own greedy baseline
COMPARED_COUNTERS = ("steps", "drafted", "accepted", "emitted", "unverified", "cut")
COUNTING = ("k", "schedule", "draft_n_min", "draft_p_min", "max_new_tokens")  # settings that change how runs count
# How a run drafts (its strategy, crossrt/speculative/strategies.py): two runs of one schedule that draft
# differently (a drafter model and a lookup, two lookups, other n-gram lengths or k policies) count
# differently. None here means "does not apply", never "unknown", so it compares as a value.
DRAFTING = ("drafting", "tree", "ngram_max", "ngram_min", "k_policy", "content_k", "k_max", "min_p1", "acceptance",
            "top_m", "delta")
IDS, COUNTERS = "token ids", "counters"  # what a comparison may have compared (PromptParity.compared)
GREEDY_ONLY = "parity compares greedy runs only"  # why a lossy run is refused


def run_label(record: RunRecord) -> str:
    return f"{record.runtime.name}/{record.params.mode}"


def labelled(records: Sequence[RunRecord], sources: Sequence[str]) -> list[tuple[str, RunRecord]]:
    """Records named runtime/mode, with their source added where two would otherwise share a
    name: the file's name, or its path where two files share a name (runs/a/r.json, runs/b/r.json),
    and a number where even that repeats, so no two runs' lines merge under one label."""
    names = [run_label(record) for record in records]
    shown = [str(source) if any(Path(other).name == Path(source).name and other != source for other in sources)
             else Path(source).name for source in sources]
    labels = [name if names.count(name) == 1 else f"{name} ({where})" for name, where in zip(names, shown, strict=True)]
    numbered = [label if labels.count(label) == 1 else f"{label} #{labels[:i].count(label) + 1}"
                for i, label in enumerate(labels)]
    return list(zip(numbered, records, strict=True))


@dataclass(frozen=True)
class CounterGap:
    name: str
    a: int
    b: int


WHOLE_RUN = "*"  # the prompt id of a comparison that is about a whole run


@dataclass(frozen=True)
class PromptParity:
    """One prompt, two runs (prompt_id WHOLE_RUN: a problem of the whole run, no prompt compared)."""

    prompt_id: str
    run_a: str
    run_b: str
    problems: tuple[str, ...]
    divergence: Optional[int]  # index in output_ids where the runs part, None if equal
    counter_gaps: tuple[CounterGap, ...]
    counters_compared: bool
    # Divergences explained as numerics (a near-tie swap), which do not fail parity unless strict.
    explained: tuple[str, ...] = ()
    # The kind of each split found (crossrt/compare/diagnosis.py), explained or not: the headline counts them.
    causes: tuple[str, ...] = ()
    splits: tuple[Split, ...] = ()  # those splits themselves: sides, gaps, verdicts (for the report)
    # What was really compared (IDS, COUNTERS): a verdict is honest only about what it compared.
    compared: tuple[str, ...] = ()
    no_ids: str = ""  # why token ids were not compared ("" when they were, or the comparison failed first)
    no_counters: str = ""  # why counters were not compared (a lossless check compares none: "")
    imported: bool = False  # a run of it is an import: no token ids by nature

    @property
    def comparable(self) -> bool:
        """Token ids were compared: without them a verdict of "identical" would be about nothing."""
        return IDS in self.compared

    @property
    def identical(self) -> bool:
        """Nothing parted: same ids (and counts, where compared), no split of any kind."""
        return self.ok and not self.causes and self.divergence is None and bool(self.compared)

    @property
    def ok(self) -> bool:
        return not self.problems


def _counter_gaps(a: PromptResult, b: PromptResult, tolerance: float) -> tuple[CounterGap, ...]:
    gaps = []
    for name in COMPARED_COUNTERS:
        value_a, value_b = getattr(a.counters, name), getattr(b.counters, name)
        if abs(value_a - value_b) > tolerance * max(value_a, value_b):
            gaps.append(CounterGap(name, value_a, value_b))
    return tuple(gaps)


def counting_difference(a: RunRecord, b: RunRecord) -> str:
    """What makes two runs count differently, each setting with both values ("k differs: 4 vs 2"),
    "" when they count alike. A setting an import does not state (None) differs from every value."""
    parts = [f"{key} differs: {getattr(a.params, key)} vs {getattr(b.params, key)}" for key in COUNTING
             if None not in (getattr(a.params, key), getattr(b.params, key))
             and getattr(a.params, key) != getattr(b.params, key)]
    parts += [f"{key} differs: {getattr(a.params, key)} vs {getattr(b.params, key)}" for key in DRAFTING
              if getattr(a.params, key) != getattr(b.params, key)]
    if (a.params.drafting == b.params.drafting == "model" and a.params.spec_type != b.params.spec_type
            and UNKNOWN not in (a.params.spec_type, b.params.spec_type)):
        # A lookup's drafting names its algorithm; a drafter model's spec type says what drafted
        # (an import that does not say it is compared as before).
        parts.append(f"spec_type differs: {a.params.spec_type} vs {b.params.spec_type}")
    # An import, or an attached server that does not report a setting (docs/endpoint.md): unknown.
    for record in dict.fromkeys((a, b)):  # one line per record, not per side
        unstated = [key for key in COUNTING if getattr(record.params, key) is None]
        if unstated:
            what = f"the {record.imported.format} import" if record.imported else f"the {record.runtime.name} record"
            parts.append(f"{what} states no {', '.join(unstated)}")
    return "; ".join(parts)


def _split_line(split: Split) -> str:
    return f"{split.kind} at token {split.index}: {split.detail}"


def compare_prompt(a: RunRecord, b: RunRecord, result_a: PromptResult, result_b: PromptResult,
                   counter_tolerance: float, labels: tuple[str, str], explainer: Explainer,
                   strict: bool = False) -> PromptParity:
    problems = [f"{label} failed: {result.error}"
                for label, result in zip(labels, (result_a, result_b), strict=True) if not result.ok]
    if problems:
        return PromptParity(result_a.prompt_id, *labels, tuple(problems), None, (), False,
                            no_ids="a run failed the prompt")
    if result_a.prompt_ids != result_b.prompt_ids:
        at = first_divergence(result_a.prompt_ids, result_b.prompt_ids)
        problems.append(f"prompt token ids differ at position {at}")
    divergence = first_divergence(result_a.output_ids, result_b.output_ids)
    explained, causes, found = [], [], []
    records, results = (a, b), (result_a, result_b)
    if divergence is not None and not problems:
        parted = f"outputs part at token {divergence} (lengths {len(result_a.output_ids)} and {len(result_b.output_ids)})"
        links = explainer.outputs(labels, records, results)
        causes.extend(link.kind for link in links)
        found.extend(links)
        reason = "; ".join(f"{link.sides[0].label.rsplit(' ', 1)[0] if link.sides else 'link'}: {_split_line(link)}"
                           for link in links) or "no link of the chain output - baseline - baseline - output parts"
        if not links or not all(link.numerics for link in links) or strict:
            problems.append(f"{parted}: {reason}")
        else:
            explained.append(f"{parted}: {reason}")
    elif divergence is not None:
        problems.append(f"outputs part at token {divergence}")
    # Counters of runs whose outputs part count different tokens: not compared.
    differs = counting_difference(a, b) or ("outputs part" if divergence is not None else "")
    compared = not differs
    gaps = _counter_gaps(result_a, result_b, counter_tolerance) if compared else ()
    if gaps:
        counted = "; ".join(f"{gap.name}: {gap.a} vs {gap.b}" for gap in gaps)
        split = explainer.counters(labels, records, results)
        causes.append(split.kind)
        found.append(split)
        line = f"{counted}: {split.kind}: {split.detail}"
        (explained if split.numerics and not strict else problems).append(line)
    return PromptParity(result_a.prompt_id, *labels, tuple(problems), divergence, gaps, compared, tuple(explained),
                        tuple(causes), tuple(found), compared=(IDS, COUNTERS) if compared else (IDS,),
                        no_counters=differs)


def lossy_rule(record: RunRecord) -> str:
    """A lossy run's acceptance rule in words ("" for a greedy run)."""
    params = record.params
    return (f"a lossy acceptance rule ({params.acceptance}, top-m {params.top_m}, delta {params.delta:g})"
            if params.lossy else "")


def refuse_lossy(label: str, record: RunRecord) -> None:
    """Parity compares greedy runs: a lossy run's output may leave greedy decoding by its rule."""
    if record.params.lossy:
        raise ComparisonError(f"{label} ran {lossy_rule(record)}: {GREEDY_ONLY}")


def compare_records(a: RunRecord, b: RunRecord, counter_tolerance: float = 0.0,
                    labels: Optional[tuple[str, str]] = None, explainer: Optional[Explainer] = None,
                    strict: bool = False) -> list[PromptParity]:
    """Every prompt of either record, compared; a prompt only one record holds is a problem.
    Outputs that part at a near-tie (crossrt/speculative/numerics.py; crossrt/compare/tolerance.py sets how near for
    the two runs) are explained, not failed, unless strict."""
    labels = labels or (run_label(a), run_label(b))
    for label, record in zip(labels, (a, b)):
        refuse_lossy(label, record)
    explainer = explainer or Explainer()
    if a.imported or b.imported:
        shared = {r.prompt_id for r in a.results} & {r.prompt_id for r in b.results} - {AGGREGATE}
        return (compare_imported_prompts(a, b, counter_tolerance, labels) if shared
                else [compare_aggregates(a, b, counter_tolerance, labels)])
    if a.pair.target.vocab_fingerprint != b.pair.target.vocab_fingerprint:
        raise ComparisonError(f"{labels[0]} and {labels[1]} ran pairs with different vocabularies: "
                         "their token ids cannot be compared")
    results_b = {r.prompt_id: r for r in b.results}
    comparisons = []
    for result_a in a.results:
        result_b = results_b.pop(result_a.prompt_id, None)
        if result_b is None:
            comparisons.append(PromptParity(result_a.prompt_id, *labels, (f"missing from {labels[1]}",),
                                            None, (), False))
        else:
            comparisons.append(compare_prompt(a, b, result_a, result_b, counter_tolerance, labels, explainer,
                                              strict))
    comparisons.extend(PromptParity(prompt_id, *labels, (f"missing from {labels[0]}",), None, (), False)
                       for prompt_id in results_b)
    return comparisons


def _gives(record: RunRecord, counter: str) -> bool:
    return record.imported is None or counter in record.imported.given


def _imported_terms(a: RunRecord, b: RunRecord, labels: tuple[str, str]) -> tuple[list[str], str, str]:
    """What two runs, one or both imported, can compare: the counters both give, why they are not
    compared ("" when both count the same way: k, schedule, draft rules, budget; an import that does
    not state them is not compared), and why no token ids are."""
    if a.pair.target and b.pair.target and a.pair.target.vocab_fingerprint != b.pair.target.vocab_fingerprint:
        raise ComparisonError(f"{labels[0]} and {labels[1]} ran pairs with different vocabularies")
    names = [name for name in COMPARED_COUNTERS if _gives(a, name) and _gives(b, name)]
    differs = counting_difference(a, b) or ("" if names else "the two give no counter in common")
    no_ids = "no token ids: imported from " + ", ".join(dict.fromkeys(record.imported.format for record in (a, b)
                                                                     if record.imported))
    return names, differs, no_ids


def _gaps(names: Sequence[str], a: dict, b: dict, tolerance: float) -> tuple[CounterGap, ...]:
    return tuple(CounterGap(name, a[name], b[name]) for name in names
                 if abs(a[name] - b[name]) > tolerance * max(a[name], b[name]))


def compare_aggregates(a: RunRecord, b: RunRecord, counter_tolerance: float, labels: tuple[str, str]) -> PromptParity:
    """Runs of which one or both are imported (crossrt import) with no prompt in common: no token
    ids to compare, so the counters both give, summed over each run's finished prompts."""
    names, differs, no_ids = _imported_terms(a, b, labels)
    notes = [f"{label}: imported from {record.imported.format}: no token ids, outputs not compared"
             for label, record in zip(labels, (a, b)) if record.imported]
    sums = [{name: sum(getattr(r.counters, name) for r in record.results if r.ok) for name in names}
            for record in (a, b)]
    compared = not differs
    gaps = _gaps(names, *sums, counter_tolerance) if compared else ()
    if not compared:
        notes.append(f"counters not compared: {differs}")
    else:
        notes.append(f"counters compared on sums over all prompts: {', '.join(names)}"
                     + ("" if a.pair.target and b.pair.target else "; an imported run names no pair files"))
    prompt_id = next(record.results[0].prompt_id for record in (a, b) if record.imported)
    return PromptParity(prompt_id, *labels, tuple(f"{gap.name}: {gap.a} vs {gap.b}" for gap in gaps), None, gaps,
                        compared, tuple(notes), compared=(COUNTERS,) if compared else (), no_ids=no_ids,
                        no_counters=differs, imported=True)


def compare_imported_prompts(a: RunRecord, b: RunRecord, counter_tolerance: float,
                             labels: tuple[str, str]) -> list[PromptParity]:
    """An import that keeps its requests as prompts (AIPerf's per-request export, --prompts) and a
    run of the same prompts: prompt by prompt, the counters both give; token ids not compared."""
    names, differs, no_ids = _imported_terms(a, b, labels)
    compared = not differs
    results_b = {r.prompt_id: r for r in b.results}
    comparisons = []
    for result_a in a.results:
        result_b = results_b.pop(result_a.prompt_id, None)
        if result_b is None:
            problems, gaps = (f"missing from {labels[1]}",), ()
        else:
            problems = tuple(f"{label} failed: {result.error}"
                             for label, result in zip(labels, (result_a, result_b)) if not result.ok)
            counts = [{name: getattr(result.counters, name) for name in names} for result in (result_a, result_b)]
            gaps = _gaps(names, *counts, counter_tolerance) if compared and not problems else ()
            problems += tuple(f"{gap.name}: {gap.a} vs {gap.b}" for gap in gaps)
        counted = compared and result_b is not None and result_a.ok and result_b.ok
        comparisons.append(PromptParity(result_a.prompt_id, *labels, problems, None, gaps, counted,
                                        compared=(COUNTERS,) if counted else (), no_ids=no_ids,
                                        no_counters=differs, imported=True))
    comparisons.extend(PromptParity(prompt_id, *labels, (f"missing from {labels[0]}",), None, (), False,
                                    no_ids=no_ids, imported=True) for prompt_id in results_b)
    return comparisons


def lossless_checks(label: str, record: RunRecord, explainer: Explainer, strict: bool = False) -> list[PromptParity]:
    """Each finished prompt of one run against its own plain greedy baseline. A departure the
    Explainer finds to be numerics (a batch-shape near-tie, from the run's pass views, a driven
    twin's or passes re-scored) is explained, not failed, unless strict."""
    refuse_lossy(label, record)
    if record.imported:  # said once for the record, not for each of its prompts
        note = f"imported from {record.imported.format}: no token ids, no lossless check"
        return [PromptParity(r.prompt_id, label, OWN_BASELINE, (), None, (), False, () if at else (note,),
                             no_ids=f"no token ids: imported from {record.imported.format}", imported=True)
                for at, r in enumerate(record.results)]
    checks = []
    for result in record.results:
        problems, explained, causes = [], [], []
        split = explainer.lossless(label, record, result)
        if split is not None:
            causes.append(split.kind)
            line = f"not lossless: speculative output leaves the greedy baseline at token {split.index}: " \
                   f"{split.kind}: {split.detail}"
            (explained if split.numerics and not strict else problems).append(line)
        if result.unfit_counts is not None:
            explained.append(result.unfit_counts.describe())
            causes.append(COUNTS_UNFIT)
        if result.own_prompt_ids is not None:
            at = first_divergence(result.own_prompt_ids, result.prompt_ids)
            problems.append(f"tokenizes the prompt text differently from the shared ids, from position {at}")
            causes.append(OWN_TOKENIZATION)
        template = template_split(label, result, explainer.detokenize)
        if template is not None:
            problems.append(f"{template.kind} split: {template.detail}")
            causes.append(template.kind)
        # A failed prompt has no output to hold against its baseline: nothing compared, not "identical".
        checks.append(PromptParity(result.prompt_id, label, OWN_BASELINE, tuple(problems),
                                   split.index if split is not None else None, (), False, tuple(explained),
                                   tuple(causes), tuple(s for s in (split, template) if s is not None),
                                   compared=(IDS,) if result.ok else (),
                                   no_ids="" if result.ok else f"the prompt failed ({result.error})"))
    return checks


def compare_all(runs: Sequence[tuple[str, RunRecord]], counter_tolerance: float = 0.0,
                logit_tolerance: Optional[float] = None, strict: bool = False, replay=None,
                batch_noise: Optional[dict] = None) -> list[PromptParity]:
    """Every (label, record) run against its own baseline, then every pair of runs, every prompt.
    Native runs borrow the pass views of a driven twin that emitted the same ids; replay
    (crossrt/compare/replay.py's Replayer) re-scores the splits neither explains (None: they stay
    unexplained and fail)."""
    twins = twins_of(runs)
    explainer = Explainer(twins, replay, logit_tolerance=logit_tolerance, batch_noise=batch_noise)
    checks = [check for label, record in runs for check in lossless_checks(label, record, explainer, strict)]
    return checks + [comparison
                     for i, (label_a, a) in enumerate(runs) for label_b, b in runs[i + 1:]
                     for comparison in compare_records(a, b, counter_tolerance, (label_a, label_b), explainer,
                                                       strict)]


def compare_against(runs: Sequence[tuple[str, RunRecord]], baselines: Sequence[RunRecord],
                    counter_tolerance: float = 0.0, replay=None) -> list[PromptParity]:
    """Each record against the saved baseline of the same runtime, mode and k: a runtime
    upgrade that changes outputs or acceptance shows up here. A record with no baseline, or a
    baseline with no new record, is a problem too."""
    def key(record: RunRecord):
        return record.runtime.name, record.params.mode, record.params.k

    saved = {key(record): record for record in baselines}
    kinds = ", ".join(f"{run_label(record)} k{record.params.k}" for record in baselines)
    comparisons = []
    for label, record in runs:
        baseline = saved.pop(key(record), None)
        if baseline is None:
            why = f"no saved run of the same runtime, mode and k (k{record.params.k}; saved: {kinds})"
            comparisons.append(PromptParity(WHOLE_RUN, label, "saved baseline", (why,), None, (), False))
            continue
        labels = (f"{run_label(baseline)} (saved)", label)
        explainer = Explainer(twins_of([(labels[0], baseline), (label, record)]), replay)
        comparisons.extend(compare_records(baseline, record, counter_tolerance, labels, explainer))
    comparisons.extend(PromptParity(WHOLE_RUN, f"{run_label(record)} (saved)", "new runs", ("not run this time",),
                                    None, (), False) for record in saved.values())
    return comparisons
