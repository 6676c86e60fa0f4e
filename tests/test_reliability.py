"""Reliability of `crossrt run` and the readers against the real runtime on the tiny pair: resume
never mixes prompt sources, one writer per record, system errors and damaged inputs as one
line (no traceback), Ctrl-C says how to resume (docs/reliability.md lists each case)."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crossrt.run.run_writer import lock_path
from crossrt.records.record_json import load_record

from conftest import REPO, TINY_PAIR, with_sigint
from in_process import crossrt_here

CROSSRT = str(Path(sys.executable).parent / "crossrt")
RUN = ["run", "--pair", str(TINY_PAIR), "--threads", "1", "--k", "3"]


def error_line(done: subprocess.CompletedProcess) -> str:
    """The one `Error:` line a failed command prints, checked to come without a traceback."""
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def here(*args) -> subprocess.CompletedProcess:
    """`crossrt *args` in this process (tests/in_process.py); paths are absolute."""
    return crossrt_here(*args)


def read_error_line(*args) -> str:
    """error_line for a reader (show, analyze) or a run refused before its runtime loads, here."""
    return error_line(here(*args))


def prompt_file(path: Path, texts: dict) -> Path:
    path.write_text("".join(json.dumps({"id": i, "category": "prose", "prompt": t}) + "\n" for i, t in texts.items()))
    return path


# ---- resume ---------------------------------------------------------------------------------

def test_resume_refuses_a_prompt_file_whose_ids_collide(tmp_path):
    first = prompt_file(tmp_path / "a.jsonl", {"p1": "The cat sat on", "p2": "def add(a, b):"})
    other = prompt_file(tmp_path / "b.jsonl", {"p1": "The cat sat on", "p2": "Once upon a time"})
    out = tmp_path / "run.json"
    assert here(*RUN, "--max-new-tokens", 4, "--prompts", first, "--out", out).returncode == 0
    line = read_error_line(*RUN, "--max-new-tokens", 4, "--prompts", other, "--out", out, "--resume")
    assert "prompt 'p2'" in line and str(out) in line
    assert [r.prompt_id for r in load_record(out).results] == ["p1", "p2"]


def test_resume_refuses_another_suite(tmp_path):
    # The code suite (22 prompts), not categories (110): any built-in suite whose ids builtin lacks.
    out = tmp_path / "code.json"
    assert here(*RUN, "--max-new-tokens", 2, "--prompts", "code", "--out", out).returncode == 0
    before = [r.prompt_id for r in load_record(out).results]
    line = read_error_line(*RUN, "--max-new-tokens", 2, "--prompts", "builtin", "--out", out, "--resume")
    assert f"its prompt {before[0]!r} is not in the prompt source" in line
    assert [r.prompt_id for r in load_record(out).results] == before


def test_old_records_without_digests_are_checked_by_tokenizing(tmp_path):
    first = prompt_file(tmp_path / "a.jsonl", {"p1": "The cat sat on"})
    other = prompt_file(tmp_path / "b.jsonl", {"p1": "Once upon a time"})
    out = tmp_path / "run.json"
    assert here(*RUN, "--max-new-tokens", 3, "--prompts", first, "--out", out).returncode == 0
    data = json.loads(out.read_text())
    for result in data["results"]:
        del result["prompt_sha256"]  # as a record written before the digest existed
    out.write_text(json.dumps(data))
    assert "prompt 'p1'" in read_error_line(*RUN, "--max-new-tokens", 3, "--prompts", other, "--out", out, "--resume")
    done = here(*RUN, "--max-new-tokens", 3, "--prompts", first, "--out", out, "--resume")
    assert done.returncode == 0, done.stderr
    assert load_record(out).results[0].prompt_sha256 is not None  # filled in once checked


def test_resume_refusal_names_only_the_differing_fields(tmp_path):
    out = tmp_path / "run.json"
    assert here(*RUN, "--max-new-tokens", 2, "--out", out).returncode == 0
    line = read_error_line(*RUN, "--max-new-tokens", 3, "--out", out, "--resume")
    assert "max_new_tokens: 2 in the record, 3 now" in line
    assert "schedule" not in line and "RunParams" not in line



def test_an_existing_record_is_refused_before_the_runtime_loads(tmp_path):
    """An --out that exists, without --resume or --overwrite, is refused first: exllamav3 cannot
    run on a CPU, so a refusal that came after opening the runtime would say that instead (and
    on vLLM it came after an engine's 80 s start)."""
    out = tmp_path / "run.json"
    out.write_text("{}")
    line = read_error_line(*RUN, "--runtime", "exllamav3", "--out", out)
    assert line == f"Error: {out} exists: pass --resume to continue it or --overwrite to replace it"


# ---- one writer; Ctrl-C ---------------------------------------------------------------------

def test_a_second_writer_is_refused_and_ctrl_c_says_how_to_resume(tmp_path):
    # The first run is stopped (SIGSTOP) once a prompt is in, holding its lock while the second
    # writer tries: 40 prompts then outlast the poll's few milliseconds on any machine (150 were
    # needed to outlast a second crossrt's start, and the resume ran what was left of them).
    count = 40
    prompts = prompt_file(tmp_path / "many.jsonl", {f"p{i}": f"Story {i}: the cat" for i in range(count)})
    out = tmp_path / "run.json"
    args = [*RUN, "--max-new-tokens", 48, "--prompts", prompts, "--out", out]
    first = subprocess.Popen([CROSSRT, *map(str, args)], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=with_sigint)
    try:
        journal = out.with_name(out.name + ".journal")
        deadline = time.monotonic() + 120
        while not (journal.is_file() and journal.read_text().count("\n") >= 2):  # a prompt is in
            assert first.poll() is None and time.monotonic() < deadline, "the first run ended too soon"
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)
        line = error_line(here(*args, "--resume"))
        assert f"pid {first.pid}" in line and str(out) in line
        first.send_signal(signal.SIGINT)  # pending until it runs again: Ctrl-C on a running crossrt
        first.send_signal(signal.SIGCONT)
        _, stderr = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130 and "Traceback" not in stderr and "Aborted!" not in stderr
    command = stderr.strip().splitlines()[-1].strip()
    assert command == shlex.join(["crossrt", *map(str, args), "--resume"])
    kept = len(load_record(out).results)
    assert 0 < kept < count and not lock_path(out).exists()
    resumed = subprocess.run([CROSSRT, *shlex.split(command)[1:]], cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert len(load_record(out).results) == count


# ---- system errors: read-only and full disks -----------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """A mount point for a small tmpfs (root can write through chmod, not through a read-only
    mount or a full tmpfs); skipped where mounting is not allowed."""
    point = tmp_path / "mnt"
    point.mkdir()
    mounted = []

    def mount(*options):
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        mounted.append(point)
        return point

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


def test_a_read_only_folder_is_one_line(tmpfs):
    point = tmpfs("size=1m")
    (point / "runs").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
    out = point / "runs" / "run.json"
    line = read_error_line(*RUN, "--max-new-tokens", 2, "--out", out)
    assert str(out) in line and "read-only" in line.lower()


def test_a_full_disk_is_one_line_and_keeps_what_finished(tmpfs):
    point = tmpfs("size=12k")
    out = point / "run.json"
    done = here(*RUN, "--max-new-tokens", 32, "--prompts", "categories", "--out", out)
    line = error_line(done)
    assert "No space left on device" in line and str(point) in line
    assert not [p.name for p in point.iterdir() if p.name.endswith(".tmp")]
    assert not lock_path(out).exists()
    assert load_record(out).results  # the record on disk still reads, with the prompts its journal kept


def test_an_unwritable_logs_folder_is_one_line(tmp_path):
    (tmp_path / "run.logs").write_text("a file where the native runtime's logs folder goes")
    line = read_error_line("run", "--runtime", "llama-server", "--mode", "native", "--pair", TINY_PAIR,
                           "--threads", 1, "--max-new-tokens", 2, "--out", tmp_path / "run.json")
    assert f"cannot write {tmp_path / 'run.logs'}: File exists; a file is in the way" in line


# ---- damaged inputs -------------------------------------------------------------------------

def test_a_truncated_gguf_is_one_line(tmp_path):
    target = tmp_path / "target.gguf"
    target.write_bytes((REPO / "models" / "tiny" / "target.f32.gguf").read_bytes()[:5000])
    line = read_error_line("run", "--target", target, "--drafter", REPO / "models" / "tiny" / "drafter.f32.gguf",
                           "--threads", "1", "--out", tmp_path / "run.json")
    assert str(target) in line and "damaged or truncated" in line


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    folder = tmp_path_factory.mktemp("traced")
    out = folder / "run.json"
    # The code suite's 22 prompts: a 5 kB trace whose bytes 3000-3100 are an array's, as damaged below.
    done = here(*RUN, "--max-new-tokens", 8, "--prompts", "code", "--trace", "--out", out)
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize("damage", [lambda b: b[:len(b) // 2], lambda b: b[:3000] + b"x" * 100 + b[3100:]],
                         ids=["truncated", "corrupt"])
def test_a_damaged_trace_is_one_line(traced, damage, tmp_path):
    record = tmp_path / traced.name
    record.write_bytes(traced.read_bytes())
    trace = tmp_path / "run.trace.npz"
    trace.write_bytes(damage((traced.parent / "run.trace.npz").read_bytes()))
    line = read_error_line("analyze", record)
    assert str(trace) in line and "not a trace file" in line


def damaged_records(record: dict) -> list:
    duplicated = json.loads(json.dumps(record))
    duplicated["results"].append(duplicated["results"][0])
    newer = {**record, "schema_version": 99}
    return [(b"\xff\xfe{" + b"x" * 10, "is not JSON"),
            (json.dumps(record).encode()[:-200], "is not JSON"),
            (json.dumps(duplicated).encode(), "appears twice"),
            (json.dumps(newer).encode(), "written by a newer crossrt (schema 99; this one reads 1)")]


def test_a_damaged_record_is_one_line(traced, tmp_path):
    for index, (data, message) in enumerate(damaged_records(json.loads(traced.read_text()))):
        path = tmp_path / f"bad{index}.json"
        path.write_bytes(data)
        line = read_error_line("show", path)
        assert str(path) in line and message in line, line


# ---- runs that cannot do anything ------------------------------------------------------------

def test_every_prompt_failing_exits_1(tmp_path):
    line = error_line(here(*RUN, "--n-ctx", 16, "--max-new-tokens", 4, "--out", tmp_path / "run.json"))
    assert "all 10 prompts failed" in line


def test_a_k_no_draft_can_reach_warns_on_a_native_runtime(tmp_path):
    done = here("run", "--runtime", "llama-server", "--mode", "native", "--pair", TINY_PAIR, "--threads", 1,
                "--k", 100, "--max-new-tokens", 8, "--prompts", "code", "--out", tmp_path / "run.json")
    assert done.returncode == 0, done.stderr
    assert "warning: --k 100: llama.cpp drops drafts shorter than draft-n-min 100" in done.stderr


def test_gpu_split_without_a_gpu_warns(tmp_path):
    done = here(*RUN, "--gpu-split", "1,1", "--n-gpu-layers", 99, "--max-new-tokens", 2, "--prompts", "code",
                "--out", tmp_path / "run.json")
    assert done.returncode == 0, done.stderr
    if load_record(tmp_path / "run.json").runtime.device != "cpu":
        pytest.skip("this machine has a GPU")
    assert "warning: --gpu-split 1,1 had no effect" in done.stderr


# ---- a hung llama-server --------------------------------------------------------------------

@pytest.mark.alone  # sub-second probes and 1-3 s timeouts that a prompt must beat: not beside another worker
@pytest.mark.parametrize("settings, message", [
    ({"HEALTH_PROBE_S": 0.5}, "no answer to 3 /health probes"),
    ({"HEALTH_MISSES": 10 ** 6, "REQUEST_BASE_S": 1.0, "REQUEST_S_PER_TOKEN": 0.0}, "no answer within 1 s"),
], ids=["health-probes", "request-timeout"])
def test_a_stopped_llama_server_is_a_failure_that_keeps_finished_prompts(tmp_path, monkeypatch, settings, message):
    from crossrt.backends import llama_server_process
    from crossrt.run.driver import RunRequest, run_pair
    from crossrt.inputs.pairs import load_pair
    from crossrt.inputs.prompts import load_prompts
    from crossrt.run.runtime import DraftRules, RuntimeFailure, RuntimeOptions

    for name, value in settings.items():
        monkeypatch.setattr(llama_server_process, name, value)
    request = RunRequest(load_pair(TINY_PAIR), "llama-server", RuntimeOptions(n_ctx=512, threads=1), DraftRules(3),
                         8, tmp_path / "run.json", mode="native")
    stopped = []

    def stop_servers(prompt, result):  # after the first prompt: the next request meets a hung server
        if not stopped:
            stopped.extend(children())
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)

    started = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"stopped by a signal\): POST /\w+: " + message):
        run_pair(request, load_prompts("code")[:3], on_prompt=stop_servers)
    assert time.monotonic() - started < 60  # not the request's whole timeout
    assert len(stopped) == 2 and not set(stopped) & set(children())  # both stopped, then ended
    assert len(load_record(tmp_path / "run.json").results) == 1


def children() -> list:
    """The live llama-server child processes of this test process (the run's servers; not, say,
    the resource tracker an earlier test's spawned worker pool leaves for the process's life)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
            command = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if entry.name.isdigit() and int(fields[1]) == os.getpid() and fields[0] != "Z" \
                and Path(command.decode(errors="replace")).name == "llama-server":
            found.append(int(entry.name))
    return found

