"""A llama-server child process: find the executable, read its version and flag names, start it
on a free local port, wait until it is healthy, talk HTTP to it, stop it.

The child never outlives crossrt: it runs in its own session (a terminal's Ctrl-C reaches only
crossrt, which then stops it in order), the kernel sends it SIGKILL if crossrt dies
(PR_SET_PDEATHSIG: strictly, when the thread that started it ends, so start servers from a
thread that lives as long as they do), and every error path while starting stops it before
raising. Every failure carries the tail of the server's log, which is kept in a file.
"""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Sequence

from crossrt.runtime import RuntimeFailure, RuntimeUnavailable

REPO = Path(__file__).resolve().parents[1]
BUILT_EXECUTABLE = REPO / ".cache" / "llama-tools" / "build" / "bin" / "llama-server"
VENDORED_COMMIT = "0c1e57098"  # what scripts/build_llama_tools builds (llama-cpp-python 0.3.36's tree)
HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 120.0  # loading a large model from a cold disk takes a while
REQUEST_TIMEOUT_S = 3600.0  # one long generation on a CPU; a dead server is noticed at once anyway
STOP_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 3
PR_SET_PDEATHSIG = 1

# Loaded before any fork: the child only calls into it between fork and exec.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class PortInUse(RuntimeFailure):
    """llama-server could not bind its port (another process took it)."""


class ServerError(Exception):
    """llama-server answered a request with an HTTP error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def find_executable(explicit: Optional[Path] = None) -> Optional[Path]:
    """The executable to run: explicit if given, else the repository's build, else PATH."""
    if explicit is not None:
        return Path(explicit) if Path(explicit).is_file() and os.access(explicit, os.X_OK) else None
    if BUILT_EXECUTABLE.is_file() and os.access(BUILT_EXECUTABLE, os.X_OK):
        return BUILT_EXECUTABLE
    found = shutil.which("llama-server")
    return Path(found) if found else None


def _has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", help_text, re.M) is not None


@dataclass(frozen=True)
class Flags:
    """Flag names of one build: the draft options were renamed (--draft-max -> --spec-draft-n-max,
    ...), builds with the new names also need --spec-type to draft at all, and -fa took a value."""

    n_max: str
    n_min: str
    p_min: str
    spec_type: Optional[str]
    no_ui: Optional[str]
    cache_ram: Optional[str]
    flash_attn_takes_value: bool

    @classmethod
    def from_help(cls, text: str) -> "Flags":
        new = "--spec-draft-n-max" in text
        if not new and "--draft-max" not in text:
            raise RuntimeUnavailable("this llama-server has no draft-model flags "
                                     "(neither --spec-draft-n-max nor --draft-max in --help)")
        return cls(
            n_max="--spec-draft-n-max" if new else "--draft-max",
            n_min="--spec-draft-n-min" if new else "--draft-min",
            p_min="--spec-draft-p-min" if new else "--draft-p-min",
            spec_type="--spec-type" if _has_flag(text, "--spec-type") else None,
            no_ui="--no-webui" if _has_flag(text, "--no-webui") else None,
            cache_ram="--cache-ram" if _has_flag(text, "--cache-ram") else None,
            flash_attn_takes_value=re.search(r"--flash-attn \[on\|off", text) is not None,
        )


@dataclass(frozen=True)
class Build:
    path: Path
    version: str  # e.g. "0.5.0-dev"
    commit: Optional[str]  # None when the build does not know it (a source tree without git)
    flags: Flags


@lru_cache(maxsize=8)
def probe(path: Path) -> Build:
    """Version, commit and flag names of the executable at path (`--version`, `--help`)."""
    outputs = []
    for flag in ("--version", "--help"):
        try:
            done = subprocess.run([str(path), flag], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeUnavailable(f"cannot run {path} {flag}: {error}") from None
        outputs.append(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeUnavailable(f"{path} {flag} exited with {done.returncode}: {outputs[-1][-500:]}")
    # New builds print "version: 0.5.0-dev (build 0, commit unknown)", old ones "version: 4567 (abcdef12)".
    match = re.search(r"version: (\S+)(?: \((?:build \S+, )?(?:commit )?([0-9a-f]{7,40}|unknown)\))?", outputs[0])
    if match is None:
        raise RuntimeUnavailable(f"{path} --version printed no version: {outputs[0][-300:]!r}")
    commit = match.group(2) if match.group(2) not in (None, "unknown") else None
    if commit is None and path.resolve() == BUILT_EXECUTABLE.resolve():
        commit = VENDORED_COMMIT  # built here from a source tree that carries no git metadata
    return Build(path, match.group(1), commit, Flags.from_help(outputs[1]))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe_socket:
        probe_socket.bind((HOST, 0))
        return probe_socket.getsockname()[1]


def _die_with_parent(parent_pid: int):
    """preexec_fn: have the kernel kill the child when its parent dies; if the parent died
    before prctl took effect, give up at once rather than run orphaned."""
    def preexec() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent_pid:
            os._exit(1)
    return preexec


class ServerProcess:
    """One running llama-server. Start it with ServerProcess.start(); stop() is idempotent."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: Path, log_file):
        self.process = process
        self.port = port
        self.log_path = log_path
        self._log_file = log_file

    @classmethod
    def start(cls, executable: Path, args: Sequence[str], log_path: Path, port: Optional[int] = None,
              health_timeout_s: float = HEALTH_TIMEOUT_S) -> "ServerProcess":
        """Start executable with args on HOST and wait for /health. With no port, free ports are
        tried until one binds (another process can take a port between the check and the bind)."""
        attempts = 1 if port is not None else PORT_ATTEMPTS
        for attempt in range(attempts):
            chosen = port if port is not None else free_port()
            try:
                return cls._start_once(executable, args, log_path, chosen, health_timeout_s)
            except PortInUse:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(cls, executable: Path, args: Sequence[str], log_path: Path, port: int,
                    health_timeout_s: float) -> "ServerProcess":
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "w")
        argv = [str(executable), *args, "--host", HOST, "--port", str(port)]
        log_file.write("$ " + " ".join(argv) + "\n")
        log_file.flush()
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   preexec_fn=_die_with_parent(os.getpid()) if _LIBC is not None else None)
        server = cls(process, port, log_path, log_file)
        try:
            server._wait_healthy(health_timeout_s)
        except BaseException:  # Ctrl-C while loading too: never leave the child behind
            server.stop()
            raise
        return server

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                self._raise_exited()
            if time.monotonic() >= deadline:
                raise RuntimeFailure(f"llama-server (pid {self.process.pid}) was not healthy within "
                                     f"{timeout_s:g} s{self.log_tail_text()}")
            try:
                status, _ = self._request("GET", "/health", timeout=0.5)
            except OSError:  # not listening yet
                status = None
            if status == 200:
                return
            time.sleep(0.05)  # 503 while the model loads

    def _raise_exited(self) -> None:
        tail = self.log_tail_text()
        if "couldn't bind" in tail:
            raise PortInUse(f"llama-server could not bind {HOST}:{self.port} (port in use){tail}")
        raise RuntimeFailure(f"llama-server exited with code {self.process.returncode} while starting{tail}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 8192))
                text = log.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_tail_text(self) -> str:
        return f"\n--- {self.log_path} (last lines) ---\n{self.log_tail()}"

    def failure(self, what: str) -> RuntimeFailure:
        """A RuntimeFailure for a request that broke, saying whether the server is gone."""
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            state = "still running"
        else:
            state = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return RuntimeFailure(f"llama-server (pid {self.pid}, {state}): {what}{self.log_tail_text()}")

    def _request(self, method: str, path: str, body: Any = None, timeout: float = REQUEST_TIMEOUT_S):
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body)
            headers = {} if body is None else {"Content-Type": "application/json"}
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def call(self, method: str, path: str, body: Any = None) -> bytes:
        """The body of a successful request; ServerError for an error status, RuntimeFailure
        when the server cannot be reached (it died, or never answered)."""
        try:
            status, data = self._request(method, path, body)
        except (OSError, http.client.HTTPException) as error:
            raise self.failure(f"{method} {path} failed: {error!r}") from None
        if status != 200:
            try:
                message = json.loads(data)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = data.decode("utf-8", errors="replace")[:500]
            raise ServerError(status, message)
        return data

    def call_json(self, method: str, path: str, body: Any = None) -> Any:
        data = self.call(method, path, body)
        try:
            return json.loads(data)
        except ValueError:
            raise self.failure(f"{method} {path} answered with non-JSON: {data[:200]!r}") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()
