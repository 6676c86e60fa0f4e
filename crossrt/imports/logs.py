"""Speculative decoding statistics from runtimes' logs: vLLM's `SpecDecoding metrics` lines,
SGLang's `Decode batch ... accept len` lines and llama-server's per-request `draft acceptance`
line, each summed over the whole file. One parser per format; each names the source file and
version it follows. Logs print rounded rates beside some counts: crossrt/imports/imported.py recovers
the counts they leave out, or refuses. docs/import.md maps every field.

A line that carries a format's marker is read whole or refused with its line number: a field
named but not readable (negative, not a number, cut short), counts that contradict each other,
or a count beyond what any runtime keeps. No such line is dropped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from crossrt.inputs.prompts import Prompt
from crossrt.imports.imported import (MAX_K, ImportFailure, SourceCounts, count, draft_length, drafts_behind, fitting, shown,
                              summed)


@dataclass(frozen=True)
class ReadOptions:
    k: Optional[int] = None  # draft tokens per step, where the text does not say it
    decode_log_interval: int = 40  # SGLang's --decode-log-interval (its default: 40)
    prompts: Optional[tuple[Prompt, ...]] = None  # aiperf: the prompts its requests ran (--prompts)
    inputs: Optional[str] = None  # aiperf: the text of its inputs.json, each request's payload


# A number ends at a separator or the line's end: "2.0x" or "0.5abc" is garbage, not 2.0 or 0.5
# with something after it (a regular expression stops where its digits stop).
END = r"(?=[,;)\s]|$)"


def _numbered(text: str, marker: str) -> list[tuple[int, str]]:
    return [(number, line) for number, line in enumerate(text.splitlines(), start=1) if marker in line]


def _field(pattern: re.Pattern, line: str, label: str, where: str) -> Optional[str]:
    """The value pattern reads after label in line; None where line does not name label,
    ImportFailure where it names it with a value crossrt cannot read."""
    if label not in line:
        return None
    match = pattern.search(line)
    if match is None:
        at = line.index(label)
        raise ImportFailure(f"{where}: cannot read '{line[at:at + len(label) + 24]}': {label} "
                            "followed by a value of another form (negative, not a number, cut short)")
    return match.group(1)


def _excerpt(line: str) -> str:
    return line.strip()[-80:]


# vLLM V1's SpecDecodingLogging.log (vllm/v1/spec_decode/metrics.py, vllm-project/vllm at
# ee4ceaae5953): one line per logging interval (the counts reset after each), "SpecDecoding
# metrics: Mean acceptance length: %.2f, ..., Accepted: %d tokens, Drafted: %d tokens,
# Per-position acceptance rate: %.3f, ..., Avg Draft acceptance rate: %.1f%%". Releases since
# 0.8.5 print the same fields in other orders (and 0.8.x "Draft acceptance rate" first), so each
# is read by its name. The number of drafts is not printed: 1 + accepted / drafts is.
VLLM_MARKER = "SpecDecoding metrics:"
VLLM_MEAN = re.compile(r"Mean acceptance length: (\d+\.\d+)" + END)
VLLM_ACCEPTED = re.compile(r"Accepted: (\d+) tokens")
VLLM_DRAFTED = re.compile(r"Drafted: (\d+) tokens")
VLLM_RATES = re.compile(r"Per-position acceptance rate: (\d\.\d+(?:, \d\.\d+)*)(?=,\s*[A-Za-z]|\s*$)")
VLLM_RATE = re.compile(r"Draft acceptance rate: (\d+\.\d)%")
VLLM_VERSION = re.compile(r"vLLM API server version (\S+)|V1 LLM engine \(v(\S+?)\)")


def read_vllm_log(text: str, options: ReadOptions) -> SourceCounts:
    lines = _numbered(text, VLLM_MARKER)
    if not lines:
        raise ImportFailure(f"no vLLM '{VLLM_MARKER}' line: not a vLLM V1 server or offline log with stats on")
    steps = drafted = accepted = 0
    per_pos, ks, notes = [], set(), []
    for number, line in lines:
        where = f"line {number}"
        counts = [_field(VLLM_ACCEPTED, line, "Accepted:", where), _field(VLLM_DRAFTED, line, "Drafted:", where)]
        if None in counts:
            raise ImportFailure(f"{where}: a '{VLLM_MARKER}' line without 'Accepted: N tokens, Drafted: N tokens'")
        line_accepted, line_drafted = count(counts[0], f"{where}: Accepted"), count(counts[1], f"{where}: Drafted")
        if line_accepted > line_drafted:
            raise ImportFailure(f"{where}: Accepted {line_accepted} tokens of Drafted {line_drafted}: more than drafted")
        if line_drafted == 0:
            continue  # an interval without drafts counts nothing
        mean = _field(VLLM_MEAN, line, "Mean acceptance length:", where)
        if mean is None:
            raise ImportFailure(f"{where}: this vLLM version prints no mean acceptance length, so the line does not "
                                "give the number of drafts; import its /metrics counters (--from vllm-metrics)")
        rate = _field(VLLM_RATE, line, "Draft acceptance rate:", where)
        if rate is not None and not shown(100 * line_accepted / line_drafted, rate):
            raise ImportFailure(f"{where}: draft acceptance rate {rate}% is not {line_accepted}/{line_drafted}")
        rates_text = _field(VLLM_RATES, line, "Per-position acceptance rate:", where)
        rates = rates_text.split(", ") if rates_text else []
        k = draft_length(len(rates), f"{where}: per-position rates") if rates else options.k  # one per position
        ks.add(k)
        found = drafts_behind(where, line_accepted, line_drafted, mean, rates, k)
        notes += [found.assumption] if found.assumption else []
        steps, drafted, accepted = steps + found.steps, drafted + line_drafted, accepted + line_accepted
        per_pos.append(found.accepted_per_pos)
    if len(ks) > 1:
        raise ImportFailure(f"the lines print different numbers of per-position rates ({sorted(map(str, ks))}): "
                            "more than one speculative configuration in one file")
    match = VLLM_VERSION.search(text)
    notes.insert(0, f"vllm-log: {len(lines)} '{VLLM_MARKER}' lines summed; drafts per line are the count that "
                    "gives back the printed mean acceptance length and per-position rates (the line prints "
                    "accepted and drafted tokens, not drafts)")
    return SourceCounts(steps, drafted, accepted, summed(per_pos), k=ks.pop() if ks else None,
                        version=(match.group(1) or match.group(2)) if match else None, notes=tuple(notes))


# SGLang's scheduler decode log (python/sglang/srt/managers/scheduler_metrics_mixin.py,
# log_decode_stats, sgl-project/sglang at 01bb3c807f7e): every --decode-log-interval decode
# passes, "Decode batch, #running-req: B, ..., accept len: %.2f, accept rate: %.2f, ...", where,
# over the passes since the previous line, accept len = (accepted + verifies) / verifies and
# accept rate = (accepted + verifies) / (verifies * speculative_num_draft_tokens): the bonus
# token is in both and num_draft_tokens counts the root (the verified last token). Each pass
# verifies one draft per running request; counts are printed for neither.
SGLANG_DECODE = re.compile(r"Decode batch\W.*?#running-req: (\d+),.*?accept len: (\d+\.\d+)" + END
                           + r"(?:, accept rate: (\d+\.\d+)" + END + ")?")
SGLANG_DECODE_MARKER = re.compile(r"Decode batch\W")
SGLANG_PREFILL = "Prefill batch"
SGLANG_RANK = re.compile(r"^\[[\d\-: .]+?(?: ([A-Z]+\d+(?: [A-Z]+\d+)*))?\]")  # "[date TP0]", "[date DP1 TP0]"


@dataclass(frozen=True)
class _Window:
    line: int
    verifies: int
    accepted: int
    rate: Optional[str]


def _sglang_windows(text: str, interval: int) -> tuple[list[_Window], int]:
    """Windows with a known number of verify passes, and how many decode lines there were. A
    window's passes are interval x B when the previous scheduler line of the same rank was a
    decode line with the same B and no prefill came between: no request joined, and a request
    that left would have lowered B."""
    previous: dict[str, Optional[int]] = {}
    windows, decodes = [], 0
    for number, line in enumerate(text.splitlines(), start=1):
        rank = SGLANG_RANK.match(line)
        rank = (rank.group(1) or "") if rank else ""
        if SGLANG_PREFILL in line:
            previous[rank] = None
            continue
        if not SGLANG_DECODE_MARKER.search(line):
            continue
        match = SGLANG_DECODE.search(line)
        if not match:
            raise ImportFailure(f"line {number}: a decode line without a readable '#running-req: N, ... accept len: "
                                f"L.LL' (negative, not a number, cut short, or speculative decoding off): "
                                f"...{_excerpt(line)}")
        decodes += 1
        running, length, rate = count(match.group(1), f"line {number}: #running-req"), match.group(2), match.group(3)
        if rate is None and "accept rate:" in line:
            at = line.index("accept rate:")
            raise ImportFailure(f"line {number}: cannot read '{line[at:at + 36]}': accept rate followed by a value "
                                "of another form (not a number, cut short)")
        if not 1 <= float(length) <= MAX_K + 1:
            raise ImportFailure(f"line {number}: accept len {length[:40]} is not between 1 (each verify pass emits a "
                                f"token) and {MAX_K + 1} (a whole draft and its bonus)")
        if running and previous.get(rank) == running:
            verifies = interval * running
            excess, unit = float(length) - 1, 10.0 ** -len(length.partition(".")[2])
            fitting_counts = fitting(lambda a: (a + verifies) / verifies, length, 0,
                                     math.ceil((excess + unit) * verifies))
            if len(fitting_counts) != 1:
                raise ImportFailure(f"line {number}: accept len {length} over {verifies} verify passes fits "
                                    f"{len(fitting_counts)} accepted counts, not one")
            windows.append(_Window(number, verifies, fitting_counts[0], rate))
        previous[rank] = running
    return windows, decodes


def read_sglang_log(text: str, options: ReadOptions) -> SourceCounts:
    windows, decodes = _sglang_windows(text, options.decode_log_interval)
    if not decodes:
        raise ImportFailure("no SGLang 'Decode batch ... accept len' line: not an SGLang server log with "
                            "speculative decoding on")
    if not windows:
        raise ImportFailure(f"none of the {decodes} decode lines follows another with the same #running-req: no "
                            "window has a known number of verify passes")
    if options.k is not None:
        width, source = options.k + 1, "--k (num_draft_tokens = k + 1)"
    else:
        rated = [w for w in windows if w.rate is not None]
        fitting = [n for n in range(2, 65) if rated and all(
            shown((w.accepted + w.verifies) / (w.verifies * n), w.rate) for w in rated)]
        if len(fitting) != 1:
            raise ImportFailure("the accept rates do not give SGLang's --speculative-num-draft-tokens "
                                f"({'fits: ' + str(fitting) if fitting else 'none fits'}): give --k, its value minus 1")
        width, source = fitting[0], "the printed accept rates"
    steps = sum(w.verifies for w in windows)
    notes = (f"sglang-log: {len(windows)} of {decodes} decode windows kept "
             f"(lines {windows[0].line}-{windows[-1].line}): "
             f"those after another decode line of the same rank with the same #running-req B and no prefill "
             f"between, so verify passes = {options.decode_log_interval} (--decode-log-interval) x B; accepted = "
             "the one count that gives back the printed accept len",
             f"sglang-log: num_draft_tokens {width} (root included) from {source}: drafted = {width - 1} per pass")
    return SourceCounts(steps, steps * (width - 1), sum(w.accepted for w in windows), None, k=width - 1,
                        notes=notes)


# llama-server's per-request statistics (tools/server/server-context.cpp, print_timings, at
# llama.cpp 0c1e57098, the commit crossrt builds): "draft acceptance = %0.5f (%5d accepted /
# %5d generated), mean len = %5.2f" with mean len = 1 + accepted / verification steps. Later
# builds print "mean acceptance length = %5.2f, acceptance rate per position = (%.3f, ...)"
# (ggml-org/llama.cpp PR 24536). The startup line "build: N (commit)" names the build.
LLAMA_LINE = re.compile(r"draft acceptance = (\d\.\d+) \(\s*(\d+) accepted /\s*(\d+) generated\), "
                        r"mean (?:len|acceptance length) =\s*(\d+\.\d+)" + END +
                        r"(?:, acceptance rate per position = \((\d\.\d+(?:, \d\.\d+)*)\))?")
LLAMA_BUILD = re.compile(r"build: (\d+) \(([0-9a-f]+)\)")


def read_llama_server_log(text: str, options: ReadOptions) -> SourceCounts:
    requests = []
    for number, line in _numbered(text, "draft acceptance ="):
        match = LLAMA_LINE.search(line)
        if match is None:
            raise ImportFailure(f"line {number}: a 'draft acceptance' line crossrt cannot read (a count negative or not "
                                f"a number, or the line cut short): ...{_excerpt(line)}")
        requests.append((number, match))
    if not requests:
        raise ImportFailure("no llama-server 'draft acceptance = ...' line: not a llama-server log of a run with a "
                            "drafter (it prints one per request that drafted)")
    steps = drafted = accepted = 0
    per_pos, ks, notes = [], set(), []
    for number, match in requests:
        ratio, line_accepted, line_drafted, mean, rates = match.groups()
        if rates is None and "acceptance rate per position" in line:
            raise ImportFailure(f"line {number}: its acceptance rates per position cannot be read (cut short?): "
                                f"...{_excerpt(line)}")
        line_accepted = count(line_accepted, f"line {number}: accepted")
        line_drafted = count(line_drafted, f"line {number}: generated")
        if not 0 < line_drafted or line_accepted > line_drafted:
            raise ImportFailure(f"line {number}: {line_accepted} accepted / {line_drafted} generated: a request that "
                                "drafted accepts at most what it generated, and generated at least one")
        if abs(float(ratio) - line_accepted / line_drafted) > 1e-5:  # printed from a float
            raise ImportFailure(f"line {number}: draft acceptance {ratio} is not {line_accepted}/{line_drafted}")
        rates = rates.split(", ") if rates else []
        k = draft_length(len(rates), f"line {number}: per-position rates") if rates else options.k
        ks.add(k)
        found = drafts_behind(f"line {number}", line_accepted, line_drafted, mean, rates, k)
        notes += [found.assumption] if found.assumption else []
        steps, drafted, accepted = steps + found.steps, drafted + line_drafted, accepted + line_accepted
        per_pos.append(found.accepted_per_pos)
    if len(ks) > 1:
        raise ImportFailure("the requests print different numbers of per-position rates: more than one draft length")
    build = LLAMA_BUILD.search(text)
    notes.insert(0, f"llama-server-log: {len(requests)} per-request 'draft acceptance' lines summed; steps per "
                    "request are the count that gives back the printed mean length (the line prints accepted "
                    "and drafted tokens, not steps)")
    return SourceCounts(steps, drafted, accepted, summed(per_pos), k=ks.pop(),
                        version=build.group(1) if build else None, build=build.group(2) if build else None,
                        notes=tuple(notes))
