"""llama-server's statistics translated into crossrt's counters (backends/llama_server.py runs
the server).

Where the counters come from (llama.cpp tools/server/server-context.cpp):
- drafted, accepted: the response's `timings.draft_n` / `draft_n_accepted` (absent when nothing
  was drafted: 0). Acceptance is counted before the stop check, so a bonus token after an
  accepted EOS counts.
- steps, accepted_per_pos: deltas of /metrics `spec_decode_num_drafts_total` and
  `spec_decode_num_accepted_tokens_per_pos_total`; the server adds a request's counts to these
  totals when it releases the slot, just after sending the response, so crossrt waits until
  `tokens_predicted_total` shows the request.
- unverified: target decodes that are not steps (`n_decode_total` delta minus steps): the prompt
  pass that yields the first token, and plain decodes where no draft was made (one token of
  budget left), the draft was empty (p_min stopped it at once) or dropped (shorter than n_min). The prompt is one batch
  (-b n_ctx), and the token that ends generation is sampled without a decode after it.
- cut: what the identity emitted = steps + accepted + unverified - cut leaves; by the server's
  algorithm it is 1 exactly when an EOS was accepted in the last draft position (the bonus
  token after it is dropped) and 0 otherwise, which is checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from crossrt.records.schema import Counters, UnfitCounts

METRIC = re.compile(r'^llamacpp:(\w+)(?:\{position="(\d+)"\})? (\S+)$', re.M)


@dataclass(frozen=True)
class MetricsCounters:
    """The /metrics counters crossrt reads, as totals since the server started."""

    drafts: int  # verification steps (non-empty drafts)
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]
    decodes: int  # target decode calls: prompt batches, steps and plain decodes
    predicted: int  # tokens generated

    @classmethod
    def parse(cls, text: str) -> "MetricsCounters":
        values: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        for name, position, value in METRIC.findall(text):
            if position:
                per_pos[int(position)] = float(value)
            else:
                values[name] = float(value)
        try:
            return cls(drafts=int(values["spec_decode_num_drafts_total"]),
                       draft_tokens=int(values["spec_decode_num_draft_tokens_total"]),
                       accepted=int(values["spec_decode_num_accepted_tokens_total"]),
                       accepted_per_pos=tuple(int(per_pos[i]) for i in sorted(per_pos)),
                       decodes=int(values["n_decode_total"]),
                       predicted=int(values["tokens_predicted_total"]))
        except KeyError as missing:
            raise ValueError(f"/metrics has no {missing.args[0]}") from None

    def minus(self, before: "MetricsCounters") -> "MetricsCounters":
        # Positions appear in /metrics only once some step has been verified.
        width = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        now, then = _padded(self.accepted_per_pos, width), _padded(before.accepted_per_pos, width)
        return MetricsCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                      self.accepted - before.accepted, tuple(a - b for a, b in zip(now, then)),
                      self.decodes - before.decodes, self.predicted - before.predicted)

    @property
    def largest(self) -> int:
        return max(self.drafts, self.draft_tokens, self.accepted, self.decodes, self.predicted,
                   *self.accepted_per_pos)


def _padded(counts: tuple[int, ...], width: int) -> tuple[int, ...]:
    return counts[:width] + (0,) * (width - len(counts))


def speculative_counters(emitted: int, stop_reason: str, timings: dict, delta: MetricsCounters,
                         k: int) -> tuple[Counters, Optional[UnfitCounts]]:
    """crossrt's counters for one speculative request (module docstring: where each comes from),
    and, when the server's numbers do not fit its schedule as crossrt reads it, what did not
    fit: the counters then keep the server's steps, drafted and accepted, and take unverified
    from the identity (cut 0, or 1 after an EOS in the last draft position); the prompt is kept."""
    drafted = int(timings.get("draft_n", 0))
    accepted = int(timings.get("draft_n_accepted", 0))
    steps = delta.drafts
    unverified = delta.decodes - steps
    cut = steps + accepted + unverified - emitted
    problems = []
    if (delta.draft_tokens, delta.accepted) != (drafted, accepted):
        problems.append(f"/metrics drafted/accepted {delta.draft_tokens}/{delta.accepted} != "
                        f"timings {drafted}/{accepted}")
    if unverified < 1:
        problems.append(f"{delta.decodes} decodes for {steps} steps leave no prompt pass")
    if not 0 <= cut <= (1 if stop_reason == "eos" else 0):
        problems.append(f"cut {cut} (steps {steps} + accepted {accepted} + unverified {unverified} "
                        f"- emitted {emitted}) with stop {stop_reason}")
    per_pos = delta.accepted_per_pos
    if any(per_pos[k:]):
        problems.append(f"acceptance at draft positions beyond k={k}: {list(per_pos)}")
    unfit = None
    if problems:
        raw = {"emitted": emitted, "timings.draft_n": drafted, "timings.draft_n_accepted": accepted,
               "metrics.drafts": delta.drafts, "metrics.draft_tokens": delta.draft_tokens,
               "metrics.accepted": delta.accepted, "metrics.decodes": delta.decodes,
               "metrics.predicted": delta.predicted,
               **{f"metrics.accepted_per_pos.{i}": n for i, n in enumerate(per_pos)}}
        cut = 1 if stop_reason == "eos" and steps + accepted >= emitted else 0
        unverified = emitted + cut - steps - accepted
        unfit = UnfitCounts(tuple(problems), raw, "steps from /metrics drafts; drafted and accepted from "
                            f"timings; cut {cut} by the stop; unverified = emitted + cut - steps - accepted")
        if sum(per_pos) != accepted or any(per_pos[k:]):
            per_pos = None  # the per-position totals do not match what is kept
    return Counters(steps=steps, drafted=drafted, accepted=accepted, emitted=emitted,
                    accepted_per_pos=_padded(per_pos, k) if per_pos is not None else None,
                    step_drafted=None, step_accepted=None, unverified=unverified, cut=cut), unfit
