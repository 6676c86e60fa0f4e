"""Speculative decoding counters from runtimes' counter endpoints: vLLM's and llama-server's
Prometheus `/metrics` text (a snapshot, or the later of two scrapes with crossrt/importer.py
taking the difference), and vLLM's counters as its spec_decode example prints them. These are
exact counts: no rate is turned back into a count except where noted. docs/import.md maps
every field.
"""

from __future__ import annotations

import re
from typing import Optional

from crossrt.import_logs import ReadOptions
from crossrt.imported import ImportFailure, SourceCounts, position_counts, shown

# The Prometheus text exposition format: name{label="value",...} value [timestamp]. Label
# values may hold braces and escaped quotes (vLLM's cache_config_info does).
SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][\w:]*)(?P<labels>\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})?'
                    r'\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$')
POSITION = re.compile(r'position="(\d+)"')


def _samples(text: str) -> list[tuple[str, str, str]]:
    """(name, labels text, value text) of every sample line; comments and blank lines skipped."""
    found = []
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            match = SAMPLE.match(line.strip())
            if match:
                found.append((match["name"], match["labels"] or "", match["value"]))
    return found


def _count(value: str, name: str, exact_digits: bool) -> int:
    """A counter value as an int. llama-server prints through a C++ stream with 6 significant
    digits, so exponent notation there means a rounded count (exact_digits)."""
    try:
        number = float(value)
    except ValueError:
        raise ImportFailure(f"{name} has the value {value!r}, not a number") from None
    if not number.is_integer() or number < 0 or (exact_digits and "e" in value.lower()):
        raise ImportFailure(f"{name} = {value} is not an exact count (llama-server prints counters with 6 "
                            "significant digits: restart it before a counter passes 999999)")
    return int(number)


def counter_totals(text: str, names: dict[str, str], per_pos_name: str, exact_digits: bool
                   ) -> tuple[dict[str, Optional[int]], Optional[tuple[int, ...]]]:
    """The counters named (by role) summed over their label sets (vLLM: one per engine), and
    the per-position counter by position. A counter the text lacks is None."""
    samples = _samples(text)
    totals: dict[str, Optional[int]] = {}
    for role, name in names.items():
        values = [_count(value, name, exact_digits) for sample, _, value in samples if sample == name]
        totals[role] = sum(values) if values else None
    by_position: dict[int, int] = {}
    for sample, labels, value in samples:
        position = POSITION.search(labels) if sample == per_pos_name else None
        if position:
            index = int(position.group(1))
            by_position[index] = by_position.get(index, 0) + _count(value, per_pos_name, exact_digits)
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
EXAMPLE = {role: re.compile(rf"^{label}: (\d+)$", re.M) for role, label in
           (("steps", "num_drafts"), ("drafted", "num_draft_tokens"), ("accepted", "num_accepted_tokens"),
            ("output", "total_num_output_tokens"))}
EXAMPLE_MEAN = re.compile(r"^mean acceptance length: (\d+\.\d+)$", re.M)
EXAMPLE_RATE = re.compile(r"^acceptance at token (\d+): (\d+\.\d+)$", re.M)


def _read_vllm_example(text: str) -> SourceCounts:
    found = {role: pattern.findall(text) for role, pattern in EXAMPLE.items()}
    if any(len(values) != 1 for values in found.values()):
        raise ImportFailure("a spec_decode example printout holds num_drafts, num_draft_tokens, num_accepted_tokens "
                            "and total_num_output_tokens once each: give one run per file")
    steps, drafted, accepted, output = (int(found[role][0]) for role in ("steps", "drafted", "accepted", "output"))
    mean = EXAMPLE_MEAN.search(text)
    if steps and (mean is None or not shown(1 + accepted / steps, mean.group(1))):
        raise ImportFailure("the printed mean acceptance length does not follow from num_accepted_tokens / num_drafts")
    rates = [rate for _, rate in sorted(EXAMPLE_RATE.findall(text), key=lambda pair: int(pair[0]))]
    per_pos = position_counts(rates, steps, accepted)[0] if steps and rates else None
    notes = ("vllm-metrics: the counters as vLLM's examples/offline_inference/spec_decode.py prints them (summed "
             f"over engines by LLM.get_metrics()); total_num_output_tokens {output} (first tokens from prefill "
             "included) is not split into steps, so emitted = steps + accepted",)
    if rates and per_pos is None:
        notes += (f"vllm-metrics: 'acceptance at token i' is printed to 2 decimals of {steps} drafts: too coarse "
                  f"for counts ({', '.join(rates)})",)
    return SourceCounts(steps, drafted, accepted, per_pos, k=len(rates) or None, notes=notes)


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
