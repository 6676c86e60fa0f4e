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


@dataclass(frozen=True)
class Report:
    title: str
    sections: tuple[Section, ...]


def page(title: str, sections: Sequence[Section]) -> Report:
    """The report of sections, in the order given. Section ids are the page's anchors (and what
    tests and scripts find sections by), so two sections may not share one."""
    ids = [section.id for section in sections]
    twice = sorted({name for name in ids if ids.count(name) > 1})
    if twice:
        raise CrossrtError(f"report sections share the id(s) {', '.join(twice)}")
    return Report(title, tuple(sections))


STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; }
section { margin-bottom: 2.5em; }
figure.steps p { white-space: pre-wrap; font-family: monospace; font-size: 13px; line-height: 1.7; margin: 0.3em 0; }
figure.steps span.step { border-radius: 2px; box-shadow: inset -1px 0 0 rgba(0, 0, 0, 0.3); }
p.swatches span { display: inline-block; padding: 0 0.6em; margin-right: 0.3em; font-family: monospace; }
caption { text-align: left; font-weight: bold; padding: 2px 0; }
section.fail { border-left: 6px solid #c62828; background: #fff4f4; padding: 0.2em 1em; }
section.note { border-left: 6px solid #e0a800; background: #fffbea; padding: 0.2em 1em; }
"""


def _html_table(table: Table) -> str:
    head = "".join(f"<th>{escape(cell)}</th>" for cell in table.header)
    cells = ("<td>{}</td>",) * table.keys + ('<td class="num">{}</td>',) * (len(table.header) - table.keys)
    body = "".join("<tr>" + "".join(form.format(escape(cell)) for form, cell in zip(cells, row, strict=True))
                   + "</tr>\n" for row in table.rows)
    caption = f"<caption>{escape(table.caption)}</caption>" if table.caption else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>"


def to_html(report: Report) -> str:
    """One self-contained page: no scripts, no external resources. It is also well-formed
    XML, so any XML parser can read the numbers back."""
    parts = ["<!DOCTYPE html>", '<html xmlns="http://www.w3.org/1999/xhtml" lang="en"><head><meta charset="utf-8"/>',
             f"<title>{escape(report.title)}</title><style>{STYLE}</style></head><body>",
             f"<h1>{escape(report.title)}</h1>"]
    for section in report.sections:
        mark = f' class="{section.mark}"' if section.mark else ""
        parts.append(f'<section id="{section.id}"{mark}><h2>{escape(section.title)}</h2><p>{escape(section.intro)}</p>')
        if section.chart:
            parts.append(f"<figure>{section.chart}</figure>")
        parts += section.figures
        parts += [_html_table(table) for table in section.tables]
        if section.notes:
            parts.append("<ul>" + "".join(f"<li>{escape(note)}</li>" for note in section.notes) + "</ul>")
        parts.append("</section>")
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


def to_markdown(report: Report) -> str:
    """The same sections and tables as to_html, without charts: Markdown has no portable way to
    embed SVG (GitHub drops data-URI images), and the tables hold every plotted number."""
    blocks = [f"# {markdown_text(report.title)}",
              "Charts are in the HTML form of this report (`crossrt report ... -o report.html`); every number "
              "they plot is in these tables."]
    for section in report.sections:
        blocks += [f"## {markdown_text(section.title)}", markdown_text(section.intro)]
        blocks += [_markdown_table(table) for table in section.tables]
        if section.notes:
            blocks.append("\n".join(f"- {markdown_text(note)}" for note in section.notes))
    return "\n\n".join(blocks) + "\n"
