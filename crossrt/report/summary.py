"""The report's first screen (docs/report.md): parity's verdict as one banner, then per run the
numbers people quote (tau, alpha, lossless, tokens/s, speedup) with tau per category beside
them, as a compact table and a chart. Every number is a metric of crossrt/records/metrics.py on
the record's summary, formatted as `crossrt show` prints it; the verdict is the one
crossrt/compare/parity_report.py gives (crossrt/report/parity.py: verdict_banner)."""

from __future__ import annotations

from typing import Optional, Sequence

from crossrt.records import metrics
from crossrt.report.page import Banner, Section, Table
from crossrt.report.runs import ReportRun, by_category_bars, categories, category_name, lossless_cell
from crossrt.report.svg import bar_chart

QUOTED = ("tau", "alpha", "tokens_per_s", "speedup")  # in the table's order, lossless after alpha
SUMMARY_PLOT_HEIGHT = 130  # the chart shares the first screen with the banner and the table


def summary_section(runs: Sequence[ReportRun], banner: Optional[Banner], chart: Optional[str] = None) -> Section:
    """banner: parity's verdict; None with one run, which has no parity across runs. chart: one
    to draw instead of tau per category, before the table (a sweep's tau against k: its table
    has a row per cell, which would push a chart below it out of the first screen)."""
    per_category = [c for c in categories(runs) if c is not None]
    quoted = [metrics.named(name) for name in QUOTED]
    rows = []
    for run in runs:
        summary = run.record.summary()
        values = [metric.format(metric.of(summary)) for metric in quoted]
        tau = metrics.named("tau")
        by_category = [tau.format(tau.of(run.record.summary(c))) if c in run.record.categories() else ""
                       for c in per_category]
        rows.append((run.label, *values[:2], lossless_cell(run, summary), *values[2:], *by_category))
    header = ("run", *(m.heading for m in quoted[:2]), "lossless", *(m.heading for m in quoted[2:]),
              *(f"tau {c}" for c in per_category))
    drawn = chart or bar_chart("tau per category", [category_name(c) for c in categories(runs)],
                               by_category_bars(runs, "tau"), "tau", plot_height=SUMMARY_PLOT_HEIGHT)
    intro = ("Per run over its finished prompts: tau (tokens per step, bonus included), alpha (accepted / "
             "drafted), lossless (outputs equal to the plain greedy baseline), tokens/s and speedup over plain "
             "greedy on the same runtime, then tau per category; the chart draws "
             + ("tau against the swept setting." if chart else "tau per category."))
    if banner is None:
        intro += " One run: no parity across runs (give two or more records)."
    return Section("summary", "Summary", intro, drawn, (Table(header, tuple(rows), 1),), (), banner=banner,
                   chart_last=chart is None)
