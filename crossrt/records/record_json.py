"""The run record's JSON form (crossrt/records/schema.py holds the record itself): encoding with the
derived blocks written for readers (jq, spreadsheets), decoding into the dataclasses,
validation against data/run-record.schema.json on write and on read (each metric a derived block
holds must match a recomputation; one it lacks, written before that metric, is left out), and
the record file on disk. A run in progress appends each finished prompt
to a journal beside its record (crossrt/records/journal.py), validated alone; load_record folds it in
(docs/design.md, "Records on disk").
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import typing
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import jsonschema

from crossrt.records.counts import Counts
from crossrt.records.journal import journal_path, read_with_journal, write_atomically
from crossrt.records import metrics
from crossrt.records.schema import SCHEMA_RESOURCE, SCHEMA_VERSION, PromptResult, RecordError, RunRecord, Summary


def _derived_of_result(result: PromptResult) -> dict[str, Any]:
    return {"lossless": result.lossless, **metrics.values(result.totals)}


# A summary's JSON: its counts, then every metric of the list (the seconds it sums stay unwritten).
SUMMARY_COUNTS = ("prompts", "failed", "lossless", *Counts().counted())


def _summary_json(summary: Summary) -> dict[str, Any]:
    return {**{name: getattr(summary, name) for name in SUMMARY_COUNTS}, **metrics.values(summary)}


def _plain(value: Any) -> Any:
    """value as dataclasses.asdict gives it, for the JSON it is written as (a tuple a list, a
    dataclass a dict of its fields in order), without asdict's deep copy of each token id (a
    third of writing a record)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [item if type(item) in (int, float, str) else _plain(item) for item in value]
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    return value


def record_to_json(record: RunRecord) -> dict[str, Any]:
    data = _plain(record)
    for result_data, result in zip(data["results"], record.results, strict=True):
        result_data["derived"] = _derived_of_result(result)
    data["summary"] = {
        "overall": _summary_json(record.summary()),
        "by_category": {c: _summary_json(record.summary(c)) for c in record.categories()},
    }
    if record.trace is None:
        del data["trace"]  # optional: an untraced record reads as before traces existed
    if record.imported is None:
        del data["imported"]  # optional: a record crossrt ran reads as before imports existed
    if record.prompt_format is None:
        del data["prompt_format"]  # optional: raw prompts read as before chat templates existed
    if record.params.repeat == 1:
        del data["params"]["repeat"]  # optional: absent reads as one run of each prompt
    if record.runtime.dtype is None:
        del data["runtime"]["dtype"]  # optional: a llama.cpp record reads as before dtypes existed
    for result_data in data["results"]:  # optional too: absent reads as None
        for name in ("output_view", "baseline_view", "unfit_counts", "prompt_sha256", "template_ids",
                     "baseline_source"):
            if result_data[name] is None:
                del result_data[name]
        if not result_data["lossy"]:
            del result_data["lossy"]  # optional: a greedy run's result reads as before strategies existed
        if not result_data["repeats"]:
            del result_data["repeats"]  # optional: a run without --repeat reads as before repeats existed
        for view in (result_data.get("output_view"), result_data.get("baseline_view")):
            for name in ("close_ids", "close_gaps"):  # optional: absent in records before them
                if view is not None and view[name] is None:
                    del view[name]
    return json.loads(json.dumps(data))  # plain JSON types: tuples become lists


def _decode(kind: Any, value: Any) -> Any:
    """Build a typed value (dataclass, tuple, Optional) from its plain JSON form."""
    origin = typing.get_origin(kind)
    if value is None:
        return None
    if origin is typing.Union:
        inner = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return _decode(inner[0], value)
    if origin is tuple:
        return tuple(_decode(typing.get_args(kind)[0], item) for item in value)
    if dataclasses.is_dataclass(kind):
        hints = _fields(kind)
        return kind(**{name: _decode(hint, value[name]) for name, hint in hints if name in value})
    return value


@lru_cache(maxsize=None)
def _fields(kind: type) -> tuple[tuple[str, Any], ...]:
    """A dataclass's fields with their resolved types, in order: typing.get_type_hints evaluates
    every annotation anew, and a record decoded each result, counter and view with it (half of
    reading a record)."""
    hints = typing.get_type_hints(kind)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(kind))


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


def _check_derived(written: dict[str, Any], recomputed: dict[str, Any], where: str) -> None:
    """Each number written that the counters give otherwise. A key not written is a metric added
    since the record was (nothing to check); one this crossrt does not know is a newer one's."""
    for name, value in recomputed.items():
        if name in written and not _close(written[name], value):
            raise RecordError(f"{where}: {name} is {written[name]!r} but the counters give {value!r}")


@lru_cache(maxsize=1)
def json_schema() -> dict[str, Any]:
    text = resources.files("crossrt").joinpath("data", SCHEMA_RESOURCE).read_text()
    return json.loads(text)


# JSON Schema's own items keyword, which descends into each item of an array in turn.
_ITEMS = jsonschema.Draft202012Validator.VALIDATORS["items"]
_SCALARS = {"integer": (int,), "number": (int, float)}  # exact types: a bool is neither here
_PASSES: dict[int, tuple[Any, Optional[typing.Callable[[Any], bool]]]] = {}  # by item schema: _passes


def _passes(schema: Any) -> Optional[typing.Callable[[Any], bool]]:
    """A test that only values schema accepts pass, where schema is a number (type, minimum) or an
    array of them (type, maxItems, items); None for any other schema."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in _SCALARS and schema.keys() <= {"type", "minimum"}:
        types, least = _SCALARS[kind], schema.get("minimum")
        return lambda value: type(value) in types and (least is None or value >= least)
    inner = _passes(schema.get("items")) if kind == "array" and schema.keys() <= {"type", "maxItems", "items"} else None
    if inner is None:
        return None
    most = schema.get("maxItems")
    return lambda value: type(value) is list and (most is None or len(value) <= most) and all(map(inner, value))


def _items(validator, items, instance, schema):
    """items, with an array of numbers or of arrays of them (token ids, margins, close ids: most of
    a record's values) checked in one loop: only an array that loop does not pass goes through
    JSON Schema's own check, so the errors are the same as without it (descending into each
    token id made a record's validation 18 ms; 7 ms with this)."""
    known = _PASSES.get(id(items))
    if known is None or known[0] is not items:
        known = _PASSES[id(items)] = (items, _passes(items))
    if known[1] is not None and type(instance) is list and "prefixItems" not in schema \
            and all(map(known[1], instance)):
        return
    yield from _ITEMS(validator, items, instance, schema)


_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"items": _items})


def validate_json(data: Any) -> None:
    """Raise RecordError naming the first place where data breaks the JSON Schema."""
    validator = _Validator(json_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise RecordError(f"record does not follow schema v{SCHEMA_VERSION} at {where}: {error.message}")


def record_from_json(data: Any) -> RunRecord:
    version = data.get("schema_version") if isinstance(data, dict) else None
    if isinstance(version, int) and version > SCHEMA_VERSION:  # first: the schema would only call it invalid
        raise RecordError(f"written by a newer crossrt (schema {version}; this one reads {SCHEMA_VERSION}): "
                          "upgrade crossrt to read it")
    validate_json(data)
    record = _decode(RunRecord, data)
    seen: set[str] = set()
    for result in record.results:
        if result.prompt_id in seen:  # a record holds one result per prompt; readers key on the id
            raise RecordError(f"prompt_id {result.prompt_id!r} appears twice in results")
        seen.add(result.prompt_id)
    check_counters(record)
    for result_data, result in zip(data["results"], record.results, strict=True):
        _check_derived(result_data["derived"], _derived_of_result(result), f"result {result.prompt_id}")
    _check_derived(data["summary"]["overall"], _summary_json(record.summary()), "summary")
    return record


def check_counters(record: RunRecord) -> None:
    """Raise RecordError when a finished prompt's counters break the identities."""
    for result in record.results:
        if result.ok:
            problems = result.counters.identity_violations(record.params.k)
            if problems:
                raise RecordError(f"result {result.prompt_id}: " + "; ".join(problems))


def check_finite(data: Any, where: str = "record") -> None:
    """RecordError naming the first value that is not a finite number (NaN, infinity): JSON has
    none, and a record holding one could be written but never read by every command again."""
    if isinstance(data, float) and not math.isfinite(data):
        raise RecordError(f"{where} is {data}, not a finite number: nothing holding it is written")
    if isinstance(data, dict):
        for key, value in data.items():
            check_finite(value, f"{where}.{key}")
    elif isinstance(data, (list, tuple)):
        for index, value in enumerate(data):
            check_finite(value, f"{where}[{index}]")


def save_record(record: RunRecord, path: Path, option: str = "--out") -> bytes:
    """Validate, then write atomically, so an interrupted run never leaves half a file.
    Returns the bytes written (a journal started beside them names their digest); option: the
    command's option naming path, for a disk error's advice."""
    check_counters(record)
    data = record_to_json(record)
    validate_json(data)
    check_finite(data)
    written = (json.dumps(data, indent=1) + "\n").encode()
    write_atomically(Path(path), written, option)
    return written


def result_entry(record: RunRecord, result: PromptResult) -> str:
    """result as one journal line of record, validated alone: the schema as it applies to a
    record holding just this result (record's runtime, pair and params; constant work
    whatever record holds), and the counter identities."""
    alone = dataclasses.replace(record, results=(result,))
    check_counters(alone)
    data = record_to_json(alone)
    validate_json(data)
    check_finite(data["results"][0], f"result {result.prompt_id}")
    return json.dumps(data["results"][0], separators=(",", ":"))


def _result_from_entry(line: str, record_data: dict[str, Any], record: RunRecord, where: str) -> PromptResult:
    """A journal line checked as result_entry wrote it: schema, counter identities, derived."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError) as error:  # also: a number too long to convert, nesting too deep
        raise RecordError(f"{where} is not JSON: {error}") from None
    try:
        validate_json({**record_data, "results": [entry]})
        result = _decode(PromptResult, entry)
        check_counters(dataclasses.replace(record, results=(result,)))
        _check_derived(entry["derived"], _derived_of_result(result), f"result {result.prompt_id}")
    except RecordError as error:
        raise RecordError(f"{where}: {error}") from None
    return result


# What makes a damaged record anew, for the commands that read records without writing them
# (show, parity, report...): they have no --overwrite of their own, so the hint names who has.
REMAKE = "write it again with the `crossrt run` or `crossrt import` that made it, passing --overwrite"


RECORD_BYTES = 1 << 30  # more than any record crossrt writes (10,000 prompts take ~100 MB): read no further


def load_record(path: Path, remake: Optional[str] = REMAKE) -> RunRecord:
    """The record at path, validated whole, with the prompts its journal holds (a run in
    progress, or one killed) folded in, each validated alone; a torn last line is left out.
    remake: what the reading command's user does to make a damaged record anew (None: no hint)."""
    path = Path(path)
    if not path.is_file():
        raise RecordError(f"no run record at {path}")
    journal = journal_path(path)
    size = path.stat().st_size + (journal.stat().st_size if journal.is_file() else 0)
    if size > RECORD_BYTES:
        raise RecordError(f"{path} (with its journal) holds {size >> 20} MiB, more than the "
                          f"{RECORD_BYTES >> 20} MiB of any record crossrt writes: not a run record")
    text, entries = read_with_journal(path)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deep (a damaged file)
        raise RecordError(f"{path} is not JSON: {error} (a damaged record{f': {remake}' if remake else ''})") \
            from None
    try:
        record = record_from_json(data)
    except RecordError as error:
        raise RecordError(f"{path}: {error}") from None
    where = journal_path(path)
    results = []
    for number, line in enumerate(entries, start=2):  # line 1 of a journal is its header
        try:
            results.append(_result_from_entry(line, data, record, f"{where} line {number}"))
        except RecordError as error:
            raise RecordError(f"{error}; {_kept_before(where, number)}") from None
    return record.with_results(results)


def _kept_before(journal: Path, line: int) -> str:
    """How to keep the prompts a journal holds before its damaged line: each line was validated
    alone when written, so the lines before the damage are whole prompts."""
    if line == 2:
        return f"no prompt precedes it: remove {journal} to read the record's own prompts"
    quoted, kept = shlex.quote(str(journal)), shlex.quote(f"{journal}.kept")
    return (f"the {line - 2} prompt(s) before it are intact: keep them by cutting the journal there "
            f"(head -n {line - 1} {quoted} > {kept} && mv {kept} {quoted}), then --resume runs the others again")
