"""Fuzzed inputs: a seeded generator of damaged prompt files (fed to `crossrt run`) and damaged
records and journals (fed to `show`, `parity`, `report` and `analyze`), a few hundred cases.
Every case ends with exit code 0 (a damage that leaves a readable input) or 1/2 and one line
(`Error: ...`), never a traceback: in-process through click's runner (the exception must be
click's SystemExit), and for a sample through real subprocesses (docs/reliability.md)."""

import dataclasses
import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.journal import Journal
from crossrt.record_json import load_record, result_entry, save_record
from crossrt.schema import RecordError

from conftest import TINY_PAIR

SEED = 11
CROSSRT = str(Path(sys.executable).parent / "crossrt")
GOOD = {"id": "p1", "category": "prose", "prompt": "The cat sat on"}
# Values of every JSON type, and the awkward ones: NaN, huge, separators inside strings.
ODD_VALUES = [None, True, False, 0, -1, 2 ** 70, 1e308, float("nan"), "", "x", "a\u2028b\x85c", "\x00",
              "é" * 3000, [], [1, "a"], {}, {"id": "p1"}]


def _line(item) -> str:
    return json.dumps(item, ensure_ascii=False)


def damaged_prompt_file(rng: random.Random) -> tuple[str, bytes]:
    """(kind, file bytes) of one damaged crossrt JSONL prompt file; every kind is invalid."""
    good = [dict(GOOD, id=f"p{i}", prompt=f"Story {i}: the cat") for i in range(rng.randrange(1, 6))]
    lines = [_line(item) for item in good]
    at = rng.randrange(len(lines))
    kind = rng.choice(["bad-json", "missing-field", "empty-field", "wrong-type", "duplicate-id", "not-object",
                       "huge-line", "binary", "empty", "blank", "bom-and-bad", "nested", "huge-int", "nul",
                       "gzip-corrupt", "gzip-truncated"])
    if kind == "bad-json":
        cut = lines[at]
        lines[at] = cut[:rng.randrange(1, len(cut))] if rng.random() < 0.7 else cut.replace(":", "", 1)
    elif kind in ("missing-field", "empty-field", "wrong-type"):
        item, name = good[at], rng.choice(["id", "category", "prompt"])
        if kind == "missing-field":
            del item[name]
        else:
            item[name] = "" if kind == "empty-field" else rng.choice([v for v in ODD_VALUES if not isinstance(v, str)])
        lines[at] = _line(item)
    elif kind == "duplicate-id":
        lines.insert(rng.randrange(len(lines) + 1), _line(dict(good[at], prompt="another text")))
    elif kind == "not-object":
        lines[at] = _line(rng.choice([[1, 2], "text", 3, None, True]))
    elif kind == "huge-line":
        lines[at] = '{"id": "p", "prompt": "' + "x" * rng.randrange(10 ** 5, 3 * 10 ** 6)  # never closed
    elif kind == "binary":
        return kind, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4000))) + b"\xff\xfe"
    elif kind == "empty":
        return kind, b""
    elif kind == "blank":
        return kind, rng.choice([b"\n\n", b"  \n\t\n", b"\r\n"])
    elif kind == "bom-and-bad":
        lines[at] = "\ufeff" + lines[at][:-1]
    elif kind == "nested":
        lines[at] = "[" * rng.randrange(10 ** 4, 10 ** 5)
    elif kind == "huge-int":
        lines[at] = lines[at][:-1] + ', "n": ' + "7" * rng.randrange(5000, 20000) + "}"
    elif kind == "nul":
        lines[at] = lines[at].replace("cat", "c\x00t")
    data = ("\n".join(lines) + "\n").encode()
    if kind == "gzip-corrupt":
        packed = bytearray(gzip.compress(data * 20))
        for _ in range(4):
            packed[rng.randrange(10, len(packed) - 8)] ^= 0xFF
        return kind, bytes(packed)
    if kind == "gzip-truncated":
        packed = gzip.compress(data)
        return kind, packed[:rng.randrange(1, len(packed) - 1)]
    return kind, data


PROMPT_CASES = 200
RECORD_CASES = 240


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def one_line_failure(result, context: str) -> str:
    """The run's one `Error:` line; the command must have ended through click (no exception of
    its own) with exit code 1 or 2."""
    assert isinstance(result.exception, SystemExit), f"{context}: {result.exception!r}\n{result.output}"
    assert result.exit_code in (1, 2), f"{context}: exit {result.exit_code}\n{result.output}"
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:"), f"{context}: {result.output[:2000]}"
    return lines[0]


def test_fuzzed_prompt_files_are_one_line_before_any_model_loads(folder, monkeypatch):
    # Opening a runtime would load models: a prompt file must be refused before that.
    monkeypatch.setattr("crossrt.driver.open_runtime", lambda *a, **k: pytest.fail("a runtime was opened"))
    rng, runner, kinds = random.Random(SEED), CliRunner(), set()
    for case in range(PROMPT_CASES):
        kind, data = damaged_prompt_file(rng)
        kinds.add(kind)
        path = folder / f"prompts{case}.jsonl{'.gz' if kind.startswith('gzip') else ''}"
        path.write_bytes(data)
        result = runner.invoke(main, ["run", "--pair", str(TINY_PAIR), "--threads", "1", "--prompts", str(path),
                                      "--out", str(folder / f"run{case}.json")])
        line = one_line_failure(result, f"case {case} ({kind})")
        assert str(path) in line, f"case {case} ({kind}): {line[:300]}"
        assert not (folder / f"run{case}.json").exists()
    assert len(kinds) == 16


def test_a_prompt_file_with_unicode_line_separators_inside_strings_reads(folder):
    from crossrt.prompts import load_prompts

    path = folder / "separators.jsonl"
    texts = ["a\u2028b", "c\x85d", "e\x1cf\x0bg"]
    path.write_text("".join(_line(dict(GOOD, id=f"p{i}", prompt=t)) + "\n" for i, t in enumerate(texts)))
    assert [p.text for p in load_prompts(str(path))] == texts


# ---- records and journals ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_record(folder):
    """A real run of the tiny pair, saved as a record holding half its prompts and a journal
    holding the rest (as a run in progress or killed leaves them)."""
    whole = folder / "whole.json"
    result = CliRunner().invoke(main, ["run", "--pair", str(TINY_PAIR), "--threads", "1", "--k", "3",
                                       "--max-new-tokens", "6", "--out", str(whole)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = load_record(whole)
    half = dataclasses.replace(record, results=record.results[:5])
    base = folder / "base.json"
    journal = Journal(base, save_record(half, base))
    lines = [result_entry(half, r) for r in record.results[5:]]
    for line in lines:
        journal.append(line)
    return whole, base.read_bytes(), (base.with_name("base.json.journal")).read_bytes()


def _paths(data, prefix=()):
    """Every (path, value) inside a JSON value."""
    yield prefix, data
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _paths(value, prefix + (index,))


def _set(data, path, value):
    for key in path[:-1]:
        data = data[key]
    if value is _DELETE:
        del data[path[-1]]
    else:
        data[path[-1]] = value


_DELETE = object()


def damaged_record(rng: random.Random, record: bytes, journal: bytes) -> tuple[str, bytes, bytes]:
    """(kind, record bytes, journal bytes) of one damaged record and its journal."""
    data = json.loads(record)
    kind = rng.choice(["truncated", "flipped", "schema-99", "schema-odd", "duplicate", "delete", "retype",
                       "not-object", "binary", "empty", "nested", "huge-int", "journal-bad-line",
                       "journal-retype", "journal-delete", "journal-torn", "journal-binary", "journal-huge-int"])
    if kind == "truncated":
        return kind, record[:rng.randrange(len(record))], journal
    if kind == "flipped":
        damaged = bytearray(record)
        for _ in range(rng.randrange(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        return kind, bytes(damaged), journal
    if kind == "binary":
        return kind, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000))), journal
    if kind == "empty":
        return kind, b"", journal
    if kind == "nested":
        return kind, b"[" * rng.randrange(10 ** 4, 10 ** 5), journal
    if kind.startswith("journal"):
        header, *entries = journal.decode().splitlines()
        at = rng.randrange(len(entries))
        entry = json.loads(entries[at])
        if kind == "journal-bad-line":
            entries[at] = entries[at][:rng.randrange(len(entries[at]))] + "}"
        elif kind in ("journal-retype", "journal-delete"):
            path, _ = rng.choice(list(_paths(entry))[1:])
            _set(entry, path, _DELETE if kind == "journal-delete" else rng.choice(ODD_VALUES))
            entries[at] = json.dumps(entry, separators=(",", ":"))
        elif kind == "journal-huge-int":
            entries[at] = entries[at][:-1] + ',"n":' + "7" * 6000 + "}"
        text = "\n".join([header, *entries]).encode() + b"\n"
        if kind == "journal-torn":
            text = text[:rng.randrange(len(header) + 2, len(text) - 1)]
        if kind == "journal-binary":
            text = header.encode() + b"\n" + bytes(rng.randrange(256) for _ in range(500)) + b"\n"
        # The journal only counts beside the record bytes its header names: keep those.
        return kind, record, text
    if kind == "schema-99":
        data["schema_version"] = 99
    elif kind == "schema-odd":
        data["schema_version"] = rng.choice([0, -1, "1", None, 1.5, [1]])
    elif kind == "duplicate":
        data["results"].append(rng.choice(data["results"]))
    elif kind in ("delete", "retype"):
        path, _ = rng.choice(list(_paths(data))[1:])
        _set(data, path, _DELETE if kind == "delete" else rng.choice(ODD_VALUES))
    elif kind == "not-object":
        data = rng.choice([[data], "record", 1, None])
    elif kind == "huge-int":
        return kind, record.replace(b'"schema_version": 1', b'"schema_version": ' + b"1" * 6000, 1), journal
    return kind, json.dumps(data, indent=1, ensure_ascii=rng.random() < 0.5).encode(), journal


def _readable(path: Path) -> bool:
    """Whether crossrt reads the record at path (the oracle for damages that may leave one)."""
    try:
        load_record(path)
    except RecordError:
        return False
    return True


COMMANDS = [
    lambda rec, good, out: ["show", rec],
    lambda rec, good, out: ["parity", "--no-logits", rec, good],
    lambda rec, good, out: ["report", rec, "-o", out / "report.md"],
    lambda rec, good, out: ["analyze", rec],
]
ALWAYS_FAILS = {"truncated", "schema-99", "schema-odd", "duplicate", "not-object", "binary", "empty", "nested",
                "huge-int", "journal-bad-line", "journal-binary", "journal-huge-int"}


def test_fuzzed_records_and_journals_are_one_line(folder, good_record):
    whole, record, journal = good_record
    rng, runner, failed = random.Random(SEED + 1), CliRunner(), 0
    for case in range(RECORD_CASES):
        kind, data, journal_data = damaged_record(rng, record, journal)
        path = folder / f"rec{case}.json"
        path.write_bytes(data)
        path.with_name(path.name + ".journal").write_bytes(journal_data)
        command = COMMANDS[case % len(COMMANDS)](path, whole, folder)
        result = runner.invoke(main, [str(arg) for arg in command])
        context = f"case {case} ({kind}): {command[0]}"
        if kind in ALWAYS_FAILS or not _readable(path):
            line = one_line_failure(result, context)
            assert str(path) in line, f"{context}: {line[:300]}"
            failed += 1
        elif command[0] != "parity":  # parity exits 1 when two different records disagree
            assert result.exit_code == 0, f"{context}: {result.exception!r}\n{result.output[-2000:]}"
        if kind == "schema-99":
            assert "written by a newer crossrt (schema 99" in result.output
        if kind == "duplicate":
            assert "appears twice" in result.output
    assert failed > RECORD_CASES // 2


def test_a_sample_through_subprocesses_prints_no_traceback(folder, good_record):
    """The runner hides tracebacks: real processes for a few cases of each generator."""
    whole, record, journal = good_record
    rng = random.Random(SEED + 2)
    cases = []
    for case in range(4):
        kind, data = damaged_prompt_file(rng)
        path = folder / f"sample{case}.jsonl"
        path.write_bytes(data)
        cases.append((kind, ["run", "--pair", TINY_PAIR, "--threads", "1", "--prompts", path,
                             "--out", folder / f"sample{case}.json"]))
    for case, kind in enumerate(["truncated", "schema-99", "nested", "journal-bad-line"]):
        while True:
            drawn, data, journal_data = damaged_record(rng, record, journal)
            if drawn == kind:
                break
        path = folder / f"sample-rec{case}.json"
        path.write_bytes(data)
        path.with_name(path.name + ".journal").write_bytes(journal_data)
        cases.append((kind, COMMANDS[case](path, whole, folder)))
    for kind, command in cases:
        done = subprocess.run([CROSSRT, *map(str, command)], capture_output=True, text=True, timeout=120)
        assert done.returncode in (1, 2) and "Traceback" not in done.stderr, f"{kind}: {done.stderr[-3000:]}"
        assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, f"{kind}: {done.stderr[:2000]}"
