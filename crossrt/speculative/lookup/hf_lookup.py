"""transformers' prompt lookup exactly: PromptLookupCandidateGenerator.get_candidates (5.24,
generation/candidate_generator.py). It differs from crossrt's PromptLookup in three ways: the
earliest match wins (windows scanned left to right, the suffix's own window included, which has
nothing after it), the draft is the match's continuation copied whole (up to k tokens, ending
where the context ends), and it is cut before its first EOS, with no other match tried when
that leaves nothing. Its length is not cut at the token budget: only with one token of budget
left is there no draft (past_budget)."""

from __future__ import annotations

from typing import Sequence

from crossrt.speculative.acceptance import Proposal
from crossrt.speculative.lookup.base import LookupDrafter


class HfPromptLookup(LookupDrafter):
    """ngram_max is its max_matching_ngram_size, eos its EOS ids (the target generation config's),
    a step's k its prompt_lookup_num_tokens."""

    past_budget = True

    def __init__(self, ngram_max: int = 2, eos: frozenset[int] = frozenset()):
        super().__init__()
        self.ngram_max, self.eos = ngram_max, eos

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        self.calls += 1
        tokens = list(context)
        n_tokens = len(tokens)
        if n_max < 1:  # the schedule allows none: transformers' one token of budget left
            return Proposal.chain(())
        for n in range(min(self.ngram_max, n_tokens - 1), 0, -1):
            suffix = tokens[n_tokens - n:]
            for start in range(n_tokens - n + 1):  # the earliest match first, as torch's nonzero() orders them
                if tokens[start:start + n] != suffix or start + n >= n_tokens:
                    continue
                # transformers also caps the end at max_length (prompt + budget), which the
                # context never reaches; its logits-processor check forbids nothing under greedy
                # decoding without processors (AssistedSession refuses a run with any).
                draft = tokens[start + n:start + n + n_max]
                ended = [i for i, token in enumerate(draft) if token in self.eos]
                return Proposal.chain(draft[:ended[0]] if ended else draft)
        return Proposal.chain(())
