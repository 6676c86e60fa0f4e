"""One vLLM engine in a process of vLLM's own environment (.venv-vllm), spoken to in JSON lines:
the parent's side of backends/vllm_worker.py, which runs there (backends/vllm.py starts two)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from functools import partial
from pathlib import Path

from crossrt.run.processes import ProcessTree, die_with_parent
from crossrt.run.runtime import RuntimeFailure
from crossrt.backends.llama_tools import log_tail
from crossrt.backends.vllm_memory import KV_CACHE_GIB

VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"
PYTHON = VENV / "bin" / "python"
WORKER = Path(__file__).with_name("vllm_worker.py")
# Loading imports torch and vLLM (~15 CPU-s) and loads the weights: minutes on a busy 2-core machine.
LOAD_TIMEOUT_S = 900.0
LOG_TAIL_LINES = 30


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
        self._process = subprocess.Popen([str(PYTHON), str(WORKER), json.dumps(config)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self._log_file, env=environment,
                                         preexec_fn=partial(die_with_parent, os.getpid()))
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
