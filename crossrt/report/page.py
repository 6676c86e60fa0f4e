"""A `crossrt report` page: sections of text, tables, charts and figures, and their two
renderings, one self-contained HTML file and Markdown (docs/report.md).

page() is where sections of any origin join one report: those built from run records
(crossrt/report/build.py), a ceiling (crossrt/report/ceiling.py), or any other reader's, in the order given.
Both renderings walk the same sections, so the HTML and the Markdown hold the same tables.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html import escape
from typing import Optional, Sequence

from crossrt.errors import CrossrtError


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    keys: int  # leading label columns; the others hold numbers (right-aligned)
    caption: str = ""  # what the table holds, where a section has several


@dataclass(frozen=True)
class Banner:
    """The page's answer in one line (parity's verdict), drawn large: green, red, or grey where
    nothing was judged."""

    ok: Optional[bool]  # None: nothing judged
    text: str
    detail: str = ""  # what the line does not say: where it comes from, what it left out


@dataclass(frozen=True)
class Section:
    id: str
    title: str
    intro: str
    chart: Optional[str]  # inline SVG, drawn in HTML only: the tables hold every plotted number
    tables: tuple[Table, ...]
    notes: tuple[str, ...]
    # Pre-rendered, escaped XHTML drawn after the chart (the step-coloured texts of
    # crossrt/report/steps.py); HTML only, like the chart, with its numbers in the tables.
    figures: tuple[str, ...] = ()
    # "fail" or "note": a finding's section, drawn apart (its title says which in Markdown too).
    mark: Optional[str] = None
    banner: Optional[Banner] = None  # drawn before everything else in the section
    # Sections within this one, after its own content (a heading level below), e.g. the splits
    # of one cause within the parity section.
    parts: tuple["Section", ...] = ()
    chart_last: bool = False  # the chart after the tables: where the table is the answer (the summary)
    # Evidence a reader opens on demand: in HTML the title is a one-line <summary> and the rest
    # is folded under it (<details>); Markdown has no folding, so it is a heading there.
    fold: bool = False


def _ids(sections: Sequence[Section]) -> list[str]:
    return [name for section in sections for name in (section.id, *_ids(section.parts))]


@dataclass(frozen=True)
class Report:
    title: str
    sections: tuple[Section, ...]


def page(title: str, sections: Sequence[Section]) -> Report:
    """The report of sections, in the order given. Section ids are the page's anchors (and what
    tests and scripts find sections by), so two sections may not share one."""
    ids = _ids(sections)
    twice = sorted({name for name in ids if ids.count(name) > 1})
    if twice:
        raise CrossrtError(f"report sections share the id(s) {', '.join(twice)}")
    return Report(title, tuple(sections))


STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 0.5em auto; padding: 0 1em; color: #222;
       overflow-wrap: anywhere; }
h1 { font-size: 1.5em; margin: 0.3em 0; }
table { border-collapse: collapse; margin: 1em 0; font-size: 14px; display: block; overflow-x: auto; max-width: 100%;
        overflow-wrap: normal; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; }
svg.chart { max-width: 100%; height: auto; }
figure.charts { display: flex; flex-wrap: wrap; gap: 0 1em; }
figure.charts figcaption { flex-basis: 100%; font-weight: bold; }
section { margin-bottom: 2.5em; }
figure.steps p { white-space: pre-wrap; font-family: monospace; font-size: 13px; line-height: 1.7; margin: 0.3em 0; }
figure.steps span.step { border-radius: 2px; box-shadow: inset -1px 0 0 rgba(0, 0, 0, 0.3); }
p.swatches span { display: inline-block; padding: 0 0.6em; margin-right: 0.3em; font-family: monospace; }
caption { text-align: left; font-weight: bold; padding: 2px 0; }
section.fail, details.fail { border-left: 6px solid #c62828; background: #fff4f4; padding: 0.2em 1em; }
section.note, details.note { border-left: 6px solid #e0a800; background: #fffbea; padding: 0.2em 1em; }
details { margin: 0.4em 0; }
details > summary { cursor: pointer; font-weight: bold; padding: 0.2em 0; }
p.banner { font-size: 1.3em; font-weight: bold; padding: 0.4em 0.8em; margin: 0.3em 0; border-radius: 3px; }
p.banner.ok { background: #e8f5e9; border-left: 8px solid #2e7d32; color: #1b5e20; }
p.banner.failed { background: #fdecea; border-left: 8px solid #c62828; color: #b71c1c; }
p.banner.none { background: #f3f3f3; border-left: 8px solid #757575; color: #333; }
p.banner span { display: block; font-size: 0.65em; font-weight: normal; color: #444; }
section#summary { margin-bottom: 1.5em; }
section#summary table { margin: 0.5em 0; }
@media print {
  body { max-width: none; margin: 0; }
  details::details-content { content-visibility: visible; }
  figure, table, svg { break-inside: avoid; }
}
"""


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{escape(cell)}</th>" for cell in table.header)
    cells = ("<td>{}</td>",) * table.keys + ('<td class="num">{}</td>',) * (len(table.header) - table.keys)
    body = "".join("<tr>" + "".join(form.format(escape(cell)) for form, cell in zip(cells, row, strict=True))
                   + "</tr>\n" for row in table.rows)
    caption = f"<caption>{escape(table.caption)}</caption>" if table.caption else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>"


def _html_section(section: Section, depth: int) -> list[str]:
    mark = f' class="{section.mark}"' if section.mark else ""
    title = escape(section.title)
    if section.fold:
        parts = [f'<details id="{section.id}"{mark}><summary>{title}</summary>']
    else:
        parts = [f'<section id="{section.id}"{mark}><h{depth}>{title}</h{depth}>']
    if section.banner:
        detail = f"<span>{escape(section.banner.detail)}</span>" if section.banner.detail else ""
        status = {True: "ok", False: "failed", None: "none"}[section.banner.ok]
        parts.append(f'<p class="banner {status}">{escape(section.banner.text)}{detail}</p>')
    if section.intro:
        parts.append(f"<p>{escape(section.intro)}</p>")
    chart = [f"<figure>{section.chart}</figure>"] if section.chart else []
    tables = [_html_table(table) for table in section.tables]
    parts += [*tables, *chart, *section.figures] if section.chart_last else [*chart, *section.figures, *tables]
    if section.notes:
        parts.append("<ul>" + "".join(f"<li>{escape(note)}</li>" for note in section.notes) + "</ul>")
    for part in section.parts:
        parts += _html_section(part, depth + 1)
    parts.append("</details>" if section.fold else "</section>")
    return parts


def to_html(report: Report) -> str:
    """One self-contained page: no scripts, no external resources. It is also well-formed
    XML, so any XML parser can read the numbers back."""
    parts = ["<!DOCTYPE html>", '<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8"/>',
             '<meta name="viewport" content="width=device-width, initial-scale=1"/>',
             f"<title>{escape(report.title)}</title><style>{STYLE}</style></head><body>",
             f"<h1>{escape(report.title)}</h1>"]
    for section in report.sections:
        parts += _html_section(section, 2)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


# Characters that can start Markdown or HTML markup anywhere in a line; a backslash makes
# each literal (CommonMark allows it before any ASCII punctuation), `|` included for tables.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|&~])")


def markdown_text(text: str) -> str:
    """Plain text as Markdown on one line: record text may hold markup or line breaks."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(text.split()))


def _markdown_table(table: Table) -> str:
    lines = [f"**{markdown_text(table.caption)}**", ""] if table.caption else []
    lines += ["| " + " | ".join(markdown_text(cell) for cell in table.header) + " |",
             "|" + "|".join("---" if i < table.keys else "---:" for i in range(len(table.header))) + "|"]
    lines += ["| " + " | ".join(markdown_text(cell) for cell in row) + " |" for row in table.rows]
    return "\n".join(lines)


def _markdown_section(section: Section, depth: int) -> list[str]:
    blocks = [f"{'#' * depth} {markdown_text(section.title)}"]
    if section.banner:
        blocks.append(f"**{markdown_text(section.banner.text)}**"
                      + (f"  \n{markdown_text(section.banner.detail)}" if section.banner.detail else ""))
    if section.intro:
        blocks.append(markdown_text(section.intro))
    blocks += [_markdown_table(table) for table in section.tables]
    if section.notes:
        blocks.append("\n".join(f"- {markdown_text(note)}" for note in section.notes))
    for part in section.parts:
        blocks += _markdown_section(part, depth + 1)
    return blocks


def to_markdown(report: Report) -> str:
    """The same sections and tables as to_html, in the same order, without charts: Markdown has
    no portable way to embed SVG (GitHub drops data-URI images), and the tables hold every
    plotted number."""
    blocks = [f"# {markdown_text(report.title)}",
              "Charts are in the HTML form of this report (`crossrt report ... -o report.html`); every number "
              "they plot is in these tables."]
    for section in report.sections:
        blocks += _markdown_section(section, 2)
    return "\n\n".join(blocks) + "\n"
