"""The runs a report is over: each record with its label, path, trace and colour, loaded once
and handed to every section (crossrt/report/build.py, steps.py, summary.py, gaps.py, parity.py),
so no section module imports another to learn what a run is."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from crossrt.analyze import analysis
from crossrt.compare.parity import run_label
from crossrt.records.record_json import load_record
from crossrt.records.schema import RecordError, RunRecord, Summary
from crossrt.records.trace import PromptTrace
from crossrt.report.svg import Bars, palette_color

ALL = "ALL"


@dataclass(frozen=True, eq=False)
class ReportRun:
    label: str  # unique within the report: names the run in tables, charts and legends
    path: str  # the record's path as given
    record: RunRecord
    trace: Mapping[str, PromptTrace]  # by prompt id; empty without one
    trace_problem: Optional[str]  # why the trace the record names could not be read
    color: str  # the run's colour in every chart


def run_labels(records: Sequence[RunRecord], paths: Sequence[str]) -> list[str]:
    """runtime/mode schedule k=K, with the pair where the records hold several, `lossy` for a
    run under a lossy acceptance rule, and the record path where two runs would still share a label."""
    several_pairs = len({record.pair.name for record in records}) > 1
    bases = [f"{run_label(record)} {record.params.schedule} k={record.params.k}"
             + (f" {record.pair.name}" if several_pairs else "") + (" lossy" if record.params.lossy else "")
             for record in records]
    return [base if bases.count(base) == 1 else f"{base} ({path})" for base, path in zip(bases, paths, strict=True)]


def load_runs(paths: Sequence[Path]) -> list[ReportRun]:
    """The records at paths with their traces. A trace that cannot be read is reported in the
    report, not raised: the record's other sections still stand."""
    resolved = [Path(path).resolve() for path in paths]
    for index, path in enumerate(resolved):
        if path in resolved[:index]:
            raise RecordError(f"{paths[index]} is given twice")
    records = [load_record(path) for path in paths]
    labels = run_labels(records, [str(path) for path in paths])
    return [report_run(label, path, record, index)
            for index, (path, record, label) in enumerate(zip(paths, records, labels, strict=True))]


def report_run(label: str, path: Optional[Path], record: RunRecord, index: int) -> ReportRun:
    """A run of the report, the index-th: its trace read where the record has a path (the runs
    of a `crossrt parity --pair` matrix are passed in memory, without one)."""
    if path is None:
        return ReportRun(label, "(run by this command)", record, {}, None, palette_color(index))
    try:
        trace, problem = analysis.load_trace(path, record), None
    except RecordError as error:
        trace, problem = {}, str(error)
    return ReportRun(label, str(path), record, trace, problem, palette_color(index))


def categories(runs: Sequence[ReportRun]) -> list[Optional[str]]:
    """Every category of any run, sorted, then None for all prompts."""
    return [*sorted({c for run in runs for c in run.record.categories()}), None]


def category_name(category: Optional[str]) -> str:
    return ALL if category is None else category


def by_category_bars(runs: Sequence[ReportRun], field: str) -> list[Bars]:
    """One series per run: the summary field per category and ALL (None where the run lacks
    the category)."""
    groups = categories(runs)
    return [Bars(run.label, tuple(getattr(run.record.summary(c), field)
                                  if c is None or c in run.record.categories() else None
                                  for c in groups), run.color) for run in runs]


def lossless_cell(run: ReportRun, summary: Summary) -> str:
    """Finished prompts whose output equals the plain greedy baseline, of the finished prompts;
    `-` for an imported record, which holds no token ids to compare; `lossy` for a run under a
    lossy acceptance rule, which makes no lossless claim."""
    if run.record.params.lossy:
        return "lossy"
    return "-" if run.record.imported else f"{summary.lossless}/{summary.prompts - summary.failed}"


def _listed(values: Sequence[str], most: int = 3) -> str:
    """Distinct values in order, the first `most` of them named."""
    distinct = list(dict.fromkeys(values))
    return ", ".join(distinct[:most]) + (f" and {len(distinct) - most} more" if len(distinct) > most else "")


def _pair(record: RunRecord) -> str:
    files = [Path(model.path).name for model in (record.pair.target, record.pair.drafter) if model]
    return f"{record.pair.name} ({' / '.join(files)})" if files else record.pair.name


def report_title(runs: Sequence[ReportRun]) -> str:
    """The setting the runs share or span: pair (target / drafter), k, prompts, max new tokens
    and where they ran, each value once."""
    records = [run.record for run in runs]
    sizes = {frozenset(r.prompt_id for r in record.results): len(record.results) for record in records}
    prompts = (f"{next(iter(sizes.values()))} prompts" if len(sizes) == 1
               else f"{len(sizes)} prompt sets ({', '.join(str(n) for n in sizes.values())} prompts)")
    budgets = [str(record.params.max_new_tokens) for record in records if record.params.max_new_tokens is not None]
    places = [record.runtime.device + (f", {record.runtime.threads} thread{'s' * (record.runtime.threads != 1)}"
                                       if record.runtime.threads else "") for record in records]
    parts = [_listed([_pair(record) for record in records]),
             "k " + ", ".join(str(k) for k in sorted({record.params.k for record in records})), prompts,
             *([f"{_listed(budgets)} new tokens"] if budgets else []), f"on {_listed(places)}"]
    return "crossrt report: " + "; ".join(parts)
