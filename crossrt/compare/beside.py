"""A call in a thread of its own, beside the caller's work: the verdict's drafter checks with
parity's --jobs 2 or more (crossrt/compare/verification.py). Worth it where the work
is native code that releases the GIL (forward passes, array statistics), and safe where each
thread holds its own sessions and loads take turns (crossrt/compare/rescore.py's open_scorer)."""

from __future__ import annotations

import threading
from typing import Any, Callable


class Beside:
    """function(*args) in a thread of its own; result() waits for its value or raises its error.
    A daemon: a caller that fails meanwhile does not wait for it."""

    def __init__(self, function: Callable, *args):
        self._outcome: list = []
        self._thread = threading.Thread(target=self._run, args=(function, args), daemon=True)
        self._thread.start()

    def _run(self, function: Callable, args: tuple) -> None:
        try:
            self._outcome.append((True, function(*args)))
        except BaseException as error:  # raised again in the caller's thread
            self._outcome.append((False, error))

    def result(self) -> Any:
        self._thread.join()
        ok, value = self._outcome[0]
        if not ok:
            raise value
        return value
