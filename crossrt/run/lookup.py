"""A prompt-lookup (n-gram) drafter as a ModelSession, so that crossrt's driven loop, its oracle
and simulators, trees and policies run it unchanged (docs/ceiling.md).

Its "logits" after each token: the token that followed the most recent earlier occurrence of
the longest suffix of the text so far (prompt, accepted output and its own draft tokens), from
max_ngram tokens down to min_ngram, as prompt-lookup decoding (transformers'
prompt_lookup_num_tokens, vLLM's ngram proposer) proposes; that token gets logit HIT, every
other token 0. Without a match every logit is 0, so its top-1 probability is 1 / n_vocab and a
drafter-confidence stop (p1 >= 0.5) ends the draft there instead of proposing token 0. A row's
second candidate and beyond are ties broken by token id: trees over this drafter only make
sense at width 1.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from crossrt.run.runtime import ModelSession, Rows

HIT = 20.0  # the logit of a found continuation: top-1 probability ~1 even over 262k tokens


class PromptLookupSession(ModelSession):
    def __init__(self, n_vocab: int, n_ctx: int, eog_ids: frozenset[int],
                 tokenize: Callable[[str], list[int]], detokenize: Callable[[Sequence[int]], str],
                 max_ngram: int = 3, min_ngram: int = 1):
        self.n_vocab, self.n_ctx, self.eog_ids = n_vocab, n_ctx, eog_ids
        self._tokenize, self._detokenize = tokenize, detokenize
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._tokens: list[int] = []
        self._rows = np.zeros((0, n_vocab), dtype=np.float32)

    def _release(self) -> None:
        self._tokens = []

    def proposal(self, tokens: Sequence[int]) -> int:
        """The continuation of tokens' longest matching suffix, -1 when there is none."""
        n_tokens = len(tokens)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            suffix = list(tokens[n_tokens - n:])
            for start in range(n_tokens - n - 1, -1, -1):  # most recent earlier occurrence first
                if list(tokens[start:start + n]) == suffix:
                    return int(tokens[start + n])
        return -1

    def _forward(self, tokens: Sequence[int], rows: Rows) -> np.ndarray:
        first = len(self._tokens)
        self._tokens.extend(int(t) for t in tokens)
        wanted = {Rows.NONE: range(0), Rows.LAST: range(len(tokens) - 1, len(tokens)),
                  Rows.ALL: range(len(tokens))}[rows]
        if self._rows.shape[0] < len(wanted):
            self._rows = np.zeros((len(wanted), self.n_vocab), dtype=np.float32)
        out = self._rows[:len(wanted)]
        out[:] = 0.0
        for row, i in enumerate(wanted):
            token = self.proposal(self._tokens[:first + i + 1])
            if token >= 0:
                out[row, token] = HIT
        return out

    def _drop(self, n_keep: int) -> None:
        del self._tokens[n_keep:]

    def tokenize(self, text: str) -> list[int]:
        return self._tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._detokenize(ids)
