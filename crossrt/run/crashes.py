"""A runtime's child process that died, read: which signal, where, and what that means.

A child of crossrt/run/isolation.py that dies by a signal leaves its exit status and the stack
Python's faulthandler wrote. crash_of reads them into a RuntimeCrashed: one line naming the
runtime, the signal (SIGKILL told apart by the kernel's out-of-memory count), the innermost
Python frame outside crossrt (the binding's call into native code) and the crossrt call it came
from.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import crossrt
from crossrt.run.runtime import RuntimeFailure

# What SIGKILL means, by whether the kernel's OOM-kill count (/proc/vmstat) rose while the child ran
# (its victims are always killed by SIGKILL; None: the count cannot be read here).
KILLED = {True: "killed by the kernel's out-of-memory killer",
          False: "killed, not by the kernel's out-of-memory killer: its count did not change",
          None: "killed: out of memory, or by a user"}
# faulthandler's frame line: `  File "/path/module.py", line 12 in function`
_FRAME = re.compile(r'^\s*File "(?P<path>.+)", line (?P<line>\d+) in (?P<function>\S+)')


# crossrt's own source folders (backends/ is installed as crossrt.backends from a folder of its own),
# by the name their frames are shown with.
_OURS = {"crossrt/backends/": Path(importlib.util.find_spec("crossrt.backends").submodule_search_locations[0]),
         "crossrt/": Path(crossrt.__file__).parent}


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    def _ours(self) -> Optional[str]:
        """The path as crossrt/... when the frame is crossrt's own code, else None."""
        for name, folder in _OURS.items():
            if self.path.startswith(str(folder) + os.sep):
                return name + self.path[len(str(folder)) + 1:]
        return None

    @property
    def in_crossrt(self) -> bool:
        return self._ours() is not None

    @property
    def in_backend(self) -> bool:
        return (self._ours() or "").startswith("crossrt/backends/")

    def short(self) -> str:
        """`crossrt/backends/llama_cpp.py:212 _forward`, `llama_cpp/_internals.py:310 decode`: the
        path from its package on (after site-packages/ or the standard library's folder)."""
        path = self._ours() or self.path
        if "/site-packages/" in path:
            path = path.rsplit("/site-packages/", 1)[1]
        elif re.search(r"/lib/python[\d.]+/", path):
            path = re.split(r"/lib/python[\d.]+/", path)[-1]
        return f"{path}:{self.line} {self.function}"


def crashed_stack(dump: str) -> list[Frame]:
    """The faulting thread's frames, innermost first, from faulthandler's dump (empty if none)."""
    blocks = dump.split("\n\n")
    current = [b for b in blocks if "Current thread" in b or "Stack (most recent call first)" in b]
    lines = (current[0] if current else "").splitlines()
    return [Frame(m["path"], int(m["line"]), m["function"]) for m in map(_FRAME.match, lines) if m]


class RuntimeCrashed(RuntimeFailure):
    """A runtime's process died by a signal (or exited without an answer): one line naming the
    runtime, the signal, the call outside crossrt it died in and the crossrt call that made it."""

    def __init__(self, runtime: str, signal_name: Optional[str], native: Optional[str] = None,
                 frame: Optional[str] = None, detail: str = "", exit_code: Optional[int] = None,
                 out_of_memory: Optional[bool] = None):
        self.runtime, self.signal_name, self.native, self.frame = runtime, signal_name, native, frame
        # For SIGKILL: whether the kernel's OOM-kill count rose while the child ran (None: unknown).
        self.detail, self.exit_code, self.out_of_memory = detail, exit_code, out_of_memory
        super().__init__(self.describe())

    def __reduce__(self):
        return RuntimeCrashed, (self.runtime, self.signal_name, self.native, self.frame, self.detail, self.exit_code,
                                self.out_of_memory)

    def cause(self) -> str:
        """The crash without the runtime's name: `SIGSEGV (Segmentation fault) in ..., from ...`."""
        if self.signal_name is None:
            what = f"its process exited with code {self.exit_code} without an answer"
        else:
            meaning = (KILLED[self.out_of_memory] if self.signal_name == "SIGKILL"
                       else signal.strsignal(signal.Signals[self.signal_name]))
            what = f"{self.signal_name} ({meaning})"
        where = (f" in {self.native}" if self.native else "") + (f", from {self.frame}" if self.frame else "")
        return what + where

    def describe(self) -> str:
        return f"{self.runtime} crashed: {self.cause()}" + (f"; {self.detail}" if self.detail else "")

    def with_detail(self, detail: str) -> "RuntimeCrashed":
        return RuntimeCrashed(self.runtime, self.signal_name, self.native, self.frame, detail, self.exit_code,
                              self.out_of_memory)


def crash_of(runtime: str, exit_code: Optional[int], dump: str, out_of_memory: Optional[bool] = None) -> RuntimeCrashed:
    """The RuntimeCrashed for a child that ended with exit_code (negative: the signal) and left
    faulthandler's dump: the innermost frame outside crossrt, and the innermost crossrt frame
    (a backend's, where one is on the stack). out_of_memory: for SIGKILL, whether the kernel's
    OOM-kill count rose meanwhile."""
    name = signal.Signals(-exit_code).name if exit_code is not None and exit_code < 0 else None
    # The child's own frames (its zygote's, isolation.py's _serve_call and the hook's counting) are
    # left out; the test hook's _crash stays.
    frames = [f for f in crashed_stack(dump) if f.path != "<string>" and not f.path.endswith(os.sep + "zygote.py")
              and (f.function == "_crash" or not f.path.endswith(os.sep + "isolation.py"))]
    outside = next((f for f in frames if not f.in_crossrt), None)
    ours = [f for f in frames if f.in_crossrt]
    backend = next((f for f in ours if f.in_backend), ours[0] if ours else None)
    return RuntimeCrashed(runtime, name, outside.short() if outside else None, backend.short() if backend else None,
                          exit_code=exit_code, out_of_memory=out_of_memory if name == "SIGKILL" else None)
