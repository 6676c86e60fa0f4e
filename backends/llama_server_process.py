"""A llama-server child process (found and read by crossrt.backends.llama_tools): start it
on a free local port, wait until it is healthy, talk HTTP to it, stop it.

The child never outlives crossrt: it runs in its own session (a terminal's Ctrl-C reaches only
crossrt, which then stops it in order), the kernel sends it SIGKILL if crossrt dies
(PR_SET_PDEATHSIG: strictly, when the thread that started it ends, so start servers from a
thread that lives as long as they do), and every error path while starting stops it before
raising. Every failure carries the tail of the server's log, which is kept in a file.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Optional, Sequence

from crossrt.backends.llama_tools import BUILD_BIN, find_tool, log_tail
from crossrt.records.journal import storage_error
from crossrt.run.processes import ProcessTree, die_with_parent
from crossrt.run.runtime import RuntimeFailure

BUILT_EXECUTABLE = BUILD_BIN / "llama-server"
HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 120.0  # loading a large model from a cold disk takes a while
# A request may take REQUEST_BASE_S plus REQUEST_S_PER_TOKEN per token of its work (a slow CPU
# runs a large model at well under a token a second); a dead server is noticed at once anyway,
# and a hung one (stopped, deadlocked) by its silence to /health probes while the request waits.
REQUEST_BASE_S = 60.0
REQUEST_S_PER_TOKEN = 2.0
HEALTH_PROBE_S = 5.0  # between probes, and each probe's own timeout
HEALTH_MISSES = 3  # probes in a row without an answer: the server is hung
STOP_TIMEOUT_S = 10.0
PORT_ATTEMPTS = 3


class PortInUse(RuntimeFailure):
    """llama-server could not bind its port (another process took it)."""


class ServerError(Exception):
    """llama-server answered a request with an HTTP error status."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def find_executable(explicit: Optional[Path] = None) -> Optional[Path]:
    """The llama-server to run: explicit if given, else the repository's build, else PATH."""
    return find_tool("llama-server", explicit)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe_socket:
        probe_socket.bind((HOST, 0))
        return probe_socket.getsockname()[1]


class ServerProcess:
    """One running llama-server. Start it with ServerProcess.start(); stop() is idempotent."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: Path, log_file):
        self.process = process
        self.tree = ProcessTree(process.pid)  # its memory, and how it ended
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
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = open(log_path, "w")
        except OSError as error:
            raise storage_error(log_path, error) from None
        argv = [str(executable), *args, "--host", HOST, "--port", str(port)]
        log_file.write("$ " + " ".join(argv) + "\n")
        log_file.flush()
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True,
                                   preexec_fn=partial(die_with_parent, os.getpid()))
        server = cls(process, port, log_path, log_file)
        try:
            server._wait_healthy(health_timeout_s)
        except BaseException:  # Ctrl-C while loading too: never leave the child behind
            server.stop()
            raise
        return server

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        sampled = 0.0
        while True:
            if time.monotonic() - sampled >= 1.0:
                self.tree.sample()
                sampled = time.monotonic()
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
        ended = self.tree.ended(self.process.returncode, during=" while starting")
        raise RuntimeFailure(f"llama-server (pid {self.pid}) {ended}{tail}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail_text(self) -> str:
        return f"\n--- {self.log_path} (last lines) ---\n{log_tail(self.log_path, 15)}"

    def failure(self, what: str) -> RuntimeFailure:
        """A RuntimeFailure for a request that broke, saying whether the server is gone."""
        try:
            code = self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            state = "stopped by a signal" if self._stopped() else "still running"
        else:
            state = self.tree.ended(code).removeprefix("was ")
        return RuntimeFailure(f"llama-server (pid {self.pid}, {state}): {what}{self.log_tail_text()}")

    def _stopped(self) -> bool:
        """The process is stopped (SIGSTOP, SIGTSTP), as /proc tells where there is one."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")

    def _request(self, method: str, path: str, body: Any = None, timeout: float = REQUEST_BASE_S):
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body)
            headers = {} if body is None else {"Content-Type": "application/json"}
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def _watched_request(self, method: str, path: str, body: Any, timeout: float):
        """_request in a worker thread while this one probes /health (answered by the server's
        HTTP threads while a slot generates): a server that stops answering is a RuntimeFailure
        after HEALTH_MISSES probes, not a wait of the whole timeout."""
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                outcome["answer"] = self._request(method, path, body, timeout)
            except BaseException as error:  # handed to the caller's thread
                outcome["error"] = error

        worker = threading.Thread(target=work, name=f"llama-server {method} {path}", daemon=True)
        worker.start()
        misses = 0
        while True:
            worker.join(HEALTH_PROBE_S)
            if not worker.is_alive():
                break
            self.tree.sample()
            try:
                status, _ = self._request("GET", "/health", timeout=HEALTH_PROBE_S)
            except (OSError, http.client.HTTPException):
                status = None
            misses = 0 if status == 200 else misses + 1
            if misses >= HEALTH_MISSES:
                raise self.failure(f"{method} {path}: no answer to {misses} /health probes in a row "
                                   f"({HEALTH_PROBE_S:g} s each): the server is hung")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["answer"]

    def call(self, method: str, path: str, body: Any = None, work_tokens: int = 0) -> bytes:
        """The body of a successful request; ServerError for an error status, RuntimeFailure
        when the server cannot be reached (it died, hung, or did not answer within the time
        work_tokens tokens of work may take)."""
        timeout = REQUEST_BASE_S + REQUEST_S_PER_TOKEN * work_tokens
        try:
            status, data = self._watched_request(method, path, body, timeout)
        except TimeoutError:
            raise self.failure(f"{method} {path}: no answer within {timeout:g} s") from None
        except (OSError, http.client.HTTPException) as error:
            raise self.failure(f"{method} {path} failed: {error!r}") from None
        if status != 200:
            try:
                message = json.loads(data)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = data.decode("utf-8", errors="replace")[:500]
            raise ServerError(status, message)
        return data

    def call_json(self, method: str, path: str, body: Any = None, work_tokens: int = 0) -> Any:
        data = self.call(method, path, body, work_tokens)
        try:
            return json.loads(data)
        except ValueError:
            raise self.failure(f"{method} {path} answered with non-JSON: {data[:200]!r}") from None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.send_signal(signal.SIGCONT)  # a stopped server acts on SIGTERM only once continued
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()
