"""Tables of run records (and of stored baselines), in the four forms the listing commands print
(`show`, `analyze`, `cache ls`, `sweep show`; `run` and `import` the first): aligned text, CSV,
JSON and GitHub Markdown.

A cell holds a value (CSV and JSON: numbers as numbers, none as empty or null) and its text (the
aligned table and Markdown). Identity columns say which run a row is of, the same in every table
of records: its file, pair, runtime, mode, schedule, drafting, k (or the k policy), acceptance and
whether it is lossy. CSV, JSON and Markdown give every column on every row; the aligned table
states once, above its columns, the identity every row shares, and numbers the files, so stacked
runs stay apart within a terminal's width.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

from crossrt.records import metrics
from crossrt.records.metrics import ratio
from crossrt.records.schema import RunParams, RunRecord, Summary

FORMATS = ("table", "csv", "json", "md")
HEADING_WIDTH = 100  # the aligned table's identity lines are wrapped to about this many characters

Value = Union[str, int, float, bool, None]


@dataclass(frozen=True)
class Column:
    key: str  # its name in CSV and JSON
    heading: str  # its name in the aligned table and Markdown
    identity: bool = False  # says which run a row is of: stated once above an aligned table where every row shares it
    numbered: bool = False  # too long for a column (a file): the aligned table numbers it, each number listed above


@dataclass(frozen=True)
class Cell:
    value: Value
    text: str


@dataclass(frozen=True)
class Table:
    columns: tuple[Column, ...]
    rows: tuple[tuple[Cell, ...], ...]


def cell(value: Value) -> Cell:
    """value shown as itself: none as `-`, a bool as yes or no."""
    if value is None:
        return Cell(None, "-")
    if isinstance(value, bool):
        return Cell(value, "yes" if value else "no")
    return Cell(value, str(value))


def number(value: Optional[float], spec: str = ".2f") -> Cell:
    """A rate, whole in CSV and JSON and shown by spec; none (or not finite) as `-`."""
    if value is None or not math.isfinite(value):
        return Cell(None, "-")
    return Cell(value, format(value, spec))


IDENTITY = (Column("file", "file", identity=True, numbered=True),
            *(Column(name, name, identity=True) for name in ("pair", "runtime", "mode", "schedule", "drafting", "k",
                                                             "acceptance", "lossy")))


def k_setting(k: int, k_policy: str = "fixed", content_k: Optional[str] = None, k_max: Optional[int] = None,
              min_p1: Optional[float] = None) -> Union[int, str]:
    """A run's k as its tables state it: k at fixed k, else the k policy with what it reads
    (`content code=7,prose=3`, `online k_max=8`, `confidence k=4,min_p1=0.5`)."""
    if k_policy == "content":
        return f"content {content_k}"
    if k_policy == "online":
        return f"online k_max={k_max}"
    if k_policy == "confidence":
        return f"confidence k={k},min_p1={min_p1:g}"
    return k


def drafting(params: RunParams) -> str:
    """What proposed the drafts: the drafting with its parameters, or a native spec type."""
    if params.drafting == "tree":
        return f"tree {params.tree}"
    if params.ngram_max is not None:
        lengths = params.ngram_max if params.ngram_min is None else f"{params.ngram_min}..{params.ngram_max}"
        return f"{params.drafting} ngram={lengths}"
    return params.spec_type if params.drafting == "model" and params.spec_type != "draft" else params.drafting


def acceptance(params: RunParams) -> str:
    """The acceptance rule with its parameters."""
    if params.acceptance == "relaxed":
        return f"relaxed top_m={params.top_m},delta={params.delta:g}"
    return params.acceptance


def identity(path: Path, record: RunRecord) -> tuple[Cell, ...]:
    """The identity cells of a record's rows, in IDENTITY's order."""
    params = record.params
    k = k_setting(params.k, params.k_policy, params.content_k, params.k_max, params.min_p1)
    return tuple(cell(value) for value in (str(path), record.pair.name, record.runtime.name, params.mode,
                                           params.schedule, drafting(params), k, acceptance(params), params.lossy))


def _lossless(record: RunRecord, summary: Summary) -> Cell:
    """Finished prompts equal to their baseline, of the finished: none where the record makes no
    such claim (imported: no token ids; lossy: its rule may leave greedy decoding)."""
    if record.params.lossy:
        return Cell(None, "lossy")
    if record.imported:
        return Cell(None, "-")
    return Cell(summary.lossless, f"{summary.lossless}/{summary.prompts - summary.failed}")


SUMMARY_COLUMNS = (Column("category", "category"), Column("prompts", "prompts"), Column("failed", "failed"),
                   Column("lossless", "lossless"), Column("steps", "steps"), Column("k_used", "k used"))


def _summary_cells(path: Path, record: RunRecord, category: str, summary: Summary) -> tuple[Cell, ...]:
    return (*identity(path, record), cell(category), cell(summary.prompts), cell(summary.failed),
            _lossless(record, summary), cell(summary.steps), number(ratio(summary.drafted, summary.steps), ".1f"),
            *(number(metric.of(summary), f".{metric.digits}f") for metric in metrics.METRICS))


def summary_table(runs: Sequence[tuple[Path, RunRecord]]) -> Table:
    """Per record (its path and itself), one row per category and one overall (ALL): counts, k
    used (drafted / steps: the mean draft a step verified, the k policy's choices less budget
    cuts and stops) and every metric of the metric list, last."""
    columns = (*IDENTITY, *SUMMARY_COLUMNS, *(Column(metric.name, metric.heading) for metric in metrics.METRICS))
    rows = tuple(_summary_cells(path, record, category or "ALL", record.summary(category))
                 for path, record in runs for category in (*record.categories(), None))
    return Table(columns, rows)


def render(table: Table, form: str) -> str:
    """The table in one of FORMATS; an aligned table of no rows is empty."""
    return {"table": _aligned, "csv": _csv, "json": _json, "md": _markdown}[form](table)


def _wrapped(items: Sequence[str], width: int = HEADING_WIDTH) -> list[str]:
    """items joined by `; ` into lines of about width, the lines after the first indented."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 2 + len(item) <= width:
            lines[-1] += "; " + item
        else:
            lines.append(("  " if lines else "") + item)
    return lines


def _aligned(table: Table) -> str:
    if not table.rows:
        return ""
    columns, rows = table.columns, table.rows
    shared = [i for i, column in enumerate(columns) if column.identity and len({row[i].text for row in rows}) == 1]
    kept = [i for i in range(len(columns)) if i not in shared]
    numbered = next((i for i in kept if columns[i].numbered), None)
    firsts = {row[numbered].text: row for row in rows} if numbered is not None else {}  # a row per number
    labels = {text: f"#{n}" for n, text in enumerate(firsts, 1)}

    def shown(row: tuple[Cell, ...], i: int) -> str:
        return labels[row[i].text] if i == numbered else row[i].text

    def width(i: int) -> int:
        return max(len(columns[i].heading), *(len(shown(row, i)) for row in rows))

    # Identity that varies stays a column while the table fits the terminal; past it, the widest
    # goes beside each number, whose identity (a record's file) says the rest of the row's.
    listed: list[int] = []
    movable = sorted((i for i in kept if columns[i].identity and numbered not in (None, i)), key=width)
    while movable and sum(width(i) + 2 for i in kept) - 2 > shutil.get_terminal_size((120, 24)).columns:
        listed.append(movable.pop())
        kept.remove(listed[-1])
    lines = _wrapped([f"{columns[i].heading}: {rows[0][i].text}" for i in shared])
    for text, row in firsts.items():
        lines += _wrapped([f"{columns[numbered].heading} {labels[text]}: {text}",
                           *(f"{columns[i].heading}: {row[i].text}" for i in sorted(listed))])
    return "\n".join([*lines, format_table([[columns[i].heading for i in kept],
                                             *([shown(row, i) for i in kept] for row in rows)])])


def _csv_value(value: Value) -> Value:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else value


def _csv(table: Table) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([column.key for column in table.columns])
    writer.writerows([_csv_value(c.value) for c in row] for row in table.rows)
    return out.getvalue().rstrip("\n")


def _json(table: Table) -> str:
    keys = [column.key for column in table.columns]
    return json.dumps([{key: c.value for key, c in zip(keys, row, strict=True)} for row in table.rows], indent=1,
                      allow_nan=False)


def _markdown_row(texts: Sequence[str]) -> str:
    return "| " + " | ".join(text.replace("|", "\\|") for text in texts) + " |"


def _markdown(table: Table) -> str:
    lines = [_markdown_row([column.heading for column in table.columns]), "|" + "---|" * len(table.columns)]
    lines += [_markdown_row([c.text for c in row]) for row in table.rows]
    return "\n".join(lines)


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
    """Rows of text as aligned columns, a rule under the first (the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
