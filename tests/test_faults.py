"""The fault suite: `crossrt run` on the tiny pair interrupted by SIGINT and SIGKILL at seeded
random points, then resumed to exactly the record an uninterrupted run writes (timings aside),
with no process left behind; the same for llama-server's native mode; and a stopped
`llama-speculative-simple` noticed and failed clearly, keeping the finished prompts
(docs/reliability.md lists each case)."""

import dataclasses
import hashlib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from crossrt.records.journal import journal_path
from crossrt.records.record_json import load_record
from crossrt.run.run_writer import lock_path
from crossrt.run.runtime import availability

from conftest import TINY_PAIR, with_sigint
from in_process import crossrt_here

CROSSRT = str(Path(sys.executable).parent / "crossrt")
SEED = 11
PROMPTS = 10  # the builtin suite
RUN = ["run", "--pair", str(TINY_PAIR), "--threads", "1", "--k", "3", "--max-new-tokens", "64"]
NATIVE = ["run", "--runtime", "llama-server", "--mode", "native", "--pair", str(TINY_PAIR), "--threads", "1",
          "--k", "3", "--max-new-tokens", "32"]


def fault_points(rng: random.Random, count: int) -> list:
    """count points of a run: "locked" (the lock is taken, nothing written yet) or the number
    of prompts in the journal, each with a delay after it (inside the next prompt or a write)."""
    points = [("locked", rng.uniform(0, 0.05))]
    points += [(n, rng.uniform(0, 0.03)) for n in sorted(rng.sample(range(PROMPTS - 1), count - 1))]
    return points


_RNG = random.Random(SEED)
CASES = [(sig, *point) for sig in (signal.SIGINT, signal.SIGKILL) for point in fault_points(_RNG, 4)]


def comparable(record) -> list:
    """Everything a result holds but its timings and when its baseline was timed (decoded, or read
    from the baseline store): token ids, counters, views, status."""
    return [dataclasses.replace(r, timings=None, baseline_source=None) for r in record.results]


def crossrt(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([CROSSRT, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300)


def in_process(*args, cwd) -> subprocess.CompletedProcess:
    """crossrt(*args) in this process (tests/in_process.py): the readers, refusals, sweeps, the
    uninterrupted runs and the resumes (48 commands). The interrupted runs stay processes: they
    are what the signal ends."""
    return crossrt_here(*args, cwd=cwd)


def journal_prompts(out: Path) -> int:
    """Prompts in the record's journal so far; -1 before it exists."""
    try:
        return journal_path(out).read_bytes().count(b"\n") - 1
    except FileNotFoundError:
        return -1


def child_pids(pid: int, name: str = "") -> list:
    """Live (not zombie) children of pid whose command name starts with name."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm, fields = (entry / "stat").read_text().rsplit(")", 1)
        except OSError:
            continue
        state, parent = fields.split()[:2]
        if int(parent) == pid and state != "Z" and comm.split("(", 1)[1].startswith(name):
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def interrupt(args: list, out: Path, cwd: Path, sig: int, point, delay: float, children: str = ""):
    """Start `crossrt *args`, send sig at point (see fault_points) plus delay, and return the
    finished process, its stderr and the pids of its children named children (taken at the signal)."""
    process = subprocess.Popen([CROSSRT, *map(str, args)], cwd=cwd, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, preexec_fn=with_sigint)
    try:
        deadline = time.monotonic() + 120
        while not (lock_path(out).exists() if point == "locked" else journal_prompts(out) >= point):
            assert process.poll() is None, f"the run ended before point {point}: {process.stderr.read()}"
            assert time.monotonic() < deadline
            time.sleep(0.002)
        time.sleep(delay)
        held = child_pids(process.pid, children) if children else []
        assert process.poll() is None, f"the run ended before point {point} + {delay:.3f} s"
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process, stderr, held


def whole_record(run, args: list, folder: Path):
    """The record of `crossrt *args` run whole in folder by run (in_process or crossrt)."""
    done = run(*args, "--out", folder / "whole.json", cwd=folder)
    assert done.returncode == 0, done.stderr
    return load_record(folder / "whole.json")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return whole_record(in_process, RUN, tmp_path_factory.mktemp("whole"))


def check_interrupted(process, stderr: str, sig: int, out: Path, args: list) -> list:
    """What an interrupted run must leave: the right exit, no traceback, for SIGINT the record
    named with the exact command that resumes it; returns that command's arguments."""
    assert "Traceback" not in stderr
    if sig == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL
        return [*args, "--out", out, "--resume"]
    assert process.returncode == 130, stderr
    # How many finished is said, never "kept" with nothing kept (issue 58).
    assert (re.search(rf"interrupted: [1-9]\d* of \d+ prompts finished, kept in {re.escape(str(out))}; continue with:",
                      stderr) is not None) != \
        (f"interrupted before any prompt finished: nothing is kept in {out} yet; continue with:" in stderr), stderr
    command = stderr.strip().splitlines()[-1].strip()
    assert command == shlex.join(["crossrt", *map(str, args), "--out", str(out), "--resume"])
    assert not lock_path(out).exists()  # SIGINT ends the run in order
    return shlex.split(command)[1:]


@pytest.mark.parametrize("sig, point, delay", CASES,
                         ids=[f"{signal.Signals(s).name}-{p}-{d * 1e3:.0f}ms" for s, p, d in CASES])
def test_an_interrupted_run_resumes_to_the_uninterrupted_one(uninterrupted, tmp_path, sig, point, delay):
    out = tmp_path / "run.json"
    process, stderr, _ = interrupt([*RUN, "--out", out], out, tmp_path, sig, point, delay)
    assert not child_pids(process.pid)
    resume = check_interrupted(process, stderr, sig, out, RUN)
    if out.exists():  # a kill before the record's first write leaves nothing to read, and nothing lost
        kept = comparable(load_record(out))
        assert len(kept) < PROMPTS and kept == comparable(uninterrupted)[:len(kept)]
    resumed = in_process(*resume, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(load_record(out)) == comparable(uninterrupted)
    assert not journal_path(out).exists() and not lock_path(out).exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---- a native runtime: no llama-server left ---------------------------------------------------

@pytest.fixture(scope="module")
def native_whole(tmp_path_factory):
    """The uninterrupted native run both signals' resumes must equal: made once, not per signal."""
    return whole_record(crossrt, NATIVE, tmp_path_factory.mktemp("native-whole"))


@pytest.mark.skipif(availability("llama-server") is not None, reason=f"{availability('llama-server')}")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_an_interrupted_native_run_leaves_no_server_and_resumes(native_whole, tmp_path, sig):
    out = tmp_path / "run.json"
    point = random.Random(SEED + sig).randrange(1, PROMPTS - 2)
    process, stderr, servers = interrupt([*NATIVE, "--out", out], out, tmp_path, sig, point, 0.0, "llama-server")
    assert servers, "no llama-server was running at the signal"
    deadline = time.monotonic() + 15  # SIGKILL: the kernel's parent-death signal; SIGINT: stopped in order
    while any(alive(pid) for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in servers if alive(pid)], "a llama-server outlived crossrt"
    resume = check_interrupted(process, stderr, sig, out, NATIVE)
    assert 0 < len(load_record(out).results) < PROMPTS
    resumed = in_process(*resume, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert comparable(load_record(out)) == comparable(native_whole)


# ---- a hung llama-speculative-simple ---------------------------------------------------------

@pytest.mark.skipif(availability("llama-spec-cli") is not None, reason=f"{availability('llama-spec-cli')}")
@pytest.mark.alone  # sub-second probes and 1-3 s timeouts that a prompt must beat: not beside another worker
@pytest.mark.parametrize("settings, message", [
    ({"PROBE_S": 0.5}, r"stopped by a signal\): still stopped at 3 probes in a row"),
    ({"STOPPED_PROBES": 10 ** 6, "TOOL_BASE_S": 3.0, "TOOL_S_PER_TOKEN": 0.0}, r"did not end within 3 s"),
], ids=["stopped-probes", "timeout"])
def test_a_stopped_spec_tool_is_a_failure_that_keeps_finished_prompts(tmp_path, monkeypatch, settings, message):
    from crossrt.backends import llama_spec_cli
    from crossrt.run.driver import RunRequest, run_pair
    from crossrt.inputs.pairs import load_pair
    from crossrt.inputs.prompts import load_prompts
    from crossrt.run.runtime import DraftRules, RuntimeFailure, RuntimeOptions

    for name, value in settings.items():
        monkeypatch.setattr(llama_spec_cli, name, value)
    request = RunRequest(load_pair(TINY_PAIR), "llama-spec-cli", RuntimeOptions(n_ctx=512, threads=1),
                         DraftRules(3), 8, tmp_path / "run.json", mode="native")
    stopped: list = []
    done = threading.Event()

    def stop_the_next_tool() -> None:
        while not done.is_set() and not stopped:
            for pid in child_pids(os.getpid(), "llama-speculati"):  # comm keeps 15 characters
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            time.sleep(0.001)

    watcher = threading.Thread(target=stop_the_next_tool, daemon=True)

    def after_first(prompt, result):  # the tool's next run (the second prompt's) is stopped
        if not watcher.is_alive() and not stopped:
            watcher.start()

    started = time.monotonic()
    try:
        with pytest.raises(RuntimeFailure, match=message):
            run_pair(request, load_prompts("code")[:3], on_prompt=after_first)
    finally:
        done.set()
    assert time.monotonic() - started < 30  # noticed, not waited out
    assert len(stopped) == 1 and not alive(stopped[0])  # killed, and reaped
    assert [r.prompt_id for r in load_record(tmp_path / "run.json").results] == \
        [p.id for p in load_prompts("code")[:1]]


# ---- output files of parity, report and simulate ----------------------------------------------

@pytest.fixture(scope="module")
def small_record(tmp_path_factory):
    out = tmp_path_factory.mktemp("small") / "run.json"
    assert in_process(*RUN[:-1], "4", "--out", out, cwd=out.parent).returncode == 0
    return out


def writers(record: Path, target: Path) -> dict:
    """Per output option, the command that writes target through it."""
    return {"--junit": ["parity", "--no-logits", record, "--junit", target],
            "--markdown": ["parity", "--no-logits", record, "--markdown", target.with_suffix(".md")],
            "-o": ["report", record, "-o", target.with_suffix(".html")],
            "--out": ["simulate", "--pair", TINY_PAIR, "--prompts", "code", "--max-k", "2", "--max-new-tokens", "4",
                      "--out", target.with_suffix(".json")]}


def written_path(command: list) -> Path:
    return Path(command[-1])


def output_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs at tmp_path/mnt (root writes through chmod, not through a read-only or
    full mount); skipped where mounting is not allowed."""
    point = tmp_path / "mnt"
    point.mkdir()

    def mount(*options):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        return point

    yield mount
    subprocess.run(["umount", str(point)], check=False, capture_output=True)


def test_outputs_go_into_a_missing_folder_and_a_file_in_the_way_is_one_line(small_record, tmp_path):
    for option, command in writers(small_record, tmp_path / "new" / "folder" / "out.xml").items():
        done = in_process(*command, cwd=tmp_path)
        assert done.returncode == 0 and written_path(command).stat().st_size > 0, done.stderr
    (tmp_path / "file").write_text("in the way")
    for option, command in writers(small_record, tmp_path / "file" / "out.xml").items():
        line = output_error(in_process(*command, cwd=tmp_path))
        assert f"cannot write {written_path(command)}: File exists; a file is in the way" in line
        assert f"pass {option} elsewhere" in line


def test_a_read_only_output_folder_is_one_line(small_record, tmpfs):
    point = tmpfs("size=1m")
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
    for option, command in writers(small_record, point / "out.xml").items():
        line = output_error(in_process(*command, cwd=point.parent))
        assert f"cannot write {written_path(command)}: Read-only file system" in line
        assert f"pass {option} somewhere writable" in line


def test_a_full_disk_leaves_no_half_written_report(small_record, tmpfs):
    point = tmpfs("size=8k")  # smaller than the HTML report
    report = point / "report.html"
    report.write_text("the previous report")
    line = output_error(in_process("report", small_record, "-o", report, cwd=point.parent))
    assert f"cannot write {report}: No space left on device" in line
    assert report.read_text() == "the previous report" and [p.name for p in point.iterdir()] == ["report.html"]


# ---- inputs given twice, outputs that are inputs ----------------------------------------------

@pytest.mark.parametrize("command", [["parity", "--no-logits", "{a}", "{a}"], ["show", "{a}", "{a}"],
                                     ["diff", "{a}", "{a}"], ["report", "{a}", "{a}", "-o", "{out}/r.md"],
                                     ["parity", "--no-logits", "{a}", "{link}"], ["show", "{a}", "{dotted}"],
                                     ["parity", "--no-logits", "{a}", "--against", "{a}"],
                                     ["parity", "--no-logits", "{a}", "{copy}"], ["diff", "{a}", "{hard}"]],
                         ids=["parity", "show", "diff", "report", "parity-symlink", "show-dotted", "parity-against",
                              "parity-copy", "diff-hard-link"])
def test_the_same_record_twice_is_one_line(small_record, tmp_path, command):
    """By content, not path: a symlink, a hard link and a byte-for-byte copy are the record again."""
    link, copy, hard = tmp_path / "link.json", tmp_path / "copy.json", tmp_path / "hard.json"
    link.symlink_to(small_record)
    copy.write_bytes(small_record.read_bytes())
    os.link(small_record, hard)
    names = {"a": small_record, "link": link, "dotted": small_record.parent / "." / small_record.name,
             "out": tmp_path, "copy": copy, "hard": hard}
    line = output_error(in_process(*(arg.format(**names) for arg in command), cwd=tmp_path))
    assert "is given twice" in line, line


def test_no_report_output_is_one_of_its_inputs(small_record, tmp_path):
    record = tmp_path / "a.json"
    record.write_bytes(small_record.read_bytes())
    markdown = tmp_path / "rec.md"
    markdown.write_text("an input the user keeps")
    before = {p: p.read_bytes() for p in (record, markdown)}
    for command, message in [
            (["report", record, "-o", tmp_path / "r.html", "--markdown", record], f"--markdown {record} is an input"),
            (["report", markdown, record, "-o", markdown], f"-o {markdown} is an input"),
            (["report", record, "-o", tmp_path / "r.md", "--markdown", tmp_path / "." / "r.md"],
             "--markdown and -o name the same file")]:
        assert message in output_error(in_process(*command, cwd=tmp_path))
    assert {p: p.read_bytes() for p in before} == before and not (tmp_path / "r.html").exists()



def test_no_parity_or_simulate_output_is_one_of_its_inputs(small_record, tmp_path):
    record, baseline = tmp_path / "a.json", tmp_path / "b.json"
    for path in (record, baseline):
        path.write_bytes(small_record.read_bytes())
    before = {p: p.read_bytes() for p in (record, baseline)}
    simulate = ["simulate", "--pair", TINY_PAIR, "--prompts", "code", "--max-k", "2", "--max-new-tokens", "4"]
    for command, message in [
            (["parity", "--no-logits", record, "--junit", record], f"--junit {record} is an input"),
            (["parity", "--no-logits", record, "--markdown", "./a.json"], "--markdown a.json is an input"),
            (["parity", "--no-logits", record, "--against", baseline, "--html", baseline],
             f"--html {baseline} is an input"),
            (["parity", "--no-logits", record, "--junit", tmp_path / "p.out", "--markdown", tmp_path / "p.out"],
             "--markdown and --junit name the same file"),
            ([*simulate, "--against", record, "--out", record], f"--out {record} is an input")]:
        assert message in output_error(in_process(*command, cwd=tmp_path))
    assert {p: p.read_bytes() for p in before} == before and not (tmp_path / "p.out").exists()


# ---- a damaged record: the hint names what makes it anew for the command in hand ------------

READER_HINT = "write it again with the `crossrt run` or `crossrt import` that made it, passing --overwrite"


def test_a_damaged_records_hint_names_what_makes_it_anew_for_each_command(small_record, tmp_path):
    damaged = tmp_path / "cut.json"
    damaged.write_bytes(small_record.read_bytes()[:300])
    claims = Path(__file__).resolve().parents[1] / "models" / "claims" / "community.toml"
    for command, hint in [
            (["show", damaged], READER_HINT), (["report", damaged, "-o", tmp_path / "r.md"], READER_HINT),
            (["reproduce", claims, "--claim", "tiny-llama-cpp-k4", "--measured", f"tiny-llama-cpp-k4={damaged}"],
             "make it again (its crossrt import or run, with --overwrite), or drop --measured tiny-llama-cpp-k4=... "
             "so reproduce runs the claim"),
            ([*RUN[:-1], "2", "--prompts", "code", "--resume", "--out", damaged],
             "start it anew instead of resuming it (crossrt run --overwrite; crossrt reproduce without --resume)")]:
        line = output_error(in_process(*command, cwd=tmp_path))
        assert f"{damaged} is not JSON" in line and f"(a damaged record: {hint})" in line, line


# ---- sweeps: one writer per directory, a killed driver ----------------------------------------

SWEEP = """name = "faults"
[axes]
runtime = "llama-cpp"
k = [1, 2, 3]
prompts = "code"
max_new_tokens = 4
[resources.llama-cpp]
threads = 1
"""


def test_a_second_sweep_run_is_refused_and_a_killed_one_leaves_no_lock(tmp_path):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP)
    out = tmp_path / "out"
    first = subprocess.Popen([CROSSRT, "sweep", "run", str(sweep), "--dir", str(out)], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The first run is stopped (SIGSTOP) while it holds the lock (its pid written: the flock is
    # taken) and the second tries, then goes on until a cell is done and is killed: its sweep
    # need not outlast a second crossrt's start, so 4 tokens a prompt do (16 did only that).
    lock = out / "sweep.lock"
    try:
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.002)
        first.send_signal(signal.SIGSTOP)
        second = in_process("sweep", "run", sweep, "--dir", out, cwd=tmp_path)
        line = output_error(second)
        assert f"being written by another `crossrt sweep run` (pid {first.pid})" in line, line
        first.send_signal(signal.SIGCONT)
        while not list((out / "cells").glob("*.cell.json")) and first.poll() is None:
            assert time.monotonic() < deadline + 60, "the first run finished no cell"
            time.sleep(0.002)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    # The kernel dropped the lock with its holder: the next run continues, whatever the kill left.
    done = in_process("sweep", "run", sweep, "--dir", out, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "3 cells: 0 to run, 3 done" in in_process("sweep", "plan", sweep, "--dir", out, cwd=tmp_path).stdout


def test_a_sweep_cell_that_does_not_read_names_what_runs_it_again(tmp_path):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(SWEEP.replace("k = [1, 2, 3]", "k = 1"))
    out = tmp_path / "out"
    assert in_process("sweep", "run", sweep, "--dir", out, cwd=tmp_path).returncode == 0
    (meta,) = (out / "cells").glob("*.cell.json")
    record = meta.with_name(meta.name.replace(".cell.json", ".json"))
    # Written over by hand, its meta made to name the new bytes: the store takes the cell as done.
    record.write_bytes(record.read_bytes()[:300])
    fields = json.loads(meta.read_text())
    meta.write_text(json.dumps({**fields, "record_sha256": hashlib.sha256(record.read_bytes()).hexdigest()}))
    line = output_error(in_process("sweep", "show", out, cwd=tmp_path))
    assert f"{record} is not JSON" in line and "--overwrite" not in line, line
    assert f"(a damaged record); delete {meta} and `crossrt sweep run` runs the cell again" in line, line
    meta.unlink()
    assert in_process("sweep", "run", sweep, "--dir", out, cwd=tmp_path).returncode == 0
    done = in_process("sweep", "show", out, cwd=tmp_path)
    assert done.returncode == 0 and load_record(record).results, done.stderr


def test_two_names_of_one_pair_are_planned_once(tmp_path):
    (tmp_path / "mine.toml").symlink_to(TINY_PAIR)  # named beside the sweep file
    names = ["tiny", str(TINY_PAIR), "mine.toml", "tiny-f16"]
    sweep, alone = tmp_path / "sweep.toml", tmp_path / "alone.toml"
    sweep.write_text(f"[axes]\npair = {json.dumps(names)}\nruntime = \"llama-cpp\"\nk = [1, 2]\n")
    alone.write_text("[axes]\npair = \"tiny\"\nruntime = \"llama-cpp\"\nk = [1, 2]\n")
    planned, once = (in_process("sweep", "plan", path, cwd=tmp_path) for path in (sweep, alone))
    assert planned.returncode == 0 and "4 cells: 4 to run" in planned.stdout, planned.stderr
    for alias in names[1:3]:
        assert f"warning: pair {alias!r} and 'tiny' name one manifest ({TINY_PAIR.resolve()}): planned once, " \
               "as 'tiny'" in planned.stderr, planned.stderr
    assert "tiny-f16" not in planned.stderr  # another manifest: its own cells
    ids = {line.split()[0] for line in once.stdout.splitlines() if line.endswith("to run")}
    assert len(ids) == 2 and all(cell in planned.stdout for cell in ids)


def test_an_interrupted_parity_says_what_each_record_kept(tmp_path):
    """Ctrl-C while a parity matrix runs: each record with what finished, and how to go on, never
    a bare `Aborted!` (issue 58). 32 tokens a prompt: the signal comes after the first prompt of
    the first of two 10-prompt cells, so 19 prompts are still to run; 64 only doubled the cost.
    --no-logits: the verdict's logit stages (re-scoring, float control, verification batches,
    drafter rollback: 7 of the matrix's 16 CPU s) run after both cells, where no signal comes;
    tests/test_progress.py and tests/test_planted.py run them."""
    out_dir = tmp_path / "matrix"
    first = out_dir / "tiny-llama-cpp-driven-k4.json"
    process = subprocess.Popen([CROSSRT, "parity", "--pair", "tiny", "--runtimes", "llama-cpp,transformers", "--modes",
                                "driven", "--max-new-tokens", "32", "--no-logits", "--out-dir", str(out_dir)],
                               cwd=tmp_path,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=with_sigint)
    try:
        deadline = time.monotonic() + 120
        while journal_prompts(first) < 1:  # the first cell has finished a prompt at least
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.01)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130 and "Traceback" not in stderr and "Aborted!" not in stderr, stderr
    assert f"interrupted: the runs' records in {out_dir}:" in stderr, stderr
    assert re.search(rf"[1-9]\d* of 10 prompts finished, kept in {re.escape(str(first))}", stderr), stderr
    # The command printed continues the matrix: the finished prompts kept, the rest run.
    command = shlex.split(stderr.split("continue with:\n  ")[1].splitlines()[0])
    assert command[0] == "crossrt" and command[-1] == "--resume", command
    kept_before = load_record(first).results
    resumed = subprocess.run([CROSSRT, *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    after = load_record(first).results
    assert len(after) == 10 and after[:len(kept_before)] == kept_before
    assert len(load_record(out_dir / "tiny-transformers-driven-k4.json").results) == 10
    changed = in_process("parity", "--pair", "tiny", "--runtimes", "llama-cpp", "--modes", "driven",
                         "--max-new-tokens", "16", "--out-dir", out_dir, "--resume", cwd=tmp_path)
    assert changed.returncode == 1 and "cannot resume" in changed.stderr and "max_new_tokens" in changed.stderr, \
        changed.stderr
