"""A crashed runtime is a verdict, not the end (crossrt/run/isolation.py): runtime processes that
really die by a signal, with the real llama.cpp runtime loaded on the tiny pair (the test hook
CROSSRT_TEST_CRASH_AFTER=RUNTIME:N[:SIGNAL] kills the run's own process after N finished prompts:
SIGSEGV by reading address 0, other signals sent to itself), and what `crossrt run`, `parity` and
`sweep run` make of it: one line naming the runtime, the signal and where it died, the finished
prompts kept, the other runtimes and cells still run; and the calls that load a runtime outside a
run (diff's and report's re-scoring, the tau gaps' oracle, MT-Bench's first answers), which go
where call_safely places them."""

import ctypes
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from crossrt.records.record_json import load_record
import crossrt
import crossrt.backends
from crossrt.compare.census import Variant, take_census
from crossrt.records.record_json import save_record
from crossrt.run.crashes import crash_of, crashed_stack
from crossrt.run.isolation import (CRASH_HOOK, RESCORING, Isolated, RuntimeCrashed, begin_safely, call_isolated,
                                   call_safely, isolated, prompt_hook)
from crossrt.run.processes import oom_kills
from crossrt.run.runtime import availability

from conftest import REPO, TINY_PAIR
from in_process import crossrt_here
from test_processes import memory_cgroup

CROSSRT = str(Path(sys.executable).parent / "crossrt")
PROMPTS = [{"id": "code", "category": "code", "prompt": "def add(a, b):"},
           {"id": "prose", "category": "prose", "prompt": "The river"},
           {"id": "story", "category": "prose", "prompt": "Once upon a time"}]
SPEC_BENCH = REPO / "tests" / "fixtures" / "benchmarks" / "spec_bench_question.jsonl"
RUN = ["run", "--pair", str(TINY_PAIR), "--threads", "1", "--k", "3", "--max-new-tokens", "8"]


def prompt_file(folder: Path, count: int = 3) -> Path:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:count]))
    return path


def cli(*args, cwd: Path, crash: str = "") -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != CRASH_HOOK}
    if crash:
        env[CRASH_HOOK] = crash
    return subprocess.run([CROSSRT, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def in_process(*args, cwd: Path, crash: str = "") -> subprocess.CompletedProcess:
    """cli(*args) in this process (tests/in_process.py), for commands whose every runtime call
    is isolated (runs, re-scoring, the oracles, MT-Bench's first answers, sweeps): the hook kills
    the forked child either way, which gets this process's environment and working folder."""
    return crossrt_here(*args, cwd=cwd, env={CRASH_HOOK: crash or None})


def comparable(result):
    return (result.prompt_id, result.status, result.prompt_ids, result.output_ids, result.baseline_ids,
            result.counters)


def test_a_crashed_run_is_one_line_that_keeps_its_prompts_and_resumes(tmp_path):
    # Processes of their own: the command printed to continue is the one the user typed (argv).
    prompts, out = prompt_file(tmp_path), tmp_path / "run.json"
    args = [*RUN, "--prompts", prompts, "--out", out]
    crashed = cli(*args, cwd=tmp_path, crash="llama-cpp:1")
    assert crashed.returncode == 1, crashed.stderr
    assert "Traceback" not in crashed.stderr
    line = crashed.stderr.strip().splitlines()[-1]
    resume = shlex.join(["crossrt", *map(str, args), "--resume"])
    assert re.fullmatch(r"Error: llama-cpp crashed: SIGSEGV \(Segmentation fault\) in ctypes/__init__\.py:\d+ "
                        r"string_at, from crossrt/run/isolation\.py:\d+ _crash; 1 of 3 prompts finished, kept in "
                        + re.escape(f"{out}; continue with: {resume}"), line), line
    kept = load_record(out).results
    assert [r.prompt_id for r in kept] == ["code"] and kept[0].ok
    resumed = cli(*shlex.split(resume)[1:], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    results = load_record(out).results
    assert [r.prompt_id for r in results] == ["code", "prose", "story"] and all(r.ok for r in results)
    assert comparable(results[0]) == comparable(kept[0])


@pytest.mark.skipif(availability("transformers") is not None, reason=f"{availability('transformers')}")
def test_a_crashed_runtime_fails_parity_and_the_other_runtime_still_runs(tmp_path):
    """llama-cpp, the matrix's first cell (whose tokenization would feed the others), dies by
    SIGABRT after one prompt; transformers still runs and is checked; parity fails naming it."""
    out_dir = tmp_path / "parity"
    done = in_process("parity", "--pair", TINY_PAIR, "--runtimes", "llama-cpp,transformers", "--modes", "driven",
                      "--prompts", prompt_file(tmp_path, 2), "--max-new-tokens", 8, "--threads", 1, "--no-logits",
                      "--out-dir", out_dir, cwd=tmp_path, crash="llama-cpp:1:SIGABRT")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    crashed = out_dir / "tiny-llama-cpp-driven-k4.json"
    assert re.search(r"^FAIL llama-cpp/driven: crashed: SIGABRT \(Aborted\), from crossrt/run/isolation\.py:\d+ "
                     rf"_crash; 1 of 2 prompts finished, kept in {re.escape(str(crashed))}$", done.stdout, re.M), \
        done.stdout
    assert re.search(r"^transformers/driven vs its baseline: 2 prompts: 2 identical", done.stdout, re.M), done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith("parity: FAILED")
    assert [r.prompt_id for r in load_record(crashed).results] == ["code"]
    assert [r.ok for r in load_record(out_dir / "tiny-transformers-driven-k4.json").results] == [True, True]


@pytest.fixture(scope="module")
def two_records(tmp_path_factory):
    """Two runs of the tiny pair on llama.cpp (k 3 and 2): the same outputs, other counts."""
    folder = tmp_path_factory.mktemp("two")
    prompts = prompt_file(folder)
    for k in (3, 2):
        done = in_process("run", "--pair", TINY_PAIR, "--threads", 1, "--k", k, "--max-new-tokens", 8, "--prompts",
                          prompts, "--out", folder / f"k{k}.json", cwd=folder)
        assert done.returncode == 0, done.stderr
    return folder / "k3.json", folder / "k2.json"


def test_a_crash_while_re_scoring_fails_parity_and_the_runs_are_still_compared(two_records, tmp_path):
    """Explaining splits and re-scoring logits load llama.cpp in a process of their own: the same
    verdict as in crossrt's process when it lives; when it dies (here as it starts), a FAIL
    naming it, and the runs compared from what they recorded."""
    a, b = two_records
    whole = in_process("parity", a, b, "--threads", 1, cwd=tmp_path)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "logits along common outputs: 3/3 within tolerance" in whole.stdout, whole.stdout
    crashed = in_process("parity", a, b, "--threads", 1, cwd=tmp_path, crash="re-scoring:0")
    assert crashed.returncode == 1 and "Traceback" not in crashed.stderr, crashed.stdout + crashed.stderr
    assert re.search(r"^FAIL re-scoring: crashed: SIGSEGV \(Segmentation fault\) in ctypes/__init__\.py:\d+ "
                     r"string_at, from crossrt/run/isolation\.py:\d+ _crash; the runs were compared from what they "
                     r"recorded, nothing re-scored$", crashed.stdout, re.M), crashed.stdout
    assert re.search(r"^llama-cpp/driven \(k3\.json\) vs llama-cpp/driven \(k2\.json\): 3 prompts: 3 identical",
                     crashed.stdout, re.M), crashed.stdout
    assert "logits along common outputs" not in crashed.stdout


SEGV = r"SIGSEGV \(Segmentation fault\) in ctypes/__init__\.py:\d+ string_at, from crossrt/run/isolation\.py:\d+ _crash"


@pytest.mark.parametrize("command", [["diff", "{a}"], ["diff", "{a}", "{b}"], ["report", "{a}", "{b}", "-o", "r.md"]],
                         ids=["diff-one", "diff-two", "report"])
def test_re_scoring_outside_parity_crashes_in_one_line(two_records, tmp_path, command):
    """diff's divergence detail and report's parity section re-score where RESCORING runs: its
    death (the hook at once) is one line, no traceback."""
    a, b = two_records
    done = in_process(*[part.format(a=a, b=b) for part in command], cwd=tmp_path, crash="re-scoring:0")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert re.fullmatch(f"Error: re-scoring crashed: {SEGV}", done.stderr.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("command", ["report", "parity", "parity --jobs 2"])
def test_a_crash_building_the_tau_gap_oracle_is_that_gaps_reason(two_records, tmp_path, command):
    """report's and parity's tau gaps (two schedules) build their oracle in llama.cpp's process: its
    death is the gap's reason, and the rest (the page; parity's comparisons and verdict) follows.
    With --jobs 2 the oracle builds beside parity's verdict."""
    a, b = two_records
    record = load_record(b)
    relabelled = tmp_path / "server.json"
    save_record(dataclasses.replace(record, params=dataclasses.replace(record.params, schedule="llama-server")),
                relabelled)
    out = ["-o", "r.md"] if command == "report" else ["--no-logits", *command.split()[1:]]
    done = in_process(command.split()[0], a, relabelled, "--no-rescore", *out, cwd=tmp_path, crash="llama-cpp:0")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    if command == "report":
        page = (tmp_path / "r.md").read_text()  # markdown: its underscores escaped
        assert "vs llama-cpp/driven llama-server k=2: not computed (llama-cpp crashed: SIGSEGV (Segmentation fault) " \
               "in ctypes/" in page, page
    else:
        assert re.search(f"^tau gap .* vs .*server.json.*: not computed \\(llama-cpp crashed: {SEGV}\\)$", done.stdout,
                         re.M), done.stdout
        assert done.stdout.strip().splitlines()[-1].startswith("parity: OK"), done.stdout


def test_a_census_batch_whose_re_scoring_crashes_is_a_failure_and_is_still_counted(two_records, tmp_path, monkeypatch):
    """The split census re-scores as parity does: a crash there (the hook at once) is that batch's
    failure, and the batch is still compared from what its runs recorded."""
    made = dict(zip(("k3", "k2"), two_records))
    monkeypatch.setenv(CRASH_HOOK, "re-scoring:0")  # each child gets the caller's environment
    census = take_census(lambda variant, prompts, out: load_record(made[variant.name]), tmp_path,
                         (Variant("k3", "llama-cpp", "driven"), Variant("k2", "llama-cpp", "driven")), batch=1,
                         max_batches=1)
    assert len(census.failures) == 1 and re.fullmatch(
        rf"batch 0 \(prompts-0\.jsonl\): re-scoring crashed: {SEGV}; the runs were compared from what they "
        r"recorded, nothing re-scored", census.failures[0]), census.failures
    assert census.compared == 9  # 3 prompts: each run against its baseline, and the two runs


def test_mt_benchs_first_answers_are_made_in_a_process_of_their_own(tmp_path):
    """--turn 2's first answers load the target in llama.cpp's process: its death is one line
    saying no answer was kept, and no answers file is written."""
    questions = tmp_path / "question.jsonl"
    questions.write_text(SPEC_BENCH.read_text().splitlines(keepends=True)[0])
    done = in_process(*RUN, "--prompts", f"mtbench:{questions}", "--turn", 2, "--out", tmp_path / "turn2.json",
                      cwd=tmp_path, crash="llama-cpp:0")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    answers = tmp_path / "tiny-first-answers.jsonl"
    assert re.match(f"Error: llama-cpp crashed: {SEGV}; while making --turn 2's first answers, none of them kept "
                    f"in {re.escape(str(answers))}; ", done.stderr.strip().splitlines()[-1]), done.stderr
    assert not answers.exists() and not (tmp_path / "turn2.json").exists()


SWEEP = """
name = "crash"
[axes]
runtime = ["llama-cpp"]
k = [2, 3, 4]
prompts = "one.jsonl"
max_new_tokens = 8
[resources.llama-cpp]
threads = 1
"""


@pytest.mark.parametrize("cpus", [None, 2], ids=["in-order", "parallel"])
def test_a_crashed_sweep_cell_fails_in_one_line_and_the_others_run(tmp_path, cpus):
    """In order, the cells of one runtime share a process (their models stay loaded): with one
    prompt per cell and a crash after the second finished prompt, k=3 crashes and k=4 runs in a
    fresh process. In worker processes each cell has its own, so each crashes after one prompt."""
    (tmp_path / "one.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n")
    (tmp_path / "sweep.toml").write_text(SWEEP)
    args = ["sweep", "run", "sweep.toml", "--dir", tmp_path / "store", *(["--cpus", cpus] if cpus else [])]
    done = in_process(*args, cwd=tmp_path, crash="llama-cpp:2" if cpus is None else "llama-cpp:1")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("[")]
    failed = [line for line in lines if "FAILED: llama-cpp crashed: SIGSEGV (Segmentation fault)" in line]
    assert len(lines) == 3 and len(failed) == (1 if cpus is None else 3), done.stderr
    if cpus is None:
        assert "-driven-k3-" in failed[0], failed


@pytest.mark.parametrize("call, args, cause", [
    (ctypes.string_at, (0,), r"SIGSEGV \(Segmentation fault\) in ctypes/__init__\.py:\d+ string_at"),
    (signal.raise_signal, (signal.SIGKILL,), r"SIGKILL \(killed, not by the kernel's out-of-memory killer: its count "
                                             r"did not change\)"),
    (os._exit, (3,), r"its process exited with code 3 without an answer")], ids=["segv", "killed", "exit"])
def test_a_child_that_dies_is_runtime_crashed(call, args, cause):
    """Standard library calls (no crossrt frame on the stack) dying three ways in the child."""
    before = oom_kills()
    with pytest.raises(RuntimeCrashed) as crash:
        call_isolated("llama-cpp", call, *args)
    if oom_kills() != before:  # an OOM kill elsewhere meanwhile (tests/test_processes.py makes some)
        pytest.skip("the kernel's OOM-kill count changed during the call: SIGKILL's cause cannot be told")
    assert re.fullmatch(cause, crash.value.cause()), crash.value.cause()
    assert str(crash.value) == f"llama-cpp crashed: {crash.value.cause()}"


def test_an_exception_in_the_child_is_raised_here_and_answers_come_back():
    assert call_isolated("llama-cpp", sorted, [3, 1, 2]) == [1, 2, 3]
    with pytest.raises(ValueError, match="invalid literal"):
        call_isolated("llama-cpp", int, "x")


def interrupted_in_a_callback(marker: str, through_prompt_hook: bool) -> bytes:
    """In the child: libc's qsort calling a Python comparator that is sleeping when the parent's
    SIGINT comes, so the KeyboardInterrupt is raised inside a ctypes callback, which swallows it
    (as llama.cpp's log callback did, loading a model); then the end of a prompt (prompt_hook),
    or a result far bigger than a pipe holds."""
    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    def compare(a, b):
        Path(marker).touch()
        time.sleep(2)
        return 0
    ctypes.CDLL(None).qsort((ctypes.c_int * 2)(), 2, ctypes.sizeof(ctypes.c_int), compare)
    if through_prompt_hook:
        prompt_hook("llama-cpp")(None, None)
    return bytes(1 << 20)


@pytest.mark.parametrize("through_prompt_hook", [True, False], ids=["prompt-hook", "big-result"])
def test_an_interrupt_a_native_callback_swallowed_ends_the_child_quietly(tmp_path, capfd, through_prompt_hook):
    marker = tmp_path / "in-callback"
    child = Isolated("llama-cpp", interrupted_in_a_callback, (str(marker), through_prompt_hook))
    deadline = time.monotonic() + 60
    while not marker.exists() and child.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if not marker.exists():
        child.close()
        pytest.fail("the child never reached its callback")
    started = time.monotonic()
    passing_on = threading.Thread(target=child.interrupt)
    passing_on.start()
    passing_on.join(timeout=30)
    if passing_on.is_alive():
        os.kill(child.process.pid, signal.SIGKILL)  # the thread's wait then ends
        passing_on.join()
        pytest.fail("the parent waited for a child that was waiting for the parent to read it")
    assert time.monotonic() - started < 10
    assert child.process.returncode == 0
    assert child._outcome[0] == ("interrupted" if through_prompt_hook else "result")
    printed = capfd.readouterr().err
    assert "KeyboardInterrupt" not in printed and "Traceback" not in printed, printed


def test_the_crashed_threads_frames_name_the_binding_call_and_the_backend():
    """A dump written in faulthandler's format (Python 3.11, all threads: other threads first,
    then the current one) for a fault inside llama.cpp's decode, as the binding calls it from
    crossrt's backend: the innermost frame outside crossrt, and the backend's frame."""
    backends = Path(crossrt.backends.__path__[0])
    dump = ('Fatal Python error: Segmentation fault\n\nThread 0x00007f1 (most recent call first):\n'
            '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
            'Current thread 0x00007f2 (most recent call first):\n'
            '  File "/venv/lib/python3.11/site-packages/llama_cpp/_internals.py", line 310 in decode\n'
            f'  File "{backends}/llama_cpp.py", line 212 in _forward\n'
            f'  File "{Path(crossrt.__file__).parent}/run/loop.py", line 90 in greedy_generate\n'
            '\nExtension modules: numpy (total: 1)\n')
    assert [(f.function, f.line) for f in crashed_stack(dump)] == [("decode", 310), ("_forward", 212),
                                                                   ("greedy_generate", 90)]
    assert crash_of("llama-cpp", -signal.SIGSEGV, dump).cause() == (
        "SIGSEGV (Segmentation fault) in llama_cpp/_internals.py:310 decode, from crossrt/backends/llama_cpp.py:212 "
        "_forward")
    assert crash_of("llama-cpp", -signal.SIGILL, "").cause() == "SIGILL (Illegal instruction)"


def test_in_process_runtimes_are_isolated_and_programs_are_not(monkeypatch):
    assert isolated("llama-cpp") and isolated("transformers") and isolated(RESCORING)
    assert not isolated("llama-server") and not isolated("llama-spec-cli")
    assert call_safely("llama-cpp", os.getpid) != os.getpid()
    assert call_safely("llama-server", os.getpid) == os.getpid()
    monkeypatch.setenv("CROSSRT_IN_PROCESS", "1")
    assert not isolated("llama-cpp") and not isolated(RESCORING)
    assert call_safely("llama-cpp", os.getpid) == os.getpid()


def test_a_call_begun_runs_beside_the_caller_and_one_given_up_on_is_killed(monkeypatch):
    """begin_safely starts an isolated call's process at once: two begun calls that each sleep
    1 s end together in about 1 s, not 2; close() kills a call not waited for."""
    call_safely("llama-cpp", os.getpid)  # the zygote started, as after any first call
    started = time.perf_counter()
    begun = [begin_safely("llama-cpp", time.sleep, 1.0) for _ in range(2)]
    assert [call.wait() for call in begun] == [None, None]
    assert time.perf_counter() - started < 1.9
    abandoned = begin_safely("llama-cpp", time.sleep, 60)
    abandoned.close()
    assert abandoned.process.poll() is not None
    monkeypatch.setenv("CROSSRT_IN_PROCESS", "1")  # no process of its own: the call runs when waited for
    here = begin_safely("llama-cpp", os.getpid)
    assert here.wait() == os.getpid()


def test_simulate_builds_its_oracle_in_a_process_of_its_own(tmp_path):
    """The oracle's models load in the child: its death (the hook at once) is simulate's one line."""
    done = in_process("simulate", "--pair", TINY_PAIR, "--threads", 1, "--max-k", 2, "--max-new-tokens", 4,
                      "--prompts", prompt_file(tmp_path, 1), cwd=tmp_path,
                      crash="llama-cpp:0:SIGILL")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert re.fullmatch(r"Error: llama-cpp crashed: SIGILL \(Illegal instruction\), from crossrt/run/isolation\.py:\d+ "
                        r"_crash", done.stderr.strip().splitlines()[-1]), done.stderr


def test_reproduce_runs_each_claim_in_a_process_of_its_own(tmp_path):
    """A runtime's death while reproducing a claim fails that claim in one line, not crossrt."""
    claims = tmp_path / "claims.toml"
    claims.write_text(f'[[claim]]\nid = "mine"\nsource = "test"\nruntime = "llama.cpp"\ncrossrt_runtime = "llama-cpp"\n'
                      f'pair = "{TINY_PAIR}"\nk = 3\nsampling = "greedy"\nhardware = "Test Box"\nmax_new_tokens = 8\n'
                      f'prompts = "{prompt_file(tmp_path)}"\n'
                      '[claim.expect.code]\ntau = 3.0\n[claim.expect.prose]\ntau = 3.0\n')
    done = in_process("reproduce", claims, "--threads", 1, "--out-dir", tmp_path / "runs", cwd=tmp_path,
                      crash="llama-cpp:1")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert re.search(r"run failed: llama-cpp crashed: SIGSEGV \(Segmentation fault\) .*; 1 of 3 prompts finished",
                     done.stdout), done.stdout
    assert [r.prompt_id for r in load_record(tmp_path / "runs" / "mine.json").results] == ["code"]


def test_a_child_the_oom_killer_takes_is_named_so(tmp_path):
    """A crossrt process in a memory cgroup of 512 MiB whose isolated child fills 2 GiB: the
    kernel's OOM killer takes the child, and the crash says so (the cgroup keeps the rest of the
    machine out of it; skipped where none can be made)."""
    procs = memory_cgroup(512 * 2 ** 20)
    script = (f"import os; open({str(procs)!r}, 'w').write(str(os.getpid()))\n"  # joined before any child
              "from crossrt.run.isolation import RuntimeCrashed, call_isolated\n"
              "try:\n    call_isolated('llama-cpp', bytes.__mul__, bytes(range(256)) * 16, 2 ** 19)\n"
              "except RuntimeCrashed as crash:\n    print(crash)\n")
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    finally:
        for _ in range(50):
            try:
                procs.parent.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert done.stdout.strip() == "llama-cpp crashed: SIGKILL (killed by the kernel's out-of-memory killer)", done
