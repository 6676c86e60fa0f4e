"""A runtime in a process of its own: a crash is a verdict about that runtime, not the end of crossrt.

An in-process runtime (llama.cpp's binding, transformers) runs native code whose faults
(SIGSEGV, SIGILL, SIGABRT) leave no exception to catch, so isolated() sends it to a child forked
by its zygote (crossrt/run/zygote.py), with faulthandler writing the child's stack; a death by a
signal becomes RuntimeCrashed (crossrt/run/crashes.py). Callers go through run_pair_safely or
call_safely; executors that keep several children hold Isolated children themselves.
Why, Ctrl-C, the test hook CROSSRT_TEST_CRASH_AFTER: docs/reliability.md, "A runtime that crashes".
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from crossrt.errors import USER_ERRORS, CrossrtError
from crossrt.inputs.prompts import Prompt
from crossrt.records.record_json import load_record
from crossrt.records.schema import PromptResult, RunRecord
from crossrt.run.crashes import RuntimeCrashed, crash_of
from crossrt.run.driver import RunRequest, run_pair
from crossrt.run.run_writer import OWNER_PID
from crossrt.run.processes import oom_kills
from crossrt.run.runtime import RUNTIMES, runtime_class
from crossrt.run.zygote import interrupted, note_interrupt, zygote_for

# Every runtime's children in a process fork from one zygote (per import-time environment): what
# one child imported is warm for the next of any runtime, and a runtime's first child finds its
# preloads (FIRST_USE too) imported, so a parity's verdict, whose re-scoring loads transformers,
# forks with the torch and transformers its transformers cells had, where a zygote of its own
# imported them again (~3-5 CPU-s a parity with transformers).
ZYGOTE = "runtimes"
CRASH_HOOK = "CROSSRT_TEST_CRASH_AFTER"
IN_PROCESS = "CROSSRT_IN_PROCESS"
ENTRY = "crossrt.run.isolation:_serve_call"
# Work that loads in-process runtimes without being one runtime's: records' outputs re-scored and
# their splits explained on each record's scorer (crossrt/compare/rescore.py). Its crashes, and
# the test hook, go by this name.
RESCORING = "re-scoring"


def isolated(runtime: str) -> bool:
    """Whether a call that loads the runtime goes to a process of its own: those whose native code
    runs in crossrt's process, which are those with a driven mode (crossrt's loop calls their
    forward pass) and RESCORING (every scorer is one), unless CROSSRT_IN_PROCESS=1 keeps them here
    (a debugger's breakpoints then reach the backend, and a crash ends crossrt). Native-only
    runtimes run their own programs or servers."""
    in_process = runtime == RESCORING or "driven" in runtime_class(runtime).modes
    return in_process and os.environ.get(IN_PROCESS) != "1"


class ChildTraceback(Exception):
    """The child's traceback, kept as the cause of an exception it raised (as concurrent.futures does)."""


def _serve_call(message_fd: int, call_fd: int, dump_path: str, parent: int, runtime: str) -> None:
    """The child, forked by the zygote: the call comes pickled on call_fd, every message goes to
    the parent on message_fd; before its outcome, the modules it imported for its zygote to learn."""
    os.environ[OWNER_PID] = str(parent)  # a record's lock names the crossrt the user started
    signal.signal(signal.SIGINT, _raise_interrupt)
    sys.unraisablehook = _quiet_interrupt
    connection = Connection(message_fd, readable=False)
    faulthandler.enable(open(dump_path, "w"), all_threads=True)
    warm = set(sys.modules)
    with os.fdopen(call_fd, "rb") as call:
        function, args, events = pickle.load(call)
    hook = crash_hook(runtime)
    if hook is not None and hook[0] == 0:  # the test hook's "after 0 prompts": at once
        _crash(hook[1])
    try:
        if interrupted():  # passed on before the call began
            raise KeyboardInterrupt
        emit = (lambda payload: connection.send(("event", payload))) if events else None
        outcome = ("result", function(*args, emit=emit) if events else function(*args))
    except KeyboardInterrupt:
        outcome = ("interrupted", None)
    except BaseException as error:  # handed to the parent, which raises it
        outcome = ("error", (_portable(error), traceback.format_exc()))
    connection.send(("imported", sorted(set(sys.modules) - warm)))
    connection.send(outcome)


def _raise_interrupt(*_) -> None:
    note_interrupt()
    raise KeyboardInterrupt


def _quiet_interrupt(unraisable) -> None:
    """sys.unraisablehook in the child: a KeyboardInterrupt a ctypes callback swallowed is not
    printed as a traceback (it is noted, and prompt_hook raises it again); others are."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


# What a runtime's sessions import on first use, which its backend module imports lazily (so that
# `crossrt runtimes` need not): the zygote imports them before the runtime's first child, which
# then starts warm as later ones do, instead of importing them itself before the zygote learns
# them (a resumed tiny chat parity, cells and verdict: 8.3 -> 5.5 CPU-s).
FIRST_USE = {"transformers": ("torch", "transformers", "transformers.modeling_utils",
                              "transformers.models.auto.modeling_auto")}


def preloads(runtime: str) -> list[str]:
    """What a zygote for runtime imports before its first child: crossrt's side of the call, the
    runtime's backend module and what its sessions import on first use (a name that is not a
    runtime's: crossrt's side alone)."""
    if runtime not in RUNTIMES:
        return [__name__]
    return [__name__, RUNTIMES[runtime].split(":")[0], *FIRST_USE.get(runtime, ())]


def _portable(error: BaseException) -> BaseException:
    """error, or where it does not survive pickling (an __init__ taking other arguments than its
    message) the same message as a CrossrtError (still one line) or a RuntimeError (a bug)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        kind = CrossrtError if isinstance(error, CrossrtError) else RuntimeError
        return kind(str(error) if kind is CrossrtError else f"{type(error).__name__}: {error}")


class Isolated:
    """One call running in a child process. step() reads what the child sent (for waiting on
    several: multiprocessing.connection.wait on .connection); outcome() is its result, its
    exception, or RuntimeCrashed."""

    def __init__(self, runtime: str, function: Callable, args: tuple, events: bool = False):
        self.runtime = runtime
        self._folder = tempfile.mkdtemp(prefix="crossrt-isolated-")
        self._dump = Path(self._folder) / "faulthandler.txt"
        self._oom_kills = oom_kills()
        read_fd, write_fd = os.pipe()
        call_read, call_write = os.pipe()
        self._zygote = zygote_for(ZYGOTE, preloads(runtime))
        try:
            self.process = self._zygote.fork((1, 2, write_fd, call_read), ENTRY, str(self._dump), os.getpid(), runtime)
        finally:
            os.close(write_fd)
            os.close(call_read)
        self.connection = Connection(read_fd, writable=False)
        try:
            with os.fdopen(call_write, "wb") as call:
                pickle.dump((function, args, events), call)
        except BrokenPipeError:  # the child died at once: step() sees it gone
            pass
        self._outcome: Optional[tuple[str, Any]] = None

    def step(self, on_event: Optional[Callable[[Any], None]] = None) -> bool:
        """Read one message; True once the call is over (answered, or the child is gone)."""
        try:
            kind, payload = self.connection.recv()
        except (EOFError, OSError):
            kind, payload = "gone", None
        if kind == "event":
            if on_event is not None:
                on_event(payload)
            return False
        if kind == "imported":
            self._zygote.preload(payload)
            return False
        self._outcome = (kind, payload)
        self.process.wait()
        return True

    def outcome(self) -> Any:
        kind, payload = self._outcome
        try:
            if kind == "result":
                return payload
            if kind == "interrupted":
                raise KeyboardInterrupt
            if kind == "error":
                error, text = payload
                raise error from ChildTraceback(f"\n(in {self.runtime}'s process)\n{text}")
            dump = self._dump.read_text(errors="replace") if self._dump.is_file() else ""
            now = oom_kills()
            raise crash_of(self.runtime, self.process.returncode, dump,
                           None if None in (now, self._oom_kills) else now > self._oom_kills)
        finally:
            self.close()

    def wait(self, on_event: Optional[Callable[[Any], None]] = None) -> Any:
        """Run to the end here: events as they come, then the outcome. Ctrl-C is passed on once,
        and the child is waited for, so it keeps what it finished before the interrupt is raised."""
        try:
            while not self.step(on_event):
                pass
        except KeyboardInterrupt:
            self.interrupt()
            raise
        return self.outcome()

    def interrupt(self) -> None:
        """Pass one SIGINT on and read what the child still sends until it ends: a child whose
        outcome does not fit the pipe waits for a reader, and the parent must not wait for it."""
        if self._outcome is None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            while not self.step():
                pass
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:  # a caller that gave up on it
            self.process.kill()
            self.process.wait()
        self.connection.close()
        shutil.rmtree(self._folder, ignore_errors=True)


def call_isolated(runtime: str, function: Callable, *args, on_event: Optional[Callable[[Any], None]] = None) -> Any:
    """function(*args) run in a child process (function(*args, emit=...) when on_event is given:
    each emit(payload) in the child calls on_event(payload) here); its result or exception, or
    RuntimeCrashed. function and args must pickle."""
    return Isolated(runtime, function, args, events=on_event is not None).wait(on_event)


def call_safely(runtime: str, function: Callable, *args) -> Any:
    """function(*args), a call that loads runtime (or RESCORING's scorers), where that runtime
    belongs: in a process of its own where its native code would run in crossrt's (isolated: a
    crash is RuntimeCrashed, one line), else here. function and args must pickle."""
    if isolated(runtime):
        return call_isolated(runtime, function, *args)
    return function(*args)


class _Deferred:
    """A call kept for later, where no process of its own starts it now (begin_safely)."""

    def __init__(self, function: Callable, args: tuple):
        self._function, self._args = function, args

    def wait(self) -> Any:
        return self._function(*self._args)

    def close(self) -> None:
        pass


def begin_safely(runtime: str, function: Callable, *args) -> Isolated | _Deferred:
    """call_safely begun: where the call is isolated its process starts now and wait() reads its
    outcome, so that other work runs beside it; else the call runs here when wait() is called.
    close() gives up on a call not waited for (its process killed)."""
    if isolated(runtime):
        return Isolated(runtime, function, args)
    return _Deferred(function, args)


def crash_hook(runtime: str) -> Optional[tuple[int, signal.Signals]]:
    """(prompts, signal) from CROSSRT_TEST_CRASH_AFTER when it names this runtime, else None."""
    value = os.environ.get(CRASH_HOOK, "")
    parts = value.split(":")
    if len(parts) < 2 or parts[0] != runtime:
        return None
    return int(parts[1]), signal.Signals[parts[2] if len(parts) > 2 else "SIGSEGV"]


def _crash(number: signal.Signals) -> None:
    """Die by the signal for real: SIGSEGV by reading address 0, others sent to this process."""
    if number == signal.SIGSEGV:
        ctypes.string_at(0)
    os.kill(os.getpid(), number)


OnPrompt = Callable[[Prompt, Optional[PromptResult]], None]
_finished = 0  # prompts this process finished, for the test hook


def prompt_hook(runtime: str, on_prompt: Optional[OnPrompt] = None) -> OnPrompt:
    """run_pair's on_prompt in a child: on_prompt, then KeyboardInterrupt if a SIGINT came (one a
    native callback swallowed: the prompt is kept, the run ends), and with the test hook set for
    runtime, this process's death after its N-th finished prompt, over all its runs (not counting
    those a resumed record held)."""
    hook = crash_hook(runtime)

    def hooked(prompt: Prompt, result: Optional[PromptResult]) -> None:
        global _finished
        if on_prompt is not None:
            on_prompt(prompt, result)
        if interrupted():
            raise KeyboardInterrupt
        _finished += result is not None
        if hook is not None and _finished == hook[0]:
            _crash(hook[1])
    return hooked


def _run_pair_child(request: RunRequest, prompts: Sequence[Prompt], emit=None) -> RunRecord:
    """driver.run_pair in the child: each prompt's (id, result) sent to the parent as it ends."""
    def on_prompt(prompt: Prompt, result: Optional[PromptResult]) -> None:
        if emit is not None:
            emit((prompt.id, result))
    return run_pair(request, prompts, prompt_hook(request.runtime, on_prompt))


def kept(out: Path, prompts: int) -> str:
    """What a crashed run left: `2 of 3 prompts finished, kept in runs/x.json`."""
    try:
        finished = sum(result.ok for result in load_record(out).results) if out.is_file() else 0
    except USER_ERRORS:  # a record the crash left unreadable says so where it is read
        finished = 0
    if not finished:
        return "no prompt finished"
    return f"{finished} of {prompts} prompts finished, kept in {out}"


class IsolatedRun(Isolated):
    """driver.run_pair(request, prompts) in a child process; a crash says what the run kept."""

    def __init__(self, request: RunRequest, prompts: Sequence[Prompt], events: bool = False):
        super().__init__(request.runtime, _run_pair_child, (request, list(prompts)), events)
        self.request, self.prompts = request, tuple(prompts)

    def outcome(self) -> RunRecord:
        try:
            return super().outcome()
        except RuntimeCrashed as crash:
            raise crash.with_detail(kept(self.request.out, len(self.prompts))) from None


def run_pair_isolated(request: RunRequest, prompts: Sequence[Prompt],
                      on_prompt: Optional[OnPrompt] = None) -> RunRecord:
    """driver.run_pair in a process of its own, on_prompt called here as each prompt ends."""
    by_id = {prompt.id: prompt for prompt in prompts}

    def on_event(payload) -> None:
        prompt_id, result = payload
        if on_prompt is not None:
            on_prompt(by_id[prompt_id], result)
    return IsolatedRun(request, prompts, events=True).wait(on_event)


def run_pair_safely(request: RunRequest, prompts: Sequence[Prompt], on_prompt: Optional[OnPrompt] = None) -> RunRecord:
    """driver.run_pair where the runtime belongs: in a process of its own where its native code
    would run in crossrt's (isolated: a crash is RuntimeCrashed, one line), else here. Callers run
    a pair through this and do not choose."""
    if isolated(request.runtime):
        return run_pair_isolated(request, prompts, on_prompt)
    return run_pair(request, prompts, on_prompt)
