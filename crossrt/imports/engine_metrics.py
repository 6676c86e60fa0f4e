"""Speculative decoding counters from runtimes' counter endpoints: vLLM's and llama-server's
Prometheus `/metrics` text (a snapshot, or the later of two scrapes with crossrt/imports/importer.py
taking the difference), and vLLM's counters as its spec_decode example prints them. These are
exact counts: no rate is turned back into a count except where noted. docs/import.md maps
every field.

Every line that is not a comment must be a sample (refused with its line number otherwise), a
series may appear once, and a counter crossrt reads must be a whole number from 0 to 2^63 - 1,
kept exact: digits are read as an int, never through a float.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

from crossrt.records.counts import Counts
from crossrt.imports.logs import ReadOptions
from crossrt.imports.imported import (MAX_COUNT, MAX_K, ImportFailure, SourceCounts, count, draft_length, position_counts,
                              shown)

# The Prometheus text exposition format: name{label="value",...} value [timestamp]. Label
# values may hold braces and escaped quotes (vLLM's cache_config_info does).
SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][\w:]*)(?P<labels>\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})?'
                    r'\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$')
POSITION = re.compile(r'position="(\d+)"')


def _samples(text: str) -> list[tuple[int, str, str, str]]:
    """(line number, name, labels text, value text) of every sample line; comments and blank
    lines skipped. In a text that holds samples, any other line is refused, and so is a series
    given twice (a text with no sample at all is left for the caller to call another format)."""
    found, seen, odd = [], {}, None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = SAMPLE.match(line.strip())
        if match is None:
            odd = odd or (number, line.strip())
            continue
        series = (match["name"], match["labels"] or "")
        if series in seen:
            raise ImportFailure(f"line {number}: {series[0]}{series[1]} again (first at line {seen[series]}): one "
                                "scrape per file")
        seen[series] = number
        found.append((number, match["name"], match["labels"] or "", match["value"]))
    if found and odd:
        raise ImportFailure(f"line {odd[0]}: not a Prometheus sample (name{{labels}} value): {odd[1][:80]!r}")
    return found


def _count(value: str, name: str, exact_digits: bool) -> int:
    """A counter value as an exact int: digits as they are; a float form (188.0, 1.5e3) only
    where it is whole and within 2^53, where a float holds every integer. llama-server prints
    through a C++ stream with 6 significant digits, so exponent notation there means a
    rounded count (exact_digits)."""
    if re.fullmatch(r"[0-9]+(\.0*)?", value):
        return count(value.split(".")[0], name)
    try:
        number = Decimal(value)
    except InvalidOperation:
        raise ImportFailure(f"{name} has the value {value[:40]!r}, not a number") from None
    if not number.is_finite() or number < 0:
        raise ImportFailure(f"{name} = {value[:40]}: a counter is a count, never negative or infinite")
    if number > MAX_COUNT:
        raise ImportFailure(f"{name} = {value[:40]} is out of range: more than 2^63 - 1, which no runtime counts to")
    if number != number.to_integral_value():
        raise ImportFailure(f"{name} = {value[:40]} is not a whole number: not a count")
    if exact_digits and "e" in value.lower():
        raise ImportFailure(f"{name} = {value} is not an exact count (llama-server prints counters with 6 "
                            "significant digits: restart it before a counter passes 999999)")
    if number > 2 ** 53:
        raise ImportFailure(f"{name} = {value}: a float above 2^53 may be a rounded count; crossrt reads counters "
                            "above that only as digits")
    return int(number)


def counter_totals(text: str, names: dict[str, str], per_pos_name: str, exact_digits: bool
                   ) -> tuple[dict[str, Optional[int]], Optional[tuple[int, ...]]]:
    """The counters named (by role) summed over their label sets (vLLM: one per engine), and
    the per-position counter by position. A counter the text lacks is None."""
    samples = _samples(text)
    totals: dict[str, Optional[int]] = {}
    for role, name in names.items():
        values = [_count(value, f"line {number}: {name}", exact_digits)
                  for number, sample, _, value in samples if sample == name]
        totals[role] = sum(values) if values else None
    by_position: dict[int, int] = {}
    for number, sample, labels, value in samples:
        position = POSITION.search(labels) if sample == per_pos_name else None
        if position:
            index = count(position.group(1), f"line {number}: position")
            if index >= MAX_K:
                raise ImportFailure(f"line {number}: position {index} is beyond any draft (at most {MAX_K} tokens)")
            by_position[index] = by_position.get(index, 0) + _count(value, f"line {number}: {per_pos_name}",
                                                                    exact_digits)
    per_pos = tuple(by_position.get(i, 0) for i in range(max(by_position) + 1)) if by_position else None
    return totals, per_pos


def require_counters(totals: dict[str, Optional[int]], names: dict[str, str], roles: tuple[str, ...],
                     what: str) -> None:
    missing = [names[role] for role in roles if totals[role] is None]
    if missing:
        raise ImportFailure(f"no {', '.join(missing)} in the text: not {what}")


# vLLM V1's Prometheus counters (vllm/v1/spec_decode/metrics.py, SpecDecodingProm, vllm-project/
# vllm at ee4ceaae5953): vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens and
# _num_accepted_tokens_per_pos{position="i"}, one series per engine; prometheus_client serves
# counters with the suffix _total (and a _created series, ignored).
VLLM_NAMES = {"steps": "vllm:spec_decode_num_drafts_total", "drafted": "vllm:spec_decode_num_draft_tokens_total",
              "accepted": "vllm:spec_decode_num_accepted_tokens_total"}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# The same counters as examples/offline_inference/spec_decode.py prints them after an offline
# run (vllm-project/vllm at eb987dffa144: summed from LLM.get_metrics(); "acceptance at token
# i" is the per-position counter over num_drafts, to 2 decimals).
EXAMPLE_LABELS = {"steps": "num_drafts", "drafted": "num_draft_tokens", "accepted": "num_accepted_tokens",
                  "output": "total_num_output_tokens"}
EXAMPLE = {role: re.compile(rf"^{label}: (\d+)$", re.M) for role, label in EXAMPLE_LABELS.items()}
EXAMPLE_MEAN = re.compile(r"^mean acceptance length: (\d+\.\d+)$", re.M)
EXAMPLE_RATE = re.compile(r"^acceptance at token (\d+): (\d+\.\d+)$", re.M)


def _read_vllm_example(text: str) -> SourceCounts:
    found = {role: pattern.findall(text) for role, pattern in EXAMPLE.items()}
    if any(len(values) != 1 for values in found.values()):
        raise ImportFailure("a spec_decode example printout holds num_drafts, num_draft_tokens, num_accepted_tokens "
                            "and total_num_output_tokens once each: give one run per file")
    steps, drafted, accepted, output = (count(found[role][0], EXAMPLE_LABELS[role])
                                        for role in ("steps", "drafted", "accepted", "output"))
    if accepted > drafted:
        raise ImportFailure(f"num_accepted_tokens {accepted} exceeds num_draft_tokens {drafted}")
    mean = EXAMPLE_MEAN.search(text)
    # vLLM's mean acceptance length is crossrt's tau
    if steps and (mean is None or not shown(Counts(steps=steps, accepted=accepted).tau, mean.group(1))):
        raise ImportFailure("the printed mean acceptance length does not follow from num_accepted_tokens / num_drafts")
    rates = [rate for _, rate in sorted(EXAMPLE_RATE.findall(text), key=lambda pair: int(pair[0]))]
    per_pos = position_counts(rates, steps, accepted)[0] if steps and rates else None
    notes = ("vllm-metrics: the counters as vLLM's examples/offline_inference/spec_decode.py prints them (summed "
             f"over engines by LLM.get_metrics()); total_num_output_tokens {output} (first tokens from prefill "
             "included) is not split into steps, so emitted = steps + accepted",)
    if rates and per_pos is None:
        notes += (f"vllm-metrics: 'acceptance at token i' is printed to 2 decimals of {steps} drafts: too coarse "
                  f"for counts ({', '.join(rates)})",)
    return SourceCounts(steps, drafted, accepted, per_pos, k=draft_length(len(rates), "acceptance at token lines")
                        if rates else None, notes=notes)


def read_vllm_metrics(text: str, options: ReadOptions) -> SourceCounts:
    if EXAMPLE["steps"].search(text):
        return _read_vllm_example(text)
    totals, per_pos = counter_totals(text, VLLM_NAMES, VLLM_PER_POS, exact_digits=False)
    require_counters(totals, VLLM_NAMES, ("steps", "drafted", "accepted"),
              "vLLM /metrics of a server with speculative decoding, nor its spec_decode example's printout")
    notes = ("vllm-metrics: vllm:spec_decode_* counters summed over engines",)
    return SourceCounts(totals["steps"], totals["drafted"], totals["accepted"], per_pos,
                        k=len(per_pos) if per_pos else None, notes=notes)


# llama-server's /metrics (tools/server/server-task.cpp, server_task_result_metrics::to_metrics,
# at llama.cpp 0c1e57098, with --metrics): llamacpp:spec_decode_num_drafts_total (verification
# steps), _num_draft_tokens_total, _num_accepted_tokens_total, one
# _num_accepted_tokens_per_pos_total{position="i"} per draft position (n_max of them, printed
# once a step verified), n_decode_total (llama_decode calls of the target) and
# tokens_predicted_total; a slot's counts are added when it is released.
LLAMA_NAMES = {"steps": "llamacpp:spec_decode_num_drafts_total",
               "drafted": "llamacpp:spec_decode_num_draft_tokens_total",
               "accepted": "llamacpp:spec_decode_num_accepted_tokens_total",
               "decodes": "llamacpp:n_decode_total", "emitted": "llamacpp:tokens_predicted_total"}
LLAMA_PER_POS = "llamacpp:spec_decode_num_accepted_tokens_per_pos_total"


def read_llama_server_metrics(text: str, options: ReadOptions) -> SourceCounts:
    totals, per_pos = counter_totals(text, LLAMA_NAMES, LLAMA_PER_POS, exact_digits=True)
    require_counters(totals, LLAMA_NAMES, tuple(LLAMA_NAMES), "llama-server /metrics (started with --metrics, built "
              "with speculative counters)")
    notes = ("llama-server-metrics: steps, drafted, accepted, per position from llamacpp:spec_decode_*; emitted = "
             "tokens_predicted_total; unverified = n_decode_total - steps (the prompt pass that yields the first "
             "token, plain decodes without a draft); cut = what emitted = steps + accepted + unverified - cut "
             "leaves (the bonus token after an EOS accepted in the last draft position)",)
    return SourceCounts(totals["steps"], totals["drafted"], totals["accepted"], per_pos, emitted=totals["emitted"],
                        unverified=totals["decodes"] - totals["steps"], k=len(per_pos) if per_pos else None,
                        notes=notes)
