"""Warm starts for runtime processes: a zygote that has imported once what a runtime's process
imports forks each new one, so it starts in milliseconds instead of seconds.

It loads no model and runs no kernel; it serves one parent, name (crossrt's runtimes share one:
isolation.ZYGOTE), sys.path and set of import-time variables (IMPORT_TIME), learns what its
children import, reaps them and reports their exit status (ForkedChild reads it like
subprocess.Popen), and dies with its parent.
Why and how: docs/reliability.md, "A runtime that crashes", the zygote's paragraph.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import traceback
from typing import Callable, Optional, Sequence

from crossrt.run.processes import die_with_parent

MESSAGE_BYTES = 1 << 20  # a request: a few paths and names, far below this
PRELOAD_CHUNK = 500  # module names per message: a datagram must fit the socket's send buffer
KEPT = 4  # zygotes one parent keeps (each with its imports resident: ~0.4 GiB with torch)
# Prefixes of the environment variables read when a library loads (OpenMP runtimes, BLAS, the
# dynamic loader, GPU runtimes, ggml and llama.cpp's binding, torch, Hugging Face, Python, vLLM,
# exllamav3) or at import by crossrt's backends (CROSSRT_LLAMA_*): part of a zygote's key.
IMPORT_TIME = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "NUMEXPR_", "NPY_", "LD_", "CUDA_", "HIP_", "ROCM_",
               "ROCR_", "HSA_", "GGML_", "LLAMA_", "TORCH", "PYTORCH_", "TRANSFORMERS_", "HF_", "TOKENIZERS_",
               "PYTHON", "VLLM_", "EXLLAMA", "CROSSRT_LLAMA_")
_interrupted = False  # a SIGINT reached this child (the zygote's own never does: no terminal sends to its group)


def note_interrupt(*_) -> None:
    """SIGINT's handler in the zygote, so that each child inherits it: a SIGINT that comes before
    the child's entry installs its own is kept, not lost."""
    global _interrupted
    _interrupted = True


def interrupted() -> bool:
    return _interrupted


def _import_all(names: Sequence[str]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # the child imports it again and meets the error where it matters
            pass


def serve() -> None:
    """The zygote: `python -c` runs this with the control socket's descriptor, the parent's pid,
    and JSON [sys.path, modules to import]; it forks a child per request until the parent closes
    the socket."""
    control = socket.socket(fileno=int(sys.argv[1]))
    die_with_parent(int(sys.argv[2]))
    path, modules = json.loads(sys.argv[3])
    sys.path[:] = path
    _import_all(modules)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wake-up pipe
    signal.signal(signal.SIGINT, note_interrupt)
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is control:
                message, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 8)
                if not message:  # the parent closed the socket (or died)
                    os._exit(0)
                kind, payload = pickle.loads(message)
                if kind == "preload":
                    _import_all(payload)
                else:
                    zygote = os.getpid()  # read here: in the child, getppid() is init once the zygote died
                    pid = os.fork()
                    if pid == 0:
                        selector.close()
                        for fd in (control.fileno(), wake_read, wake_write):
                            os.close(fd)
                        _child(zygote, fds, *payload)
                    for fd in fds:
                        os.close(fd)
                    control.send(pickle.dumps(("forked", pid)))
            else:
                os.read(wake_read, 4096)
        _reap(control)


def _reap(control: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        control.send(pickle.dumps(("exit", (pid, os.waitstatus_to_exitcode(status)))))


def _child(zygote: int, fds: list[int], entry: str, args: tuple, environment: dict, folder: str) -> None:
    """In the forked child of the zygote (its pid): the caller's stdout and stderr (fds[0],
    fds[1]), environment and working folder as its own, then entry ("module:function") called
    with the other descriptors and args; never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # A fork does not inherit the parent-death signal; a zygote killed before this line leaves the
    # child orphaned already, which die_with_parent sees by the pid the zygote read before forking.
    die_with_parent(zygote)
    code = 0
    try:
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        os.close(fds[0])
        os.close(fds[1])
        os.environ.clear()
        os.environ.update(environment)
        os.chdir(folder)
        module, function = entry.split(":")
        getattr(importlib.import_module(module), function)(*fds[2:], *args)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)  # never the zygote's loop, atexit handlers or finally blocks


class Zygote:
    """The parent's side of one zygote."""

    def __init__(self, modules: Sequence[str]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.modules = set(modules)
        self._learned: list[str] = []  # imported by children, sent to the zygote with the next fork
        # A process group of its own, as each child: a terminal's Ctrl-C reaches the parent alone.
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from crossrt.run.zygote import serve; serve()", str(theirs.fileno()),
             str(os.getpid()), json.dumps([sys.path, sorted(self.modules)])],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, process_group=0)
        theirs.close()
        self._control = ours
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self.running: set[int] = set()  # children not yet reported ended: closing would kill them
        self._alive = True

    def fork(self, fds: Sequence[int], entry: str, *args) -> "ForkedChild":
        """A child calling entry(*fds[2:], *args) with the caller's fds[0] and fds[1] as stdout and
        stderr (the fds are the caller's to close), its environment and working folder; a dead
        zygote raises OSError."""
        with self._lock:
            for start in range(0, len(self._learned), PRELOAD_CHUNK):
                self._control.send(pickle.dumps(("preload", self._learned[start:start + PRELOAD_CHUNK])))
            self._learned = []
            request = ("fork", (entry, args, dict(os.environ), os.getcwd()))
            socket.send_fds(self._control, [pickle.dumps(request)], list(fds))
            while True:
                kind, payload = self._receive()
                if kind == "forked":
                    self.running.add(payload)
                    return ForkedChild(self, payload)
                if kind == "gone":
                    raise OSError(f"crossrt's zygote (pid {self.process.pid}) died before it forked")

    def preload(self, modules: Sequence[str]) -> None:
        """Have the zygote import modules a child imported before it forks the next child."""
        with self._lock:
            new = sorted(set(modules) - self.modules)
            self.modules.update(new)
            self._learned += new

    def _receive(self, block: bool = True) -> tuple:
        """One message; ("exit", (pid, code)) is kept for exit_code. ("gone", None) when the zygote
        has died: its children died with it, by SIGKILL (the parent-death signal)."""
        if not self._alive:
            return "gone", None
        try:
            message = self._control.recv(MESSAGE_BYTES, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return "none", None
        except OSError:
            message = b""
        if not message:
            self._alive = False
            return "gone", None
        kind, payload = pickle.loads(message)
        if kind == "exit":
            self._exits[payload[0]] = payload[1]
        return kind, payload

    def exit_code(self, pid: int, block: bool) -> Optional[int]:
        """The child's exit code (negative: its signal) once it ended, else None (block: wait)."""
        with self._lock:
            while pid not in self._exits:
                kind, _ = self._receive(block)
                if kind == "gone":
                    self.running.discard(pid)
                    return -signal.SIGKILL
                if kind == "none":
                    return None
            self.running.discard(pid)
            return self._exits.pop(pid)

    @property
    def alive(self) -> bool:
        return self._alive and self.process.poll() is None

    def close(self) -> None:
        """Kill it (it holds nothing but imports: there is nothing to wait for) and its children."""
        self._alive = False
        self._control.close()
        self.process.kill()
        self.process.wait()


class ForkedChild:
    """A zygote's child, read like subprocess.Popen: pid, poll(), wait(), returncode, signals."""

    def __init__(self, zygote: Zygote, pid: int):
        self._zygote, self.pid = zygote, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, block=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, block=True)
        return self.returncode

    def send_signal(self, number: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, number)
            except ProcessLookupError:  # ended since: wait() reads how
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class KeptZygotes:
    """The zygotes one process keeps, by key, most recently used last; crossrt's runtimes' and
    vLLM's workers' (backends/vllm_process.py) alike. A zygote found no longer alive is retired and
    closed once its children have ended (closing kills them); the least recently used idle ones
    beyond kept are closed; at exit the process closes its own (a forked child inherits this
    object, not the zygotes)."""

    def __init__(self, kept: int):
        self.kept = kept
        self._held: dict[tuple, object] = {}  # (pid, key) -> zygote
        self._retired: list[tuple[int, object]] = []  # (pid, zygote)
        atexit.register(self.close_all)

    def get(self, key: tuple, start: Callable[[], object]):
        """The zygote kept for key, started by start() if there is none alive."""
        pid = os.getpid()
        key = (pid, *key)
        zygote = self._held.pop(key, None)
        if zygote is not None and not zygote.alive:
            self._retired.append((pid, zygote))
            zygote = None
        for retired in [entry for entry in self._retired if entry[0] == pid and not entry[1].running]:
            self._retired.remove(retired)
            retired[1].close()
        self._held[key] = zygote = zygote or start()
        # Only this process's own: a forked child sees its parent's entries and must not close them.
        own = [other for other in self._held if other[0] == pid]
        idle = [other for other in own if other != key and not self._held[other].running]
        for other in idle[:max(0, len(own) - self.kept)]:
            self._held.pop(other).close()
        return zygote

    def close_all(self) -> None:
        for key in [key for key in self._held if key[0] == os.getpid()]:
            self._held.pop(key).close()
        for retired in [entry for entry in self._retired if entry[0] == os.getpid()]:
            self._retired.remove(retired)
            retired[1].close()


process_zygotes = KeptZygotes(KEPT)


def _key(name: str) -> tuple:
    read_at_import = sorted((key, value) for key, value in os.environ.items() if key.startswith(IMPORT_TIME))
    return name, tuple(sys.path), tuple(read_at_import)


def zygote_for(name: str, modules: Sequence[str]) -> Zygote:
    """This process's zygote for name under the current import-time environment, started with
    modules imported if there is none yet (KeptZygotes keeps KEPT); a kept one imports those of
    modules it has not before its next child (another runtime's backend, when several share it)."""
    zygote = process_zygotes.get(_key(name), lambda: Zygote(modules))
    zygote.preload(modules)
    return zygote
