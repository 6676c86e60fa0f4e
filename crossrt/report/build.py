"""`crossrt report`: any number of run records in one file, HTML with inline SVG charts or
Markdown with the same tables (docs/report.md).

The details the records give are built here as sections of plain text, tables and charts
(record_sections); crossrt/report/layout.py puts the answer before them (the verdict and the
summary, the tau gaps, parity) and crossrt/report/page.py renders the page (to_html,
to_markdown), so both formats hold the same numbers. Every number comes from the record's
summary or from crossrt/analyze/analysis.py, formatted as `crossrt show` and `crossrt analyze`
print it; the step-coloured output texts are crossrt/report/steps.py.
"""

from __future__ import annotations

from typing import Optional, Sequence

from crossrt.records import metrics
from crossrt.analyze import analysis
from crossrt.imports.importer import import_summary
from crossrt.report.page import Section, Table
from crossrt.report.steps import steps_section
from crossrt.records.schema import RecordError
from crossrt.report.runs import ReportRun, by_category_bars, categories, category_name, lossless_cell
from crossrt.report.svg import Bars, Points, bar_chart, palette_color, xy_chart


def _fixed(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _signed(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _run_notes(run: ReportRun) -> list[str]:
    notes = [f"{run.label}: {note}" for note in run.record.notes]
    if run.record.imported:
        notes.append(f"{run.label}: {import_summary(run.record)}")
    if not any(r.ok for r in run.record.results):
        notes.append(f"{run.label}: no prompt finished, so the run has no numbers, bars or points")
    for result in run.record.results:
        if not result.ok:
            notes.append(f"{run.label}: prompt {result.prompt_id} ({result.category}) failed: {result.error}")
    differing = [r.prompt_id for r in run.record.results if r.lossless is False]  # None: not checked
    if differing:
        notes.append(f"{run.label}: output differs from the plain greedy baseline: {', '.join(differing)}")
    return notes


def runs_section(runs: Sequence[ReportRun]) -> Section:
    rows = []
    for run in runs:
        record, summary = run.record, run.record.summary()
        runtime = record.runtime
        traced = (f"{len(run.trace)} prompts" if run.trace else "unreadable" if run.trace_problem else "none")
        threads = f", threads {runtime.threads}" if runtime.threads else ""
        where = f"imported from {record.imported.format}" if record.imported else f"{runtime.device}{threads}"
        budget = record.params.max_new_tokens
        rows.append((run.label, f"{runtime.name} {runtime.version} ({where})",
                     record.params.mode, record.params.schedule, record.pair.name, run.path, traced,
                     str(record.params.k), "-" if budget is None else str(budget), str(summary.prompts),
                     str(summary.failed)))
    table = Table(("run", "runtime", "mode", "schedule", "pair", "record", "trace", "k", "new tokens", "prompts",
                   "failed"), tuple(rows), 7)
    notes = tuple(note for run in runs for note in _run_notes(run))
    return Section("runs", "Runs", f"{len(runs)} run record(s): what each is, where its record lies, and "
                   "what its counts note. The run label names each run in the tables and charts above.",
                   None, (table,), notes)


def tau_section(runs: Sequence[ReportRun]) -> Section:
    groups = [category_name(c) for c in categories(runs)]
    chart = bar_chart("tau per category", groups, by_category_bars(runs, "tau"), "tau (tokens per step)")
    rows = []
    for run in runs:
        for category in [*run.record.categories(), None]:
            s = run.record.summary(category)
            rows.append((run.label, category_name(category), str(s.prompts), str(s.failed), lossless_cell(run, s),
                         str(s.steps),
                         *(metric.format(metric.of(s)) for metric in metrics.METRICS)))
    table = Table(("run", "category", "prompts", "failed", "lossless", "steps",
                   *(m.heading for m in metrics.METRICS)),
                  tuple(rows), 2)
    return Section("tau", "Tau per category",
                   f"tau: {metrics.named('tau').meaning}. alpha: {metrics.named('alpha').meaning}. "
                   "Both are ratios of sums over the finished prompts; lossless "
                   "counts finished prompts whose output equals the plain greedy baseline, token for token.",
                   chart, (table,), ())


def position_section(runs: Sequence[ReportRun]) -> Section:
    k_max = max(run.record.params.k for run in runs)
    series, rows, notes = [], [], []
    for run in runs:
        positions = analysis.position_acceptance(run.record)
        series.append(Points(run.label, tuple((p.position + 1, p.rate) for p in positions if p.rate is not None),
                             run.color))
        cells = [f"{_fixed(p.rate, 3)} ({p.reached})" for p in positions]
        rows.append((run.label, str(run.record.params.k), *cells, *[""] * (k_max - len(cells))))
        if any(r.ok and r.counters.step_drafted is None for r in run.record.results):
            notes.append(f"{run.label}: no per-step draft lengths; a position counts as reached when the one before "
                         "it was accepted, which overcounts drafts cut short")
    chart = xy_chart("acceptance per draft position", series, "draft position", "P(accept i | reached i)",
                     x_ticks=range(1, k_max + 1), y_max=1.0)
    table = Table(("run", "k", *[f"pos {i}" for i in range(1, k_max + 1)]), tuple(rows), 1)
    return Section("positions", "Acceptance per draft position",
                   "P(accept i | reached i): of the steps whose draft reached position i (every draft token "
                   "before it accepted), the share that accepted the token there. Cells: rate (steps reaching "
                   "the position).", chart, (table,), tuple(notes))


def entropy_section(runs: Sequence[ReportRun], edges: Sequence[float] = analysis.ENTROPY_BUCKETS) -> Section:
    traced = [run for run in runs if run.trace]
    buckets = {run.label: analysis.entropy_acceptance(run.record, run.trace, edges) for run in traced}
    used = [i for i in range(len(edges) - 1) if any(b[i].tokens for b in buckets.values())]
    names = [f"[{edges[i]:g}, {edges[i + 1]:g})" for i in used]
    rows = [(run.label, names[j], f"{b.branching_low:.4g}-{b.branching_high:.4g}", str(b.tokens), str(b.accepted),
             _fixed(b.rate, 3), f"{b.mean_entropy:.3g}")
            for run in traced for j, b in enumerate(buckets[run.label][i] for i in used)]
    table = Table(("run", "entropy (nats)", "exp(entropy)", "reached", "accepted", "P(accept)", "mean entropy"),
                  tuple(rows), 3)
    chart = None
    if used:
        chart = bar_chart("acceptance by target entropy", names,
                          [Bars(run.label, tuple(buckets[run.label][i].rate for i in used), run.color)
                           for run in traced], "P(accept | reached)", y_max=1.0)
    notes = [f"{run.label}: {run.trace_problem}" for run in runs if run.trace_problem]
    untraced = [run.label for run in runs if not run.trace and not run.trace_problem]
    if untraced:
        notes.append(f"no trace (run with --trace): {', '.join(untraced)}")
    return Section("entropy", "Acceptance by target entropy",
                   "Reached draft positions of the traced prompts, bucketed by the target's entropy there "
                   "(nats; exp(entropy) is the effective number of choices), and the share accepted. Empty "
                   "buckets are left out.", chart, (table,) if rows else (), tuple(notes))


def entropy_by_type_section(runs: Sequence[ReportRun], edges: Sequence[float] = analysis.ENTROPY_BUCKETS) -> Section:
    """Acceptance by target entropy per content type: whether a content type accepts less
    because its text is less predictable, or less at the same entropy."""
    series = []  # (run, content type, buckets)
    for run in (run for run in runs if run.trace):
        typed = analysis.grouped(run.record, "content-type")
        series += [(run, kind, analysis.entropy_acceptance(typed, run.trace, edges, kind))
                   for kind in typed.categories() if any(r.prompt_id in run.trace for r in typed.results
                                                          if r.ok and r.category == kind)]
    used = [i for i in range(len(edges) - 1) if any(buckets[i].tokens for _, _, buckets in series)]
    names = [f"[{edges[i]:g}, {edges[i + 1]:g})" for i in used]
    rows = [(run.label, kind, names[j], str(b.tokens), str(b.accepted), _fixed(b.rate, 3),
             "-" if b.mean_entropy is None else f"{b.mean_entropy:.3g}")
            for run, kind, buckets in series for j, b in enumerate(buckets[i] for i in used)]
    chart = None
    if used:
        chart = bar_chart("acceptance by target entropy, per content type", names,
                          [Bars(f"{run.label}: {kind}", tuple(buckets[i].rate for i in used), palette_color(n))
                           for n, (run, kind, buckets) in enumerate(series)], "P(accept | reached)", y_max=1.0)
    table = Table(("run", "content type", "entropy (nats)", "reached", "accepted", "P(accept)", "mean entropy"),
                  tuple(rows), 3)
    return Section("entropy-types", "Acceptance by target entropy, per content type",
                   "The entropy buckets above, per content type of the traced prompts (code, prose, structured, "
                   "math, chat: crossrt's content type of each prompt's category, docs/prompts.md). At equal "
                   "entropy, a content type that still accepts less has a drafter that fits it less well. A "
                   "bucket a content type never reached has no bar.", chart, (table,) if rows else (),
                   () if series else ("no traced prompts (run with --trace)",))


def speedup_section(runs: Sequence[ReportRun]) -> Section:
    groups = [category_name(c) for c in categories(runs)]
    chart = bar_chart("speedup over plain greedy", groups, by_category_bars(runs, "speedup"), "speedup",
                      reference=(1.0, "plain greedy"))
    timed = [metric for metric in metrics.METRICS if metric.hardware_bound]
    rows = [(run.label, category_name(c), *(metric.format(metric.of(s)) for metric in timed))
            for run in runs for c in [*run.record.categories(), None] for s in [run.record.summary(c)]]
    table = Table(("run", "category", *(metric.heading for metric in timed)), tuple(rows), 2)
    return Section("speedup", "Speedup",
                   "; ".join(f"{metric.heading}: {metric.meaning}" for metric in timed)
                   + " (sums over finished prompts). Timings depend on the machine and its load.", chart, (table,), ())


def iid_section(runs: Sequence[ReportRun]) -> Section:
    series, rows = [], []
    for run in runs:
        fits = analysis.iid_fit(run.record)
        for name, field, hollow in (("a = P(acc|reached), own lengths", "predicted_tau_reached", False),
                                    ("a = alpha", "predicted_tau", True)):
            shown = [f for f in fits if f.measured_tau is not None and getattr(f, field) is not None]
            series.append(Points(f"{run.label}: {name}", tuple((f.measured_tau, getattr(f, field)) for f in shown),
                                 run.color, connect=False, hollow=hollow,
                                 labels=tuple(category_name(f.category) for f in shown)))
        rows += [(run.label, category_name(f.category), str(f.k), _fixed(f.measured_tau), _fixed(f.alpha, 3),
                  _fixed(f.predicted_tau), _signed(f.error), _fixed(f.accept_rate, 3),
                  _fixed(f.predicted_tau_reached), _signed(f.error_reached)) for f in fits]
    chart = xy_chart("i.i.d. model: predicted against measured tau", series, "measured tau", "predicted tau",
                     diagonal=True)
    table = Table(("run", "category", "k", "tau", "alpha", "iid tau a=alpha", "error", "P(acc|reached)",
                   "iid tau a=P, own lengths", "error"), tuple(rows), 2)
    return Section("iid", "i.i.d. fit per category",
                   "The i.i.d. model E(a, k) = (1 - a^(k+1)) / (1 - a) with a = alpha, as usually applied, "
                   "and with a = P(acc|reached) and each step's own draft length. Errors are predicted minus "
                   "measured; points on the dashed line are predicted exactly. One point per run and category.",
                   chart, (table,), ())


def record_sections(runs: Sequence[ReportRun], edges: Sequence[float] = analysis.ENTROPY_BUCKETS) -> list[Section]:
    """The details the records themselves give, in page order, the runs last: they come after
    the answer (crossrt/report/layout.py)."""
    if not runs:
        raise RecordError("no run records to report on")
    return [tau_section(runs), position_section(runs), steps_section(runs), entropy_section(runs, edges),
            entropy_by_type_section(runs, edges), speedup_section(runs), iid_section(runs), runs_section(runs)]

