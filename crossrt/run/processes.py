"""How a child process crossrt started ended, told as it happened.

A runtime's process (a llama-server, a vLLM worker) that the kernel's out-of-memory killer ends
is otherwise reported as its exit code, or as that of a parent that exits when a process under
it is killed. ProcessTree samples
the process and its descendants while crossrt waits on them (what they hold, which are alive,
the kernel's count of OOM kills), so that the end can be named: the signal, the process it
reached, and the kernel's out-of-memory killer where its count rose meanwhile (its victims are
always killed by SIGKILL), with the memory held and free just before. die_with_parent makes a
child end with crossrt.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
from pathlib import Path
from typing import Optional

from crossrt.run.memory import gib

PR_SET_PDEATHSIG = 1
# Loaded before any fork: a child only calls into it between fork and exec.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this process (SIGKILL) when parent ends, or end it now if parent already
    has: a child's first act (a preexec_fn, or right after a fork), so it never runs orphaned."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def oom_kills() -> Optional[int]:
    """Processes the kernel's out-of-memory killer has killed since boot (/proc/vmstat oom_kill,
    Linux 4.13 on), or None where it cannot be read."""
    try:
        match = re.search(r"^oom_kill (\d+)$", Path("/proc/vmstat").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _alive_descendants(root: int) -> dict[int, str]:
    """pid -> name of root and every process under it that has not exited (zombies excluded)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        rest = stat[stat.rindex(")") + 1:].split()
        if rest[0] != "Z":
            names[int(entry)] = stat[stat.index("(") + 1:stat.rindex(")")]
            children.setdefault(int(rest[1]), []).append(int(entry))
    found, todo = {}, [root] if root in names else []
    while todo:
        pid = todo.pop()
        found[pid] = names[pid]
        todo += children.get(pid, [])
    return found


def _mem_available() -> int:
    """The machine's MemAvailable (not CROSSRT_MEMORY_LIMIT: the kernel acts on what is there)."""
    try:
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)[1]) * 1024
    except (OSError, TypeError):
        return 0


def _held(pid: int) -> int:
    """Bytes pid holds that the kernel cannot reclaim (RssAnon + RssShmem: the OOM killer's count)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return sum(int(kb) * 1024 for kb in re.findall(r"^Rss(?:Anon|Shmem):\s+(\d+) kB", status, re.MULTILINE))


class ProcessTree:
    """A child process and the processes under it, sampled while crossrt waits on it."""

    def __init__(self, pid: int):
        self.pid = pid
        self._oom_start = oom_kills()
        self._alive: dict[int, tuple[str, int]] = {}  # pid -> (name, bytes held) at the last sample
        self._before_oom = (0, 0)  # (bytes the tree held, RAM free) at the last sample before an OOM kill
        self._victim: Optional[tuple[str, int]] = None  # (name, pid): the first to vanish after an OOM kill

    def _oom_rose(self) -> bool:
        now = oom_kills()
        return None not in (now, self._oom_start) and now > self._oom_start

    def sample(self, exited: bool = False) -> None:
        """exited: the process itself has exited by itself (so it is not the OOM killer's victim)."""
        alive = {pid: (name, _held(pid)) for pid, name in _alive_descendants(self.pid).items()}
        if not self._oom_rose():
            self._before_oom = (sum(held for _, held in alive.values()), _mem_available())
        elif self._victim is None:
            # The OOM killer's victim is the process holding the most, and its SIGKILL leaves the
            # others running a moment longer: the largest of the first to vanish.
            gone = [(held, name, pid) for pid, (name, held) in self._alive.items()
                    if pid not in alive and not (exited and pid == self.pid)]
            if gone:
                _, name, pid = max(gone)
                self._victim = (name, pid)
        self._alive = alive

    def ended(self, returncode: int, during: str = "") -> str:
        """How the process ended, to follow its name: "was killed by SIGKILL{during}: the kernel's
        out-of-memory killer (...)", or "exited with 1{during}" (during: " while loading", ...)."""
        self.sample(exited=returncode >= 0)
        number, who = None, ""
        if returncode < 0:
            number = -returncode
        elif self._victim is not None:
            number, who = signal.SIGKILL, f" (its process {self._victim[0]}, pid {self._victim[1]})"
        if number is None:
            return f"exited with {returncode}{during}"
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        killed = f"was killed by {name}{who}{during}"
        if number != signal.SIGKILL or None in (oom_kills(), self._oom_start):
            return killed
        if self._oom_rose():
            held, free = self._before_oom
            return f"{killed}: the kernel's out-of-memory killer ({gib(held)} in use by its processes, {gib(free)} free)"
        return f"{killed} (not by the kernel's out-of-memory killer: its count did not change)"
