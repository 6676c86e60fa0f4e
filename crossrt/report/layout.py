"""The order of a report page (docs/report.md): the answer first, the explanation after. The
verdict and the summary (crossrt/report/summary.py) fill the first screen; then why tau differs
(crossrt/report/gaps.py), where the runs part and why (crossrt/report/parity.py, which passes
its verdict and section in as page objects), the details of every record
(crossrt/report/build.py), and the runs themselves with their record paths and notes last."""

from __future__ import annotations

from typing import Optional, Sequence

from crossrt.analyze import analysis
from crossrt.report.build import record_sections
from crossrt.report.gaps import RunGap, gap_section
from crossrt.report.page import Banner, Section
from crossrt.report.runs import ReportRun
from crossrt.report.summary import summary_section
from crossrt.report.sweeps import SweptCell, axis_chart, swept, sweep_section


def report_sections(runs: Sequence[ReportRun], parity: Optional[tuple[Banner, Section]] = None,
                    gaps: Sequence[RunGap] = (), edges: Sequence[float] = analysis.ENTROPY_BUCKETS,
                    cells: Sequence[SweptCell] = (), unplaced: Sequence[str] = ()) -> list[Section]:
    """Every section of the page, in order. parity: the verdict and the parity section (None
    with one run); gaps: the tau gaps of runs whose schedules differ; cells: the runs as cells
    of a sweep, with its failed cells (the summary then draws tau against the first swept
    setting, and the sweep's charts follow it); unplaced: failed cells whose settings are not
    known, as notes."""
    details = record_sections(runs, edges)
    banner, compared = parity if parity else (None, None)
    axes = swept(cells)[1] if cells else []
    summary = summary_section(runs, banner, axis_chart(cells, axes[0], "tau") if axes else None)
    placed = sweep_section(cells, unplaced) if cells or unplaced else None
    gap = gap_section(gaps)
    return [summary, *([placed] if placed else []), *([gap] if gap else []), *([compared] if compared else []),
            *details]
