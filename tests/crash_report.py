"""A pytest plugin: a test that kills its process (a SIGSEGV or SIGILL in native code, an abort,
a kill) is that test's failure, naming what killed it, and the suite goes on.

scripts/test always runs pytest-xdist, which replaces a worker that died and fails the test it
was running with "worker 'gw0' crashed while running '...'". That line does not say how it died,
and Python's fault handler, which does, would print into the terminal that all workers share,
away from the test. So each worker writes its fault handler's report to a file of its own, and
when a worker dies the failed test's report gets the worker's exit signal and that file's text
(the fatal error and the Python stack it happened in). tests/conftest.py loads it;
tests/test_crash_report.py runs it on tests that really crash.
"""

import faulthandler
import signal
import subprocess
from pathlib import Path

import pytest

from controller_folder import make_controller_folder

WORKER_KEY = "crossrt_fault_log"  # the file of a worker's fault handler, in its workerinput
FOLDER = pytest.StashKey[Path]()  # the controller's folder of those files


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which enables it on stderr
def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and WORKER_KEY in workerinput:
        log = open(workerinput[WORKER_KEY], "w")  # noqa: SIM115 (open for the worker's life)
        config.add_cleanup(log.close)
        faulthandler.enable(file=log, all_threads=True)
    else:
        make_controller_folder(config, FOLDER, "crossrt-faults-")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """On the controller, for each worker it starts (replacements of crashed ones too)."""
    if FOLDER in node.config.stash:
        node.workerinput[WORKER_KEY] = str(node.config.stash[FOLDER] / f"{node.gateway.id}.log")


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    """On the controller, when a worker died while running crashitem: say how."""
    worker = report.node
    lines = [str(report.longrepr)]
    how = exit_signal(worker)
    if how:
        lines.append(f"the worker process was killed by {how}")
    log = worker.workerinput.get(WORKER_KEY)
    text = Path(log).read_text(errors="replace") if log and Path(log).is_file() else ""
    if text.strip():
        lines += ["Python's fault handler in the worker:", *crashing_stack(text)]
    report.longrepr = "\n".join(lines)


def crashing_stack(text: str) -> list[str]:
    """The fault handler's fatal error line and the crashing thread's frames down to the test
    (innermost first), without the other threads and pytest's own frames below the test."""
    lines = text.strip().splitlines()
    if "Current thread" not in text:
        return lines
    start = next(i for i, line in enumerate(lines) if line.startswith("Current thread"))
    stack = [lines[start]]
    for line in lines[start + 1:]:
        if "/_pytest/" in line or not line.strip():
            break
        stack.append(line)
    return [lines[0], *stack]


def exit_signal(worker) -> str | None:
    """The signal that ended the worker's process, as "SIGSEGV (signal 11)", or None.

    execnet keeps the worker's Popen as gateway._io.popen (not a public API: where it is missing,
    the fault handler's text alone names the crash)."""
    popen = getattr(getattr(worker.gateway, "_io", None), "popen", None)
    if popen is None:
        return None
    try:
        code = popen.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return None
    if code >= 0:
        return None
    try:
        return f"{signal.Signals(-code).name} (signal {-code})"
    except ValueError:
        return f"signal {-code}"
