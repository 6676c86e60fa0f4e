"""A sweep on the report page (docs/report.md): tau, alpha and speedup against each swept
numeric setting (k, and any other), one line per combination of the other swept settings (per
runtime and mode, say), as vLLM's sweep plots draw them; a cell that failed is a cross on the
axis where its point would be, and a row of the table, never dropped.

What a cell's settings are comes from the sweep directory (crossrt/cli/report.py reads it: the
report stage does not import the sweep stage); the numbers are the records' summaries, as
`crossrt show` prints them (crossrt/records/metrics.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from crossrt.records import metrics
from crossrt.report.page import Section, Table
from crossrt.report.runs import ReportRun, lossless_cell
from crossrt.report.svg import Points, palette_color, xy_chart

CHARTED = ("tau", "alpha", "speedup")  # the numbers people plot against k


@dataclass(frozen=True)
class SweptCell:
    settings: Mapping[str, Any]  # the cell's settings as its sweep names them (runtime, mode, k, ...)
    run: Optional[ReportRun]  # None: the cell failed
    failure: str = ""  # why it failed


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def swept(cells: Sequence[SweptCell]) -> tuple[list[str], list[str]]:
    """(the settings that differ between cells, in the sweep's order; those of them that are
    numeric in every cell: the x axes)."""
    keys = list(dict.fromkeys(key for cell in cells for key in cell.settings))
    varying = [key for key in keys if len({repr(cell.settings.get(key)) for cell in cells}) > 1]
    return varying, [key for key in varying if all(_numeric(cell.settings.get(key)) for cell in cells)]


def _series_name(cell: SweptCell, others: Sequence[str]) -> str:
    """The other swept settings' values (numbers named: `k=4`; a native cell's schedule, None, left out)."""
    values = [(key, cell.settings.get(key)) for key in others]
    return " ".join(f"{key}={value}" if _numeric(value) else str(value)
                    for key, value in values if value is not None) or "all cells"


def _failure(cell: SweptCell) -> Optional[str]:
    """Why the cell has no numbers: its run failed, or finished no prompt."""
    if cell.run is None:
        return cell.failure
    if not any(r.ok for r in cell.run.record.results):
        return "no prompt finished"
    return None


def axis_chart(cells: Sequence[SweptCell], axis: str, metric: str) -> str:
    """metric against axis, one line per combination of the other swept settings."""
    varying, _ = swept(cells)
    others = [key for key in varying if key != axis]
    names = list(dict.fromkeys(_series_name(cell, others) for cell in cells))
    series, failures = [], []
    for index, name in enumerate(names):
        members = sorted((cell for cell in cells if _series_name(cell, others) == name),
                         key=lambda cell: cell.settings[axis])
        color = palette_color(index)
        points = []
        for cell in members:
            value = metrics.named(metric).of(cell.run.record.summary()) if cell.run else None
            why = _failure(cell)
            if why is not None:
                failures.append((cell.settings[axis], color, f"{name}, {axis}={cell.settings[axis]}: failed: {why}"))
            elif value is not None:
                points.append((cell.settings[axis], value))
        series.append(Points(name, tuple(points), color))
    ticks = sorted({cell.settings[axis] for cell in cells})
    heading = metrics.named(metric).heading
    return xy_chart(f"{heading} against {axis}", series, axis, heading, x_ticks=ticks,
                    y_max=1.0 if metric == "alpha" else None, failures=failures)


def sweep_section(cells: Sequence[SweptCell], unplaced: Sequence[str] = ()) -> Section:
    """The charts against every numeric swept setting (but tau against the first, which the
    summary draws) and a row per cell. unplaced: failed cells whose settings are not known, each
    a note."""
    varying, axes = swept(cells)
    figures = []
    for axis in axes:  # the summary draws tau against the first axis already
        charts = [axis_chart(cells, axis, metric) for metric in CHARTED if (axis, metric) != (axes[0], "tau")]
        figures.append(f'<figure class="charts">{"".join(charts)}</figure>')
    quoted = [metrics.named(name) for name in ("tau", "alpha", "tokens_per_s", "speedup")]
    rows = []
    for cell in sorted(cells, key=lambda cell: [repr(cell.settings.get(key)) for key in varying if key not in axes]
                       + [cell.settings.get(key) for key in axes]):
        settings = [str(cell.settings.get(key)) for key in varying]
        if cell.run is None:
            rows.append((*settings, f"failed: {cell.failure}", *[""] * (len(quoted) + 1)))
            continue
        summary = cell.run.record.summary()
        shown = [metric.format(metric.of(summary)) for metric in quoted]
        rows.append((*settings, cell.run.label, *shown[:2], lossless_cell(cell.run, summary), *shown[2:]))
    header = (*varying, "run", *(m.heading for m in quoted[:2]), "lossless", *(m.heading for m in quoted[2:]))
    failed = sum(cell.run is None for cell in cells) + len(unplaced)
    return Section("sweep", "Against the swept settings",
                   f"{len(cells) + len(unplaced)} cells, {failed} failed. Each chart draws one number against one swept setting, "
                   "a line per combination of the other swept settings; a cross on the axis is a cell that failed "
                   "(its tooltip says why). Cells in the table, failed ones with their reason.", None,
                   (Table(header, tuple(rows), len(varying) + 1),), tuple(unplaced), tuple(figures))
