"""Records on disk during a run: journals beside the record and its traces, folded in by
readers and at the end; torn and stale journals; constant work per saved prompt; a run killed
with SIGKILL and resumed, against an uninterrupted one."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from crossrt.records import record_json
from crossrt.cli import main
from crossrt.run.prompt_run import run_prompt
from crossrt.records.journal import Journal, journal_path
from crossrt.inputs.pairs import pair_info
from crossrt.inputs.prompts import load_prompts
from crossrt.run.run_writer import RunWriter
from crossrt.run.runtime import DraftRules
from crossrt.records.schema import RecordError, RunParams, RunRecord
from crossrt.records.record_json import load_record, save_record
from crossrt.records.trace import TraceRecorder, load_trace, read_traces, trace_entry, trace_path

from conftest import REPO, TINY_PAIR
from test_faults import alive, child_pids

K = 3
PROMPTS = load_prompts("builtin")[:4]


@pytest.fixture(scope="module")
def header(tiny_pair, llama_runtime):
    params = RunParams(k=K, greedy=True, max_new_tokens=16, mode="driven", spec_type="draft",
                       schedule="crossrt", n_ctx=512, draft_n_min=K, draft_p_min=0.0)
    return RunRecord(llama_runtime.info(), pair_info(tiny_pair, "gguf"), params, trace="run.trace.npz")


@pytest.fixture(scope="module")
def finished(tiny_sessions):
    """(result, trace) of each prompt, from the tiny pair."""
    target, drafter = tiny_sessions
    pairs = []
    for prompt in PROMPTS:
        recorder = TraceRecorder()
        pairs.append((run_prompt(target, drafter, prompt, DraftRules(K), 16, trace=recorder), recorder.finish()))
    return pairs


def started(header, finished, out, added):
    """A writer that has added the first `added` prompts: the files of a run in progress."""
    writer = RunWriter(dataclasses.replace(header, results=()), out, {})
    for result, trace in finished[:added]:
        writer.add(result, trace)
    return writer


def test_readers_see_a_run_in_progress_and_the_end_folds_the_journals(header, finished, tmp_path):
    out = tmp_path / "run.json"
    writer = started(header, finished, out, 3)
    record_bytes = out.read_bytes()
    in_progress = load_record(out)
    assert [r.prompt_id for r in in_progress.results] == [p.id for p in PROMPTS[:3]]
    assert in_progress.results == tuple(result for result, _ in finished[:3])
    assert set(load_trace(out, in_progress)) == {p.id for p in PROMPTS[:3]}
    assert json.loads(record_bytes)["results"] == []  # the record itself was not rewritten
    writer.add(*finished[3])
    record = writer.close()
    assert not journal_path(out).exists() and not journal_path(trace_path(out)).exists()
    assert load_record(out) == record == header.with_results(result for result, _ in finished)
    assert len(json.loads(out.read_text())["results"]) == len(PROMPTS)
    traces = load_trace(out, record)
    for (result, trace), prompt in zip(finished, PROMPTS):
        for name in ("step_drafted", "step_accepted", "target_entropy", "drafter_p1"):
            np.testing.assert_array_equal(getattr(traces[prompt.id], name), getattr(trace, name))


def test_a_torn_last_line_is_ignored_and_a_broken_one_is_not(header, finished, tmp_path):
    out = tmp_path / "run.json"
    started(header, finished, out, 2)
    entry = record_json.result_entry(header, finished[2][0])
    with journal_path(out).open("ab") as journal:
        journal.write(entry[:len(entry) // 2].encode())  # killed in the middle of an append
    assert [r.prompt_id for r in load_record(out).results] == [p.id for p in PROMPTS[:2]]
    traces = trace_path(out)
    with journal_path(traces).open("ab") as journal:
        journal.write(trace_entry("torn", finished[2][1])[:40].encode())
    assert set(read_traces(traces)) == {p.id for p in PROMPTS[:2]}

    with journal_path(out).open("ab") as journal:  # a complete line that is wrong is an error
        journal.write(b"\n")
    with pytest.raises(RecordError, match=r"run.json.journal line 4 is not JSON"):
        load_record(out)


def test_an_entry_is_checked_alone_and_its_errors_name_the_line(header, finished, tmp_path):
    out = tmp_path / "run.json"
    writer = started(header, finished, out, 1)
    result = finished[1][0]
    broken = dataclasses.replace(result, counters=dataclasses.replace(result.counters, emitted=0))
    size = journal_path(out).stat().st_size
    with pytest.raises(RecordError, match="emitted 0 != steps"):
        writer.add(broken)
    assert journal_path(out).stat().st_size == size  # refused before anything was written
    entry = json.loads(record_json.result_entry(header, result))
    entry["status"] = "done"
    with journal_path(out).open("a") as journal:
        journal.write(json.dumps(entry) + "\n")
    with pytest.raises(RecordError, match=r"run.json.journal line 3: .* at results/0/status"):
        load_record(out)


@pytest.mark.parametrize("continues", [True, False], ids=["resumed", "overwritten"])
def test_a_journal_belongs_to_the_record_it_was_started_beside(header, finished, tmp_path, monkeypatch, continues):
    out = tmp_path / "run.json"
    writer = started(header, finished, out, 2)
    ids = [p.id for p in PROMPTS[:2]]
    # Killed after the end's rewrite, before the journal was removed: nothing counts twice.
    save_record(writer._record.with_results(writer._results), out)
    assert [r.prompt_id for r in load_record(out).results] == ids
    save_record(dataclasses.replace(writer._record, notes=("edited",)), out)  # another record
    assert load_record(out).results == ()
    save_record(writer._record, out)  # as the run started it: the journal counts again
    assert [r.prompt_id for r in load_record(out).results] == ids
    # A new run killed after it wrote its record, before the record's journal started: a resumed
    # run wrote the prompts into the record, an overwriting one left none of the old ones.
    def journal_or_killed(base, base_bytes):
        if base == out:
            raise KeyboardInterrupt
        return Journal(base, base_bytes)

    monkeypatch.setattr("crossrt.run.run_writer.Journal", journal_or_killed)
    with pytest.raises(KeyboardInterrupt):
        if continues:
            RunWriter(load_record(out), out, {"no-prompt": finished[0][1]}, continues=True)
        else:
            RunWriter(header, out, {}, continues=False)
    assert [r.prompt_id for r in load_record(out).results] == (ids if continues else [])
    assert set(read_traces(trace_path(out))) == ({"no-prompt"} if continues else set())


def test_saving_a_prompt_is_constant_work(header, finished, tmp_path, monkeypatch):
    """Each prompt serializes and validates itself only, whatever the record holds, and
    appends one line: the record and the trace file stay as the run started them."""
    serialized, validated = [], []
    to_json, validate = record_json.record_to_json, record_json.validate_json
    monkeypatch.setattr(record_json, "record_to_json", lambda record: serialized.append(len(record.results))
                        or to_json(record))
    monkeypatch.setattr(record_json, "validate_json", lambda data: validated.append(len(data["results"]))
                        or validate(data))
    out = tmp_path / "run.json"
    many = [dataclasses.replace(finished[i % len(finished)][0], prompt_id=f"p{i}") for i in range(40)]
    writer = RunWriter(dataclasses.replace(header, results=tuple(many[:20])), out, {})
    assert serialized == validated == [20]  # the start writes the record whole once
    files = {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in (out, trace_path(out))}
    for result in many[20:]:
        before = journal_path(out).stat().st_size
        writer.add(result, finished[0][1])
        assert serialized[-1] == validated[-1] == 1
        last = journal_path(out).read_bytes().splitlines()[-1]
        assert journal_path(out).stat().st_size - before == len(last) + 1
        assert json.loads(last)["prompt_id"] == result.prompt_id
    assert len(serialized) == len(validated) == 1 + 20
    assert {path: (path.read_bytes(), path.stat().st_mtime_ns) for path in files} == files
    writer.close()
    assert serialized[-1] == validated[-1] == 40  # the end writes it whole once


def test_with_results_is_with_result_in_turn(finished, header):
    first, second, third, fourth = (result for result, _ in finished)
    start = header.with_results([first, second, third])
    again = dataclasses.replace(first, status="failed", error="retried", counters=None, timings=None)
    added = [fourth, again, dataclasses.replace(fourth, stop_reason="eos")]
    one_by_one = start
    for result in added:
        one_by_one = one_by_one.with_result(result)
    assert start.with_results(added) == one_by_one
    assert [r.prompt_id for r in one_by_one.results] == [second.prompt_id, third.prompt_id,
                                                         first.prompt_id, fourth.prompt_id]


def cli_args(out, *extra):
    return ["run", "--pair", TINY_PAIR, "--threads", "1", "--k", "4", "--max-new-tokens", "8",
            "--prompts", "categories", "--trace", "--out", out, *extra]


def comparable(record):
    return [dataclasses.replace(r, timings=None, baseline_source=None) for r in record.results]  # store-timed


def test_a_run_killed_mid_way_resumes_to_the_uninterrupted_one(tmp_path):
    killed = tmp_path / "killed.json"
    process = subprocess.Popen([sys.executable, "-c", "from crossrt.cli import main; main()",
                                *map(str, cli_args(killed))], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        journal = journal_path(killed)
        if journal.exists() and journal.read_bytes().count(b"\n") > 10:  # header + 10 prompts
            zygotes = child_pids(process.pid)
            run_processes = zygotes + [pid for zygote in zygotes for pid in child_pids(zygote)]
            os.kill(process.pid, signal.SIGKILL)
            break
        time.sleep(0.005)
    assert process.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    # The runtime's process dies with crossrt through its zygote's death, a few milliseconds later,
    # and may finish one more prompt meanwhile: what the run kept is read once it is gone.
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in run_processes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert run_processes and not any(alive(pid) for pid in run_processes), "the runtime's process outlived crossrt"
    assert json.loads(killed.read_text())["results"] == []  # the record file: as the run started it
    kept = load_record(killed)
    assert 10 <= len(kept.results) < len(load_prompts("categories"))
    assert set(load_trace(killed, kept)) == {r.prompt_id for r in kept.results}
    runner = CliRunner()
    shown = runner.invoke(main, ["show", str(killed)], catch_exceptions=False).output.splitlines()
    assert shown[-1].split()[:2] == ["ALL", str(len(kept.results))]

    resumed = runner.invoke(main, [str(a) for a in cli_args(killed, "--resume")], catch_exceptions=False)
    assert resumed.exit_code == 0, resumed.output
    whole = tmp_path / "whole.json"
    assert runner.invoke(main, [str(a) for a in cli_args(whole)], catch_exceptions=False).exit_code == 0
    assert not journal_path(killed).exists() and not journal_path(trace_path(killed)).exists()
    after_kill, uninterrupted = load_record(killed), load_record(whole)
    assert comparable(after_kill)[:len(kept.results)] == comparable(kept)  # kept as they were
    assert comparable(after_kill) == comparable(uninterrupted)
    traces, expected = load_trace(killed, after_kill), load_trace(whole, uninterrupted)
    assert list(traces) == list(expected)
    for prompt_id, trace in expected.items():
        for name in ("step_drafted", "step_accepted", "target_entropy", "target_margin", "drafter_p1"):
            np.testing.assert_array_equal(getattr(traces[prompt_id], name), getattr(trace, name))


def test_a_value_that_is_not_a_finite_number_is_never_written(header, finished, tmp_path):
    """A NaN time once went into a record that no command could read again (issue 58): no record
    or journal line holding one is written, and the error names the value."""
    result = finished[0][0]
    broken = dataclasses.replace(result, timings=dataclasses.replace(result.timings, decode_s=float("nan")))
    record = dataclasses.replace(header, results=(broken,))
    with pytest.raises(RecordError, match=r"record\.results\[0\]\.timings\.decode_s is nan, not a finite number"):
        save_record(record, tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()
    with pytest.raises(RecordError, match=r"result .*decode_s is nan"):
        record_json.result_entry(header, broken)


def test_a_file_larger_than_any_record_is_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr(record_json, "RECORD_BYTES", 1024)
    path = tmp_path / "huge.json"
    path.write_text("[" + "0," * 2000 + "0]")
    with pytest.raises(RecordError, match=r"more than the 0 MiB of any record crossrt writes: not a run record"):
        load_record(path)
