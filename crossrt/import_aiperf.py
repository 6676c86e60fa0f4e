"""NVIDIA AIPerf's speculative decoding statistics as `crossrt import --from aiperf` reads them.

AIPerf (ai-dynamo/aiperf) is a benchmark client: for each request it turns the engine's
per-request statistics into one engine-neutral `SpecDecodeAcceptanceRecord`
(src/aiperf/common/models/spec_decode_models.py; docs/reference/spec-decode-acceptance.md): its
`num_spec_steps`, `num_draft_tokens`, `num_accepted_draft_tokens` (bonus excluded),
`acceptance_histogram` {accepted draft tokens j: steps accepting exactly j} (bonus excluded,
JSON keys are strings), `mean_acceptance_length` = 1 + accepted / steps (bonus included),
`draft_acceptance_rate` = accepted / drafted (a fraction here, a percent in its metrics),
`num_spec_tokens` (k, where the engine has one), `completion_tokens` (the response's usage) and,
at vLLM's `detailed` level, `per_step_accepted` / `per_step_drafted`. Its only adapter is vLLM's
(`--per-request-spec-decode-stats`), so the counts follow vLLM's counting.

crossrt reads either export:
- `profile_export.jsonl`, one `MetricRecordInfo` per request: `metrics` {tag: {"value", "unit"}}
  with `spec_decode_steps`, `spec_decode_draft_tokens`, `spec_decode_accepted_draft_tokens`,
  `spec_decode_acceptance_length`, `spec_decode_draft_acceptance_rate` (percent), and, at
  `--export-level records`, the whole record under `spec_decode_acceptance`;
- `profile_export_aiperf.json`, the run's aggregate: `total_spec_decode_steps`,
  `total_draft_tokens`, `total_accepted_draft_tokens` (each {"avg": sum, ...}) and
  `pooled_spec_decode_acceptance_histogram`.
Warm-up requests (metadata.benchmark_phase "warmup"), failed ones and those without statistics
are left out, as AIPerf's own profiling metrics leave them out. docs/import.md maps every field.
"""

from __future__ import annotations

import json
import math
from typing import Mapping, Optional

from crossrt.import_logs import ReadOptions
from crossrt.imported import DIGITS, MAX_K, ImportFailure, SourceCounts, draft_length, json_count

ENGINES = ("vllm",)  # engines whose counting crossrt maps (AIPerf's adapters)
TOTALS = ("total_spec_decode_steps", "total_draft_tokens", "total_accepted_draft_tokens")
HISTOGRAM = "pooled_spec_decode_acceptance_histogram"
EXACT_FLOAT = 2 ** 53  # the largest whole float every count below it is exact as


def _count(value, where: str) -> int:
    """A count from JSON: AIPerf writes the record's fields as ints and the aggregate's sums as
    floats (16.0), which count only when whole and within 2^53, where floats are exact."""
    if isinstance(value, float):
        if not (value.is_integer() and 0 <= value <= EXACT_FLOAT):
            raise ImportFailure(f"{where} is {str(value)[:40]!r}, not a count (a whole number, exact as a float "
                                "up to 2^53)")
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
    if length is not None and steps and not _close(length, 1 + accepted / steps):
        raise ImportFailure(f"{where}: acceptance length {length} is not 1 + {accepted} / {steps}")
    if rate is not None and drafted and not _close(rate, accepted / drafted):
        raise ImportFailure(f"{where}: draft acceptance rate {rate} is not {accepted} / {drafted}")


def _value(metrics: Mapping, tag: str):
    entry = metrics.get(tag)
    return entry.get("value") if isinstance(entry, dict) else None


class _Request:
    """One request's counts, from its spec_decode_acceptance record or else its metrics."""

    def __init__(self, line: dict, where: str):
        record, metrics = line.get("spec_decode_acceptance"), line.get("metrics") or {}
        self.histogram, self.k, self.completion = None, None, None
        if isinstance(record, dict):
            engine = record.get("engine")
            if engine not in ENGINES:
                raise ImportFailure(f"{where}: engine {engine!r}; crossrt maps the counting of {', '.join(ENGINES)}")
            self.steps = _count(record.get("num_spec_steps"), f"{where}, num_spec_steps")
            self.drafted = _count(record.get("num_draft_tokens"), f"{where}, num_draft_tokens")
            self.accepted = _count(record.get("num_accepted_draft_tokens"), f"{where}, num_accepted_draft_tokens")
            self.histogram = histogram_counts(record.get("acceptance_histogram"), where)
            if record.get("num_spec_tokens") is not None:
                self.k = draft_length(_count(record["num_spec_tokens"], f"{where}, num_spec_tokens"),
                                      f"{where}, num_spec_tokens")
            if record.get("completion_tokens") is not None:
                self.completion = _count(record["completion_tokens"], f"{where}, completion_tokens")
            for name, total in (("per_step_accepted", self.accepted), ("per_step_drafted", self.drafted)):
                steps = record.get(name)
                if steps is not None and (len(steps) != self.steps or sum(steps) != total):
                    raise ImportFailure(f"{where}: {name} has {len(steps)} steps summing to {sum(steps)}, "
                                        f"not {self.steps} steps summing to {total}")
            _checked(where, self.steps, self.drafted, self.accepted, self.histogram,
                     record.get("mean_acceptance_length"), record.get("draft_acceptance_rate"))
        else:
            self.steps = _count(_value(metrics, "spec_decode_steps"), f"{where}, spec_decode_steps")
            self.drafted = _count(_value(metrics, "spec_decode_draft_tokens"), f"{where}, spec_decode_draft_tokens")
            self.accepted = _count(_value(metrics, "spec_decode_accepted_draft_tokens"),
                                   f"{where}, spec_decode_accepted_draft_tokens")
        percent = _value(metrics, "spec_decode_draft_acceptance_rate")
        _checked(where, self.steps, self.drafted, self.accepted, None, _value(metrics, "spec_decode_acceptance_length"),
                 percent / 100 if isinstance(percent, (int, float)) else None)


def _has_stats(line: dict) -> bool:
    return isinstance(line.get("spec_decode_acceptance"), dict) or \
        _value(line.get("metrics") or {}, "spec_decode_steps") is not None


def _requests(text: str) -> tuple[list[_Request], list[str]]:
    requests, skipped = [], {"warm-up": 0, "failed": 0, "without speculative statistics": 0}
    for number, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        where = f"line {number}"
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as error:
            raise ImportFailure(f"{where} is not JSON ({error.msg})") from None
        if not isinstance(line, dict) or "metrics" not in line:
            raise ImportFailure(f"{where} is not an AIPerf record (no 'metrics')")
        if (line.get("metadata") or {}).get("benchmark_phase") == "warmup":
            skipped["warm-up"] += 1
        elif line.get("error"):
            skipped["failed"] += 1
        elif not _has_stats(line):
            skipped["without speculative statistics"] += 1
        else:
            requests.append(_Request(line, where))
    return requests, [f"{n} {what}" for what, n in skipped.items() if n]


def _from_records(text: str, options: ReadOptions) -> SourceCounts:
    requests, skipped = _requests(text)
    if not requests:
        raise ImportFailure("no request with speculative decoding statistics" +
                            (f" ({', '.join(skipped)} left out)" if skipped else ""))
    steps, drafted, accepted = (sum(getattr(r, name) for r in requests) for name in ("steps", "drafted", "accepted"))
    ks = {r.k for r in requests if r.k is not None}
    if len(ks) > 1:
        raise ImportFailure(f"requests drafted with num_spec_tokens {sorted(ks)}: import each run on its own")
    k = options.k or (ks.pop() if ks else None)
    notes = [f"aiperf: {len(requests)} request(s) summed: steps = num_spec_steps, drafted = num_draft_tokens, "
             "accepted = num_accepted_draft_tokens (bonus excluded)" +
             (f"; left out: {', '.join(skipped)}" if skipped else "")]
    per_pos = emitted = unverified = None
    if k is not None and all(r.histogram is not None for r in requests):
        if any(j > k for r in requests for j in r.histogram):
            raise ImportFailure(f"a step accepted more than k = {k} draft tokens")
        per_pos = tuple(map(sum, zip(*(per_position(r.histogram, k) for r in requests))))
        notes.append("aiperf: accepted_per_pos[i] = steps whose histogram bucket j (exactly j accepted) is above i")
    if all(r.completion is not None for r in requests):
        # Per request, the tokens beyond its steps' (first token from the prefill, plain decodes)
        # are unverified and a shortfall is cut (a step's tokens dropped at a stop).
        emitted = sum(r.completion for r in requests)
        unverified = sum(max(0, r.completion - r.steps - r.accepted) for r in requests)
        notes.append("aiperf: emitted = usage completion_tokens; per request, tokens beyond steps + accepted are "
                     "unverified (vLLM's first token comes from the prefill) and a shortfall is cut")
    return SourceCounts(steps, drafted, accepted, per_pos, emitted, unverified, k, notes=tuple(notes))


def _from_aggregate(data: dict, options: ReadOptions) -> SourceCounts:
    missing = [name for name in TOTALS if not isinstance(data.get(name), dict)]
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
    return SourceCounts(steps, drafted, accepted, per_pos, k=options.k, notes=tuple(notes))


def read_aiperf(text: str, options: ReadOptions) -> SourceCounts:
    # Leading '#' lines are skipped, so a saved export can say where it came from.
    text = "\n".join("" if line.startswith("#") else line for line in text.split("\n"))
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # JSON Lines: one record per line
    if isinstance(data, dict) and "metrics" not in data:
        return _from_aggregate(data, options)
    return _from_records(text, options)
