"""SGLang's speculative decoding counts, as `crossrt import --from sglang-metrics` reads them:
its Prometheus `/metrics` counters (a snapshot, or the later of two scrapes), or the per-request
`meta_info` its responses carry. (Its decode log lines are crossrt/imports/logs.py's.)

Only counts are read: the accept-length and accept-rate gauges are rates of the last log window
that two scrapes cannot difference, and are refused. Every field, the SGLang source and PRs it
was read from, and its traps: docs/import.md, "SGLang".
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Optional

from crossrt.imports.exllamav3 import json_body
from crossrt.imports.logs import ReadOptions
from crossrt.imports.engine_metrics import counter_totals, require_counters
from crossrt.imports.imported import MAX_K, ImportFailure, SourceCounts, json_count, summed

NAMES = {"steps": "sglang:spec_verify_calls_total", "emitted": "sglang:generation_tokens_total"}
GAUGE = re.compile(r"^sglang:spec_accept_length\b", re.M)
ACCEPTED_CONVENTION = ("accepted = completion tokens - verify passes, SGLang's own accept length (completion_tokens "
                       "/ spec_verify_ct, bonus in): exact where the prefill pass that yields a request's first "
                       "token is counted as a verify pass; where it is not, accepted includes that first token, one "
                       "per request")


def _read_prometheus(text: str, options: ReadOptions) -> SourceCounts:
    totals, _ = counter_totals(text, NAMES, "", exact_digits=False)
    if totals["steps"] is None and GAUGE.search(text):
        raise ImportFailure("this SGLang exports speculative acceptance only as gauges (sglang:spec_accept_length, "
                            "_rate: the last decode log window's rates, no counts); import its server log "
                            "(--from sglang-log) or scrape a build with sglang:spec_verify_calls_total (PR 25689)")
    require_counters(totals, NAMES, ("steps", "emitted"), "SGLang /metrics of a server with speculative decoding "
                     "(sglang:spec_verify_calls_total arrived with sgl-project/sglang PR 25689)")
    if options.k is None:
        raise ImportFailure("SGLang's /metrics do not say the draft length: give --k, its "
                            "--speculative-num-draft-tokens minus 1 (that count includes the root token)")
    steps, emitted = totals["steps"], totals["emitted"]
    if emitted < steps:
        raise ImportFailure(f"generation_tokens_total {emitted} is below spec_verify_calls_total {steps}: every verify "
                            "pass emits at least one token")
    notes = ("sglang-metrics: /metrics counters, added as each request finishes (a request still running at a "
             "scrape is not in it): steps = sglang:spec_verify_calls_total, emitted = sglang:generation_tokens_total; "
             f"{ACCEPTED_CONVENTION}; drafted = steps x k (k = --k = --speculative-num-draft-tokens - 1, nominal: "
             "these counters hold no draft token count)",)
    return SourceCounts(steps, steps * options.k, emitted - steps, None, emitted=emitted, unverified=0,
                        k=options.k, notes=notes)


def _requests(text: str) -> list[dict]:
    try:
        value = json_body(text)
    except ImportFailure:  # JSON lines: one response (or meta_info) per line
        value = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip() and not line.startswith("#"):
                try:
                    value.append(json.loads(line))
                except (ValueError, RecursionError):  # not JSON, nested too deep, a 5,000-digit number
                    raise ImportFailure(f"line {number} is not JSON: neither JSON nor JSON lines of SGLang responses "
                                        "or their meta_info") from None
    value = value if isinstance(value, list) else [value]
    requests = [item.get("meta_info", item) if isinstance(item, dict) else None for item in value]
    if not requests or any(not isinstance(r, dict) or "spec_verify_ct" not in r for r in requests):
        raise ImportFailure("not SGLang meta_info: each request needs spec_verify_ct (a server with speculative "
                            "decoding on)")
    return requests


def _checked_counts(info: dict, where: str) -> None:
    """Every count a request's meta_info gives is a whole number from 0 to 2^63 - 1."""
    for name in ("spec_verify_ct", "completion_tokens", *ACCEPTED_FIELDS, *PROPOSED_FIELDS):
        if name in info and not (name == "completion_tokens" and info[name] is None):
            json_count(info[name], f"{where}: {name}")
    histogram = info.get("spec_correct_drafts_histogram")
    if histogram is not None:
        if not isinstance(histogram, list) or not 2 <= len(histogram) <= MAX_K + 1:
            raise ImportFailure(f"{where}: spec_correct_drafts_histogram is not a list of 2 to {MAX_K + 1} counts")
        for j, n in enumerate(histogram):
            json_count(n, f"{where}: spec_correct_drafts_histogram[{j}]")


def _close(printed, value: float) -> bool:
    return isinstance(printed, (int, float)) and math.isclose(printed, value, rel_tol=1e-9, abs_tol=1e-12)


# Field names by SGLang version: spec_accept_token_num / spec_draft_token_num (late 2025, PR
# 13754), spec_num_correct_drafts / spec_num_proposed_drafts (PR 33518). Both draft counts are
# nominal, spec_verify_ct x a per-pass width: speculative_num_steps (EAGLE: no root) or
# speculative_num_draft_tokens (NGRAM in PR 13754: the root included).
ACCEPTED_FIELDS = ("spec_num_correct_drafts", "spec_accept_token_num")
PROPOSED_FIELDS = ("spec_num_proposed_drafts", "spec_draft_token_num")


@dataclass(frozen=True)
class _Request:
    steps: int
    drafted: int
    accepted: int
    accepted_per_pos: Optional[tuple[int, ...]]
    emitted: Optional[int]
    k: Optional[int]
    note: Optional[str]  # how the draft count was read, where it took a choice


def _field(info: dict, names: tuple[str, ...]) -> Optional[int]:
    return next((info[name] for name in names if name in info), None)


def _drafted(where: str, steps: int, proposed: Optional[int], k: Optional[int]) -> tuple[int, Optional[str]]:
    if k is None:
        raise ImportFailure(f"{where}: the draft length is not in the meta_info (no spec_correct_drafts_histogram): "
                            "give --k, SGLang's --speculative-num-draft-tokens minus 1")
    if proposed is None or proposed == steps * k:
        return steps * k, None
    if proposed == steps * (k + 1):  # the root (the verified last token) counted in every pass
        return steps * k, f"{where}: proposed draft tokens {proposed} = spec_verify_ct x (k + 1): the root counted, " \
                          f"drafted = spec_verify_ct x k = {steps * k}"
    raise ImportFailure(f"{where}: proposed draft tokens {proposed} are neither spec_verify_ct {steps} x k {k} nor x "
                        f"(k + 1): --k does not match this server's draft length")


def _one_request(number: int, info: dict, options: ReadOptions) -> _Request:
    where = f"request {number}"
    _checked_counts(info, where)
    steps, completion = info["spec_verify_ct"], info.get("completion_tokens")
    histogram = info.get("spec_correct_drafts_histogram")
    accepted, proposed = _field(info, ACCEPTED_FIELDS), _field(info, PROPOSED_FIELDS)
    if steps == 0:  # finished before any verify pass (a one-token request): its tokens are outside steps
        width = len(histogram) - 1 if histogram is not None else options.k
        return _Request(0, 0, 0, (0,) * width if histogram is not None else None, completion, width, None)
    if accepted is None:
        if completion is None:
            raise ImportFailure(f"{where}: neither an accepted draft count ({', '.join(ACCEPTED_FIELDS)}) nor "
                                "completion_tokens")
        accepted = completion - steps
    per_pos, k = None, options.k
    if histogram is not None:
        if sum(histogram) != steps or sum(j * n for j, n in enumerate(histogram)) != accepted:
            raise ImportFailure(f"{where}: spec_correct_drafts_histogram {histogram} does not give spec_verify_ct "
                                f"{steps} passes accepting {accepted}")
        if k is not None and k != len(histogram) - 1:
            raise ImportFailure(f"--k {k}, but the histogram has {len(histogram)} buckets: k = {len(histogram) - 1}")
        k = len(histogram) - 1
        per_pos = tuple(sum(histogram[i + 1:]) for i in range(k))
    drafted, note = _drafted(where, steps, proposed, k)
    if completion is not None and not _close(info.get("spec_accept_length", completion / steps), completion / steps):
        raise ImportFailure(f"{where}: spec_accept_length {info['spec_accept_length']} is not completion_tokens "
                            f"{completion} / spec_verify_ct {steps}")
    if proposed and _field(info, ACCEPTED_FIELDS) is not None and not _close(
            info.get("spec_accept_rate", accepted / proposed), accepted / proposed):
        raise ImportFailure(f"{where}: spec_accept_rate {info['spec_accept_rate']} is not {accepted} / {proposed}")
    if completion is not None and completion < steps + accepted:
        raise ImportFailure(f"{where}: completion_tokens {completion} below verify passes {steps} + accepted "
                            f"{accepted}")
    return _Request(steps, drafted, accepted, per_pos, completion, k, note)


def _read_meta_info(text: str, options: ReadOptions) -> SourceCounts:
    requests = _requests(text)
    parts = [_one_request(number, info, options) for number, info in enumerate(requests)]
    ks = {part.k for part in parts}
    if len(ks) > 1:
        raise ImportFailure(f"requests with different draft lengths ({sorted(map(str, ks))}): more than one "
                            "speculative configuration")
    steps, drafted, accepted = (sum(getattr(part, name) for part in parts) for name in ("steps", "drafted", "accepted"))
    emitted = sum(part.emitted for part in parts) if all(part.emitted is not None for part in parts) else None
    notes = (f"sglang-metrics: {len(parts)} request(s)' meta_info summed: steps = spec_verify_ct, accepted = "
             f"{' or '.join(ACCEPTED_FIELDS)}, drafted = spec_verify_ct x k, per position from "
             "spec_correct_drafts_histogram where given; emitted = completion_tokens, and unverified = what "
             "completion_tokens holds beyond the verify passes (the first token, from the prefill, where SGLang "
             "does not count that pass as a verify pass)",)
    notes += tuple(part.note for part in parts if part.note)
    if any(_field(info, ACCEPTED_FIELDS) is None for info in requests):
        notes += (f"sglang-metrics: some requests give no accepted draft count: {ACCEPTED_CONVENTION}",)
    return SourceCounts(steps, drafted, accepted, summed([part.accepted_per_pos for part in parts]), emitted=emitted,
                        unverified=None if emitted is None else emitted - steps - accepted, k=ks.pop(), notes=notes)


def read_sglang_metrics(text: str, options: ReadOptions) -> SourceCounts:
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#")).lstrip()
    if body.startswith(("{", "[")):
        return _read_meta_info(text, options)
    return _read_prometheus(text, options)
