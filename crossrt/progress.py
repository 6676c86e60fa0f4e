"""Progress of long work on stderr: a tqdm bar on a terminal; nothing when stderr is not one, or
with --quiet.

The CLI decides once (`decide`) and the choice travels in the environment, so a stage running in
a process of its own (crossrt/run/isolation.py, whose children write to the caller's stderr)
shows its bar on the same terminal without being passed anything.
"""

from __future__ import annotations

import os
import sys
from typing import Iterable, Iterator, Optional, TypeVar

from tqdm import tqdm

ENV = "CROSSRT_PROGRESS"  # "1": bars shown, "0": none; set by the CLI, or by a user forcing either
T = TypeVar("T")


def decide(quiet: bool) -> None:
    """Bars on a terminal unless quiet; a value the user set in the environment stands."""
    if quiet:
        os.environ[ENV] = "0"
    elif ENV not in os.environ:
        os.environ[ENV] = "1" if sys.stderr.isatty() else "0"


def shown() -> bool:
    return os.environ.get(ENV) == "1"


def bar(label: str, total: Optional[int], unit: str = "prompt") -> tqdm:
    """A bar of total units (a context manager: update(n), set_postfix_str(text)); disabled unless shown."""
    return tqdm(total=total, desc=label, unit=unit, file=sys.stderr, disable=not shown(), dynamic_ncols=True,
                leave=False, mininterval=0.2)


def each(items: Iterable[T], label: str, unit: str = "prompt", total: Optional[int] = None) -> Iterator[T]:
    """items, one bar step per item."""
    if not shown():
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with bar(label, total, unit) as shown_bar:
        for item in items:
            yield item
            shown_bar.update(1)
