"""crossrt's own prompt lookup: the token that followed the most recent earlier occurrence of the
longest suffix of the text so far (prompt, emitted output, its own draft), from ngram_max tokens
down to ngram_min, looked up again for every draft token. It proposes tokens, never logits, and
its draft ends where nothing matches. No runtime drafts this way: transformers' and vLLM's copy
an earliest match's continuation whole (docs/ngram.md)."""

from __future__ import annotations

from typing import Optional, Sequence

from crossrt.speculative.acceptance import Proposal
from crossrt.speculative.lookup.base import LookupDrafter


class PromptLookup(LookupDrafter):
    """crossrt's prompt lookup; ends: tokens after which a draft stops (the schedule's EOS cut)."""

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, ends: frozenset[int] = frozenset()):
        super().__init__()
        self.ngram_max, self.ngram_min, self.ends = ngram_max, ngram_min, ends

    def proposal(self, tokens: Sequence[int]) -> Optional[int]:
        """The continuation of tokens' longest matching suffix, None when there is none."""
        n_tokens = len(tokens)
        for n in range(min(self.ngram_max, n_tokens - 1), self.ngram_min - 1, -1):
            suffix = list(tokens[n_tokens - n:])
            for start in range(n_tokens - n - 1, -1, -1):  # most recent earlier occurrence first
                if list(tokens[start:start + n]) == suffix:
                    return int(tokens[start + n])
        return None

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        text = list(context)
        draft: list[int] = []
        while len(draft) < n_max:
            self.calls += 1
            token = self.proposal(text)
            if token is None:
                break
            draft.append(token)
            text.append(token)
            if token in self.ends:
                break
        return Proposal.chain(draft)
