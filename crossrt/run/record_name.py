"""The default name of a run's record: every setting that makes a run distinct shows in it.

runs/<pair>-<runtime>-k<k>.json for the plain run (a draft model at fixed k, greedy, crossrt's
schedule, the runtime's first mode), then one part per setting that differs from that, and a
short digest of the strategy's parameters where they differ: two runs of other settings never
share a file (`run --schedule llama-server` beside the plain run, a lossy run beside a greedy one).
A k the strategy never reads (a content policy with a k for every content type) is left out of
the name, which names the policy's own (`-content-code-7-prose-3-`), and kept in the digest.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from crossrt.run.runtime import DraftRules
from crossrt.speculative.schedules import SCHEDULE
from crossrt.speculative.strategies import Strategy


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-").lower()


def default_record_path(pair: str, runtime: str, mode: str, default_mode: str, k: int, schedule: str,
                        strategy: Strategy, rules: DraftRules, folder: Path = Path("runs")) -> Path:
    parts = [pair, runtime]
    if mode != default_mode:
        parts.append(mode)
    if schedule != SCHEDULE:
        parts.append(schedule)
    if not strategy.is_default or strategy != Strategy():
        label = strategy.label()
        digested = strategy if strategy.reads_k else (strategy, k)  # k unread: in the digest, not the name
        digest = hashlib.sha256(repr(digested).encode()).hexdigest()[:6]
        parts.append(f"{_slug(label)[:48]}-{digest}")
    if strategy.reads_k:
        parts.append(f"k{k}")
    if rules.n_min != rules.k:
        parts.append(f"nmin{rules.n_min}")
    if rules.p_min:
        parts.append(f"pmin{rules.p_min:g}")
    if rules.spec_type != "draft":
        parts.append(_slug(rules.spec_type))
    return folder / f"{'-'.join(parts)}.json"
