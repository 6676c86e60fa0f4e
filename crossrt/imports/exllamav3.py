"""exllamav3's per-round draft statistics as `crossrt import --from exllamav3-stats` reads them.

exllamav3 prints no speculative statistics a log reader could use: its examples print only
`accepted / (accepted + rejected)` per job, with no count of verification rounds. What it does
keep is, with `Generator(..., record_draft_stats=True)`, one tuple per verification round in
`job.draft_stats`: `(new_tokens, window, accepted)` in exllamav3 1.6.5 (generator/generator.py
near line 2001, the version crossrt's own exllamav3 runtime pins), `(new_tokens, window,
accepted, ema)` at turboderp-org/exllamav3 4f8ad0121f48 (generator.py near line 1063, with the
dynamic draft window's moving average), where new_tokens is the job's count after the round,
window the draft tokens verified and accepted the draft tokens accepted (the bonus token not
included). Its `eval/spec_decode.py --draft_stats FILE` (at 4f8ad0121f48) writes them as JSON:
a list of {"category", "file", "stats": [round, ...]}, one per prompt. crossrt reads that file,
a bare JSON list of rounds (`json.dump(job.draft_stats, f)`), or objects holding "draft_stats"
(or "stats") beside the job's final-result keys `new_tokens`, `accepted_draft_tokens` and
`rejected_draft_tokens`, which are then checked against the rounds. docs/import.md maps every
field.
"""

from __future__ import annotations

import json
from typing import Optional

from crossrt.imports.logs import ReadOptions
from crossrt.imports.imported import ImportFailure, SourceCounts, draft_length, json_count
from crossrt.records.schema import accepted_per_position

ROUND_KEYS = ("stats", "draft_stats")  # eval/spec_decode.py's key, and the Job attribute's name


def json_body(text: str):
    """The JSON value of text, leading '#' lines skipped (a saved file may carry a note on
    where it came from), or ImportFailure."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    try:
        return json.loads(body)
    except json.JSONDecodeError as error:
        raise ImportFailure(f"not JSON ({error.msg} at line {error.lineno})") from None
    except (ValueError, RecursionError) as error:  # a number of 5,000 digits, nesting too deep
        raise ImportFailure(f"not JSON crossrt reads ({str(error)[:80]})") from None


def _rounds(trace, where: str) -> list[tuple[int, int, int]]:
    if not isinstance(trace, list) or not trace:
        raise ImportFailure(f"{where}: no verification rounds (a list of [new_tokens, window, accepted, ...])")
    rounds = []
    for number, row in enumerate(trace):
        if (not isinstance(row, list) or len(row) not in (3, 4)
                or not all(isinstance(value, int) and not isinstance(value, bool) for value in row[:3])):
            raise ImportFailure(f"{where}, round {number}: {str(row)[:80]} is not [new_tokens, window, accepted] "
                                "or [new_tokens, window, accepted, ema]")
        new_tokens, window, accepted = (json_count(value, f"{where}, round {number}: {name}")
                                        for value, name in zip(row[:3], ("new_tokens", "window", "accepted")))
        draft_length(window, f"{where}, round {number}: window")
        if not 0 <= accepted <= window:
            raise ImportFailure(f"{where}, round {number}: accepted {accepted} of a window of {window}")
        rounds.append((new_tokens, window, accepted))
    return rounds


def _traces(value) -> list[tuple[str, list[tuple[int, int, int]], dict]]:
    """(where, rounds, the job's final-result totals given beside them) per trace."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ImportFailure("neither a list of rounds nor a list of traces with 'stats' or 'draft_stats'")
    if all(isinstance(row, list) for row in value):  # one job's draft_stats
        return [("rounds", _rounds(value, "rounds"), {})]
    traces = []
    for number, trace in enumerate(value):
        key = next((key for key in ROUND_KEYS if isinstance(trace, dict) and key in trace), None)
        if key is None:
            raise ImportFailure(f"trace {number} holds no 'stats' or 'draft_stats' list")
        where = f"trace {number}" + (f" ({str(trace.get('category'))[:40]} - {str(trace['file'])[:80]})"
                                     if "file" in trace else "")
        totals = {name: json_count(trace[name], f"{where}: {name}")
                  for name in ("new_tokens", "accepted_draft_tokens", "rejected_draft_tokens") if name in trace}
        traces.append((where, _rounds(trace[key], where), totals))
    return traces


def _checked(where: str, rounds: list[tuple[int, int, int]], totals: dict) -> Optional[int]:
    """The job's emitted tokens where its totals give them, after checking its totals against
    the rounds (ImportFailure: the numbers are not one job's)."""
    accepted, drafted = sum(r[2] for r in rounds), sum(r[1] for r in rounds)
    if "accepted_draft_tokens" in totals and totals["accepted_draft_tokens"] != accepted:
        raise ImportFailure(f"{where}: the rounds accept {accepted}, accepted_draft_tokens is "
                            f"{totals['accepted_draft_tokens']}")
    if "rejected_draft_tokens" in totals:
        resolved = totals.get("accepted_draft_tokens", accepted) + totals["rejected_draft_tokens"]
        # 1.6.5 counts the positions past a stop token as rejected (resolved = drafted); 4f8ad0121f48
        # leaves them out (resolved < drafted); more than drafted is neither
        if resolved > drafted:
            raise ImportFailure(f"{where}: accepted + rejected draft tokens {resolved} exceed the {drafted} the "
                                "rounds verified")
    emitted = totals.get("new_tokens")
    if emitted is not None and emitted < rounds[-1][0]:
        raise ImportFailure(f"{where}: new_tokens {emitted} is below the {rounds[-1][0]} the last round reached")
    return emitted


def read_exllamav3_stats(text: str, options: ReadOptions) -> SourceCounts:
    traces = _traces(json_body(text))
    steps = drafted = accepted = emitted = unverified = 0
    all_accepted, windows, finals = [], set(), 0
    for where, rounds, totals in traces:
        # A round emits its accepted tokens and one of its own: new_tokens growing by more
        # between rounds came from rounds without a draft, which draft_stats does not list.
        previous = 0
        for number, (new_tokens, window, taken) in enumerate(rounds):
            gap = new_tokens - previous - (taken + 1)
            if gap < 0:
                raise ImportFailure(f"{where}, round {number}: new_tokens went from {previous} to {new_tokens}, "
                                    f"fewer than the {taken + 1} tokens a round accepting {taken} emits")
            unverified, previous = unverified + gap, new_tokens
        final = _checked(where, rounds, totals)
        finals += final is not None
        unverified += (final - previous) if final is not None else 0
        emitted += final if final is not None else previous
        steps, drafted = steps + len(rounds), drafted + sum(r[1] for r in rounds)
        accepted += sum(r[2] for r in rounds)
        all_accepted += [r[2] for r in rounds]
        windows.update(r[1] for r in rounds)
    k = max(windows)
    notes = [f"exllamav3-stats: {len(traces)} trace(s), {steps} verification rounds from job.draft_stats: steps = "
             "rounds, drafted = sum of windows, accepted = sum of accepted (bonus excluded), per position from "
             "each round's accepted count; unverified = tokens new_tokens gained outside rounds"]
    if finals < len(traces):
        notes.append(f"exllamav3-stats: {len(traces) - finals} trace(s) without the job's new_tokens: emitted counts "
                     "their tokens up to the last round (rounds without a draft after it are not in the stats)")
    if len(windows) > 1:
        notes.append(f"exllamav3-stats: windows of {sorted(windows)} tokens (dynamic_draft_tokens or the budget): "
                     f"k = the largest, {k}")
    if options.k is not None and options.k < k:
        raise ImportFailure(f"--k {options.k}, but rounds verified windows of {k} draft tokens")
    return SourceCounts(steps, drafted, accepted, accepted_per_position(all_accepted, options.k or k),
                        emitted=emitted, unverified=unverified, k=options.k or k, notes=tuple(notes))
