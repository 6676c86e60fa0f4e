"""llama.cpp's n-gram drafting exactly, at the vendored commit (common/ngram-map.cpp).

ngram-simple (common_ngram_simple_draft): the context's last size_n tokens are looked up, most
recent match first, skipping position 0 and the window that ends one token before the context
does; the draft is what followed the match, at most size_m tokens, none at all when fewer than
size_n tokens followed it or when the context holds size_n + size_m + 2 tokens or fewer.
llama-server then cuts it to the step's limit (common/speculative.cpp)."""

from __future__ import annotations

from typing import Sequence

from crossrt.run.acceptance import Proposal
from crossrt.run.lookup.base import LookupDrafter


class LlamaNgramSimple(LookupDrafter):
    """size_n its --spec-ngram-simple-size-n, size_m its --spec-ngram-simple-size-m (crossrt's
    llama-server runs pass k)."""

    def __init__(self, size_n: int, size_m: int):
        super().__init__()
        self.size_n, self.size_m = size_n, size_m

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        self.calls += 1
        # llama-server's slot tokens and the token it sampled last, which the lookup names apart.
        tokens, n, m = list(context[:-1]), self.size_n, self.size_m
        if n_max < 1 or len(tokens) <= n + m + 1:
            return Proposal.chain(())
        pattern = [*tokens[len(tokens) - n + 1:], context[-1]]
        for start in range(len(tokens) - n - 1, 0, -1):
            if tokens[start:start + n] == pattern:
                copied = min(m, len(tokens) - (start + n))
                return Proposal.chain(tokens[start + n:start + n + copied][:n_max] if copied >= n else ())
        return Proposal.chain(())
