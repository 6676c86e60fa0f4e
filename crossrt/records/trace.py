"""Per-token traces of driven speculative runs: what the target and the drafter made of each
emitted token, stored beside the run record.

Recorded under the "crossrt" and "hf-assisted" schedules when asked (`crossrt run --trace`),
from rows the loop already computes: per step its lengths, per token the target's entropy, top-1
probability and margin and the drafter's top-1 probability (NaN where nothing was proposed).
One `<record stem>.trace.npz`, with a journal beside it while a run goes on.
Rules and the format, field by field: docs/analysis.md, "Traces".
"""

from __future__ import annotations

import base64
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from crossrt.records.journal import StorageError, journal_path, read_with_journal, write_atomically
from crossrt.records.schema import RecordError, RunRecord
from crossrt.records.record_json import load_record

TRACE_FORMAT = 1
TOKEN_FIELDS = ("target_entropy", "target_p1", "target_margin", "drafter_p1")
# A journal entry's arrays, as the trace holds them; written as raw little-endian bytes in
# base64: exact, and a third larger than raw.
ENTRY_DTYPES = {"step_drafted": np.int32, "step_accepted": np.int32, **{name: np.float32 for name in TOKEN_FIELDS}}


def _little_endian(dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


@dataclass(frozen=True, eq=False)
class PromptTrace:
    """One prompt's trace. Step arrays are int32 (one entry per step), token arrays float32
    (one entry per emitted token, in output order)."""

    step_drafted: np.ndarray
    step_accepted: np.ndarray
    target_entropy: np.ndarray
    target_p1: np.ndarray
    target_margin: np.ndarray
    drafter_p1: np.ndarray  # NaN where the drafter proposed nothing for the token

    def __post_init__(self):
        if len(self.step_drafted) != len(self.step_accepted):
            raise RecordError("trace: step_drafted and step_accepted differ in length")
        n_tokens = int(np.sum(self.step_accepted)) + len(self.step_accepted)
        for name in TOKEN_FIELDS:
            if len(getattr(self, name)) != n_tokens:
                raise RecordError(f"trace: {name} has {len(getattr(self, name))} entries, the steps emit {n_tokens}")

    @property
    def n_tokens(self) -> int:
        return len(self.target_entropy)

    def position(self) -> np.ndarray:
        """Each token's position in its step: 0 .. step_accepted."""
        lengths = self.step_accepted + 1
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        return np.arange(self.n_tokens) - starts

    def proposed(self) -> np.ndarray:
        """Tokens the drafter proposed a token for (position < the step's draft length)."""
        return self.position() < np.repeat(self.step_drafted, self.step_accepted + 1)

    def accepted(self) -> np.ndarray:
        """Tokens that are accepted draft tokens (position < the step's accepted length)."""
        return self.position() < np.repeat(self.step_accepted, self.step_accepted + 1)


def row_stats(rows: np.ndarray) -> np.ndarray:
    """Per row of logits: (entropy in nats, top-1 probability, top-1 minus top-2 logit).
    One shifted copy of the rows and one array of weights: no other full-vocabulary copies."""
    rows = np.asarray(rows, dtype=np.float32)
    at = np.arange(len(rows))
    top = rows.argmax(axis=1)
    shifted = rows - rows[at, top][:, None]
    shifted[at, top] = -np.inf
    runner_up = shifted.max(axis=1)
    shifted[at, top] = 0
    # Raw logits may hold -inf (masked tokens): a finite floor keeps 0 * -inf out of the entropy.
    np.maximum(shifted, np.float32(-1e30), out=shifted)
    weights = np.exp(shifted)
    total = weights.sum(axis=1, dtype=np.float64)
    weighted = np.multiply(weights, shifted, out=shifted).sum(axis=1, dtype=np.float64)
    entropy = np.log(total) - weighted / total
    return np.stack([np.maximum(entropy, 0.0), 1.0 / total, -runner_up], axis=1)


def top1_probability(row: np.ndarray) -> float:
    """The full-softmax probability of a row's argmax."""
    return float(1.0 / np.exp(row - row.max()).sum(dtype=np.float64))


class TraceRecorder:
    """Collects one prompt's trace inside the driven loop: drafted() once per draft token, as
    the drafter proposes it; verified() once per step, with the target rows of the tokens the
    step emits."""

    def __init__(self):
        self._draft_p1: list[float] = []
        self._steps: list[tuple[int, int]] = []
        self._stats: list[np.ndarray] = []
        self._drafter: list[np.ndarray] = []

    def drafted(self, row: np.ndarray) -> None:
        self._draft_p1.append(top1_probability(row))

    def verified(self, rows: np.ndarray, n_drafted: int, n_accepted: int) -> None:
        """rows: the step's verify rows 0 .. n_accepted, one per emitted token."""
        if len(self._draft_p1) != n_drafted or len(rows) != n_accepted + 1:
            raise ValueError(f"trace: {len(self._draft_p1)} draft rows and {len(rows)} verify rows for a step "
                             f"that drafted {n_drafted} and accepted {n_accepted}")
        proposals = np.full(n_accepted + 1, np.nan, dtype=np.float32)
        shown = min(n_drafted, n_accepted + 1)
        proposals[:shown] = self._draft_p1[:shown]
        self._steps.append((n_drafted, n_accepted))
        self._stats.append(row_stats(rows))
        self._drafter.append(proposals)
        self._draft_p1.clear()

    def finish(self) -> PromptTrace:
        steps = np.array(self._steps, dtype=np.int32).reshape(-1, 2)
        stats = np.concatenate(self._stats).astype(np.float32) if self._stats else np.empty((0, 3), np.float32)
        drafter = np.concatenate(self._drafter) if self._drafter else np.empty(0, np.float32)
        return PromptTrace(steps[:, 0], steps[:, 1], stats[:, 0], stats[:, 1], stats[:, 2], drafter)


def trace_path(record_path: Path) -> Path:
    """Where the trace of the record at record_path goes: beside it, `<stem>.trace.npz`."""
    record_path = Path(record_path)
    return record_path.with_name(record_path.stem + ".trace.npz")


def save_traces(traces: Mapping[str, PromptTrace], path: Path) -> bytes:
    """Write every prompt's trace to one file, atomically (temporary file, then os.replace).
    Returns the bytes written (a journal started beside them names their digest)."""
    ids = list(traces)
    items = [traces[i] for i in ids]

    def joined(name: str, dtype) -> np.ndarray:
        return np.concatenate([getattr(t, name) for t in items]).astype(dtype) if items else np.empty(0, dtype)

    arrays = {
        "format": np.array(TRACE_FORMAT),
        "prompt_id": np.array(ids, dtype=str),
        "n_steps": np.array([len(t.step_drafted) for t in items], dtype=np.int64),
        "n_tokens": np.array([t.n_tokens for t in items], dtype=np.int64),
        "step_drafted": joined("step_drafted", np.int32),
        "step_accepted": joined("step_accepted", np.int32),
        **{name: joined(name, np.float32) for name in TOKEN_FIELDS},
    }
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    written = buffer.getvalue()
    write_atomically(Path(path), written)
    return written


def trace_entry(prompt_id: str, trace: PromptTrace) -> str:
    """One prompt's trace as a journal line of its trace file."""
    arrays = {name: np.ascontiguousarray(getattr(trace, name), _little_endian(dtype)).tobytes()
              for name, dtype in ENTRY_DTYPES.items()}
    encoded = {name: base64.b64encode(raw).decode() for name, raw in arrays.items()}
    return json.dumps({"prompt_id": prompt_id, **encoded}, separators=(",", ":"))


def _trace_from_entry(line: str, where: str) -> tuple[str, PromptTrace]:
    try:
        entry = json.loads(line)
        raw = {name: base64.b64decode(entry[name], validate=True) for name in ENTRY_DTYPES}
        arrays = {name: np.frombuffer(raw[name], _little_endian(dtype)).astype(dtype)
                  for name, dtype in ENTRY_DTYPES.items()}
        return str(entry["prompt_id"]), PromptTrace(**arrays)
    except (ValueError, KeyError, TypeError) as error:  # RecordError (lengths) is a ValueError too
        raise RecordError(f"{where}: not a trace entry ({error})") from None


def read_traces(path: Path) -> dict[str, PromptTrace]:
    """Every prompt's trace in a trace file and its journal, by prompt id (not checked against
    any record)."""
    try:
        written, entries = read_with_journal(path)
    except StorageError as error:  # a RecordError, as every trace problem: a report shows it and goes on
        raise RecordError(str(error)) from None
    try:
        with np.load(io.BytesIO(written), allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:  # a truncated or damaged file
        raise RecordError(f"{path}: not a trace file ({error}); run the record again with --trace "
                          "--overwrite") from None
    if int(arrays.get("format", -1)) != TRACE_FORMAT:
        raise RecordError(f"{path}: trace format {arrays.get('format')} is not {TRACE_FORMAT}")
    step_ends = np.cumsum(arrays["n_steps"])
    token_ends = np.cumsum(arrays["n_tokens"])
    traces = {}
    for index, prompt_id in enumerate(arrays["prompt_id"]):
        steps = slice(step_ends[index] - arrays["n_steps"][index], step_ends[index])
        tokens = slice(token_ends[index] - arrays["n_tokens"][index], token_ends[index])
        traces[str(prompt_id)] = PromptTrace(arrays["step_drafted"][steps], arrays["step_accepted"][steps],
                                             *(arrays[name][tokens] for name in TOKEN_FIELDS))
    # Line 1 of a journal is its header, so entries start at line 2.
    traces.update(_trace_from_entry(line, f"{journal_path(path)} line {number}")
                  for number, line in enumerate(entries, start=2))
    return traces


def load_trace(record_path: Path, record: Optional[RunRecord] = None) -> dict[str, PromptTrace]:
    """The traces of the record at record_path (loaded unless given), by prompt id: empty
    when the record has none. Each trace is checked against its prompt's counters; a trace
    for a prompt the record does not hold as finished (written just before a crash) is left
    out."""
    record_path = Path(record_path)
    record = record if record is not None else load_record(record_path)
    if record.trace is None:
        return {}
    path = record_path.parent / record.trace
    if not path.is_file():
        raise RecordError(f"{record_path} names the trace {record.trace}, which is missing")
    finished = {r.prompt_id: r for r in record.results if r.ok}
    traces = {}
    for prompt_id, trace in read_traces(path).items():
        result = finished.get(prompt_id)
        if result is None:
            continue
        counters = result.counters
        if (list(trace.step_drafted) != list(counters.step_drafted or ())
                or list(trace.step_accepted) != list(counters.step_accepted or ())
                or trace.n_tokens != counters.emitted):
            raise RecordError(f"{path}: the trace of {prompt_id} does not match the record's counters")
        traces[prompt_id] = trace
    return traces
