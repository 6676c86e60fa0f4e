"""Plain-text tables of run records, shared by the commands that print summaries."""

from __future__ import annotations

from typing import Sequence

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


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
