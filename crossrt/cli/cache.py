"""`crossrt cache`: the baseline store (crossrt/run/baselines.py) shown and cleared."""

from __future__ import annotations

import click

from crossrt.cli.common import echo_note, echo_table, format_option
from crossrt.run.baselines import BaselineStore, entries_table


@click.group()
def cache() -> None:
    """crossrt's stored plain greedy baselines ($CROSSRT_CACHE/baselines): every run, sweep,
    parity matrix and reproduce takes a prompt's baseline from here when its key (runtime,
    build, target file, numerics, machine, prompt, budget) matches exactly."""


@cache.command("ls")
@format_option
def list_entries(output_format: str) -> None:
    """One line per stored baseline: its file (the key's digest), target file, runtime, mode, the
    schedules it serves (plain greedy: no drafting, no k, greedy, not lossy), tokens and budget,
    when and where it was timed, and why it is damaged where it is."""
    store = BaselineStore.default()
    entries = store.entries()
    echo_note(f"{len(entries)} baseline(s) in {store.root}", output_format)
    echo_table(entries_table(entries), output_format)


@cache.command("clear")
def clear_entries() -> None:
    """Remove every stored baseline: the next runs decode theirs afresh."""
    store = BaselineStore.default()
    click.echo(f"removed {store.clear()} baseline(s) from {store.root}")
