"""Rough edges a probe of the newer commands found (issue 40), each through the real command on
real files: a tiny-pair run and a one-cell sweep of real llama.cpp made here."""

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.records.journal import Journal
from crossrt.records.record_json import load_record, result_entry, save_record

from conftest import TINY_PAIR

RUN = ("run", "--pair", TINY_PAIR, "--prompts", "builtin", "--max-new-tokens", 6, "--threads", 1, "--n-ctx", 256)
SWEEP = """name = "edges"
[axes]
pair = {pairs}
runtime = "llama-cpp"
mode = "driven"
k = 2
prompts = "builtin"
max_new_tokens = 4
[resources.llama-cpp]
threads = 1
"""


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def error_line(result) -> str:
    assert result.exit_code in (1, 2) and isinstance(result.exception, SystemExit), result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("Error: "), result.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("edges") / "run.json"
    result = invoke(*RUN, "--out", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "s.toml").write_text(SWEEP.format(pairs='"tiny"'))
    result = invoke("sweep", "run", folder / "s.toml", "--dir", folder / "sw")
    assert result.exit_code == 0, result.output + result.stderr
    return folder / "sw"


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs at tmp_path/mnt (root writes through chmod, not through a read-only mount);
    skipped where mounting is not allowed."""
    point = tmp_path / "mnt"
    point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
    yield point
    subprocess.run(["umount", str(point)], check=False)


def test_sweep_plan_flags_a_pair_that_does_not_load(tmp_path):
    """`plan` listed the missing pair's cell `to run`, exit 0; only `sweep run` failed it."""
    path = tmp_path / "s.toml"
    path.write_text(SWEEP.format(pairs='["tiny", "no-such-pair"]'))
    result = invoke("sweep", "plan", path)
    assert result.exit_code == 1, result.output
    rows = {line.split()[1]: line for line in result.output.splitlines()[2:] if "-llama-cpp-" in line}
    assert rows["tiny-llama-cpp-driven-k2-builtin-n4"].endswith("to run")
    assert "fails here: pair manifest not found: no-such-pair" in rows["no-such-pair-llama-cpp-driven-k2-builtin-n4"]
    assert error_line(result).startswith("Error: 1 cell(s) would fail in `crossrt sweep run`: pair 'no-such-pair': ")
    path.write_text(SWEEP.format(pairs='"tiny"'))
    assert invoke("sweep", "plan", path).exit_code == 0


def test_sweep_query_prints_a_limited_stream(sweep_dir):
    """`SELECT * FROM range(10000000)` took 2.8 GB and 24 s and printed every row."""
    start = time.perf_counter()
    result = invoke("sweep", "query", sweep_dir, "SELECT * FROM range(10000000)")
    assert result.exit_code == 0, result.stderr
    assert time.perf_counter() - start < 60
    lines = result.stdout.splitlines()
    assert lines[:2] == ["range", "-----"] and lines[2:] == [str(n) for n in range(1000)]
    assert "note: the first 1,000 rows; the query gives more: pass --limit N or --all-rows" in result.stderr
    every = invoke("sweep", "query", sweep_dir, "SELECT * FROM range(2500)", "--all-rows", "--csv")
    assert every.stdout.splitlines() == ["range", *map(str, range(2500))] and "note:" not in every.stderr
    table = invoke("sweep", "query", sweep_dir, "SELECT * FROM range(2500)", "--all-rows").stdout.splitlines()
    assert table[:2] == ["range", "-----"] and table[2:] == [str(n) for n in range(2500)]
    five = invoke("sweep", "query", sweep_dir, "SELECT * FROM range(5)", "--limit", 5)
    assert five.stdout.splitlines()[2:] == list("01234") and "note:" not in five.stderr


def test_sweep_run_on_a_read_only_dir_names_its_own_option(tmpfs):
    """The hint said `pass --out ...`: `sweep run` has --dir."""
    sweep = tmpfs / "s.toml"
    sweep.write_text(SWEEP.format(pairs='"tiny"'))
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    line = error_line(invoke("sweep", "run", sweep, "--dir", tmpfs / "sw"))
    assert line.endswith("Read-only file system; the location is read-only: pass --dir somewhere writable")
    assert "--out" not in line


def test_run_refuses_resume_with_overwrite(record):
    before = record.read_bytes()
    line = error_line(invoke(*RUN, "--out", record, "--resume", "--overwrite"))
    assert "--resume and --overwrite contradict each other" in line
    assert record.read_bytes() == before


def test_analyze_refuses_one_record_twice(record):
    for twice in (record, record.parent / "." / record.name):
        assert error_line(invoke("analyze", record, twice)).endswith("is given twice")


def test_a_prompt_file_not_in_utf8_is_refused_with_its_line(tmp_path):
    prompts = tmp_path / "p.jsonl"
    good = [json.dumps({"id": f"p{n}", "category": "prose", "prompt": "river value"}) for n in range(2)]
    latin1 = b'{"id": "p2", "category": "prose", "prompt": "caf\xe9"}\n'  # cafe with its accent in Latin-1
    prompts.write_bytes(("\n".join(good) + "\n").encode() + latin1)
    line = error_line(invoke("run", "--pair", TINY_PAIR, "--prompts", prompts, "--out", tmp_path / "r.json"))
    column = latin1.index(b"\xe9") + 1
    assert line == f"Error: {prompts} line 3: not UTF-8 (byte 0xe9 at column {column}): save the file as UTF-8"
    assert not (tmp_path / "r.json").exists()


def test_a_journal_damaged_in_its_middle_says_how_to_keep_the_prompts_before(record, tmp_path):
    """A run's journal (written by crossrt's own writer, from a real run's results) with its 5th
    prompt's line damaged: the refusal names what keeps the 4 before it, and doing so works;
    --resume then runs the others to the whole record."""
    whole = load_record(record)
    base = tmp_path / "run.json"
    journal = Journal(base, save_record(dataclasses.replace(whole, results=()), base))
    for number, result in enumerate(whole.results, start=1):
        journal.append('{"damaged": ' if number == 5 else result_entry(whole, result))
    line = error_line(invoke("show", base))
    assert f"{base}.journal line 6 is not JSON" in line
    command = f"head -n 5 {base}.journal > {base}.journal.kept && mv {base}.journal.kept {base}.journal"
    assert f"the 4 prompt(s) before it are intact: keep them by cutting the journal there ({command}), " \
           "then --resume runs the others again" in line
    subprocess.run(command, shell=True, check=True)
    assert [r.prompt_id for r in load_record(base).results] == [r.prompt_id for r in whole.results[:4]]
    resumed = invoke(*RUN, "--out", base, "--resume")
    assert resumed.exit_code == 0, resumed.output + resumed.stderr
    again = load_record(base)
    assert [(r.prompt_id, r.output_ids) for r in again.results] == [(r.prompt_id, r.output_ids) for r in whole.results]
