"""Append-only journals beside files too large to rewrite often (run records, trace files).

A journal `<base file name>.journal` holds one entry per line, each written with one append,
and belongs to one version of its base file: its first line names the sha256 of that version's
bytes. A reader folds a journal into its base only when the digest matches, so a journal left
beside a base rewritten since (a run that ended and folded it, a resumed or overwritten run that
started anew) is ignored, whatever moment a crash or kill chose. A last line without its newline
was torn by a crash and is ignored too.

Entries are flushed to the operating system as they are written (a killed process loses none),
not fsync'd to the disk, as the record files themselves are not.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from crossrt.errors import CrossrtError

HEADER = "crossrt-journal 1 sha256="
# What to do about the errors a run's files meet most, by errno.
ADVICE = {
    errno.ENOSPC: "free space on that disk or pass --out on another one",
    errno.EDQUOT: "free space within your quota or pass --out elsewhere",
    errno.EROFS: "the location is read-only: pass --out somewhere writable",
    errno.EACCES: "check the folder's permissions or pass --out somewhere writable",
    errno.EPERM: "check the folder's permissions or pass --out somewhere writable",
    errno.ENOENT: "its folder is missing: create it or pass --out elsewhere",
    errno.ENOTDIR: "a part of its folder path is a file: pass --out elsewhere",
    errno.EEXIST: "a file is in the way of that folder: move it or pass --out elsewhere",
}


class StorageError(CrossrtError):
    """A file of a run that could not be written or read (disk full, read-only, permissions),
    said in one line naming the file and what to do."""


def storage_error(path: Path, error: OSError, doing: str = "write", option: str = "--out") -> StorageError:
    """option: the command-line option that names path, for the advice."""
    advice = ADVICE.get(error.errno, "check the disk and the path").replace("--out", option)
    return StorageError(f"cannot {doing} {path}: {error.strerror or error}; {advice}")


def write_atomically(path: Path, data: bytes, option: str = "--out") -> None:
    """Write data to path (creating its folder) through a temporary file of this process, then
    os.replace: readers and other writers never see half a file, and a failed write (a full
    disk) leaves no temporary behind. Raises StorageError (its advice names option)."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
    except OSError as error:
        raise storage_error(path, error, option=option) from None


def journal_path(base: Path) -> Path:
    base = Path(base)
    return base.with_name(base.name + ".journal")


def _header(base_bytes: bytes) -> bytes:
    return f"{HEADER}{hashlib.sha256(base_bytes).hexdigest()}\n".encode()


class Journal:
    """The open journal of one base file version: started empty, appended to, then discarded
    once its entries are in the base."""

    def __init__(self, base: Path, base_bytes: bytes):
        """Start an empty journal for the base whose bytes on disk are base_bytes, atomically
        replacing any journal already there."""
        self.path = journal_path(base)
        write_atomically(self.path, _header(base_bytes))
        try:
            self._file = open(self.path, "ab")
        except OSError as error:
            raise storage_error(self.path, error) from None

    def append(self, entry: str) -> None:
        """Add one entry (a line of text without newlines) and hand it to the OS at once. On
        a full disk a torn last line may stay behind: readers leave it out."""
        try:
            self._file.write(entry.encode() + b"\n")
            self._file.flush()
        except OSError as error:
            raise storage_error(self.path, error) from None

    def discard(self) -> None:
        """Close and remove the journal: its entries are now in the base."""
        self._file.close()
        self.path.unlink(missing_ok=True)


def remove_journal(base: Path) -> None:
    journal_path(base).unlink(missing_ok=True)


def read_with_journal(base: Path) -> tuple[bytes, list[str]]:
    """The base file's bytes and the complete entries of its journal ([] when it has none).

    The journal is read before the base: a writer rewrites the base before it discards or
    replaces the journal, so whichever versions this sees, the entries either belong to the
    base read or are already in it (and the digest then differs)."""
    try:
        journal = journal_path(base).read_bytes()
    except FileNotFoundError:
        journal = b""
    except OSError as error:
        raise storage_error(journal_path(base), error, "read") from None
    try:
        base_bytes = Path(base).read_bytes()
    except OSError as error:
        raise storage_error(Path(base), error, "read") from None
    header = _header(base_bytes)
    if not journal.startswith(header):
        return base_bytes, []
    complete = journal[len(header):].split(b"\n")[:-1]  # the last piece is b"" or a torn line
    return base_bytes, [line.decode(errors="replace") for line in complete]
