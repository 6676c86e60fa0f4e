"""How a child process ended (crossrt/run/processes.py), on real processes: killed by a signal
from here, exited, and killed by the kernel's out-of-memory killer for real, in a memory cgroup
of its own with a small limit (so nothing else on the machine runs short): the process itself,
and a process under it whose parent then exits with 1 (a program that runs its work in a process
of its own). The cgroup tests are skipped where no memory cgroup can be made
(not root, or a read-only /sys/fs/cgroup)."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from crossrt.run.processes import ProcessTree, oom_kills

LIMIT = 64 * 2 ** 20
# Names itself (its comm), joins the cgroup named in argv[1] if any, waits for a line, then
# allocates 8 MiB at a time, touching every page, far past LIMIT.
HOG = """
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(15, b"crossrt-hog")  # PR_SET_NAME
if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as procs:
        procs.write(str(os.getpid()))
sys.stdin.readline()
held = []
for _ in range(64):
    held.append(bytearray(8 * 2 ** 20))
    time.sleep(0.02)
"""
# Starts HOG under it and exits with 1 when HOG ends, whatever killed it.
PARENT = f"""
import subprocess, sys
hog = subprocess.Popen([sys.executable, "-c", {HOG!r}, *sys.argv[1:]], stdin=sys.stdin)
hog.wait()
sys.exit(1)
"""


def memory_cgroup(limit: int = LIMIT) -> Path:
    """A new memory cgroup limited to limit bytes, its cgroup.procs returned; skip where none can be made."""
    for root, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):
        if not (root / "cgroup.procs").is_file() or not (root / limit_file).parent.is_dir():
            continue
        group = root / f"crossrt-test-{uuid.uuid4().hex[:8]}"
        try:
            group.mkdir()
            (group / limit_file).write_text(str(limit))
            return group / "cgroup.procs"
        except OSError:
            if group.is_dir():
                group.rmdir()
    pytest.skip("no memory cgroup can be made here (needs root and a writable /sys/fs/cgroup)")


def named_hog(tree: ProcessTree) -> bool:
    return any(name == "crossrt-hog" for name, _ in tree._alive.values())


def watch(process: subprocess.Popen) -> ProcessTree:
    """Sample process and its children until it ends, as the runtimes do while waiting on it;
    the allocation starts once the hog has been seen (a runtime's processes live a while)."""
    tree = ProcessTree(process.pid)
    while not named_hog(tree):
        tree.sample()
        time.sleep(0.05)
    process.stdin.write(b"go\n")
    process.stdin.flush()
    while process.poll() is None:
        tree.sample()
        time.sleep(0.05)
    return tree


def start(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE)


@pytest.fixture
def cgroup():
    procs = memory_cgroup()
    yield str(procs)
    for _ in range(50):  # empty once its processes are reaped
        try:
            procs.parent.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def test_the_oom_killers_victim_is_named_with_the_memory_held_and_free(cgroup):
    before = oom_kills()
    process = start(HOG, cgroup)
    tree = watch(process)
    assert process.returncode == -signal.SIGKILL and oom_kills() > before
    told = tree.ended(process.returncode)
    assert told.startswith("was killed by SIGKILL: the kernel's out-of-memory killer (")
    assert told.endswith(" free)") and " in use by its processes, " in told


def test_a_process_killed_under_a_parent_that_exits_1_is_named_with_its_signal(cgroup):
    """vLLM's shape: the process holding the weights is killed, the worker crossrt started exits 1."""
    process = start(PARENT, cgroup)
    tree = watch(process)
    assert process.returncode == 1
    told = tree.ended(process.returncode)
    assert told.startswith("was killed by SIGKILL (its process crossrt-hog, pid "), told
    assert "): the kernel's out-of-memory killer (" in told


def test_a_signal_from_elsewhere_is_named_and_not_blamed_on_the_oom_killer():
    before = oom_kills()
    process = start("import sys, time\nsys.stdin.readline()\ntime.sleep(60)")
    tree = ProcessTree(process.pid)
    tree.sample()
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    told = tree.ended(process.returncode)
    if before is None:
        assert told == "was killed by SIGKILL"
    elif oom_kills() == before:  # else an OOM kill elsewhere on the machine happened meanwhile
        assert told == "was killed by SIGKILL (not by the kernel's out-of-memory killer: its count did not change)"
    assert tree.ended(process.returncode, during=" while loading").startswith("was killed by SIGKILL while loading")


def test_other_signals_and_exits_are_named_as_such():
    for script, end, told in (("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM,
                               "was killed by SIGTERM"), ("raise SystemExit(3)", 3, "exited with 3")):
        process = subprocess.Popen([sys.executable, "-c", script])
        tree = ProcessTree(process.pid)
        assert process.wait() == end and tree.ended(end) == told
