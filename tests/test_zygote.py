"""Warm starts (crossrt/run/zygote.py): isolated children forked by a zygote, on real processes.
What a child gets must be what a fresh interpreter would give it under the caller's environment,
folder and streams; what it learns to import is imported before the next child; its end is
reported as a Popen's would be, also when its zygote is killed under it."""

import os
import signal
import sys
import time

import pytest

from crossrt.run import zygote as zygotes
from crossrt.run.isolation import RuntimeCrashed, call_isolated, preloads
from crossrt.run.zygote import zygote_for


def wave_was_imported() -> tuple[bool, int]:
    """(whether the standard library's wave module, which neither crossrt nor a runtime imports,
    was imported before this call, this process's pid)."""
    warm = "wave" in sys.modules
    import wave  # noqa: F401
    return warm, os.getpid()


def surroundings(name: str) -> tuple[str | None, str, int]:
    print(f"child says {name}", flush=True)
    return os.environ.get(name), os.getcwd(), os.getppid()


def sleep_then(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def ended(pid: int) -> bool:
    """pid is gone or a zombie (killed, waiting for whoever adopted it to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_child_is_forked_fresh_and_the_zygote_learns_what_it_imported():
    assert "wave" not in sys.modules
    first, first_pid = call_isolated("llama-cpp", wave_was_imported)
    second, second_pid = call_isolated("llama-cpp", wave_was_imported)
    assert (first, second) == (False, True)  # the first child's import reached the zygote
    assert first_pid != second_pid != os.getpid()


def test_a_child_runs_in_the_callers_environment_folder_and_streams(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("CROSSRT_ZYGOTE_TEST", "one")
    value, folder, zygote_pid = call_isolated("llama-cpp", surroundings, "CROSSRT_ZYGOTE_TEST")
    assert (value, folder) == ("one", os.getcwd())
    monkeypatch.setenv("CROSSRT_ZYGOTE_TEST", "two")  # read when used: the same zygote
    monkeypatch.chdir(tmp_path)
    value, folder, same_pid = call_isolated("llama-cpp", surroundings, "CROSSRT_ZYGOTE_TEST")
    assert (value, folder, same_pid) == ("two", str(tmp_path), zygote_pid)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # read once, as OpenMP loads: another zygote
    value, _, other_pid = call_isolated("llama-cpp", surroundings, "OMP_NUM_THREADS")
    assert value == "3" and other_pid != zygote_pid
    assert capfd.readouterr().out.count("child says") == 3


def test_a_childs_end_is_reported_as_popen_reports_it_and_a_killed_zygote_kills_its_children():
    zygote = zygote_for("llama-cpp", preloads("llama-cpp"))
    child = zygote.fork((1, 2), "time:sleep", 30)
    assert child.poll() is None
    child.send_signal(signal.SIGTERM)
    assert child.wait() == -signal.SIGTERM and zygote.running == set()
    child = zygote.fork((1, 2), "time:sleep", 30)
    os.kill(zygote.process.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL and not zygote.alive
    deadline = time.monotonic() + 10
    while not ended(child.pid) and time.monotonic() < deadline:  # gone with its zygote (parent-death signal)
        time.sleep(0.05)
    assert ended(child.pid)
    assert call_isolated("llama-cpp", sorted, [2, 1]) == [1, 2]  # a new zygote for the next call


def test_a_crash_under_a_zygote_is_still_named_by_its_signal():
    with pytest.raises(RuntimeCrashed, match=r"^llama-cpp crashed: SIGABRT \(Aborted\)"):
        call_isolated("llama-cpp", os.abort)


def test_zygotes_beyond_the_kept_few_are_closed_only_when_idle(monkeypatch):
    monkeypatch.setattr(zygotes.process_zygotes, "kept", 1)
    busy = zygote_for("busy", preloads("busy"))
    child = busy.fork((1, 2), "time:sleep", 5)
    others = [zygote_for(f"other-{i}", []) for i in range(2)]
    assert busy.alive and not others[0].alive and others[1].alive  # the busy one is kept
    assert child.wait() == 0
    zygote_for("last", [])
    assert not busy.alive
