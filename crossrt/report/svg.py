"""Small inline SVG charts for `crossrt report`: grouped bars and x-y lines or points, each
with axes, ticks, labels and a legend. Drawn as plain strings so a report is one
self-contained file: no plotting library, no scripts, no external resources.

Every text from a record (series names, group labels) is escaped. Each bar and point carries
a <title>, which browsers show as a tooltip, with its exact value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from typing import Optional, Sequence

# Tableau 10: distinct hues that stay apart for common colour-vision deficiencies.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")
WIDTH = 720
PLOT_HEIGHT = 240
FONT_PX = 12
# Average width of a character at FONT_PX in a sans-serif font: lays out legends and decides
# whether labels fit, since there is no renderer to measure text with.
CHAR_PX = 6.6
LEFT, RIGHT, TOP = 60, 16, 28
LINE_PX = 18
MAX_LABEL = 32  # characters of a bar group's label; longer ones are cut, whole in their tooltip
TURN = 35  # degrees labels are turned by when they do not fit side by side


@dataclass(frozen=True)
class Bars:
    """One bar per group, in one colour; None draws no bar."""

    name: str
    values: tuple[Optional[float], ...]
    color: str


@dataclass(frozen=True)
class Points:
    """A series of (x, y) points, joined by a line unless connect is False."""

    name: str
    points: tuple[tuple[float, float], ...]
    color: str
    connect: bool = True
    hollow: bool = False  # open markers: tells two series of one colour apart
    labels: tuple[str, ...] = ()  # per point, for its tooltip (e.g. the category it stands for)


def palette_color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def nice_ticks(high: float, low: float = 0.0, count: int = 5) -> tuple[float, ...]:
    """About `count` ticks at a step of 1, 2 or 5 times a power of ten, from low to the
    first tick at or above high."""
    span = high - low if high > low else 1.0
    raw = span / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(f * power for f in (1, 2, 5, 10) if f * power >= raw)
    ticks = [low]
    while ticks[-1] < high - 1e-9 * span:
        ticks.append(round(low + len(ticks) * step, 10))
    return tuple(ticks)


def _number(value: float) -> str:
    return f"{value:.4g}"


def _text(x: float, y: float, text: str, anchor: str = "middle", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}"{extra}>{escape(text)}</text>'


def _legend(entries: Sequence[tuple[str, str, bool]], top: float, chart_width: float = WIDTH) -> tuple[list[str], float]:
    """Legend entries (name, colour, hollow) laid out left to right, wrapping at the chart
    width; returns the elements and the height they take."""
    parts, x, y = [], float(LEFT), top
    for name, color, hollow in entries:
        width = 22 + len(name) * CHAR_PX + 16
        if x + width > chart_width - RIGHT and x > LEFT:
            x, y = float(LEFT), y + LINE_PX
        fill = "#fff" if hollow else color
        parts.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="12" height="12" fill="{fill}" stroke="{color}" '
                     f'stroke-width="2"/>')
        parts.append(_text(x + 18, y + 1, name, "start"))
        x += width
    return parts, y - top + LINE_PX


@dataclass(frozen=True)
class _Frame:
    """The plot area (its bottom, height and width) and the value range of its y axis."""

    bottom: float
    y_ticks: tuple[float, ...]
    height: float = PLOT_HEIGHT
    width: float = WIDTH

    @property
    def y_max(self) -> float:
        return self.y_ticks[-1]

    def y(self, value: float) -> float:
        return self.bottom - (value - self.y_ticks[0]) / (self.y_max - self.y_ticks[0]) * self.height


def _y_axis(frame: _Frame, label: str) -> list[str]:
    parts, right = [], frame.width - RIGHT
    for tick in frame.y_ticks:
        y = frame.y(tick)
        parts.append(f'<line x1="{LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        parts.append(_text(LEFT - 6, y + 4, f"{tick:g}", "end"))
    middle = frame.bottom - frame.height / 2
    parts.append(_text(16, middle, label, extra=f' transform="rotate(-90 16 {middle:.1f})"'))
    parts.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{frame.bottom}" stroke="#333"/>')
    parts.append(f'<line x1="{LEFT}" x2="{right}" y1="{frame.bottom}" y2="{frame.bottom}" stroke="#333"/>')
    return parts


def _svg(title: str, height: float, parts: Sequence[str], left_pad: float = 0.0, width: float = WIDTH) -> str:
    """The chart's root element; left_pad widens it leftwards for turned labels that reach
    past the y axis."""
    pad, width = round(left_pad), round(width)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width + pad}" height="{height:.0f}" '
            f'viewBox="{-pad} 0 {width + pad} {height:.0f}" role="img" aria-label="{escape(title)}" '
            f'font-family="sans-serif" font-size="{FONT_PX}">'
            f'<title>{escape(title)}</title>' + "".join(parts) + "</svg>")


def _reference_line(frame: _Frame, value: float, label: str) -> list[str]:
    y = frame.y(value)
    return [f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#333" '
            f'stroke-dasharray="5 4"/>', _text(WIDTH - RIGHT - 4, y - 4, label, "end")]


@dataclass(frozen=True)
class _GroupLabels:
    """Labels under the slots of a bar chart. Labels too wide for their slot are shortened and
    turned (the full label in a tooltip), and the chart grows down and left to hold them."""

    parts: tuple[str, ...]
    height: float
    left_pad: float

    @classmethod
    def of(cls, groups: Sequence[str], slot: float, label_y: float) -> "_GroupLabels":
        shown = [g if len(g) <= MAX_LABEL else g[:MAX_LABEL - 1] + "\u2026" for g in groups]
        turned = max((len(g) for g in shown), default=0) * CHAR_PX > slot - 4
        reach = [len(g) * CHAR_PX * math.cos(math.radians(TURN)) for g in shown] if turned else []
        parts = []
        for g, group in enumerate(groups):
            centre = LEFT + slot * (g + 0.5)
            extra = f' transform="rotate(-{TURN} {centre:.1f} {label_y:.1f})"' if turned else ""
            tooltip = f"<title>{escape(group)}</title>" if shown[g] != group else ""
            parts.append(f'<text x="{centre:.1f}" y="{label_y:.1f}" text-anchor="{"end" if turned else "middle"}"'
                         f'{extra}>{tooltip}{escape(shown[g])}</text>')
        return cls(tuple(parts), max(reach, default=0.0) * math.tan(math.radians(TURN)) + 10 if turned else LINE_PX,
                   max([0.0] + [r - (LEFT + slot * (g + 0.5)) + 4 for g, r in enumerate(reach)]))


def bar_chart(title: str, groups: Sequence[str], series: Sequence[Bars], y_label: str,
              y_max: Optional[float] = None, reference: Optional[tuple[float, str]] = None,
              plot_height: float = PLOT_HEIGHT) -> str:
    """Grouped bars: one cluster per group, one bar per series in it. y starts at 0 and
    reaches y_max (default: the largest value, rounded up to a tick). reference: a dashed
    horizontal line (value, label), e.g. speedup 1. plot_height: a smaller chart where the
    page has little room (its summary)."""
    values = [v for s in series for v in s.values if v is not None]
    top_value = max([y_max or 0.0, *values, reference[0] if reference else 0.0]) or 1.0
    slot = (WIDTH - LEFT - RIGHT) / max(len(groups), 1)
    frame = _Frame(TOP + plot_height, nice_ticks(top_value), plot_height)
    labels = _GroupLabels.of(groups, slot, frame.bottom + 16)
    parts = _y_axis(frame, y_label) + list(labels.parts)
    inner = slot * 0.8 / max(len(series), 1)
    for g, group in enumerate(groups):
        for s, bars in enumerate(series):
            value = bars.values[g]
            if value is None:
                continue
            x = LEFT + slot * (g + 0.1) + inner * s
            y = frame.y(value)
            parts.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{max(inner - 1, 1):.1f}" '
                         f'height="{frame.bottom - y:.1f}" fill="{bars.color}"><title>'
                         f'{escape(f"{bars.name}, {group}: {_number(value)}")}</title></rect>')
    if reference:
        parts += _reference_line(frame, *reference)
    legend, legend_height = _legend([(s.name, s.color, False) for s in series], frame.bottom + labels.height + 20)
    return _svg(title, frame.bottom + labels.height + 12 + legend_height, parts + legend, labels.left_pad)


def _marker(x: float, y: float, series: Points, label: str) -> str:
    fill = "#fff" if series.hollow else series.color
    return (f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{fill}" stroke="{series.color}" '
            f'stroke-width="2"><title>{escape(label)}</title></circle>')


def xy_chart(title: str, series: Sequence[Points], x_label: str, y_label: str,
             x_ticks: Optional[Sequence[float]] = None, y_max: Optional[float] = None,
             diagonal: bool = False, failures: Sequence[tuple[float, str, str]] = ()) -> str:
    """Points on numeric axes, one line (or marker set) per series; y starts at 0. x_ticks:
    evenly spaced x values to tick (e.g. draft positions 1..k), with half a step of room on
    each side; by default x starts at 0 with nice ticks. diagonal: both axes from 0 on the
    same range, with the line y = x, to compare a prediction with a measurement. failures:
    (x, colour, tooltip) of points that have no value because their run failed, drawn as a
    cross on the x axis so a failure is seen where its point would be, not left out."""
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    top_y = max([y_max or 0.0, *ys, *(xs if diagonal else ())]) or 1.0
    frame = _Frame(TOP + PLOT_HEIGHT, nice_ticks(top_y))
    if diagonal:
        x_ticks = frame.y_ticks
        x_low, x_high = 0.0, frame.y_max
    elif x_ticks:
        x_ticks = tuple(x_ticks)
        pad = (x_ticks[1] - x_ticks[0]) / 2 if len(x_ticks) > 1 else 0.5
        x_low, x_high = x_ticks[0] - pad, x_ticks[-1] + pad
    else:
        x_ticks = nice_ticks(max(xs, default=1.0))
        x_low, x_high = 0.0, x_ticks[-1]
    width = WIDTH - LEFT - RIGHT

    def x_of(value: float) -> float:
        return LEFT + (value - x_low) / (x_high - x_low) * width

    parts = _y_axis(frame, y_label)
    parts += [_text(x_of(tick), frame.bottom + 16, f"{tick:g}") for tick in x_ticks]
    parts.append(_text(LEFT + width / 2, frame.bottom + 34, x_label))
    if diagonal:
        parts.append(f'<line x1="{x_of(0):.1f}" y1="{frame.y(0):.1f}" x2="{x_of(x_high):.1f}" '
                     f'y2="{frame.y(x_high):.1f}" stroke="#999" stroke-dasharray="5 4"/>')
    for s in series:
        if s.connect and len(s.points) > 1:
            path = " ".join(f"{x_of(x):.1f},{frame.y(y):.1f}" for x, y in s.points)
            parts.append(f'<polyline class="line" points="{path}" fill="none" stroke="{s.color}" stroke-width="2"/>')
        names = s.labels or ("",) * len(s.points)
        parts += [_marker(x_of(x), frame.y(y), s, f"{s.name}{', ' + name if name else ''}: ({_number(x)}, {_number(y)})")
                  for (x, y), name in zip(s.points, names, strict=True)]
    for x, color, tooltip in failures:
        cx, cy = x_of(x), frame.bottom
        parts.append(f'<path class="failed" d="M{cx - 5:.1f},{cy - 5:.1f} L{cx + 5:.1f},{cy + 5:.1f} '
                     f'M{cx - 5:.1f},{cy + 5:.1f} L{cx + 5:.1f},{cy - 5:.1f}" stroke="{color}" stroke-width="3">'
                     f'<title>{escape(tooltip)}</title></path>')
    legend, legend_height = _legend([(s.name, s.color, s.hollow) for s in series], frame.bottom + 58)
    return _svg(title, frame.bottom + 50 + legend_height, parts + legend)


WATERFALL_WIDTH = 540  # two fit side by side on the page
RISE, FALL = "#59a14f", "#e15759"


def _range_ticks(low: float, high: float, count: int = 4) -> tuple[float, ...]:
    """About `count` round ticks from at or below low to at or above high."""
    step = nice_ticks(high - low if high > low else abs(high) or 1.0, count=count)[1]
    ticks = [round(math.floor(low / step) * step, 10)]
    while ticks[-1] < high - 1e-9 * step:
        ticks.append(round(ticks[0] + len(ticks) * step, 10))
    return tuple(ticks)


def waterfall_chart(title: str, start: tuple[str, float, str], changes: Sequence[tuple[str, float]],
                    end: tuple[str, float, str], y_label: str, digits: int = 2) -> str:
    """A total, the changes that lead from it to another total, and that total: start and end
    are (label, value, colour), changes (label, change). Totals are bars from the axis's foot;
    a change floats from the running sum before it to the one after, green up and red down,
    joined to the next bar by a dashed line; each bar is labelled with its value to `digits`
    decimals and its tooltip holds it to four significant digits. The y axis spans the totals
    and running sums rather than starting at 0: parts of a few hundredths beside a tau of 3 to
    4 would not show from 0 (its foot is labelled, so the cut is seen)."""
    levels = [start[1]]
    for _, change in changes:
        levels.append(levels[-1] + change)
    low, high = min(levels + [end[1]]), max(levels + [end[1]])
    margin = (high - low) * 0.2 or abs(high) * 0.05 or 0.1
    foot = max(0.0, low - margin) if low >= 0 else low - margin
    frame = _Frame(TOP + PLOT_HEIGHT * 0.75, _range_ticks(foot, high + margin), PLOT_HEIGHT * 0.75, WATERFALL_WIDTH)
    names = [start[0], *(name for name, _ in changes), end[0]]
    slot = (WATERFALL_WIDTH - LEFT - RIGHT) / len(names)
    labels = _GroupLabels.of(names, slot, frame.bottom + 16)
    parts = _y_axis(frame, y_label) + list(labels.parts)
    bar = slot * 0.6
    spans = [(frame.y_ticks[0], start[1], start[2], _number(start[1]), f"{start[1]:.{digits}f}")]
    spans += [(levels[i], levels[i + 1], RISE if change >= 0 else FALL, f"{change:+.4g}", f"{change:+.{digits}f}")
              for i, (_, change) in enumerate(changes)]
    spans.append((frame.y_ticks[0], end[1], end[2], _number(end[1]), f"{end[1]:.{digits}f}"))
    for i, (name, (base, top, color, exact, shown)) in enumerate(zip(names, spans, strict=True)):
        x = LEFT + slot * (i + 0.2)
        y_top, y_bottom = frame.y(max(base, top)), frame.y(min(base, top))
        kind = "total" if i in (0, len(names) - 1) else "change"
        parts.append(f'<rect class="bar {kind}" x="{x:.1f}" y="{y_top:.1f}" width="{bar:.1f}" '
                     f'height="{max(y_bottom - y_top, 1):.1f}" fill="{color}"><title>{escape(f"{name}: {exact}")}'
                     "</title></rect>")
        parts.append(_text(x + bar / 2, y_top - 4, shown))
        if i < len(names) - 1:  # from this bar's level after it to the next bar
            y = frame.y(top)
            parts.append(f'<line x1="{x + bar:.1f}" x2="{x + slot:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#666" '
                         'stroke-dasharray="3 3"/>')
    return _svg(title, frame.bottom + labels.height + 12, parts, labels.left_pad, WATERFALL_WIDTH)
