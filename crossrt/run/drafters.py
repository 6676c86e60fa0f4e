"""What proposes a step's draft in crossrt's one loop (crossrt/run/loop.py): a chain from a draft
model (a ModelSession: a smaller model or a layer-skip drafter), a chain from prompt lookup, or a
static tree from a draft model. A drafter keeps its own cache in step with the context; the loop
tells it what the target kept.

- ModelDrafter: the drafter decodes the context's uncached tail, then its own argmax one token
  at a time, up to the step's length. Two stops come from the schedule and the k policy: before
  a token the drafter is unsure of (llama.cpp's p_min on its top-10 softmax probability, the
  confidence policy's min_p1 on the full softmax: the pass that found it still counts), and
  after a token that ends drafts (transformers' assisted generation stops at EOS). It never
  decodes its own last draft token, which it would only need if every draft token were kept.
  Under llama.cpp's schedules it mirrors the target: cut back to the target's cache and fed the
  batch the target verifies, so its numerics are those of the native tools.
- PromptLookup: crossrt's own: the token that followed the most recent earlier occurrence of
  the longest suffix of the text so far (prompt, emitted output, its own draft), from ngram_max
  tokens down to ngram_min, looked up again for every draft token. It proposes tokens, never
  logits, and its draft ends where nothing matches. No runtime drafts this way: transformers'
  and vLLM's copy an earliest match's continuation whole (docs/ngram.md).
- HfPromptLookup: transformers' PromptLookupCandidateGenerator.get_candidates exactly (5.24,
  generation/candidate_generator.py), which differs from PromptLookup in three ways: the
  earliest match wins (windows scanned left to right, the suffix's own window included, which
  has nothing after it), the draft is the match's continuation copied whole (up to k tokens,
  ending where the context ends), and it is cut before its first EOS, with no other match tried
  when that leaves nothing. Its length is not cut at the token budget: only with one token of
  budget left is there no draft (past_budget).
- LlamaNgramSimple: llama.cpp's ngram-simple exactly (common/ngram-map.cpp,
  common_ngram_simple_draft, at the vendored commit): the context's last size_n tokens are looked
  up, most recent match first, skipping position 0 and the window that ends one token before the
  context does; the draft is what followed the match, at most size_m tokens, none at all when
  fewer than size_n tokens followed it or when the context holds size_n + size_m + 2 tokens or
  fewer. llama-server then cuts it to the step's limit (common/speculative.cpp).
- TreeDrafter: a static tree (crossrt/run/tree.py) cut to the step's depth, built depth first:
  one pass over the context's tail gives the root's candidates, one single-token pass per inner
  node gives that node's; a node of rank path p + [r] is the r-th candidate (candidates)
  after p's tokens.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from crossrt.records.trace import TraceRecorder
from crossrt.run.acceptance import Proposal
from crossrt.run.runtime import ModelSession, Rows
from crossrt.run.tree import Tree



def candidates(row: np.ndarray, width: int) -> list[int]:
    """The drafter's width best tokens in tree.token_rank's order (a stable descending sort)."""
    top = np.argpartition(-row, width - 1)[:width] if width < row.size else np.arange(row.size)
    return sorted((int(t) for t in top), key=lambda t: (-row[t], t))[:width]


class Drafter(Protocol):
    calls: int  # drafter passes (lookups for prompt lookup) made so far
    sessions: tuple[ModelSession, ...]  # the caches it holds, whose contexts must fit the run
    # Its drafts run past the token budget (up to k tokens whenever the schedule allows any),
    # as transformers' prompt lookup does; the schedule crops what a step yields past it.
    past_budget: bool

    def prefill(self, ids: Sequence[int]) -> None:
        """Start from an empty cache holding ids."""

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        """A draft of at most n_max tokens (a tree: of depth at most n_max) after context."""

    def mirror(self, n_keep: int, batch: Sequence[int]) -> None:
        """Cut back to n_keep tokens and decode batch, as the target verifies it."""

    def keep(self, n_keep: int) -> None:
        """The target kept n_keep tokens of context: drop anything cached past them."""


class _SessionDrafter:
    """The cache handling of a drafter that is a ModelSession."""

    past_budget = False

    def __init__(self, session: ModelSession):
        self.session = session
        self.sessions = (session,)
        self.calls = 0

    def prefill(self, ids: Sequence[int]) -> None:
        self.session.truncate(0)
        self.session.eval(ids, Rows.NONE)

    def mirror(self, n_keep: int, batch: Sequence[int]) -> None:
        self.session.truncate(n_keep)
        self.session.eval(batch, Rows.NONE)

    def keep(self, n_keep: int) -> None:
        self.session.truncate(min(self.session.n_past, n_keep))

    def _row(self, tokens: Sequence[int]) -> np.ndarray:
        self.calls += 1
        return self.session.eval(tokens, Rows.LAST)[0]


class ModelDrafter(_SessionDrafter):
    """A draft model's greedy chain (module docstring). unsure(row): stop before this row's
    token; ends(token): stop after it; trace: records the drafter's row of every draft token."""

    def __init__(self, session: ModelSession, unsure: Optional[Callable[[np.ndarray], bool]] = None,
                 ends: frozenset[int] = frozenset(), trace: Optional[TraceRecorder] = None):
        super().__init__(session)
        self.unsure, self.ends, self.trace = unsure, ends, trace

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        draft: list[int] = []
        pending = context[self.session.n_past:]
        while len(draft) < n_max:
            row = self._row(pending)
            if self.unsure is not None and self.unsure(row):
                break
            token = int(row.argmax())
            if self.trace is not None:
                self.trace.drafted(row)
            draft.append(token)
            if token in self.ends:
                break
            pending = (token,)
        return Proposal.chain(draft)


class TreeDrafter(_SessionDrafter):
    """A static tree from a draft model (module docstring)."""

    def __init__(self, session: ModelSession, tree: Tree):
        super().__init__(session)
        self.cuts = {depth: tree.cut(depth) for depth in range(tree.depth + 1)}
        self.depth = tree.depth

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        tree = self.cuts[min(self.depth, n_max)]
        if tree is None:
            return Proposal.chain(())
        children: dict[tuple, list[int]] = {}
        for path in tree.paths:
            children.setdefault(path[:-1], []).append(path[-1])
        tokens: dict[tuple, int] = {}
        base = len(context)

        def expand(path: tuple, row: np.ndarray) -> None:
            ranks = children[path]
            best = candidates(row, max(ranks) + 1)  # taken before the next pass reuses row's buffer
            for rank in ranks:
                tokens[path + (rank,)] = best[rank]
            for rank in ranks:
                child = path + (rank,)
                if child in children:
                    expand(child, self._row((tokens[child],)))
                    self.session.truncate(base + len(path))

        expand((), self._row(context[self.session.n_past:]))
        self.session.truncate(base)
        index = {path: node for node, path in enumerate(tree.paths, start=1)}
        return Proposal(tuple(tokens[path] for path in tree.paths),
                        (-1,) + tuple(index.get(path[:-1], 0) for path in tree.paths))


class PromptLookup:
    """Prompt-lookup drafting (module docstring); ends: tokens after which a draft stops."""

    sessions: tuple[ModelSession, ...] = ()
    past_budget = False

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1, ends: frozenset[int] = frozenset()):
        self.ngram_max, self.ngram_min, self.ends = ngram_max, ngram_min, ends
        self.calls = 0

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

    def prefill(self, ids: Sequence[int]) -> None:
        """Nothing to cache: every lookup reads the context it is given."""

    def mirror(self, n_keep: int, batch: Sequence[int]) -> None:
        """Nothing cached to mirror."""

    def keep(self, n_keep: int) -> None:
        """Nothing cached past the context."""


class HfPromptLookup(PromptLookup):
    """transformers' prompt lookup (module docstring): ngram_max is its max_matching_ngram_size,
    eos its EOS ids (the target generation config's), a step's k its prompt_lookup_num_tokens."""

    past_budget = True

    def __init__(self, ngram_max: int = 2, eos: frozenset[int] = frozenset()):
        super().__init__(ngram_max, 1)
        self.eos = eos

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


class LlamaNgramSimple(PromptLookup):
    """llama.cpp's ngram-simple (module docstring): size_n its --spec-ngram-simple-size-n,
    size_m its --spec-ngram-simple-size-m (crossrt's llama-server runs pass k)."""

    def __init__(self, size_n: int, size_m: int):
        super().__init__(size_n, 1)
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
