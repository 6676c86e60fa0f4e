"""A pytest plugin: pytest-xdist scheduling for scripts/test (--dist loadgroup).

A test file runs whole on one worker, as with --dist loadfile, so its module-scoped models,
servers and runs start once; the longest files start first (tests/file_durations.txt), so
the two workers end about together instead of one starting a long file near the end; and the
tests marked alone (sub-second probes, timeouts a prompt
must beat) run last, by themselves: on one worker, once every other worker is idle and nothing
else is left, so no other test shares the CPU with them.

xdist's own groups (xdist_group) cannot say that, and with pytest 9 they do not group at all
(xdist 3.8 renames a grouped test's node id through an attribute pytest 9 no longer reads). So
each worker writes the ids of the alone tests it collected into a file the controller names, and
the controller's scheduler reads it. tests/conftest.py loads this plugin.
"""

import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from controller_folder import make_controller_folder

DURATIONS = Path(__file__).with_name("file_durations.txt")
ALONE = "alone"  # the marker, and the scheduler's unit of those tests
WORKER_KEY = "crossrt_alone_ids"  # the file of alone test ids, in each worker's workerinput
FOLDER = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    make_controller_folder(config, FOLDER, "crossrt-alone-")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    if FOLDER in node.config.stash:
        node.workerinput[WORKER_KEY] = str(node.config.stash[FOLDER] / "ids")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    path = getattr(config, "workerinput", {}).get(WORKER_KEY)
    if path:  # every worker collects the same tests: the last to write wins, whole (a rename)
        ids = "".join(item.nodeid + "\n" for item in items if item.get_closest_marker(ALONE) is not None)
        temporary = Path(f"{path}.{os.getpid()}")
        temporary.write_text(ids)
        os.replace(temporary, path)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") == "loadgroup" and FOLDER in config.stash:
        return AloneLast(config, log)
    return None


def file_durations() -> dict[str, float]:
    """tests/file_durations.txt: "seconds path" lines, # comments."""
    seconds = {}
    for line in DURATIONS.read_text().splitlines() if DURATIONS.is_file() else []:
        if line.strip() and not line.startswith("#"):
            value, path = line.split()
            seconds[path] = float(value)
    return seconds


class AloneLast(LoadScopeScheduling):
    """A worker holds its last test until it is given more or told to stop (pytest needs the
    next test to tear down fixtures), so "the others are idle" means "the others are down": once
    the alone tests are all that is left, the first worker to ask keeps waiting, the others are
    told to stop, and the alone tests go to that worker when it is the last one up."""

    runner = None  # the worker that runs the alone tests

    def schedule(self) -> None:
        ids = self.config.stash[FOLDER] / "ids"  # written before the workers reported their collections
        self.alone = set(ids.read_text().splitlines()) if ids.is_file() else set()
        self.seconds = file_durations()
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        if nodeid in self.alone:
            return ALONE
        return nodeid.split("::", 1)[0]  # the file

    def _assign_work_unit(self, node) -> None:
        if len(self.workqueue) > 1:  # the longest file next; the alone tests after every file
            longest = max(self.workqueue, key=lambda scope: -1.0 if scope == ALONE else self.seconds.get(scope, 0.0))
            self.workqueue.move_to_end(longest, last=False)
        elif list(self.workqueue) == [ALONE] and len(self.assigned_work) > 1:
            return  # not yet: _reschedule stops the other workers first
        super()._assign_work_unit(node)

    def _reschedule(self, node) -> None:
        if list(self.workqueue) != [ALONE] or node.shutting_down:
            super()._reschedule(node)
            return
        if self.runner not in self.assigned_work:
            self.runner = node
        for other in self.assigned_work:
            if other is not self.runner and not other.shutting_down:
                other.shutdown()
        if len(self.assigned_work) == 1:
            self._assign_work_unit(self.runner)

    def remove_node(self, node):
        """A worker that is down: at its end, or crashed in its first pending test. xdist's own
        version puts a crashed worker's tests back whole, so the test that crashed ran again
        on each new worker until the restarts ran out and the rest of its file never ran; here
        it stays a failure (xdist reports it, tests/crash_report.py says how it died) and only
        the tests after it are run again."""
        workload = self.assigned_work.pop(node)
        pending = [(scope, nodeid) for scope, unit in workload.items() for nodeid, done in unit.items() if not done]
        crashed = pending[0][1] if pending else None
        if crashed:
            workload[pending[0][0]][crashed] = True
            for scope, unit in workload.items():
                if not all(unit.values()):
                    self.workqueue[scope] = unit
                    self.workqueue.move_to_end(scope, last=False)
            for other in self.assigned_work:
                self._reschedule(other)
        if list(self.workqueue) == [ALONE] and self.runner in self.assigned_work:
            self._reschedule(self.runner)  # the last other worker is down
        return crashed
