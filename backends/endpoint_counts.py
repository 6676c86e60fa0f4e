"""Per-prompt counters of an attached server (backends/endpoint.py): its /metrics read at one
moment (Prometheus text), what a prompt's deltas may be trusted for, and the counters each kind's
numbers give (llama-server's are read by backends/llama_server_counts.py, as for crossrt's own
llama-server runtime).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from crossrt.records.schema import Counters, UnfitCounts
from crossrt.run.runtime import K_LIMIT, RuntimeFailure

SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][\w:]*)(?P<labels>\{[^\n]*\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$', re.M)
POSITION = re.compile(r'position="(\d+)"')



@dataclass(frozen=True)
class Scrape:
    """A server's counters at one moment (/metrics), by crossrt's name; None where absent."""

    started: Optional[str]  # the process start the server reports (llama-server's header)
    busy: int  # requests running or waiting right now
    emitted: Optional[int]
    prompt: Optional[int]
    steps: Optional[int]
    drafted: Optional[int]
    accepted: Optional[int]
    per_pos: tuple[int, ...]
    decodes: Optional[int]
    exact: bool  # every counter printed as a whole number (llama-server prints 6 significant digits)


def parse_metrics(text: str, names: dict[str, str], per_pos_name: str, busy_names: Sequence[str],
                  started: Optional[str]) -> Scrape:
    """Prometheus text: each named counter summed over its label sets (vLLM: one per engine)."""
    values: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    exact = True
    series: dict[tuple[str, str], str] = {}  # one value per name and label set: a repeated line is one sample
    for match in SAMPLE.finditer(text):
        series[match["name"], match["labels"] or ""] = match["value"]
    for (name, labels), raw in series.items():
        try:
            value = float(raw)
        except ValueError:
            continue
        if not math.isfinite(value):  # NaN or infinity: no count, and nothing to sum
            exact = exact and not (name in names.values() or name == per_pos_name)
            continue
        if "e" in raw.lower() or value != int(value):
            exact = exact and not (name in names.values() or name == per_pos_name)
        position = POSITION.search(labels) if name == per_pos_name else None
        if position and int(position.group(1)) >= K_LIMIT:  # beyond any draft: bounded before anything is built
            exact = False
        elif position:
            per_pos[int(position.group(1))] = per_pos.get(int(position.group(1)), 0) + value
        else:
            values[name] = values.get(name, 0) + value
    counts = {role: int(values[name]) if name in values else None for role, name in names.items()}
    width = max(per_pos) + 1 if per_pos else 0
    return Scrape(started, int(sum(values.get(name, 0) for name in busy_names)), counts.get("emitted"),
                  counts.get("prompt"), counts.get("steps"), counts.get("drafted"), counts.get("accepted"),
                  tuple(int(per_pos.get(i, 0)) for i in range(width)), counts.get("decodes"), exact)


def numbers(value: object) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, tuple) else (value,) if isinstance(value, int) else ()


COUNTED = ("emitted", "prompt", "steps", "drafted", "accepted", "decodes")


def went_down(then: Scrape, now: Scrape) -> list[str]:
    """The counters lower now than then: in one server process they only grow (a value below 0
    is no count at all, which other_work says)."""
    return [name for name in COUNTED if getattr(now, name) is not None and getattr(then, name) is not None
            and 0 <= getattr(now, name) < getattr(then, name)] + \
        (["accepted per position"] if any(0 <= a < b for a, b in zip(now.per_pos, then.per_pos)) else [])


def other_work(before: Scrape, after: Scrape, emitted: int, n_prompt: int) -> Optional[str]:
    """Why a prompt's counter deltas cannot be its own, or None: a counter below 0 or printed
    too large to difference exactly, or the server generated or read more tokens than this
    prompt's (it served other requests)."""
    negative = sorted({name for scrape in (before, after) for name in COUNTED if (getattr(scrape, name) or 0) < 0}
                      | ({"accepted per position"} if any(n < 0 for n in (*before.per_pos, *after.per_pos)) else set()))
    if negative:
        return f"/metrics shows counters below 0 ({', '.join(negative)}), which no count can be"
    if not (before.exact and after.exact):
        return "a counter is past /metrics' printed precision"
    if after.emitted is not None and before.emitted is not None and after.emitted - before.emitted != emitted:
        return (f"the server served other requests during this prompt (/metrics shows "
                f"{after.emitted - before.emitted} tokens generated, this prompt {emitted})")
    if after.prompt is not None and before.prompt is not None and after.prompt - before.prompt > n_prompt:
        return (f"the server served other requests during this prompt (/metrics shows "
                f"{after.prompt - before.prompt} prompt tokens read, this prompt has {n_prompt})")
    return None


def minus(now: tuple[int, ...], then: tuple[int, ...]) -> tuple[int, ...]:
    width = max(len(now), len(then))
    pad = lambda counts: counts + (0,) * (width - len(counts))  # positions print once a step reached them
    return tuple(a - b for a, b in zip(pad(now), pad(then)))


def vllm_counters(before: Scrape, after: Scrape, emitted: int, k: int) -> tuple[Counters, Optional[UnfitCounts]]:
    """vLLM's /metrics deltas: steps (num_drafts), drafted, accepted and per position; read as
    crossrt's vllm runtime reads the same counters (backends/vllm.py, translate): the first token
    comes from the prefill (unverified 1), and vLLM drafts k even where the budget ends, so the
    accepted tokens past it are cut (cut = 1 + steps + accepted - emitted, at most k)."""
    steps, drafted = after.steps - before.steps, after.drafted - before.drafted
    accepted, per_pos = after.accepted - before.accepted, minus(after.per_pos, before.per_pos)
    unverified = 1 if emitted else 0
    cut = unverified + steps + accepted - emitted
    problems = ([f"{cut} tokens cut (1 + steps {steps} + accepted {accepted} - emitted {emitted}): only the last "
                 f"step's accepted tokens can be"] if not 0 <= cut <= k else []) + \
        ([f"acceptance beyond k={k}: {list(per_pos)}"] if any(per_pos[k:]) else [])
    unfit = None
    if problems:
        unfit = UnfitCounts(tuple(problems), {"emitted": emitted, "metrics.drafts": steps,
                                              "metrics.draft_tokens": drafted, "metrics.accepted": accepted},
                            "unverified = emitted + cut - steps - accepted, cut clamped to 0..k")
        cut = min(max(cut, 0), k)
        unverified = emitted + cut - steps - accepted
    per_pos = (per_pos + (0,) * k)[:k] if sum(per_pos) == accepted and not any(per_pos[k:]) else None
    return Counters(steps=steps, drafted=drafted, accepted=accepted, emitted=emitted, accepted_per_pos=per_pos,
                    step_drafted=None, step_accepted=None, unverified=unverified, cut=cut), unfit


def sglang_counters(counts: dict[str, Any], emitted: int, k: int) -> tuple[Counters, Optional[UnfitCounts]]:
    """SGLang's meta_info: steps = spec_verify_ct; accepted = its accepted draft count (where it
    gives none, completion_tokens - spec_verify_ct, SGLang's own accept length); drafted = steps x k
    (a chain drafts k every pass); unverified = what the identity leaves."""
    steps = counts.get("spec_verify_ct")
    if steps is None:
        raise RuntimeFailure("SGLang's response has no meta_info.spec_verify_ct: the server does not speculate")
    accepted = counts.get("accepted")
    if accepted is None:
        accepted = (counts.get("completion_tokens") or emitted) - steps
    rest = emitted - steps - accepted
    unfit = None
    if rest < 0:
        unfit = UnfitCounts((f"emitted {emitted} < steps {steps} + accepted {accepted}",),
                            {"emitted": emitted, **{n: v for n, v in counts.items() if isinstance(v, int)}},
                            "cut = steps + accepted - emitted, unverified 0")
    return Counters(steps=steps, drafted=steps * k, accepted=accepted, emitted=emitted, accepted_per_pos=None,
                    step_drafted=None, step_accepted=None, unverified=max(rest, 0), cut=max(-rest, 0)), unfit
