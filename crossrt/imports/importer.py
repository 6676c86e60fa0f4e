"""`crossrt import`: another runtime's own statistics as a run record, beside crossrt's runs.

A source format (FORMATS) is read into counts (crossrt/imports/logs.py, import_metrics.py), and
the counts become a record marked `imported` (schema.ImportInfo) with one aggregate result, or
one result per request where the source keeps them apart (AIPerf's per-request export):
counters only, no token ids, no timings. Counters the source does not give follow crossrt's
identities (emitted = steps + accepted, nothing unverified or cut), and the record says which
are given, so readers compare only those. docs/import.md gives each source's fields.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from crossrt.imports.aiperf import read_aiperf
from crossrt.imports.aiperf_prompts import PromptMismatch
from crossrt.imports.exllamav3 import read_exllamav3_stats
from crossrt.imports.logs import ReadOptions, read_llama_server_log, read_sglang_log, read_vllm_log
from crossrt.imports.engine_metrics import read_llama_server_metrics, read_vllm_metrics
from crossrt.imports.sglang import read_sglang_metrics
from crossrt.imports.imported import ImportFailure, PromptCounts, SourceCounts, padded
from crossrt.inputs.pairs import Pair, pair_info
from crossrt.inputs.prompts import Prompt
from crossrt.records.schema import Counters, ImportInfo, PairInfo, PromptResult, RunParams, RunRecord, RuntimeInfo

AGGREGATE = "aggregate"  # the prompt id of an imported record's one result
AIPERF_INPUTS = "inputs.json"  # AIPerf's payload of each request, written beside its exports
UNKNOWN = "unknown"  # a text field the source does not say (numbers and flags it does not say are null)


@dataclass(frozen=True)
class Format:
    read: Callable[[str, ReadOptions], SourceCounts]
    runtime: str  # the record's runtime name
    schedule: str  # whose counting the counters follow (docs/schema.md, schedules)
    model_format: str  # the model files a --pair manifest names for this runtime
    counters: bool  # a counter endpoint: a --before scrape can be subtracted
    per_request: bool = False  # it can keep its requests as prompts: --prompts names them


FORMATS = {
    "vllm-log": Format(read_vllm_log, "vllm", "vllm", "hf", counters=False),
    "vllm-metrics": Format(read_vllm_metrics, "vllm", "vllm", "hf", counters=True),
    "sglang-log": Format(read_sglang_log, "sglang", "sglang", "hf", counters=False),
    "sglang-metrics": Format(read_sglang_metrics, "sglang", "sglang", "hf", counters=True),
    "llama-server-metrics": Format(read_llama_server_metrics, "llama-server", "llama-server", "gguf", counters=True),
    "llama-server-log": Format(read_llama_server_log, "llama-server", "llama-server", "gguf", counters=False),
    "exllamav3-stats": Format(read_exllamav3_stats, "exllamav3", "exllamav3", "exl3", counters=False),
    # AIPerf is the client that wrote the file; the counts are its one adapter's engine's, vLLM's.
    "aiperf": Format(read_aiperf, "aiperf", "vllm", "hf", counters=False, per_request=True),
}


# Schedules whose engines draft k tokens on every step: their records state n_min k and p_min 0.
FIXED_K = ("vllm", "sglang")


@dataclass(frozen=True)
class ImportRequest:
    path: Path
    format: str
    before: Optional[Path] = None  # an earlier scrape of the same counter endpoint
    options: ReadOptions = ReadOptions()
    pair: Optional[Pair] = None  # the pair's files, to digest, when they are at hand
    pair_name: Optional[str] = None
    category: str = AGGREGATE
    spec_type: Optional[str] = None
    greedy: Optional[bool] = None
    max_new_tokens: Optional[int] = None
    n_ctx: Optional[int] = None
    draft_n_min: Optional[int] = None
    draft_p_min: Optional[float] = None
    prompts: Optional[tuple[Prompt, ...]] = None  # the prompts the requests ran (per_request formats)
    inputs: Optional[Path] = None  # AIPerf's inputs.json (default: beside path, where --prompts is given)


LOG_BYTES = 256 << 20  # the most of a log or scrape crossrt reads (its text is held whole while parsed)


def _text(path: Path) -> str:
    """The file's text: a regular file (a FIFO would wait for a writer for ever, a device never
    ends) of at most LOG_BYTES, checked before anything is read."""
    try:
        found = os.stat(path)
        if stat.S_ISDIR(found.st_mode):
            raise IsADirectoryError
        if not stat.S_ISREG(found.st_mode):
            raise ImportFailure(f"{path} is not a regular file (a pipe, FIFO or device): save what to import to a "
                                "file first")
        if found.st_size > LOG_BYTES:
            raise ImportFailure(f"{path} holds {found.st_size >> 20} MiB, more than the {LOG_BYTES >> 20} MiB crossrt "
                                "reads of a log: keep the lines it reads first (e.g. grep -i spec_decode)")
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ImportFailure(f"no file {path}") from None
    except (UnicodeDecodeError, IsADirectoryError):
        raise ImportFailure(f"{path} is not a text file") from None
    except OSError as error:
        raise ImportFailure(f"cannot read {path}: {error.strerror or error}") from None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)  # links too
    except OSError:  # one is missing: _text says so
        return False


def read_counts(request: ImportRequest) -> SourceCounts:
    """The counts of request.path in its format, less those of request.before if given."""
    source = FORMATS[request.format]
    if request.before is not None and not source.counters:
        counting = ", ".join(name for name, entry in FORMATS.items() if entry.counters)
        raise ImportFailure(f"--before is for counter endpoints ({counting}): {request.format} text covers what "
                            "it holds")
    if (request.prompts is not None or request.inputs is not None) and not source.per_request:
        per_request = ", ".join(name for name, entry in FORMATS.items() if entry.per_request)
        raise ImportFailure(f"--prompts and --inputs name the prompts of a per-request export ({per_request}): "
                            f"{request.format} text is one aggregate")

    def read(path: Path, text: str, options: ReadOptions) -> SourceCounts:
        try:
            return source.read(text, options)
        except PromptMismatch as error:
            raise ImportFailure(f"{path}: {error}") from None
        except ImportFailure as error:
            raise ImportFailure(f"{path} is not {request.format} output crossrt can read: {error}") from None

    if request.before is not None and _same_file(request.path, request.before):
        raise ImportFailure(f"--before {request.before} is the scrape itself ({request.path}): give the scrape made "
                            "before the benchmark (FILE minus itself counts nothing)")
    text = _text(request.path)  # a missing or unreadable file is that, not a text of another format
    inputs = request.inputs
    if inputs is None and request.prompts is not None and (request.path.parent / AIPERF_INPUTS).is_file():
        inputs = request.path.parent / AIPERF_INPUTS  # AIPerf writes it beside its exports
    options = dataclasses.replace(request.options, prompts=request.prompts,
                                  inputs=None if inputs is None else _text(inputs))
    counts = read(request.path, text, options)
    return counts.minus(read(request.before, _text(request.before), options)) if request.before is not None else counts


def _counters(counts: SourceCounts, k: int) -> tuple[Counters, tuple[str, ...], tuple[str, ...]]:
    """crossrt's counters, the names the source gives, and notes on those it does not."""
    given, notes = ["steps", "drafted", "accepted"], []
    per_pos = None
    if counts.accepted_per_pos is not None:
        if any(counts.accepted_per_pos[k:]):
            raise ImportFailure(f"acceptance at draft positions beyond k={k}: {list(counts.accepted_per_pos)}")
        per_pos = padded(counts.accepted_per_pos, k)
        given.append("accepted_per_pos")
    emitted, unverified, cut = counts.steps + counts.accepted, 0, 0
    if counts.emitted is not None:
        cut = counts.steps + counts.accepted + counts.unverified - counts.emitted
        if cut >= 0:
            emitted, unverified = counts.emitted, counts.unverified
            given += ["emitted", "unverified", "cut"]
        else:  # decodes counted per call, not per slot: several slots shared a decode
            cut = 0
            notes.append(f"emitted {counts.emitted} exceeds steps + accepted + decodes outside steps: the decode "
                         "counter did not count one decode per token (slots batched together), so emitted = steps + "
                         "accepted")
    counters = Counters(steps=counts.steps, drafted=counts.drafted, accepted=counts.accepted, emitted=emitted,
                        accepted_per_pos=per_pos, step_drafted=None, step_accepted=None, unverified=unverified, cut=cut)
    problems = counters.identity_violations(k)
    if problems:
        raise ImportFailure("the counts break crossrt's counter identities: " + "; ".join(problems))
    return counters, tuple(given), tuple(notes)


def _missing(given: tuple[str, ...], request: ImportRequest, counts: SourceCounts) -> tuple[str, ...]:
    missing = ["token ids: no lossless check, no output or logit parity",
               *([] if counts.prompts else ["per-prompt split: one aggregate result over everything the text covers"]),
               "timings: no tokens/s or speedup", *counts.missing]
    if "emitted" not in given:
        missing.append("tokens outside verification steps: emitted is steps + accepted")
    if "accepted_per_pos" not in given:
        missing.append("per-position acceptance counts")
    if request.pair is None:
        missing.append("the pair's files: no digests or vocabulary fingerprint")
    return tuple(missing)


def import_record(request: ImportRequest) -> RunRecord:
    """The record of request.path's counts (ImportFailure, PairError: nothing usable)."""
    counts = read_counts(request)
    try:
        return _record(request, counts)
    except ImportFailure as error:  # counts that read but do not add up: still the file's to name
        raise ImportFailure(f"{request.path}: {error}") from None


def _record(request: ImportRequest, counts: SourceCounts) -> RunRecord:
    source = FORMATS[request.format]
    if request.options.k is not None and counts.k is not None and request.options.k != counts.k:
        raise ImportFailure(f"--k {request.options.k}, but the text shows k = {counts.k}")
    k = counts.k or request.options.k
    if k is None:
        raise ImportFailure(f"the {request.format} text does not say the draft length: give --k")
    if counts.steps == 0:
        raise ImportFailure("no verification steps counted (nothing was drafted)")
    counters, given, notes = _counters(counts, k)
    n_min, p_min = request.draft_n_min, request.draft_p_min
    if source.schedule in FIXED_K:
        if (n_min, p_min) not in ((None, None), (k, None), (None, 0.0), (k, 0.0)):
            raise ImportFailure(f"--draft-n-min {n_min}, --draft-p-min {p_min}: {source.schedule} drafts k = {k} tokens "
                                "every step, it has no n_min or p_min rules")
        n_min, p_min = k, 0.0  # what the engine's counting is: the record can then be compared without them
        notes += (f"draft_n_min {k} and draft_p_min 0 stated from {source.schedule}'s counting: it drafts k tokens "
                  "every step (no n_min or p_min rules)",)
    pair = (pair_info(request.pair, source.model_format) if request.pair is not None
            else PairInfo(request.pair_name or UNKNOWN, None, None))
    runtime = RuntimeInfo(name=source.runtime, version=counts.version or UNKNOWN, build=counts.build,
                          device=UNKNOWN, threads=None, gpu_split=None, kv_cache=UNKNOWN, flash_attn=None)
    params = RunParams(k=k, greedy=request.greedy, max_new_tokens=request.max_new_tokens, mode="native",
                       spec_type=request.spec_type or UNKNOWN, schedule=source.schedule, n_ctx=request.n_ctx,
                       draft_n_min=n_min, draft_p_min=p_min)
    results = tuple(_result(part, request.category, k) for part in counts.prompts) or \
        (PromptResult(AGGREGATE, request.category, "ok", None, (), (), (), None, counters, None),)
    described = f"{request.before} -> {request.path}" if request.before is not None else str(request.path)
    info = ImportInfo(request.format, described, given, _missing(given, request, counts))
    return RunRecord(runtime, pair, params, results, notes=counts.notes + notes, imported=info)


def _result(part: PromptCounts, category: str, k: int) -> PromptResult:
    """One request's result: its counters as the aggregate's are read, or failed with why."""
    if part.counts is None:
        return PromptResult.failed(part.prompt_id, part.category or category, part.error)
    try:
        counters = _counters(part.counts, k)[0]
    except ImportFailure as error:
        raise ImportFailure(f"prompt {part.prompt_id}: {error}") from None
    return PromptResult(part.prompt_id, part.category or category, "ok", None, (), (), (), None, counters, None)


def import_summary(record: RunRecord) -> str:
    """One line: where an imported record's counters come from and what its source lacks."""
    info = record.imported
    return (f"imported from {info.format} ({info.source}): counters given: {', '.join(info.given)}; "
            f"not in the source: {'; '.join(info.missing)}")
