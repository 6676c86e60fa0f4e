"""A run's files as it goes: the record (and its traces) written whole when the run starts and
when it ends, and each finished prompt appended to journals beside them in between, so saving
the 10,000th prompt costs what saving the 10th does (docs/design.md, "Records on disk").

Readers never see less than what finished: load_record and read_traces fold the journals in.
One process writes a record at a time: record_lock() holds an OS lock beside it for the run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator, Mapping, Optional

from crossrt.records.journal import Journal, StorageError, remove_journal, storage_error
from crossrt.records.schema import PromptResult, RunRecord
from crossrt.records.record_json import result_entry, save_record
from crossrt.records.trace import PromptTrace, save_traces, trace_entry, trace_path


class RecordBusy(StorageError):
    """Another process is writing the record."""


# Set in a runtime's isolated child (crossrt/run/isolation.py): the pid of the crossrt the user
# started, which a lock names, so "another crossrt (pid N)" is a process the user can see and stop.
OWNER_PID = "CROSSRT_OWNER_PID"


def lock_path(record: Path) -> Path:
    record = Path(record)
    return record.with_name(record.name + ".lock")


@contextlib.contextmanager
def record_lock(record: Path, option: str = "--out") -> Iterator[None]:
    """Hold an exclusive flock on `<record>.lock` (which names the holder's pid) while the
    block runs; RecordBusy at once if another process holds it. The kernel drops the lock when
    its holder dies, so a killed run never leaves the record locked. option: the command's option
    naming where the lock lives, for a disk error's advice."""
    path = lock_path(record)
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a+")
        except OSError as error:
            raise storage_error(path, error, option=option) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise RecordBusy(f"{record} is being written by another crossrt (pid {holder}); "
                             "wait for it to end or pass another --out") from None
        # The holder before us may have removed the file between our open and our lock: a lock
        # on that unlinked file excludes no one, so take the lock on the file now there.
        try:
            same = os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        handle.close()
    try:
        try:
            handle.truncate(0)
            handle.write(f"{os.environ.get(OWNER_PID) or os.getpid()}\n")
            handle.flush()
        except OSError as error:
            raise storage_error(path, error) from None
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock goes, so no one locks a file about to vanish
        handle.close()


class RunWriter:
    """Writes one run: start, add() per finished prompt, close() (also after an error, so the
    record is whole on disk whenever the process lives to do it)."""

    def __init__(self, record: RunRecord, path: Path, traces: Optional[Mapping[str, PromptTrace]] = None,
                 continues: bool = False):
        """Save record (validated whole) at path and, for a traced run (traces given, those the
        run continues), the traces beside it; then start an empty journal beside each.
        continues: record holds what is on disk at path, journals folded in (a resumed run);
        otherwise journals there are removed first, so none can join what this run writes."""
        self._record, self._path = record, Path(path)
        if not continues:
            remove_journal(self._path)
            remove_journal(trace_path(self._path))
        self._results: list[PromptResult] = []
        self._traces = dict(traces) if traces is not None else None
        self._trace_journal = None
        if self._traces is not None:  # traces first, here as in add(): no result on disk lacks its trace
            trace_file = trace_path(self._path)
            self._trace_journal = Journal(trace_file, save_traces(self._traces, trace_file))
        self._journal = Journal(self._path, save_record(record, self._path))

    def add(self, result: PromptResult, trace: Optional[PromptTrace] = None) -> None:
        """Keep a finished prompt: validated alone, then appended to the journals, its trace
        first. Constant work, whatever the run holds already."""
        line = result_entry(self._record, result)
        if trace is not None:
            self._traces[result.prompt_id] = trace
            self._trace_journal.append(trace_entry(result.prompt_id, trace))
        # Kept before the append: close() after an interrupted append still folds it in.
        self._results.append(result)
        self._journal.append(line)

    def close(self) -> RunRecord:
        """Fold the journals in: traces and record rewritten whole (the record validated
        whole), then the journals removed. Returns the record."""
        if self._trace_journal is not None:
            save_traces(self._traces, trace_path(self._path))
            self._trace_journal.discard()
        record = self._record.with_results(self._results)
        save_record(record, self._path)
        self._journal.discard()
        return record
