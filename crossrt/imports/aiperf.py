"""NVIDIA AIPerf's speculative decoding statistics as `crossrt import --from aiperf` reads them.

AIPerf (ai-dynamo/aiperf) is a benchmark client that turns an engine's per-request statistics
into one engine-neutral SpecDecodeAcceptanceRecord; its one adapter is vLLM's, so the counts
follow vLLM's counting (one token per request from the prefill, cut = 1 + steps + accepted -
emitted). crossrt reads its per-request export (profile_export.jsonl; prompts matched by
aiperf_prompts.py), its aggregate (profile_export_aiperf.json) and its server metrics export.
Every field, its trap and the tests: docs/import.md, "NVIDIA AIPerf (--from aiperf)".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping, Optional

from crossrt.imports.aiperf_prompts import PromptMismatch, Sent, prompts_of, sent_by
from crossrt.imports.imported import (DIGITS, MAX_K, ImportFailure, PromptCounts, SourceCounts, draft_length,
                                      json_count, summed)
from crossrt.imports.logs import ReadOptions
from crossrt.inputs.prompts import json_lines
from crossrt.records.counts import Counts
from crossrt.records.printable import one_line

ENGINES = ("vllm",)  # engines whose counting crossrt maps (AIPerf's adapters)
TOTALS = ("total_spec_decode_steps", "total_draft_tokens", "total_accepted_draft_tokens")
HISTOGRAM = "pooled_spec_decode_acceptance_histogram"
# server_metrics_export.json: vLLM's counters by family name (docs/server_metrics_json_schema.md)
SERVER_COUNTERS = {"steps": "vllm:spec_decode_num_drafts", "drafted": "vllm:spec_decode_num_draft_tokens",
                   "accepted": "vllm:spec_decode_num_accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATED, FINISHED = "vllm:generation_tokens", "vllm:request_success"
EXACT_FLOAT = 2 ** 53  # whole floats below it are exact; 2^53 itself may be 2^53 + 1 rounded by the parse


def _count(value, where: str) -> int:
    """A count from JSON: AIPerf writes the record's fields as ints and the aggregate's sums as
    floats (16.0), which count only when whole and below 2^53, where a float is exact: the text
    9007199254740993.0 parses to 2^53 (rounded), so 2^53 is refused too."""
    if isinstance(value, float):
        if not (value.is_integer() and 0 <= value < EXACT_FLOAT):
            raise ImportFailure(f"{where} is {str(value)[:40]!r}, not a count (a whole number, exact as a float "
                                "below 2^53)")
        value = int(value)
    return json_count(value, where)


def histogram_counts(histogram: Mapping, where: str) -> dict[int, int]:
    """{accepted draft tokens j: steps}, keys cast from the JSON strings (0 .. MAX_K)."""
    if not isinstance(histogram, dict):
        raise ImportFailure(f"{where}: the acceptance histogram is not an object")
    keys = [j for j in histogram if not (isinstance(j, str) and DIGITS.fullmatch(j) and int(j) <= MAX_K)]
    if keys:
        raise ImportFailure(f"{where}: histogram key {str(keys[0])[:40]!r} is not a draft token count (0 to {MAX_K})")
    return {int(j): _count(n, f"{where}, histogram bucket {j}") for j, n in histogram.items()}


def per_position(histogram: Mapping[int, int], k: int) -> tuple[int, ...]:
    """accepted_per_pos[i] = steps accepting more than i draft tokens: bucket j counts steps that
    accepted exactly j, so it adds to positions 0 .. j-1 (bucket 0 to none)."""
    return tuple(sum(n for j, n in histogram.items() if j > i) for i in range(k))


def _close(given, computed: float) -> bool:
    return isinstance(given, (int, float)) and math.isclose(given, computed, rel_tol=1e-9, abs_tol=1e-9)


def _checked(where: str, steps: int, drafted: int, accepted: int, histogram: Optional[dict[int, int]],
             length=None, rate=None) -> None:
    """The identities AIPerf's record validator enforces, and its printed rates against the counts."""
    if accepted > drafted:
        raise ImportFailure(f"{where}: {accepted} accepted of {drafted} drafted tokens")
    if histogram is not None:
        if sum(histogram.values()) != steps:
            raise ImportFailure(f"{where}: the histogram counts {sum(histogram.values())} steps, not {steps}")
        if sum(j * n for j, n in histogram.items()) != accepted:
            raise ImportFailure(f"{where}: the histogram accepts {sum(j * n for j, n in histogram.items())} "
                                f"draft tokens, not {accepted}")
    printed = Counts(steps=steps, drafted=drafted, accepted=accepted)  # AIPerf's rates are crossrt's tau and alpha
    if length is not None and steps and not _close(length, printed.tau):
        raise ImportFailure(f"{where}: acceptance length {length} is not 1 + {accepted} / {steps}")
    if rate is not None and drafted and not _close(rate, printed.alpha):
        raise ImportFailure(f"{where}: draft acceptance rate {rate} is not {accepted} / {drafted}")


def _object(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise ImportFailure(f"{what} is not a JSON object")
    return value


def _value(metrics: Mapping, tag: str):
    entry = metrics.get(tag)
    return entry.get("value") if isinstance(entry, dict) else None


@dataclass(frozen=True)
class Request:
    """One profiled request: what it sent, and its counts from its spec_decode_acceptance record
    or else its metrics; error says why it has none (it failed, or has no statistics)."""

    sent: Sent
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: Optional[dict[int, int]] = None  # None: metrics only
    k: Optional[int] = None
    completion: Optional[int] = None
    error: Optional[str] = None


def _per_step(record: dict, name: str, steps: int, total: int, where: str) -> None:
    values = record.get(name)
    if values is None:
        return
    if not isinstance(values, list):
        raise ImportFailure(f"{where}: {name} is not a list")
    counted = [_count(v, f"{where}, {name}") for v in values]
    if len(counted) != steps or sum(counted) != total:
        raise ImportFailure(f"{where}: {name} has {len(counted)} steps summing to {sum(counted)}, not {steps} steps "
                            f"summing to {total}")


def _request(line: dict, sent: Sent) -> Request:
    where = sent.where
    metrics = _object(line.get("metrics"), f"{where}: metrics")
    record = line.get("spec_decode_acceptance")
    if record is not None:
        record = _object(record, f"{where}: spec_decode_acceptance")
        if record.get("engine") not in ENGINES:
            raise ImportFailure(f"{where}: engine {str(record.get('engine'))[:40]!r}; crossrt maps the counting of "
                                f"{', '.join(ENGINES)}")
        counts = [_count(record.get(name), f"{where}, {name}")
                  for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")]
        histogram = histogram_counts(record.get("acceptance_histogram"), where)
        k = None if record.get("num_spec_tokens") is None else \
            draft_length(_count(record["num_spec_tokens"], f"{where}, num_spec_tokens"), f"{where}, num_spec_tokens")
        completion = None if record.get("completion_tokens") is None else \
            _count(record["completion_tokens"], f"{where}, completion_tokens")
        completion = _completion(metrics, where) if completion is None else completion
        _per_step(record, "per_step_accepted", counts[0], counts[2], where)
        _per_step(record, "per_step_drafted", counts[0], counts[1], where)
        _checked(where, *counts, histogram, record.get("mean_acceptance_length"), record.get("draft_acceptance_rate"))
    else:
        counts = [_count(_value(metrics, tag), f"{where}, {tag}")
                  for tag in ("spec_decode_steps", "spec_decode_draft_tokens", "spec_decode_accepted_draft_tokens")]
        histogram = k = None
        completion = _completion(metrics, where)
    if completion is not None and completion > 1 + counts[0] + counts[2]:
        raise ImportFailure(f"{where}: completion_tokens {completion} is more than vLLM's counting gives (1 from the "
                            f"prefill + steps {counts[0]} + accepted {counts[2]})")
    percent = _value(metrics, "spec_decode_draft_acceptance_rate")
    _checked(where, *counts, None, _value(metrics, "spec_decode_acceptance_length"),
             percent / 100 if isinstance(percent, (int, float)) else None)
    return Request(sent, *counts, histogram, k, completion)


def _completion(metrics: Mapping, where: str) -> Optional[int]:
    """The response's usage completion_tokens, as AIPerf 0.13 writes it among the request's metrics."""
    value = _value(metrics, "usage_completion_tokens")
    return None if value is None else _count(value, f"{where}, usage_completion_tokens")


def _has_stats(line: dict) -> bool:
    metrics = line.get("metrics")
    return line.get("spec_decode_acceptance") is not None or \
        (isinstance(metrics, dict) and _value(metrics, "spec_decode_steps") is not None)


def _failure(line: dict) -> str:
    error = line["error"]
    said = f"{error.get('type')}: {error.get('message')}" if isinstance(error, dict) else str(error)
    return f"the request failed in AIPerf ({one_line(said[:200])})"


def _requests(text: str) -> tuple[list[Request], int]:
    """The profiled requests in the order AIPerf issued them (session_num, then turn_index, where
    every request has them; else the lines' order), and how many warm-up requests were left out."""
    requests, order, warmup = [], [], 0
    for line, where in json_lines(text, "export", ImportFailure):
        if "metrics" not in line:
            raise ImportFailure(f"{where} is not an AIPerf record (no 'metrics')")
        metadata = line.get("metadata")
        if isinstance(metadata, dict) and metadata.get("benchmark_phase") == "warmup":
            warmup += 1
            continue
        sent, session = sent_by(line, where)
        order.append(None if session is None else (session, sent.turn))
        if line.get("error"):
            requests.append(Request(sent, error=_failure(line)))
        elif not _has_stats(line):
            requests.append(Request(sent, error="no speculative decoding statistics in AIPerf's export (no verify "
                                          "step, or the server did not report them)"))
        else:
            requests.append(_request(line, sent))
    if requests and None not in order:
        issued = sorted(range(len(requests)), key=lambda i: order[i])
        twice = next(((i, j) for i, j in zip(issued, issued[1:]) if order[i] == order[j]), None)
        if twice is not None:
            first, second = sorted(twice)
            raise ImportFailure(f"{requests[first].sent.where} and {requests[second].sent.where.split(' ', 1)[1]} are "
                                f"both session_num {order[first][0]}, turn {order[first][1]}: not one benchmark's "
                                "export")
        requests = [requests[i] for i in issued]
    return requests, warmup


def _prompt_ids(requests: list[Request], options: ReadOptions) -> tuple[list[tuple[str, Optional[str]]], list[str],
                                                                       tuple[str, ...]]:
    """Each request's (prompt id, category: None for --category), notes, and prompts without a request."""
    if options.prompts is None:
        if options.inputs is not None:
            raise PromptMismatch("inputs.json matches requests to --prompts: give --prompts too")
        return [(f"request-{i}", None) for i in range(len(requests))], \
            ["aiperf: prompt ids request-0, request-1, ... in the order AIPerf issued the requests (session_num, "
             "else the lines' order); give --prompts to name them as a prompts file does"], ()
    prompts, how, missing = prompts_of([r.sent for r in requests], options.prompts, options.inputs)
    return [(p.id, p.category) for p in prompts], [f"aiperf: {how}"], missing


def _from_records(text: str, options: ReadOptions) -> SourceCounts:
    every, warmup = _requests(text)
    requests = [r for r in every if r.error is None]
    if not requests:
        kept = [f"{warmup} warm-up"] if warmup else []
        kept += [f"{len(every)} without statistics or failed"] if every else []
        raise ImportFailure("no request with speculative decoding statistics" +
                            (f" ({', '.join(kept)})" if kept else ""))
    steps, drafted, accepted = (sum(getattr(r, name) for r in requests) for name in ("steps", "drafted", "accepted"))
    ks = {r.k for r in requests if r.k is not None}
    if len(ks) > 1:
        raise ImportFailure(f"requests drafted with num_spec_tokens {sorted(ks)}: import each run on its own")
    k = options.k or (ks.pop() if ks else None)
    if k is not None:
        over = [r for r in requests if r.completion and 1 + r.steps + r.accepted - r.completion > k]
        if over:
            r = over[0]
            raise ImportFailure(f"{r.sent.where}: a request of {r.steps} steps and {r.accepted} accepted tokens "
                                f"emitted {r.completion}: {1 + r.steps + r.accepted - r.completion} tokens cut, more "
                                f"than k = {k} (vLLM cuts only its last step's accepted tokens)")
    ids, notes, missing = _prompt_ids(every, options)
    failed = len(every) - len(requests)
    notes += [f"aiperf: {len(every)} request(s), one prompt each: steps = num_spec_steps, drafted = num_draft_tokens, "
              "accepted = num_accepted_draft_tokens (bonus excluded)" +
              (f"; {failed} kept as failed (failed in AIPerf, or without statistics)" if failed else "") +
              (f"; left out: {warmup} warm-up" if warmup else ""),
              "aiperf: no output token ids: profile_export.jsonl's records (metadata, metrics, error, "
              "spec_decode_acceptance) carry none, so parity compares counters request by request, not outputs"]
    histograms = k is not None and all(r.histogram is not None for r in requests)
    if histograms:
        if any(j > k for r in requests for j in r.histogram):
            raise ImportFailure(f"a step accepted more than k = {k} draft tokens")
        notes.append("aiperf: accepted_per_pos[i] = steps whose histogram bucket j (exactly j accepted) is above i")
    completions = all(r.completion is not None for r in requests)
    if completions:
        # vLLM's counting, as crossrt's vllm runtime reads it: each request's first token comes
        # from the prefill (unverified 1), and the importer's identity leaves cut = 1 + steps +
        # accepted - emitted per request (the accepted tokens past a stop or the budget).
        notes.append("aiperf: emitted = usage completion_tokens; per request one unverified token (vLLM's first token "
                     "comes from the prefill), so cut = 1 + steps + accepted - emitted (tokens accepted past a stop)")

    def counts(r: Request) -> SourceCounts:
        return SourceCounts(r.steps, r.drafted, r.accepted, per_position(r.histogram, k) if histograms else None,
                            r.completion if completions else None, (1 if r.completion else 0) if completions else None,
                            k)

    prompts = tuple(PromptCounts(prompt_id, category, None if r.error else counts(r), r.error)
                    for r, (prompt_id, category) in zip(every, ids))
    per_pos = summed([part.counts.accepted_per_pos for part in prompts if part.counts]) if histograms else None
    emitted = sum(r.completion for r in requests) if completions else None
    unverified = sum(1 for r in requests if r.completion) if completions else None
    return SourceCounts(steps, drafted, accepted, per_pos, emitted, unverified, k, notes=tuple(notes), prompts=prompts,
                        missing=missing)


def _from_aggregate(data: dict, options: ReadOptions) -> SourceCounts:
    missing = [name for name in TOTALS if not isinstance(data.get(name), dict)]
    if len(missing) == len(TOTALS) and not any(isinstance(v, dict) and "avg" in v for v in data.values()):
        # Not AIPerf's shape at all (its metrics are {"unit", "avg", ...} objects): say what it is not first.
        what = "a crossrt record (crossrt reads it as it is: no import)" if "schema_version" in data else "a JSON object"
        raise ImportFailure(f"{what}, not an AIPerf export: no metric objects ({', '.join(TOTALS)}) as in "
                            "profile_export_aiperf.json, and no per-request 'metrics' as in profile_export.jsonl")
    if missing:
        raise ImportFailure(f"an AIPerf aggregate without {', '.join(missing)} (speculative decoding was off)")
    steps, drafted, accepted = (_count(data[name].get("avg"), f"{name}.avg") for name in TOTALS)
    histogram = histogram_counts(data[HISTOGRAM], HISTOGRAM) if HISTOGRAM in data else None
    _checked("aggregate", steps, drafted, accepted, histogram)
    notes = ["aiperf: aggregate profile_export_aiperf.json: steps, drafted, accepted from total_spec_decode_steps, "
             "total_draft_tokens, total_accepted_draft_tokens"]
    per_pos = None
    if histogram is not None and options.k is not None:
        if max(histogram, default=0) > options.k:
            raise ImportFailure(f"--k {options.k}, but a step accepted {max(histogram)} draft tokens")
        per_pos = per_position(histogram, options.k)
        notes.append(f"aiperf: accepted_per_pos from {HISTOGRAM} (bucket j: steps accepting exactly j)")
    emitted = unverified = None
    if all(isinstance(data.get(name), dict) for name in ("total_usage_completion_tokens", "completed_request_count")):
        emitted = _count(data["total_usage_completion_tokens"].get("avg"), "total_usage_completion_tokens.avg")
        unverified = _count(data["completed_request_count"].get("avg"), "completed_request_count.avg")
        notes.append("aiperf: emitted = total_usage_completion_tokens; one unverified token per completed request "
                     "(vLLM's first token comes from the prefill), so cut = requests + steps + accepted - emitted")
    return SourceCounts(steps, drafted, accepted, per_pos, emitted, unverified, k=options.k, notes=tuple(notes))


def _server_series(metrics: Mapping, name: str) -> Optional[list[tuple[dict, int]]]:
    """(labels, total increase) of each series of a counter in server_metrics_export.json (keyed
    by its family name, without Prometheus' _total), None where the export lacks the counter."""
    entry = metrics.get(name, metrics.get(name + "_total"))
    if entry is None:
        return None
    series = _object(entry, f"metrics[{name!r}]").get("series")
    if not isinstance(series, list):
        raise ImportFailure(f"metrics[{name!r}].series is not a list")
    found = []
    for at, item in enumerate(series):
        where = f"metrics[{name!r}].series[{at}]"
        stats = _object(_object(item, where).get("stats"), f"{where}.stats")
        labels = item.get("labels") or {}
        found.append((labels if isinstance(labels, dict) else {}, _count(stats.get("total"), f"{where}.stats.total")))
    return found


def _from_server_metrics(metrics: Mapping, options: ReadOptions) -> SourceCounts:
    """AIPerf's server_metrics_export.json: each Prometheus counter's increase over the benchmark
    (stats.total), per series (an endpoint and label set), summed as a /metrics difference is."""
    totals = {role: _server_series(metrics, name) for role, name in SERVER_COUNTERS.items()}
    missing = [SERVER_COUNTERS[role] for role, series in totals.items() if series is None]
    if missing:
        raise ImportFailure(f"an AIPerf server metrics export without {', '.join(missing)} (the server was not vLLM "
                            "with speculative decoding, or AIPerf did not scrape it)")
    steps, drafted, accepted = (sum(n for _, n in totals[role]) for role in ("steps", "drafted", "accepted"))
    _checked("server metrics", steps, drafted, accepted, None)
    positions: dict[int, int] = {}
    for labels, n in _server_series(metrics, PER_POSITION) or ():
        position = str(labels.get("position", ""))
        if not DIGITS.fullmatch(position) or int(position) >= MAX_K:
            raise ImportFailure(f"metrics[{PER_POSITION!r}]: position {position[:40]!r} is not a draft position")
        positions[int(position)] = positions.get(int(position), 0) + n
    k = options.k or (max(positions) + 1 if positions else None)
    per_pos = tuple(positions.get(i, 0) for i in range(k)) if positions and k is not None else None
    if per_pos is not None and (any(i >= k for i in positions) or sum(per_pos) != accepted):
        raise ImportFailure(f"the per-position counters {sorted(positions.items())} do not sum to the {accepted} "
                            f"accepted tokens within k = {k}")
    notes = ["aiperf: server_metrics_export.json: steps, drafted, accepted from the increase (stats.total) of "
             f"{', '.join(SERVER_COUNTERS.values())} over the benchmark's profiling phase (`metrics`; its warm-up is "
             "apart), summed over series (endpoints, engines)" +
             (f"; accepted_per_pos from {PER_POSITION}" if per_pos is not None else "")]
    generated, finished = (_server_series(metrics, name) for name in (GENERATED, FINISHED))
    emitted = unverified = None
    if generated is not None and finished is not None:
        emitted, unverified = sum(n for _, n in generated), sum(n for _, n in finished)
        notes.append(f"aiperf: emitted = {GENERATED}; one unverified token per finished request ({FINISHED}, every "
                     "finished_reason: vLLM's first token comes from the prefill)")
    return SourceCounts(steps, drafted, accepted, per_pos, emitted, unverified, k=k, notes=tuple(notes))


def read_aiperf(text: str, options: ReadOptions) -> SourceCounts:
    # Leading '#' lines are skipped, so a saved export can say where it came from.
    text = "\n".join("" if line.startswith("#") else line for line in text.split("\n"))
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # JSON Lines: one record per line
    metrics = data.get("metrics") if isinstance(data, dict) else None
    aggregate = isinstance(data, dict) and "metrics" not in data
    server = isinstance(metrics, dict) and any(isinstance(v, dict) and "series" in v for v in metrics.values())
    if (aggregate or server) and (options.prompts is not None or options.inputs is not None):
        raise PromptMismatch("--prompts and --inputs match the requests of profile_export.jsonl; this is "
                             f"{'server_metrics_export.json' if server else 'an aggregate'}, which keeps none apart")
    if aggregate:
        return _from_aggregate(data, options)
    if server:
        return _from_server_metrics(metrics, options)
    return _from_records(text, options)
