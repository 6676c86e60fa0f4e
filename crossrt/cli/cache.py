"""`crossrt cache`: the baseline store (crossrt/run/baselines.py) shown and cleared."""

from __future__ import annotations

from typing import Optional

import click

from crossrt.run.baselines import BaselineStore
from crossrt.records.schema import RunRecord
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
