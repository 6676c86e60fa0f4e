#!/usr/bin/env python3
"""Where the test suite's time goes: scripts/test run once with every test's durations (set-up,
call and teardown, module-scoped fixtures counted in the set-up of the first test that needs them),
summed per test file, slowest first, with the wall time of the whole run.

    .venv/bin/python scripts/suite_times.py                 # the whole suite, as CI runs it
    .venv/bin/python scripts/suite_times.py -- -k planted    # extra arguments after -- go to pytest

Prints a markdown table (file, tests, seconds, share of the summed seconds); the summed seconds
exceed the wall time by the two workers' overlap.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DURATION = re.compile(r"^\s*([\d.]+)s (setup|call|teardown)\s+(tests/[^:\s]+)(?:::(\S+))?", re.M)
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).* in [\d.]+s.*?)\s*=*$", re.M)


def main() -> None:
    extra = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    started = time.monotonic()
    done = subprocess.run([str(REPO / "scripts" / "test"), "--durations=0", "--durations-min=0", *extra],
                          cwd=REPO, capture_output=True, text=True)
    wall = time.monotonic() - started
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set] = defaultdict(set)
    for match in DURATION.finditer(done.stdout):
        seconds[match[3]] += float(match[1])
        if match[4]:
            tests[match[3]].add(match[4])
    total = sum(seconds.values()) or 1.0
    summary = SUMMARY.findall(done.stdout)
    print(f"scripts/test exit {done.returncode} in {wall:.0f} s wall; {summary[-1] if summary else 'no summary'}")
    print("\n| file | tests | seconds | share |\n|---|---|---|---|")
    for path, spent in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"| {path} | {len(tests[path])} | {spent:.0f} | {spent / total:.1%} |")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
