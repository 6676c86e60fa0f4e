"""A llama.cpp session that verifies a draft tree in one batch (crossrt/speculative/loop.py with a tree drafter).

As llama.cpp's examples/speculative does with several draft sequences: the cached context is
sequence 0; a tree step first copies it to one sequence per leaf (llama_memory_seq_cp, which in
a unified KV cache only tags the context's cells with the new ids), then decodes the root and
every node in one batch, each token tagged with the sequences of the leaves below it. The KV
mask lets a token see the cells of its first sequence only, which are its ancestors and the
context: a cell off its path belongs to no leaf below the token. After verification the
sequence of a leaf below the last accepted node is kept (llama_memory_seq_keep), cut after
that node, and renamed back to sequence 0, so the cache holds the accepted path only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from crossrt.backends.llama_cpp import LlamaCppRuntime, LlamaCppSession, llama_cpp
from crossrt.errors import ModelError, PromptRefused, SettingsError
from crossrt.run.runtime import RuntimeOptions


class LlamaCppTreeSession(LlamaCppSession):
    """A LlamaCppSession (plain eval and truncate on sequence 0) that also evaluates trees."""

    def __init__(self, path: Path, options: RuntimeOptions, max_leaves: int):
        super().__init__(path, options, n_seq_max=max(2, max_leaves))
        self.max_leaves = max_leaves
        self._tree_batch = llama_cpp.llama_batch_init(self.n_ctx, 0, max(2, max_leaves))
        self._leaf_of: list[int] = []  # per node of the tree last evaluated: the first leaf below it

    def _release(self) -> None:
        llama_cpp.llama_batch_free(self._tree_batch)
        super()._release()

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """Decode tokens[0] (the root, at n_past) and its tree (parents[i] < i is node i's
        parent, parents[0] = -1) in one batch; return every row, shape (len(tokens), n_vocab),
        a view valid until the next call. keep_path must follow before any other call."""
        n = len(tokens)
        depth = [0] * n
        has_child = [False] * n
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise SettingsError(f"tree node {i}: parent {parents[i]} is not an earlier node")
            depth[i] = depth[parents[i]] + 1
            has_child[parents[i]] = True
        leaves = [i for i in range(n) if not has_child[i]]
        if len(leaves) > self.max_leaves:
            raise SettingsError(f"a tree of {len(leaves)} leaves; this session holds {self.max_leaves} sequences")
        if self._n_past + n > self.n_ctx:
            raise PromptRefused(f"context full: {self._n_past} cached + {n} tree tokens > n_ctx {self.n_ctx}")
        seqs: list[list[int]] = [[] for _ in range(n)]
        for leaf_id, leaf in enumerate(leaves):
            node = leaf
            while node >= 0:
                seqs[node].append(leaf_id)
                node = parents[node]
        for leaf_id in range(1, len(leaves)):
            llama_cpp.llama_memory_seq_cp(self._memory, 0, leaf_id, -1, -1)
        batch = self._tree_batch
        batch.n_tokens = n
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = self._n_past + depth[i]
            batch.n_seq_id[i] = len(seqs[i])
            for j, seq in enumerate(seqs[i]):
                batch.seq_id[i][j] = seq
            batch.logits[i] = True
        code = llama_cpp.llama_decode(self._ctx, batch)
        if code != 0:
            raise PromptRefused(f"llama_decode returned {code} for a tree at position {self._n_past}")
        self._leaf_of = [s[0] for s in seqs]
        pointer = llama_cpp.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, shape=(n, self.n_vocab))

    def keep_path(self, nodes: Sequence[int]) -> None:
        """Keep the root and the nodes listed (a chain from the root: nodes[0] == 0) as the
        cache's next positions on sequence 0; drop every other sequence and node."""
        seq = self._leaf_of[nodes[-1]]
        keep = self._n_past + len(nodes)
        llama_cpp.llama_memory_seq_keep(self._memory, seq)
        llama_cpp.llama_memory_seq_rm(self._memory, seq, keep, -1)
        if seq != 0:
            llama_cpp.llama_memory_seq_cp(self._memory, seq, 0, -1, -1)
            llama_cpp.llama_memory_seq_rm(self._memory, seq, -1, -1)
        self._n_past = keep
        self._leaf_of = []


def load_tree_session(options: RuntimeOptions, path: Path, max_leaves: int) -> LlamaCppTreeSession:
    """A tree session of the model at path, for trees of up to max_leaves leaves."""
    LlamaCppRuntime.check_available()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    try:
        return LlamaCppTreeSession(path, options, max_leaves)
    except ValueError as error:
        raise ModelError(f"llama.cpp could not load {path}: {error}") from None
