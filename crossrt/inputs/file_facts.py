"""What crossrt derives from model files' contents, kept on disk by the files' sha256 digests, so
that the next process reads it instead of deriving it again.

Every crossrt process that runs a pair derived the same things from the same files: a GGUF's
262,144 vocabulary strings read, their meanings compared with the drafter's and fingerprinted,
its tensors counted for the memory check, its chat template and quantization read (~1 CPU-s
a run on Gemma 3 270M, paid again by each runtime's process and each command of a session).
Each fact is a JSON value in $CROSSRT_CACHE/file-facts/, named by its kind and the digests of
the files it comes from (sha256_of: cached by path, size and modification time, so a changed
file has another digest and never meets a fact of its old content). An entry carries a
checksum of its value: one that does not parse, or whose checksum, kind or digests differ, is
derived again and replaced. A cache that cannot be written (read-only, full) costs only the
deriving next time. A fact is what a derivation returned; its errors are raised, never kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable, Sequence

from crossrt.inputs.builtin import cache_dir

FOLDER = "file-facts"


def file_fact(kind: str, paths: Sequence[Path], derive: Callable[[], Any]) -> Any:
    """derive()'s JSON value for the files at paths, from the cache when an intact entry of this
    kind holds it for their digests. kind names the derivation and its version (a name safe in a
    file name): a derivation that changes what it returns takes a new kind. The value comes back
    as JSON gives it back (lists for tuples), kept or just derived alike."""
    from crossrt.inputs.pairs import sha256_of  # pairs uses facts: imported here, not at the top

    try:
        digests = [sha256_of(Path(path)) for path in paths]
    except OSError:  # a missing or unreadable file: the derivation says what is wrong with it
        return json.loads(json.dumps(derive()))
    entry = cache_dir() / FOLDER / f"{kind}-{hashlib.sha256(json.dumps(digests).encode()).hexdigest()[:32]}.json"
    try:
        kept = json.loads(entry.read_text())
        if kept["kind"] == kind and kept["digests"] == digests and kept["check"] == _check(kept["value"]):
            return kept["value"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or damaged: derived again below
    value = json.loads(json.dumps(derive()))
    write_json(entry, {"kind": kind, "digests": digests, "value": value, "check": _check(value)})
    return value


def _check(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def write_json(path: Path, content: Any) -> None:
    """A cache file written whole or not at all (a temporary file renamed over it, where a link
    points), so a process reading at the same time sees the old content or the new, never half
    (which would cost it what the file holds); a read-only or full cache leaves it as it was."""
    path = path.resolve()
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(content))
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink()  # what the file holds is derived again next time
