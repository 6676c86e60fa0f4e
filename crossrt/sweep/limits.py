"""What one `sweep query` may take: DuckDB's memory, its spill to disk, wall time, and the
memory of this process while the query runs and its rows are fetched.

DuckDB's memory_limit bounds its buffer manager, not every value it builds: `SELECT
range(200000000)` made a 1.6 GB list beside it and Python's copy of it (6.2 GB, killed), and a
sort over millions of generated rows took 3.2 GB and 21 s before there were limits. So the
process's data (RLIMIT_DATA: its heap and private mappings) may grow by the same limit only while
a query runs; an allocation past it fails there, in DuckDB or in Python, as one line.
"""

from __future__ import annotations

import contextlib
import re
import resource
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from crossrt.sweep.cell import SweepError

UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.I)


def size_bytes(text: str) -> int:
    """DuckDB's size text (500MB, 1GB, 2GiB) in bytes; SweepError for another form."""
    match = SIZE.match(text)
    if not match or match[2].lower() not in UNITS:
        raise SweepError(f"--memory-limit {text!r}: give a size such as 500MB or 1GB")
    return int(float(match[1]) * UNITS[match[2].lower()])


def _data_in_use() -> int:
    """This process's data (VmData: heap and private writable mappings, what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class QueryLimits:
    memory: str = "1GB"
    spill: str = "4GB"
    seconds: float = 60.0

    def config(self, spill_folder: Path) -> dict:
        return {"memory_limit": self.memory, "max_temp_directory_size": self.spill,
                "temp_directory": str(spill_folder)}

    @contextlib.contextmanager
    def process_memory(self) -> Iterator[None]:
        """This process's data may grow by the memory limit only, until the query's rows are read."""
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        allowed = _data_in_use() + size_bytes(self.memory)
        if hard != resource.RLIM_INFINITY:
            allowed = min(allowed, hard)
        if soft != resource.RLIM_INFINITY:
            allowed = min(allowed, soft)
        resource.setrlimit(resource.RLIMIT_DATA, (allowed, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))

    def error(self, error: Exception, timer: threading.Timer) -> SweepError:
        first = (str(error).splitlines() or [type(error).__name__])[0]
        if timer.finished.is_set() and "nterrupt" in first:
            return SweepError(f"query stopped after {self.seconds:g} s, its time limit (--timeout)")
        if isinstance(error, MemoryError) or "Out of Memory" in first or "max_temp_directory_size" in first:
            return SweepError(f"query failed: {first or 'out of memory'} (limits: memory {self.memory}, spill "
                              f"{self.spill}: --memory-limit)")
        return SweepError(f"query failed: {first}")
