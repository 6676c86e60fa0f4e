"""`crossrt sweep`: plan, run and query many runs at once (crossrt/sweep/, docs/scale.md)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Optional

import click

from crossrt.cli.common import echo_table, format_option, user_errors
from crossrt.sweep.plan import STRATEGIES, SweepError, load_sweep, plan_rows, unloadable_pairs
from crossrt.sweep.runner import Executor, run_sweep
from crossrt.sweep.servers import Servers
from crossrt.sweep.limits import QueryLimits
from crossrt.sweep.store import INDEX, SweepStore, check_sweep_dir, table_rows
from crossrt.records.tables import format_table, summary_table

SWEEP_FILE = click.Path(path_type=Path, dir_okay=False)
SWEEP_DIR = click.Path(path_type=Path, file_okay=False)
QUERY_LIMIT = 1000  # rows `sweep query` prints unless told otherwise
QUERY_BATCH = 1000  # rows fetched (and, with --all-rows, printed) at a time


def _default_dir(name: str) -> Path:
    return Path("runs") / "sweeps" / name


def server_options(command):
    """--url and --baseline-url: the running servers of the cells whose runtime attaches to one
    (endpoint), given to the command as servers= (Servers)."""
    command = click.option("--baseline-url", "baseline_urls", multiple=True, metavar="URL",
                           help="A plain server of the same target (no drafter) for the endpoint cells' baselines: "
                           "once for all, or once per --url in the same order.")(command)
    command = click.option("--url", "urls", multiple=True, metavar="URL",
                           help="A running llama-server, vLLM or SGLang server for the cells of runtime endpoint "
                           "(docs/endpoint.md); repeat it for a server axis. Each cell runs on one server at the "
                           "server's own draft length; cells of one server never run at once.")(command)
    return command


@click.group()
def sweep() -> None:
    """Many runs at once: the product of a sweep file's axes (pairs, runtimes, modes, k, ...),
    here or on a Ray cluster, into one sweep directory queryable with SQL.

    \b
      crossrt sweep plan models/sweeps/tiny.toml
      crossrt sweep run models/sweeps/tiny.toml               # here, one cell after another
      crossrt sweep run models/sweeps/tiny.toml --ray local   # on a Ray cluster started here
      crossrt sweep query runs/sweeps/tiny "SELECT runtime, mode, k, tau FROM cells ORDER BY ALL"
    """


def _warn(loaded) -> None:
    for attachment in loaded.attachments.values():
        server = attachment.server
        click.echo(f"attached: {server.identity}; draft length "
                   f"{server.k if server.k is not None else 'not reported yet (checked after its first draft)'}",
                   err=True)
    for warning in loaded.warnings:
        click.echo(f"warning: {warning}", err=True)


def _counts(loaded, store: Optional[SweepStore]) -> str:
    """How many cells there are, to run, done (with --dir), damaged (run again) and skipped."""
    runnable = {cell.id for cell in loaded.runnable()}
    done = runnable & store.done() if store else set()
    damaged = runnable & set(store.damaged()) if store else set()
    skipped = len(loaded.cells) - len(runnable)
    return (f"{len(loaded.cells)} cells: {len(runnable - done)} to run"
            + (f" ({len(damaged)} damaged, run again)" if damaged else "")
            + (f", {len(done)} done" if store else "") + f", {skipped} skipped")


@sweep.command()
@user_errors
@click.argument("sweep_file", type=SWEEP_FILE)
@click.option("--dir", "sweep_dir", type=SWEEP_DIR, help="Also say which cells are done in this sweep directory.")
@server_options
def plan(sweep_file: Path, sweep_dir: Optional[Path], urls: tuple[str, ...], baseline_urls: tuple[str, ...]) -> None:
    """List the cells of SWEEP_FILE: id, name, what each needs, and those skipped and why.
    Exit code 1 when a cell to run names a pair whose manifest does not load here (`sweep run`
    would fail it). With --url, endpoint cells are planned per server, which is asked what it is
    and its draft length (no generation); the ids are those `sweep run` with the same servers uses."""
    loaded = load_sweep(sweep_file, Servers(urls, baseline_urls))
    store = SweepStore(sweep_dir) if sweep_dir else None
    done = store.done() if store else set()
    _warn(loaded)
    failing = unloadable_pairs(loaded)
    click.echo(format_table(plan_rows(loaded, sorted(done), failing)))
    click.echo(_counts(loaded, store))
    cells = sum(cell.pair in failing and cell.id not in done for cell in loaded.runnable())
    if cells:
        raise SweepError(f"{cells} cell(s) would fail in `crossrt sweep run`: " + "; ".join(
            f"pair {name!r}: {why}" for name, why in failing.items()))


@sweep.command(name="run")
@user_errors
@click.argument("sweep_file", type=SWEEP_FILE)
@click.option("--dir", "sweep_dir", type=SWEEP_DIR, help="Sweep directory. Default: runs/sweeps/<sweep name>.")
@click.option("--ray", "ray_address", metavar="auto|local|ADDRESS",
              help="Run on a Ray cluster: auto (the one `ray start` made on this host), local (start one "
              "in this process, --cpus CPUs), or its address (ray://host:10001, host:6379).")
@click.option("--cpus", "thread_budget", type=click.IntRange(min=1),
              help="Here: run cells in worker processes while their threads fit in this many; with "
              "--ray local: the cluster's CPUs. Default: one cell after another in this process.")
@click.option("--strategy", type=click.Choice(STRATEGIES),
              help="Ray: a task per cell, or an actor per (runtime, pair). Default: the sweep file's [ray] strategy.")
@click.option("--max-retries", type=click.IntRange(min=0),
              help="Ray: runs of a cell whose worker died. Default: the sweep file's [ray] max_retries (2).")
@click.option("--fresh-baseline", is_flag=True, help="Every cell decodes its plain baselines (replacing their "
              "baseline store entries) instead of the first cell decoding each and the others reading it.")
@server_options
def run_command(sweep_file: Path, sweep_dir: Optional[Path], ray_address: Optional[str], thread_budget: Optional[int],
                strategy: Optional[str], max_retries: Optional[int], fresh_baseline: bool, urls: tuple[str, ...],
                baseline_urls: tuple[str, ...]) -> None:
    """Run the cells of SWEEP_FILE not finished in the sweep directory (finished cells are
    skipped, failed ones tried again), keeping each as it finishes; Ctrl-C keeps them too.

    \b
    Cells of runtime endpoint attach to the servers you run:
      crossrt sweep run endpoint.toml --url http://gpu1:8080 --url http://gpu2:8080 --baseline-url http://gpu1:8081
    """
    try:
        loaded = load_sweep(sweep_file, Servers(urls, baseline_urls))
        store = SweepStore(sweep_dir or _default_dir(loaded.name))
        _warn(loaded)
        for planned in loaded.cells:
            if planned.skipped:
                click.echo(f"skipped {planned.cell.id} {planned.cell.name}: {planned.skipped}", err=True)
        if not loaded.runnable():
            raise SweepError(f"nothing to run: all {len(loaded.cells)} cells are skipped (reasons above)")
        click.echo(f"sweep {loaded.name}: {_counts(loaded, store)} -> {store.root}", err=True)

        def line(position, total, cell, record, outcome):
            if record is None:
                status = f"FAILED: {outcome['error']}"
            else:
                overall = record.summary()
                tau = f"{overall.tau:.3f}" if overall.tau is not None else "-"
                status = f"ok  {overall.prompts} prompts, {overall.failed} failed, tau {tau}"
            click.echo(f"[{position}/{total}] {cell.id} {cell.name}  {status}  ({outcome.get('wall_s', 0):.1f} s)",
                       err=True)

        progress = run_sweep(loaded, store, Executor(ray_address, thread_budget, strategy, max_retries), line,
                             fresh_baseline)
    except KeyboardInterrupt:
        click.echo(f"\ninterrupted: the finished cells are kept in {store.root}; run the same command to "
                   "continue", err=True)
        sys.exit(130)
    index = store.root / INDEX
    click.echo(f"{progress.finished - len(progress.failed)} cells run, {len(progress.failed)} failed "
               "(tried again next run)" + (f"; index: {index}" if index.is_file() else ""))
    if progress.failed:
        raise click.ClickException(f"{len(progress.failed)} cells failed: {', '.join(progress.failed)}")


def _warn_damaged(store: SweepStore) -> None:
    damaged = store.damaged()
    if damaged:
        click.echo(f"warning: {len(damaged)} cell(s) damaged and left out ({', '.join(damaged[:5])}"
                   f"{', ...' if len(damaged) > 5 else ''}): `crossrt sweep run SWEEP_FILE --dir {store.root}` "
                   "runs the sweep file's cells among them again", err=True)


@sweep.command()
@user_errors
@click.argument("sweep_dir", type=SWEEP_DIR)
@click.argument("sql")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV instead of a table.")
@click.option("--limit", type=click.IntRange(min=1), default=QUERY_LIMIT, show_default=True,
              help="Print at most this many rows; a note on stderr says when the query gives more.")
@click.option("--all-rows", is_flag=True, help="Print every row, streamed as DuckDB makes them (a table is "
              f"aligned per block of {QUERY_BATCH:,} rows).")
@click.option("--memory-limit", default=QueryLimits.memory, show_default=True,
              help="Most memory the query may take, in DuckDB and in this process (DuckDB's units: 500MB, "
              f"1GB); it spills to a temporary folder up to {QueryLimits.spill}, then the query stops in one line.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=QueryLimits.seconds,
              show_default=True, help="Seconds the query may run before it is stopped.")
def query(sweep_dir: Path, sql: str, as_csv: bool, limit: int, all_rows: bool, memory_limit: str,
          timeout: float) -> None:
    """Run SQL (DuckDB) over a sweep directory's tables: `prompts` (one row per prompt: the
    cell's settings, counters, tau, alpha, lossless, timings) and `cells` (one row per cell),
    within a memory and a time limit."""
    store = check_sweep_dir(sweep_dir)
    shown, more = 0, False
    limits = QueryLimits(memory=memory_limit, seconds=timeout)
    with store.results(sql, QUERY_BATCH, limits) as (columns, batches):
        _warn_damaged(store)
        writer = csv.writer(sys.stdout) if as_csv else None
        if writer:
            writer.writerow(columns)
        for rows in batches:
            if not all_rows and shown >= limit:
                more = True
                break
            kept = rows if all_rows else rows[:limit - shown]
            more = len(kept) < len(rows)
            if writer:
                writer.writerows(kept)
            else:  # the header once, above the first block
                click.echo("\n".join(format_table(table_rows(columns, kept)).splitlines()[0 if not shown else 2:]))
            shown += len(kept)
            if more:
                break
    if not shown and not writer and columns:
        click.echo(format_table(table_rows(columns, [])))
    if more:
        click.echo(f"note: the first {limit:,} rows; the query gives more: pass --limit N or --all-rows", err=True)


@sweep.command()
@user_errors
@click.argument("sweep_dir", type=SWEEP_DIR)
@click.option("--paths", is_flag=True, help="Print the cells' record paths only, e.g. for "
              "`crossrt report $(crossrt sweep show DIR --paths) -o report.html`.")
@format_option
def show(sweep_dir: Path, paths: bool, output_format: str) -> None:
    """The summary table of every finished cell (as `crossrt show` prints records), or their paths."""
    store = check_sweep_dir(sweep_dir)
    stored = store.stored()
    _warn_damaged(store)
    if paths:
        for cell in stored:
            click.echo(cell.record_path)
        return
    echo_table(summary_table([(cell.record_path, cell.record()) for cell in stored]), output_format)
    failures = store.failures()
    for cell_id, reason in failures.items():
        click.echo(f"failed: {cell_id}: {reason}", err=True)
