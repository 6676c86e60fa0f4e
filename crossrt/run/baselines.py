"""The plain greedy baseline, decoded once: a store on disk beside crossrt's other caches
($CROSSRT_CACHE/baselines), one JSON file per baseline, named by the sha256 of its key.

A baseline depends on the runtime (name, version, build, system_info), its numerics (KV cache,
flash attention, threads, dtype, device, GPU split, n_ctx), the target file's sha256, the mode
and, in driven mode, whether the first token comes from the whole prompt's pass (the
llama-server schedule), the prompt's ids and the token budget; not on k, the drafter, the
schedule otherwise or the acceptance rule. The machine (host, architecture, CPUs) is in the key
too: a stored timing is only ever divided into a speedup measured on the same machine.

Safety: an entry is used only when the key written inside it equals the key asked for, field by
field; an entry that does not read back whole (not JSON, wrong types, lengths that disagree, a
body that does not match the sha256 written with it) is a one-line warning and a fresh decode. Entries are written through a temporary file and
os.replace, and decoding a key holds a lock file of that key, so two cells or two workers on
one machine decode it once (the second waits, then reads) and never see half an entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import hashlib
import json
import os
import platform
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import click

from crossrt.records.journal import write_atomically
from crossrt.inputs.pairs import cache_dir
from crossrt.records.schema import BaselineSource, PassView
from crossrt.records.tables import Cell, Column, Table, cell
from crossrt.speculative.schedules import SCHEDULE_TYPES

STORE_VERSION = 1
ORIGINS = ("decoded", "store")


@dataclass(frozen=True)
class Baseline:
    """One prompt's plain greedy decode as the run uses it: loop's Generation and a native
    runtime's NativeGeneration both give these fields (view: driven runs only)."""

    output_ids: tuple[int, ...]
    stop_reason: str
    prefill_s: float
    decode_s: float
    view: Optional[PassView] = None


def machine() -> dict[str, Any]:
    return {"host": socket.gethostname(), "arch": platform.machine(), "cpus": os.cpu_count()}


def run_key(runtime_info: Any, options: Any, target_sha256: str, mode: str) -> dict[str, Any]:
    """The parts of a baseline's key one run shares across its prompts (RuntimeInfo and
    RuntimeOptions as plain JSON values; a server's URL without its password)."""
    return {"runtime": _plain(dataclasses.asdict(runtime_info)),
            "options": _plain(dataclasses.asdict(options.public())), "target_sha256": target_sha256, "mode": mode,
            "machine": machine()}


def prompt_key(base: Mapping[str, Any], prompt_ids: Sequence[int], max_new_tokens: int,
               whole_prompt: bool) -> dict[str, Any]:
    ids = hashlib.sha256(json.dumps(list(prompt_ids)).encode()).hexdigest()
    return {**base, "prompt_ids_sha256": ids, "max_new_tokens": max_new_tokens, "whole_prompt": whole_prompt}


def key_sha256(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _plain(value: Any) -> Any:
    """value as JSON gives it back (tuples as lists, paths as text), so a key compares equal to
    itself read from disk."""
    return json.loads(json.dumps(value, default=str))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _load_1m() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


class EntryDamaged(ValueError):
    """A store entry that does not read back as one whole baseline."""


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                              for i in value):
        raise EntryDamaged(f"{what} is not a list of token ids")
    return tuple(value)


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise EntryDamaged(f"{what} is not a number of seconds")
    return float(value)


def _view(data: Any, n: int) -> Optional[PassView]:
    if data is None:
        return None
    try:
        view = PassView(
            tuple(float(m) for m in data["margins"]), _ints(data["runner_up"], "runner_up"),
            _ints(data["pass_tokens"], "pass_tokens"),
            None if data.get("close_ids") is None else tuple(_ints(c, "close_ids") for c in data["close_ids"]),
            None if data.get("close_gaps") is None else tuple(tuple(float(g) for g in c) for c in data["close_gaps"]))
    except (KeyError, TypeError, ValueError) as error:
        raise EntryDamaged(f"view: {error}") from None
    lengths = {len(view.margins), len(view.runner_up), len(view.pass_tokens)}
    lengths |= {len(view.close_ids)} if view.close_ids is not None else set()
    lengths |= {len(view.close_gaps)} if view.close_gaps is not None else set()
    if lengths != {n}:
        raise EntryDamaged("view does not hold one entry per token")
    return view


def _body_sha256(data: Mapping[str, Any]) -> str:
    return key_sha256({name: value for name, value in data.items() if name != "sha256"})


def _entry(data: Any) -> tuple[dict[str, Any], Baseline, BaselineSource]:
    """(key, baseline, source) of an entry's JSON, or EntryDamaged."""
    if not isinstance(data, dict) or data.get("store_version") != STORE_VERSION or not isinstance(data.get("key"), dict):
        raise EntryDamaged("not a baseline entry of this crossrt")
    if data.get("sha256") != _body_sha256(data):  # a changed byte that still parses: never a wrong baseline
        raise EntryDamaged("its content does not match its sha256")
    try:
        ids = _ints(data["output_ids"], "output_ids")
        if data["stop_reason"] not in ("eos", "max_new_tokens"):
            raise EntryDamaged(f"stop_reason {data['stop_reason']!r}")
        baseline = Baseline(ids, data["stop_reason"], _seconds(data["prefill_s"], "prefill_s"),
                            _seconds(data["decode_s"], "decode_s"), _view(data.get("view"), len(ids)))
        load = None if data["load_1m"] is None else _seconds(data["load_1m"], "load_1m")
        if not all(isinstance(data[name], str) for name in ("timed_at", "host")):
            raise EntryDamaged("timed_at or host is not text")
        source = BaselineSource("store", key_sha256(data["key"]), data["timed_at"], data["host"], load)
    except KeyError as error:
        raise EntryDamaged(f"no {error}") from None
    return data["key"], baseline, source


@dataclass(frozen=True)
class EntryInfo:
    """One entry as `crossrt cache ls` shows it (error: why it is damaged)."""

    path: Path
    runtime: Optional[str]
    mode: Optional[str]
    tokens: Optional[int]
    timed_at: Optional[str]
    host: Optional[str]
    error: Optional[str] = None
    target_sha256: Optional[str] = None
    whole_prompt: Optional[bool] = None  # its first token from a pass over the whole prompt
    max_new_tokens: Optional[int] = None


# A baseline's identity, in the columns a run's has (plain greedy decoding drafts nothing), then the rest.
ENTRY_COLUMNS = (*(Column(key, key, identity=True) for key in ("file", "target", "runtime", "mode", "schedule",
                                                                "drafting", "k", "acceptance", "lossy")),
                 *(Column(key, key.replace("_", " ")) for key in ("tokens", "max_new_tokens", "timed_at", "host",
                                                                  "damaged")))


def _schedules(entry: EntryInfo) -> Optional[str]:
    """The driven schedules whose runs an entry serves: those taking the first token from the
    prompt's pass, or the others."""
    if entry.mode != "driven" or entry.whole_prompt is None:
        return None
    return ",".join(name for name, kind in SCHEDULE_TYPES.items() if kind.first_from_prompt == entry.whole_prompt)


def entries_table(entries: Sequence[EntryInfo]) -> Table:
    """`crossrt cache ls`'s table: each entry's identity (its file shown by the key's first 16
    digits, its target file by 12), then its tokens and budget, when and where it was timed, and
    why it is damaged where it is."""
    rows = tuple((Cell(str(e.path), e.path.stem[:16]),
                  Cell(e.target_sha256, str(e.target_sha256)[:12]) if e.target_sha256 else cell(None), cell(e.runtime),
                  cell(e.mode), cell(_schedules(e)), cell("none"), cell(None), cell("greedy"), cell(False),
                  cell(e.tokens), cell(e.max_new_tokens), cell(e.timed_at), cell(e.host), cell(e.error))
                 for e in entries)
    return Table(ENTRY_COLUMNS, rows)


class BaselineStore:
    """Baselines on disk under root. refresh: never read an entry (decode every baseline) but
    write what was decoded, replacing the entry (`--fresh-baseline`)."""

    def __init__(self, root: Path, refresh: bool = False):
        self.root = Path(root)
        self.refresh = refresh

    @classmethod
    def default(cls, refresh: bool = False) -> "BaselineStore":
        return cls(cache_dir() / "baselines", refresh)

    def path(self, digest: str) -> Path:
        return self.root / f"{digest}.json"

    def holds(self, key: Mapping[str, Any]) -> bool:
        """Whether get reads an entry for key (not read here: one found damaged is decoded by get)."""
        return not self.refresh and self.path(key_sha256(key)).is_file()

    def get(self, key: Mapping[str, Any]) -> Optional[tuple[Baseline, BaselineSource]]:
        """The stored baseline of exactly key, or None (none stored, another key, damaged: warned)."""
        if not self.holds(key):
            return None
        path = self.path(key_sha256(key))
        try:
            stored_key, baseline, source = _entry(json.loads(path.read_bytes()))
        except (OSError, ValueError, RecursionError) as error:  # EntryDamaged and bad JSON are ValueErrors
            click.echo(f"warning: baseline store entry {path} is damaged ({error}); decoding the baseline afresh",
                       err=True)
            return None
        if stored_key != _plain(dict(key)):
            click.echo(f"warning: baseline store entry {path} holds another key; decoding the baseline afresh",
                       err=True)
            return None
        return baseline, source

    def put(self, key: Mapping[str, Any], baseline: Baseline, timed_at: str, load_1m: Optional[float]) -> None:
        view = dataclasses.asdict(baseline.view) if baseline.view is not None else None
        entry = {"store_version": STORE_VERSION, "key": _plain(dict(key)), "output_ids": list(baseline.output_ids),
                 "stop_reason": baseline.stop_reason, "prefill_s": baseline.prefill_s,
                 "decode_s": baseline.decode_s, "view": view, "timed_at": timed_at,
                 "host": machine()["host"], "load_1m": load_1m}
        entry["sha256"] = _body_sha256(entry)
        write_atomically(self.path(key_sha256(key)), (json.dumps(entry) + "\n").encode(), "$CROSSRT_CACHE")

    @contextlib.contextmanager
    def holding(self, key: Mapping[str, Any]) -> Iterator[None]:
        """The key's lock: a second process decoding the same baseline waits for the first."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{key_sha256(key)}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def entries(self) -> list[EntryInfo]:
        found = []
        for path in sorted(self.root.glob("*.json")) if self.root.is_dir() else ():
            try:
                key, baseline, source = _entry(json.loads(path.read_bytes()))
                found.append(EntryInfo(path, key.get("runtime", {}).get("name"), key.get("mode"),
                                       len(baseline.output_ids), source.timed_at, source.host, None,
                                       key.get("target_sha256"), key.get("whole_prompt"), key.get("max_new_tokens")))
            except (OSError, ValueError, RecursionError, AttributeError) as error:
                found.append(EntryInfo(path, None, None, None, None, None, str(error) or type(error).__name__))
        return found

    def clear(self) -> int:
        """Remove every entry (and lock file); the number of entries removed."""
        removed = 0
        for path in list(self.root.glob("*.json")) + list(self.root.glob("*.lock")) if self.root.is_dir() else ():
            path.unlink(missing_ok=True)
            removed += path.suffix == ".json"
        return removed


def baseline_of(store: Optional[BaselineStore], key: Mapping[str, Any],
                decode: Callable[[], Any]) -> tuple[Baseline, BaselineSource]:
    """The baseline of key: from store when it holds exactly key, else decode() (anything with
    Baseline's fields), kept in store when there is one. Without a store, decoded and not kept."""
    digest = key_sha256(key)
    with store.holding(key) if store is not None else contextlib.nullcontext():
        found = store.get(key) if store is not None else None
        if found is not None:
            return found
        timed_at, load = _now(), _load_1m()
        made = decode()
        baseline = Baseline(tuple(made.output_ids), made.stop_reason, made.prefill_s, made.decode_s,
                            getattr(made, "view", None))
        if store is not None:
            store.put(key, baseline, timed_at, load)
    return baseline, BaselineSource("decoded", digest, timed_at, machine()["host"], load)


@dataclass(frozen=True)
class RunBaselines:
    """One run's way to its prompts' baselines: its store (None: decode every one, keep none)
    and the key parts the run shares (run_key)."""

    store: Optional[BaselineStore]
    base: Mapping[str, Any]

    def get(self, prompt_ids: Sequence[int], max_new_tokens: int, whole_prompt: bool,
            decode: Callable[[], Any]) -> tuple[Baseline, BaselineSource]:
        return baseline_of(self.store, prompt_key(self.base, prompt_ids, max_new_tokens, whole_prompt), decode)

    def stored(self, prompt_ids: Sequence[int], max_new_tokens: int, whole_prompt: bool) -> bool:
        """Whether get would find an entry (BaselineStore.holds)."""
        return self.store is not None and self.store.holds(prompt_key(self.base, prompt_ids, max_new_tokens,
                                                                      whole_prompt))
