"""Fuzzed inputs: a seeded generator of damaged prompt files (fed to `crossrt run`), damaged
records and journals (fed to `show`, `parity`, `report` and `analyze`), damaged sweep files
(`sweep plan`), queries that try to write or read outside a sweep's store (`sweep query`), and
damaged texts of every import format (`import`), a few hundred cases each.
Every case ends with exit code 0 (a damage that leaves a readable input) or 1/2 and one line
(`Error: ...`), never a traceback: in-process through click's runner (the exception must be
click's SystemExit), and for a sample through real subprocesses (docs/reliability.md)."""

import dataclasses
import gzip
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.records.journal import Journal
from crossrt.records.record_json import load_record, result_entry, save_record
from crossrt.records.schema import RecordError

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
    monkeypatch.setattr("crossrt.run.driver.open_runtime", lambda *a, **k: pytest.fail("a runtime was opened"))
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



@pytest.mark.parametrize("scheme, expected", [("", "as PATH or jsonl:PATH (id, category, prompt"),
                                              ("specbench:", "as specbench:PATH (Spec-Bench question.jsonl")])
def test_prompts_naming_a_folder_say_it_is_one_and_what_file_is_expected(folder, monkeypatch, scheme, expected):
    monkeypatch.setattr("crossrt.run.driver.open_runtime", lambda *a, **k: pytest.fail("a runtime was opened"))
    checkout = folder / "a-benchmark-checkout"
    checkout.mkdir(exist_ok=True)
    result = CliRunner().invoke(main, ["run", "--pair", str(TINY_PAIR), "--threads", "1", "--prompts",
                                       f"{scheme}{checkout}", "--out", str(folder / "folder-run.json")])
    line = one_line_failure(result, scheme)
    assert f"{checkout} is a folder, not a prompt file: name the file in it, {expected}" in line, line
    assert "not found" not in line and not (folder / "folder-run.json").exists()

def test_a_prompt_file_with_unicode_line_separators_inside_strings_reads(folder):
    from crossrt.inputs.prompts import load_prompts

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
        if kind == "journal-bad-line":  # cut before the closing "}}": a cut at the last "}" gives the line back
            entries[at] = entries[at][:rng.randrange(len(entries[at]) - 1)] + "}"
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


# ---- sweep files, sweep queries, import formats -----------------------------------------------

SWEEP_CASES = 200
QUERY_CASES = 120
IMPORT_CASES = 280
BOUND_S = 5.0  # per case: no input may make a reader run away
SWEEP = """name = "fuzz"
[axes]
pair = "tiny"
runtime = ["llama-cpp", "llama-server"]
mode = ["driven", "native"]
k = [1, 2]
prompts = "code"
max_new_tokens = 4
[[exclude]]
runtime = "llama-server"
k = 1
[[include]]
runtime = "llama-cpp"
k = 3
[resources.llama-cpp]
threads = 1
[ray]
strategy = "task"
max_retries = 1
"""
TOML_VALUES = ["-1", "0", "1e308", "inf", "nan", '"x"', '""', "[]", "[[]]", "{}", "true", "1.5", "[1, 1, 1]",
               "99999999999999999999", '"../../etc"', '["llama-cpp", "llama-cp"]', "[" + ", ".join(["1"] * 400) + "]"]
# Kinds every one of which a sweep file crossrt reads cannot be.
SWEEP_ALWAYS_FAILS = {"empty", "unknown-top", "binary", "axes-renamed", "empty-axis"}


def damaged_sweep(rng: random.Random) -> tuple[str, bytes]:
    lines = SWEEP.splitlines()
    values = [i for i, line in enumerate(lines) if " = " in line]
    kind = rng.choice(["delete-line", "duplicate-line", "value", "key", "truncated", "binary", "empty",
                       "unknown-top", "axes-renamed", "empty-axis", "swap"])
    if kind == "delete-line":
        del lines[rng.randrange(len(lines))]
    elif kind == "duplicate-line":
        at = rng.randrange(len(lines))
        lines.insert(at, lines[at])
    elif kind == "value":
        at = rng.choice(values)
        lines[at] = lines[at].split(" = ")[0] + " = " + rng.choice(TOML_VALUES)
    elif kind == "key":
        at = rng.choice(values)
        lines[at] = "".join(rng.choice("abcdefgh_") for _ in range(rng.randrange(1, 9))) + " = " + \
            lines[at].split(" = ")[1]
    elif kind == "truncated":
        return kind, SWEEP.encode()[:rng.randrange(len(SWEEP))]
    elif kind == "binary":
        return kind, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000))) + b"\xff"
    elif kind == "empty":
        return kind, rng.choice([b"", b"\n", b"# a comment\n"])
    elif kind == "unknown-top":
        lines.insert(0, rng.choice(["runtimes = [1]", "axis = 2", "k = 4", "version = 1"]))
    elif kind == "axes-renamed":
        lines[lines.index("[axes]")] = rng.choice(["[axis]", "[Axes]", "[settings]"])
    elif kind == "empty-axis":
        lines.insert(lines.index("[axes]") + 1, rng.choice(["k = []", "runtime = []"]))
        lines = [line for line in lines if not line.startswith("k = [1, 2]") or lines.count("k = []") == 0]
    elif kind == "swap":
        a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
        lines[a], lines[b] = lines[b], lines[a]
    return kind, ("\n".join(lines) + "\n").encode()


def test_fuzzed_sweep_files_are_planned_or_one_line(folder):
    from crossrt.sweep.plan import SweepError, load_sweep

    rng, runner, kinds, failed = random.Random(SEED + 3), CliRunner(), set(), 0
    for case in range(SWEEP_CASES):
        kind, data = damaged_sweep(rng)
        kinds.add(kind)
        path = folder / f"sweep{case}.toml"
        path.write_bytes(data)
        start = time.perf_counter()
        try:
            load_sweep(path)
            readable = True
        except SweepError:  # never another exception
            readable = False
        result = runner.invoke(main, ["sweep", "plan", str(path)])
        assert time.perf_counter() - start < BOUND_S, f"case {case} ({kind})"
        context = f"case {case} ({kind}): {data[:200]!r}"
        if kind in SWEEP_ALWAYS_FAILS or not readable:
            assert not readable, context
            assert str(path) in one_line_failure(result, context)
            failed += 1
        else:
            assert result.exit_code == 0 and " cells: " in result.output, f"{context}\n{result.output[-1000:]}"
    assert len(kinds) == 11 and failed > SWEEP_CASES // 3


@pytest.fixture(scope="module")
def one_cell_store(folder):
    from crossrt.sweep.plan import load_sweep
    from crossrt.sweep.runner import Executor, run_sweep
    from crossrt.sweep.store import SweepStore

    path = folder / "one-cell.toml"
    path.write_text('name = "one"\n[axes]\nruntime = "llama-cpp"\nk = 2\nprompts = "code"\nmax_new_tokens = 4\n'
                    '[resources.llama-cpp]\nthreads = 1\n')
    store = SweepStore(folder / "one-cell")
    assert not run_sweep(load_sweep(path), store, Executor()).failed
    return store


def fuzzed_query(rng: random.Random, target: Path, store: Path) -> tuple[str, str]:
    """(kind, SQL): a statement that writes or reads outside the store, or one that may run."""
    spot = rng.choice([target / f"x{rng.randrange(99)}", store / "index.parquet", store / "cells" / "a.json",
                       Path("/etc/hostname")])
    kind = rng.choice(["copy", "export", "attach", "install", "load", "create", "insert", "drop", "set", "pragma",
                       "call", "read", "many", "garbage", "comment", "select"])
    sql = {
        "copy": f"COPY (SELECT * FROM prompts) TO '{spot}' (FORMAT {rng.choice(['csv', 'parquet', 'json'])})",
        "export": f"EXPORT DATABASE '{spot}'",
        "attach": f"ATTACH '{spot}' AS other",
        "install": f"INSTALL {rng.choice(['httpfs', 'spatial', 'shellfs'])}",
        "load": f"LOAD '{spot}'",
        "create": rng.choice(["CREATE TABLE t AS FROM prompts", "CREATE VIEW v AS SELECT 1",
                              f"CREATE SECRET s (TYPE s3, KEY_ID '{spot}')", "CREATE MACRO m(a) AS a"]),
        "insert": "INSERT INTO prompts SELECT * FROM prompts",
        "drop": rng.choice(["DROP TABLE prompts", "DROP VIEW cells"]),
        "set": rng.choice(["SET enable_external_access = true", "SET lock_configuration = false",
                           f"SET temp_directory = '{spot}'", "RESET enable_external_access"]),
        "pragma": rng.choice(["PRAGMA enable_profiling", "PRAGMA version"]),
        "call": rng.choice(["CALL duckdb_settings()", f"CALL pragma_table_info('{spot}')"]),
        "read": f"SELECT * FROM {rng.choice(['read_text', 'read_blob', 'read_csv', 'read_parquet', 'glob', 'read_json'])}"
                f"('{spot}')",
        "many": "SELECT 1; " + rng.choice(["SELECT 2", f"COPY prompts TO '{spot}'", "DROP TABLE prompts"]),
        "garbage": "".join(rng.choice("SELECT *;'\"()\x00\u2028é") for _ in range(rng.randrange(0, 40))),
        "comment": rng.choice(["-- nothing", "/* nothing */", ";", "  "]),
        "select": rng.choice(["SELECT * FROM cells", "FROM prompts LIMIT 3", "SELECT runtime, sum(accepted) FROM "
                              "prompts GROUP BY ALL", "SELECT count(*) FROM prompts, cells",
                              "WITH a AS (SELECT 1 AS x) SELECT x FROM a", "VALUES (1, 'a')"]),
    }[kind]
    return kind, sql


def test_fuzzed_queries_read_the_store_alone_and_write_nothing(folder, one_cell_store):
    target = folder / "query-target"
    target.mkdir()
    files = {p: p.read_bytes() for p in one_cell_store.root.rglob("*") if p.is_file()}
    rng, runner, kinds = random.Random(SEED + 4), CliRunner(), set()
    for case in range(QUERY_CASES):
        kind, sql = fuzzed_query(rng, target, one_cell_store.root)
        kinds.add(kind)
        result = runner.invoke(main, ["sweep", "query", str(one_cell_store.root), sql])
        context = f"case {case} ({kind}): {sql[:200]!r}"
        if kind == "select":
            assert result.exit_code == 0, f"{context}\n{result.output[-1000:]}"
        else:
            if kind not in ("garbage",):
                assert result.exit_code == 1, f"{context}\n{result.output[-1000:]}"
            if result.exit_code:
                one_line_failure(result, context)
        assert not list(target.iterdir()), context
        assert {p: p.read_bytes() for p in one_cell_store.root.rglob("*") if p.is_file()} == files, context
    # The store still reads: once, not after every case (a query there cost ~0.5 s, half of this
    # test), since every case left each of its files byte for byte as it was, and a query reads
    # those files alone.
    assert one_cell_store.query("SELECT 1") == (["1"], [(1,)])
    assert len(kinds) == 16


IMPORTS = Path(__file__).resolve().parent / "fixtures" / "import"
FORMATS = {"aiperf-records-mock.jsonl": ("aiperf",),
           # its requests matched to a prompts file through inputs.json (test_import_aiperf_prompts.py)
           "aiperf-vllm-real-records.jsonl": ("aiperf", "--prompts", str(IMPORTS / "aiperf-prompts-constructed.jsonl"),
                                              "--inputs", str(IMPORTS / "aiperf-vllm-real-inputs-constructed.json")),
           "exllamav3-draft-stats-constructed.json": ("exllamav3-stats",),
           "exllamav3-job-constructed.json": ("exllamav3-stats",),
           "llama-server-log-pr24536.log": ("llama-server-log",),
           "llama-server-log-tiny.log": ("llama-server-log", "--k", "4"),
           "llama-server-metrics-after-tiny.txt": ("llama-server-metrics",),
           "sglang-log-11948.log": ("sglang-log",),
           "sglang-meta-info-pr13754.json": ("sglang-metrics", "--k", "4"),
           "sglang-meta-info-pr33518.json": ("sglang-metrics",),
           "sglang-metrics-constructed-pr13754.txt": ("sglang-metrics", "--k", "4"),
           "vllm-log-club3090-105.log": ("vllm-log",), "vllm-log-pr24127.log": ("vllm-log",),
           "vllm-log-vllm-ascend-13665.log": ("vllm-log",),
           "vllm-spec-decode-example-pr43091.txt": ("vllm-metrics",)}
NUMBER = re.compile(rb"\d+(?:\.\d+)?")
ODD_NUMBERS = [b"-1", b"-2.00", b"1e308", b"1e29", b"nan", b"inf", b"0", b"0.0", b"188.5", b"9" * 26, b"7" * 31,
               b"9007199254740993", b"4000000000000000000", b"1" + b"0" * 300, b"9" * 400 + b".00", b"", b"x"]


def damaged_import(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    kind = rng.choice(["number", "numbers", "truncated", "delete-line", "duplicate-line", "binary-line", "swap",
                       "flipped", "empty"])
    lines = data.split(b"\n")
    if kind in ("number", "numbers"):
        spots = list(NUMBER.finditer(data))
        for match in sorted(rng.sample(spots, min(len(spots), 1 if kind == "number" else rng.randrange(2, 6))),
                            key=lambda m: -m.start()):
            data = data[:match.start()] + rng.choice(ODD_NUMBERS) + data[match.end():]
        return kind, data
    if kind == "truncated":
        return kind, data[:rng.randrange(len(data))]
    if kind == "flipped":
        damaged = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        return kind, bytes(damaged)
    if kind == "empty":
        return kind, b""
    at = rng.randrange(len(lines))
    if kind == "delete-line":
        del lines[at]
    elif kind == "duplicate-line":
        lines.insert(at, lines[at])
    elif kind == "binary-line":
        lines.insert(at, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
    elif kind == "swap":
        other = rng.randrange(len(lines))
        lines[at], lines[other] = lines[other], lines[at]
    return kind, b"\n".join(lines)


def test_fuzzed_imports_of_every_format_are_a_record_or_one_line(folder):
    rng, runner, kinds, outcomes = random.Random(SEED + 5), CliRunner(), set(), {"record": 0, "refused": 0}
    names = sorted(FORMATS)
    for case in range(IMPORT_CASES):
        name = names[case % len(names)]
        kind, data = damaged_import(rng, (IMPORTS / name).read_bytes())
        kinds.add(kind)
        path, out = folder / f"import{case}-{name}", folder / f"import{case}.json"
        path.write_bytes(data)
        source, *extra = FORMATS[name]
        start = time.perf_counter()
        result = runner.invoke(main, ["import", str(path), "--from", source, *extra, "--out", str(out)])
        context = f"case {case} ({kind}, {name})"
        assert time.perf_counter() - start < BOUND_S, f"{context}: {time.perf_counter() - start:.1f} s"
        if result.exit_code == 0:
            load_record(out)  # whatever was kept is a valid record
            outcomes["record"] += 1
        else:
            assert str(path) in one_line_failure(result, context) and not out.exists()
            outcomes["refused"] += 1
    assert len(kinds) == 9 and outcomes["refused"] > IMPORT_CASES // 3 and outcomes["record"] > 0, outcomes
