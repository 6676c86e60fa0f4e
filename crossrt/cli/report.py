"""`crossrt report`: run records in one HTML page with charts, or in Markdown tables."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import click

from crossrt.analyze import analysis
from crossrt.cli.common import Increasing, refuse_inputs_as_outputs, user_errors
from crossrt.compare.tau_gap import pair_gaps
from crossrt.report.ceiling import ceiling_section
from crossrt.records.journal import write_atomically
from crossrt.report.gaps import run_gaps
from crossrt.report.layout import report_sections
from crossrt.report.page import page, to_html, to_markdown
from crossrt.report.parity import report_parity
from crossrt.report.runs import load_runs, report_title
from crossrt.report.sweeps import SweptCell
from crossrt.simulate.ceiling import load_ceilings
from crossrt.sweep.cell import SweepError
from crossrt.sweep.plan import load_sweep
from crossrt.sweep.store import check_sweep_dir

# The output format follows the file name, so `-o report.md` cannot silently be HTML.
FORMATS = {".html": to_html, ".htm": to_html, ".md": to_markdown, ".markdown": to_markdown}


@dataclass(frozen=True)
class Inputs:
    """What the command's arguments name: record paths, and where they are cells of a sweep, each
    cell's settings with its record (None where it failed) and failure."""

    paths: tuple[Path, ...]
    cells: tuple[tuple[dict[str, Any], Optional[Path], str], ...]
    unplaced: tuple[str, ...]  # failed cells whose settings are not known


def _cell_settings(record: Path) -> Optional[dict[str, Any]]:
    """A sweep cell's settings from the meta beside its record (`sweep show --paths` gives the
    records); None for a record that is not a cell's."""
    try:
        return json.loads(record.with_name(f"{record.stem}.cell.json").read_bytes())["params"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _reading_order(settings: dict[str, Any]) -> tuple:
    """Cells by their named settings (runtime, mode, schedule, ...), then by their numbers (k, ...):
    the page's tables then read a runtime's cells in order of k (a sweep stores them by id)."""
    numeric = [(key, value) for key, value in settings.items() if isinstance(value, (int, float))]
    return (tuple(str(value) for key, value in settings.items() if (key, value) not in numeric),
            tuple(value for _, value in numeric))


def _inputs(given: Sequence[Path], sweep_file: Optional[Path]) -> Inputs:
    """Records as given; a sweep directory's finished cells and its failed ones, placed by the
    sweep file where it is given (a failure keeps only its cell's id and reason)."""
    planned = {cell.id: cell.params() for cell in load_sweep(sweep_file).runnable()} if sweep_file else {}
    paths, cells, unplaced = [], [], []
    for path in given:
        if not path.is_dir():
            paths.append(path)
            settings = _cell_settings(path)
            if settings is not None:
                cells.append((settings, path, ""))
            continue
        store = check_sweep_dir(path)
        if not store.stored() and not store.failures():
            raise SweepError(f"{path} is a folder with no sweep cell in it, finished or failed: give run records "
                             "or a sweep directory")
        for stored in sorted(store.stored(), key=lambda stored: _reading_order(stored.meta["params"])):
            paths.append(stored.record_path)
            cells.append((stored.meta["params"], stored.record_path, ""))
        for cell_id, reason in sorted(store.failures().items()):
            if cell_id in planned:
                cells.append((planned[cell_id], None, reason))
            else:
                unplaced.append(f"failed cell {cell_id}: {reason} (give --sweep with the sweep file to place it)")
    return Inputs(tuple(paths), tuple(cells), tuple(unplaced))


def _writer(path: Path):
    writer = FORMATS.get(path.suffix.lower())
    if writer is None:
        raise click.UsageError(f"{path}: name the output .html or .md (the format follows the suffix)")
    return writer


@click.command()
@user_errors
@click.argument("records", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("-o", "--out", type=click.Path(path_type=Path, dir_okay=False),
              help="Report to write: .html (charts and tables, one self-contained file) or .md (tables).")
@click.option("--markdown", "markdown_out", type=click.Path(path_type=Path, dir_okay=False),
              help="Also write the Markdown tables here (with -o report.html, say).")
@click.option("--title", help="The page's title. Default: the setting of the runs (pair and its files, k, "
              "prompts, max new tokens, device).")
@click.option("--entropy-buckets", type=Increasing(), default=",".join(f"{e:g}" for e in analysis.ENTROPY_BUCKETS),
              show_default=True, help="Edges of the target-entropy buckets, in nats.")
@click.option("--by", "grouping", type=click.Choice(analysis.GROUPINGS), default="category", show_default=True,
              help="Group prompts by their own category or by crossrt's content type of it (docs/prompts.md).")
@click.option("--ceiling", "ceiling_path", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="A `crossrt simulate --tree ... --out` result: add its per-category ceiling (docs/ceiling.md).")
@click.option("--no-rescore", is_flag=True, help="Explain the parity section's splits only from what the runs "
              "recorded (as `crossrt parity --no-rescore`): a native run's split with no driven twin stays "
              "unexplained instead of being re-scored in-process.")
@click.option("--no-tau-gap", is_flag=True, help="Leave out why tau differs between runs whose schedules differ "
              "(its oracle runs the pair once in llama.cpp, as `crossrt parity` does).")
@click.option("--sweep", "sweep_file", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="The sweep file a sweep directory given ran: places its failed cells on the charts.")
def report(records: Sequence[Path], out: Optional[Path], markdown_out: Optional[Path], title: Optional[str],
           entropy_buckets, grouping, ceiling_path, no_rescore: bool, no_tau_gap: bool,
           sweep_file: Optional[Path]) -> None:
    """One report over any number of run records (runtimes, modes, schedules, k, pairs): first
    parity's verdict and per run tau, alpha, lossless, tokens/s and speedup; then why tau differs
    between schedules, where the runs part and why (two or more records), tau per category,
    acceptance per draft position, the output coloured by accepted length, acceptance by target
    entropy (runs with --trace), speedup, the i.i.d. model's fit; the runs last (docs/report.md).

    A sweep directory (or its cells' records, `crossrt sweep show DIR --paths`) draws tau,
    alpha and speedup against k and any other swept setting, failed cells marked.

    \b
      crossrt report runs/*.json -o report.html
      crossrt report runs/*.json -o report.html --markdown report.md
      crossrt report runs/sweeps/tiny -o sweep.html --sweep models/sweeps/tiny.toml
    """
    outputs = [(path, writer, option) for path, writer, option in ((out, out and _writer(out), "-o"),
                                                                   (markdown_out, markdown_out and to_markdown,
                                                                    "--markdown")) if path]
    if not outputs:
        raise click.UsageError("give -o report.html (or .md) and/or --markdown report.md")
    refuse_inputs_as_outputs({option: path for path, _, option in outputs},
                             [*records, *([ceiling_path] if ceiling_path else [])])
    inputs = _inputs(records, sweep_file)
    loaded = load_runs(inputs.paths)
    # Parity and the tau gaps on the records as run, before any regrouping, as `crossrt parity` has them.
    # A sweep's cells differ in k and schedule by design: their pairwise tau gaps would be one chart per
    # pair of cells, so a sweep draws its numbers against k instead.
    parity = report_parity(loaded, rescore=not no_rescore)
    gaps = [] if no_tau_gap or inputs.cells else run_gaps(loaded, pair_gaps([(run.label, run.record) for run in loaded]))
    runs = [dataclasses.replace(run, record=analysis.grouped(run.record, grouping)) for run in loaded]
    by_path = {Path(run.path): run for run in runs}
    cells = [SweptCell(settings, by_path[path] if path else None, failure)
             for settings, path, failure in inputs.cells]
    built = page(title or report_title(loaded),
                 report_sections(runs, parity, gaps, entropy_buckets, cells, inputs.unplaced))
    if ceiling_path:
        built = dataclasses.replace(built, sections=built.sections + (
            ceiling_section(load_ceilings(ceiling_path), str(ceiling_path)),))
    for path, writer, option in outputs:  # each file whole or not at all
        write_atomically(path, writer(built).encode("utf-8"), option=option)
        click.echo(f"report: {path}")
