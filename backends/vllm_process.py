"""One vLLM engine in a process of vLLM's own environment (.venv-vllm), spoken to in JSON lines:
the parent's side of backends/vllm_worker.py, which runs there (backends/vllm.py starts two).

Each worker is forked by this process's vLLM zygote (backends/vllm_zygote.py: torch,
transformers and vLLM imported once, ~8 CPU-s, kept while this process lives), so that an engine
costs its build alone; where the zygote cannot fork (it died, it is not one thread), or with
CROSSRT_VLLM_ZYGOTE=0, the worker starts on its own, importing everything itself. Either way it
is read the same: its pid, stdin, stdout, exit status (ForkedWorker reads the zygote's reports
like subprocess.Popen)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time
from functools import partial
from pathlib import Path
from typing import Optional

from crossrt.run.processes import ProcessTree, die_with_parent
from crossrt.run.runtime import RuntimeFailure
from crossrt.run.zygote import IMPORT_TIME, KeptZygotes
from crossrt.backends.llama_tools import log_tail
from crossrt.backends.vllm_memory import KV_CACHE_GIB

VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
WORKER = Path(__file__).with_name("vllm_worker.py")
ZYGOTE = Path(__file__).with_name("vllm_zygote.py")
ZYGOTE_ENV = "CROSSRT_VLLM_ZYGOTE"  # "0": every worker starts on its own
# Loading imports torch and vLLM (~8 CPU-s) and loads the weights: minutes on a busy 2-core machine.
LOAD_TIMEOUT_S = 900.0
LOG_TAIL_LINES = 30
MESSAGE_BYTES = 1 << 22
# Besides IMPORT_TIME's prefixes, what torch, transformers or vLLM read when they load (cache
# folders, the temporary folder): a zygote serves workers whose values are its own.
READ_AT_IMPORT = ("HOME", "TMPDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")
KEPT = 2  # zygotes one process keeps (each holds its imports resident: ~0.5 GiB)


class Zygote:
    """The parent's side of one backends/vllm_zygote.py, started with the workers' environment."""

    def __init__(self, environment: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen([str(PYTHON), str(ZYGOTE), str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, env=environment,
                                        preexec_fn=partial(die_with_parent, os.getpid()))
        theirs.close()
        self._control = ours
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self.running: set[int] = set()
        self._alive = True
        self.usable = True
        self._requests = 0

    def fork(self, config: dict, environment: dict, fds: list[int]) -> Optional[int]:
        """A child running the worker's main on config with fds as its stdin, stdout and stderr
        (the caller's to close); None where the zygote cannot (it died, hung, or is not one thread)."""
        with self._lock:
            self._requests += 1  # a reply to an earlier request (one interrupted while waiting) is not this one's
            try:
                socket.send_fds(self._control, [json.dumps({"op": "fork", "id": self._requests, "config": config,
                                                            "environ": environment, "cwd": os.getcwd()}).encode()],
                                fds)
                deadline = time.monotonic() + LOAD_TIMEOUT_S  # its first fork waits for its imports
                while True:
                    message = self._receive(deadline - time.monotonic())
                    if message is None or message.get("id") == self._requests and "unsafe" in message:
                        break
                    if message.get("id") == self._requests and "forked" in message:
                        self.running.add(message["forked"])
                        return message["forked"]
            except OSError:
                pass
            # It died, hung or is not one thread: it forks no more, and is closed once its running
            # children have ended (closing it kills them).
            self.usable = False
        return None

    def _receive(self, timeout: Optional[float]) -> Optional[dict]:
        """One message (an exit is kept for exit_code); None when none came within timeout, or the
        zygote has gone (then _alive is False)."""
        if not self._alive:
            return None
        try:
            self._control.settimeout(None if timeout is None else max(0.0, timeout))
            message = self._control.recv(MESSAGE_BYTES)
        except (BlockingIOError, socket.timeout):
            return None
        except OSError:
            message = b""
        if not message:
            self._alive = False
            return None
        message = json.loads(message)
        if "exit" in message:
            self._exits[message["exit"][0]] = message["exit"][1]
        return message

    def exit_code(self, pid: int, timeout: Optional[float]) -> Optional[int]:
        """The child's exit code (negative: its signal) once it ended, else None after timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                if not self._alive:  # its children die with it (the parent-death signal)
                    self.running.discard(pid)
                    return -signal.SIGKILL
                if self._receive(None if deadline is None else deadline - time.monotonic()) is None \
                        and self._alive and deadline is not None and time.monotonic() >= deadline:
                    return None
            self.running.discard(pid)
            return self._exits.pop(pid)

    @property
    def alive(self) -> bool:
        return self._alive and self.usable and self.process.poll() is None

    def close(self) -> None:
        """Kill it (it holds nothing but imports) and, with it, its children."""
        self._alive = False
        self._control.close()
        self.process.kill()
        self.process.wait()


class ForkedWorker:
    """A zygote's child, read like subprocess.Popen: pid, stdin, stdout, poll(), wait(), kill()."""

    def __init__(self, zygote: Zygote, pid: int, stdin, stdout):
        self._zygote, self.pid, self.stdin, self.stdout = zygote, pid, stdin, stdout
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"vLLM worker {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # ended since: wait() reads how
                pass


worker_zygotes = KeptZygotes(KEPT)


def _key(environment: dict) -> tuple:
    # By thread too: the kernel kills a zygote when the thread that started it ends.
    read = sorted((name, value) for name, value in environment.items()
                  if name.startswith(IMPORT_TIME) or name in READ_AT_IMPORT)
    return threading.get_ident(), tuple(read)


def _zygote_for(environment: dict) -> Zygote:
    return worker_zygotes.get(_key(environment), lambda: Zygote(environment))


def start(config: dict, environment: dict, stderr) -> tuple[subprocess.Popen | ForkedWorker, Optional[Zygote]]:
    """The worker for config, forked by this process's zygote for environment (started if there is
    none), else started on its own; and the zygote that forked it."""
    if environment.get(ZYGOTE_ENV, "1") != "0":
        zygote = _zygote_for(environment)
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        pid = None
        try:
            pid = zygote.fork(config, environment, [stdin_read, stdout_write, stderr.fileno()])
        finally:
            os.close(stdin_read)
            os.close(stdout_write)
            if pid is None:  # a child forked meanwhile (an interrupt) reads the end of its stdin once loaded
                os.close(stdin_write)
                os.close(stdout_read)
        if pid is not None:
            return ForkedWorker(zygote, pid, open(stdin_write, "wb"), open(stdout_read, "rb")), zygote
    return subprocess.Popen([str(PYTHON), str(WORKER), json.dumps(config)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, env=environment,
                            preexec_fn=partial(die_with_parent, os.getpid())), None


class Worker:
    """One vLLM engine in a process of vLLM's environment, spoken to in JSON lines."""

    def __init__(self, name: str, config: dict, log: Path, threads: int):
        self.name = name  # "baseline engine", "speculative engine": for messages
        environment = dict(os.environ)
        # One engine process computing on `threads` cores, not bound to any (a shared machine).
        environment.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads),
                            "VLLM_CPU_KVCACHE_SPACE": environment.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB),
                            "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        # vLLM warns that speculative decoding without Intel OpenMP preloaded is much slower;
        # the wheel installs it into the environment's lib/.
        iomp = VENV / "lib" / "libiomp5.so"
        if iomp.is_file():
            environment["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD")]))
        self._log = log
        self._log_file = open(log, "wb")
        self._process, self._zygote = start(config, environment, self._log_file)
        self._tree = ProcessTree(self._process.pid)  # its engine processes, sampled while it is waited on
        self._loaded = False

    def wait_ready(self) -> dict:
        """The worker's first line: versions, system_info and load time, once vLLM has loaded."""
        ready = self._reply(LOAD_TIMEOUT_S, "loading")
        self._loaded = True
        return ready

    def _reply(self, timeout: float, doing: str) -> dict:
        # select sees the pipe, not the reader's buffer: safe because the worker writes exactly
        # one line per request, so no second line can wait in the buffer unseen.
        deadline = time.monotonic() + timeout
        stdout = self._process.stdout
        while True:
            self._tree.sample()
            ready, _, _ = select.select([stdout], [], [], max(0.0, min(0.5, deadline - time.monotonic())))
            if ready:
                line = stdout.readline()
                if line:
                    reply = json.loads(line)
                    if "error" in reply:
                        raise RuntimeFailure(f"vLLM failed {doing}: {reply['error']}; log {self._log}")
                    return reply
            if self._process.poll() is not None or (ready and not line):
                code, tail = self._process.wait(), log_tail(self._log, LOG_TAIL_LINES)
                raise RuntimeFailure(f"vLLM's {self.name} {self._tree.ended(code, f' while {doing}')}; log "
                                     f"{self._log}:\n{tail}")
            if time.monotonic() >= deadline:
                raise RuntimeFailure(f"vLLM did not answer within {timeout:g} s while {doing}: hung; log {self._log}")

    def ask(self, request: dict, timeout: float, doing: str) -> dict:
        try:
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # _reply reports the exit, with the log
        return self._reply(timeout, doing)

    def stop(self) -> None:
        """Ask the worker to end (its loop ends; vLLM shuts its engine down) without waiting."""
        if self._process.poll() is None and not self._process.stdin.closed:
            try:
                self._process.stdin.close()
            except BrokenPipeError:
                pass  # it ended already: close() waits for it

    def close(self) -> None:
        if self._process.poll() is None:
            self.stop()
            try:
                # Still loading (the other engine failed, an interrupt), it has nothing to shut down
                # and reads its stdin only once loaded (~18 CPU-s on Gemma 3): killed at once.
                self._process.wait(timeout=30 if self._loaded else 0)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log_file.close()
