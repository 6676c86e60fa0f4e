"""Plain-text tables of run records, shared by the commands that print summaries."""

from __future__ import annotations

from typing import Optional, Sequence

from crossrt.records import metrics
from crossrt.records.schema import RunRecord, Summary

SETTINGS_HEADER = ["runtime", "mode", "schedule", "k", "category", "prompts", "failed", "lossless", "steps"]


def _summary_cells(record: RunRecord, category: str, summary: Summary) -> list[str]:
    done = summary.prompts - summary.failed
    lossless = "-" if record.imported else f"{summary.lossless}/{done}"  # imported: no token ids
    return [record.runtime.name, record.params.mode, record.params.schedule, str(record.params.k), category, str(summary.prompts),
            str(summary.failed), lossless, str(summary.steps),
            *(metric.format(metric.of(summary)) for metric in metrics.METRICS)]


def summary_rows(records: Sequence[RunRecord]) -> list[list[str]]:
    """Header plus, per record, one row per category and one overall row."""
    rows = [SETTINGS_HEADER + [metric.heading for metric in metrics.METRICS]]
    for record in records:
        for category in record.categories():
            rows.append(_summary_cells(record, category, record.summary(category)))
        rows.append(_summary_cells(record, "ALL", record.summary()))
    return rows


def record_notes(records: Sequence[RunRecord]) -> list[str]:
    """Lines to print under a summary table: prompts whose runtime counts did not fit its
    schedule (kept, with the runtime's raw numbers in the record)."""
    lines = []
    for record in records:
        for result in record.results:
            if result.unfit_counts is not None:
                lines.append(f"note: {record.runtime.name}/{record.params.mode} {result.prompt_id}: "
                             + result.unfit_counts.describe())
    return lines


def stored_baselines_note(record: RunRecord) -> Optional[str]:
    """A line saying how many of the record's baselines came from the store and when they were
    timed (their speedups divide by those timings), or None when every one was decoded here."""
    stored = [r.baseline_source for r in record.results if r.baseline_source and r.baseline_source.origin == "store"]
    if not stored:
        return None
    times = sorted(s.timed_at for s in stored)
    span = times[0] if times[0] == times[-1] else f"{times[0]} to {times[-1]}"
    return (f"baseline: {len(stored)} of {len(record.results)} prompts from the baseline store, timed {span} "
            "on this machine (speedup divides by those timings; --fresh-baseline decodes them now)")


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
