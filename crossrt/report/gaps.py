"""Why tau differs, drawn (docs/report.md): for every two runs of one pair whose schedules or
draftings differ, the gap `crossrt parity` prints (crossrt/compare/tau_gap.py: counting,
rendering, drafter algorithm, schedule and rules, numerics, residual), as a waterfall from one
run's tau to the other's, and the same for alpha; the tables hold every figure, per category
too, as parity prints them.

The decomposition is tau_gap's (pair_gaps, which picks the pairs and gives `crossrt parity` its
lines); this module only draws it."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Optional, Sequence

from crossrt.compare.tau_gap import PARTS, PairGap, TauGap
from crossrt.report.page import Section, Table
from crossrt.report.runs import ReportRun, category_name
from crossrt.report.svg import waterfall_chart

DIGITS = {"tau": 2, "alpha": 3}  # as `crossrt parity` prints each gap


@dataclass(frozen=True)
class RunGap:
    """One pair of runs: its gap per category and over all common prompts (last), or why not."""

    a: ReportRun
    b: ReportRun
    gaps: tuple[TauGap, ...]
    problem: Optional[str] = None


def run_gaps(runs: Sequence[ReportRun], computed: Sequence[PairGap]) -> list[RunGap]:
    """The gaps computed for these runs (crossrt/compare/tau_gap.py's pair_gaps, whose labels are
    the runs'), each with its two runs, to be drawn."""
    by_label = {run.label: run for run in runs}
    return [RunGap(by_label[gap.label_a], by_label[gap.label_b], gap.gaps, gap.problem) for gap in computed]


def _figure(value) -> Optional[float]:
    return None if value is None else float(value)


def _waterfall(gap: RunGap, metric: str) -> Optional[str]:
    whole = gap.gaps[-1]
    start, end = _figure(whole.native_b[metric]), _figure(whole.native_a[metric])
    changes = [(part.name, _figure(part.value[metric])) for part in whole.parts]
    if start is None or end is None or any(change is None for _, change in changes):
        return None
    return waterfall_chart(f"{metric} gap: {gap.a.label} vs {gap.b.label}", ("B", start, gap.b.color),
                           changes, ("A", end, gap.a.color), metric, DIGITS[metric])


def _rows(gap: RunGap, metric: str) -> list[tuple[str, ...]]:
    digits = DIGITS[metric]

    def shown(value, sign: str = "") -> str:
        return "-" if value is None else f"{float(value):{sign}.{digits}f}"
    return [(gap.a.label, gap.b.label, category_name(g.category), str(g.prompts), shown(g.native_a[metric]),
             shown(g.native_b[metric]), shown(g.gap(metric), "+"), *(shown(p.value[metric], "+") for p in g.parts))
            for g in gap.gaps]


def _none(gap: RunGap) -> bool:
    """Whether the two runs have the same tau and alpha, every part 0: said in one line, not drawn."""
    whole = gap.gaps[-1]
    return all(value == 0 for metric in DIGITS for value in (whole.gap(metric), *(p.value[metric] for p in whole.parts)))


def gap_section(gaps: Sequence[RunGap]) -> Optional[Section]:
    """None where no two runs of one pair ran other schedules or draftings."""
    if not gaps:
        return None
    figures = []
    for gap in gaps:
        if gap.gaps and not _none(gap):
            charts = [chart for chart in (_waterfall(gap, "tau"), _waterfall(gap, "alpha")) if chart]
            caption = escape(f"A: {gap.a.label} against B: {gap.b.label}, {gap.gaps[-1].prompts} prompts")
            figures.append(f'<figure class="charts"><figcaption>{caption}</figcaption>{"".join(charts)}</figure>')
    tables = tuple(Table(("run A", "run B", "category", "prompts", f"{metric} A", f"{metric} B", "gap", *PARTS),
                         tuple(row for gap in gaps for row in _rows(gap, metric)), 3,
                         f"{metric}: A - B = the sum of the parts")
                   for metric in DIGITS if any(gap.gaps for gap in gaps))
    notes = tuple(f"{gap.a.label} vs {gap.b.label}: not computed ({gap.problem})" if gap.problem else
                  f"{gap.a.label} vs {gap.b.label}: no gap (the same tau and alpha; every part 0)"
                  for gap in gaps if gap.problem or _none(gap))
    folded = (Section("tau-gap-figures", "Every figure of these gaps, per category too", "", None, tables, (),
                      fold=True),) if tables else ()
    return Section("tau-gap", "Why tau differs",
                   "For every two runs of one pair whose schedules or draftings differ, the gap in tau (and alpha) "
                   "over the prompts both finished, as `crossrt parity` decomposes it (docs/analysis.md): counting "
                   "(how each runtime counts its own figure), rendering (other prompt ids), drafter algorithm (the "
                   "drafter model or a lookup, and its n-gram lengths), schedule and rules (when drafts start, how "
                   "long, cut how), numerics (other tokens accepted where a run left the greedy output) and the "
                   "residual the simulation misses. Each chart goes from run B's figure through the parts to run A's; "
                   "the tables hold every figure, per category too.", None, (), notes, tuple(figures), parts=folded)
