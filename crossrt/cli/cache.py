"""`crossrt cache`: the baseline store (crossrt/run/baselines.py) shown and cleared."""

from __future__ import annotations

import click

from crossrt.run.baselines import BaselineStore
from crossrt.records.tables import format_table


@click.group()
def cache() -> None:
    """crossrt's stored plain greedy baselines ($CROSSRT_CACHE/baselines): every run, sweep,
    parity matrix and reproduce takes a prompt's baseline from here when its key (runtime,
    build, target file, numerics, machine, prompt, budget) matches exactly."""


@cache.command("ls")
def list_entries() -> None:
    """One line per stored baseline: its key digest, runtime, mode, tokens, when and where timed."""
    store = BaselineStore.default()
    entries = store.entries()
    rows = [[e.path.stem[:16], e.runtime or "-", e.mode or "-", "-" if e.tokens is None else str(e.tokens),
             e.timed_at or "-", e.host or "-", f"damaged: {e.error}" if e.error else ""] for e in entries]
    click.echo(f"{len(entries)} baseline(s) in {store.root}")
    if rows:
        click.echo(format_table([["key", "runtime", "mode", "tokens", "timed at", "host", ""]] + rows))


@cache.command("clear")
def clear_entries() -> None:
    """Remove every stored baseline: the next runs decode theirs afresh."""
    store = BaselineStore.default()
    click.echo(f"removed {store.clear()} baseline(s) from {store.root}")
