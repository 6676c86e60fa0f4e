"""Greedy speculative decoding with a static draft tree: the crossrt schedule with a tree in
place of the chain (crossrt/run/tree.py gives the tree and its simulator).

Per step, with e tokens emitted: the tree is cut to depth min(depth, budget - e - 1). The
drafter, a plain ModelSession, builds it depth first: one pass over the context's uncached tail
gives the root's candidates, and one single-token pass per inner node gives that node's; a
node of rank path p + [r] is the r-th candidate (stable descending order of the drafter's
logits, tree.candidates) after p's tokens. The target verifies the root (the context's last
token) and every node in one batch, a tree session (backends/llama_cpp_tree.py) masking each
token to its ancestors. From the root, the child whose token is the target's argmax is
accepted while there is one and it is not an EOS; the target's argmax after the last accepted
node is the step's own token, and the target keeps the accepted path's KV only. So the output
is the target's greedy output, and with a drafter conditioned only on its prefix the counts
equal tree.simulate_tree's (a test checks both on the tiny pair).
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

import numpy as np

from crossrt.run.runtime import ModelSession, Rows
from crossrt.run.numerics import choose
from crossrt.run.schedules import Generation, ViewRecorder, check_prompt, prefill_pair
from crossrt.run.tree import Tree, candidates


class TreeSession(Protocol):
    """A target session that evaluates a tree in one batch (backends/llama_cpp_tree.py)."""

    n_past: int
    eog_ids: frozenset[int]

    def eval(self, tokens: Sequence[int], rows: Rows) -> np.ndarray: ...

    def truncate(self, n_keep: int) -> None: ...

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray: ...

    def keep_path(self, nodes: Sequence[int]) -> None: ...


def _draft(drafter: ModelSession, context: Sequence[int], tree: Tree) -> list[int]:
    """The token of every node of tree (in tree.paths order) after context."""
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
                expand(child, drafter.eval((tokens[child],), Rows.LAST)[0])
                drafter.truncate(base + len(path))

    expand((), drafter.eval(context[drafter.n_past:], Rows.LAST)[0])
    drafter.truncate(base)
    return [tokens[path] for path in tree.paths]


def tree_generate(target: TreeSession, drafter: ModelSession, prompt_ids: Sequence[int], tree: Tree,
                  max_new_tokens: int) -> Generation:
    """Greedy speculative decoding verifying tree at every step (module docstring). The
    generation's step_drafted counts the tree nodes each step verified."""
    check_prompt(prompt_ids, max_new_tokens, [target, drafter], overrun=tree.n_nodes)
    start = time.perf_counter()
    context = prefill_pair(target, drafter, prompt_ids)
    prefilled = time.perf_counter()

    eog = target.eog_ids
    views = ViewRecorder()
    step_drafted: list[int] = []
    step_accepted: list[int] = []
    n_emitted = 0
    stop_reason = "max_new_tokens"
    cuts = {cap: tree.cut(cap) for cap in range(tree.depth + 1)}
    while n_emitted < max_new_tokens:
        cut = cuts[min(tree.depth, max_new_tokens - n_emitted - 1)]
        paths = cut.paths if cut else ()
        draft = _draft(drafter, context, cut) if cut else []
        index = {path: i + 1 for i, path in enumerate(paths)}
        parents = [-1] + [index.get(path[:-1], 0) for path in paths]
        rows = target.eval_tree([context[-1]] + draft, parents)
        choices = choose(rows)
        by_token = {}  # (parent node, token) -> node
        for i, path in enumerate(paths, start=1):
            by_token[(parents[i], draft[i - 1])] = i
        walk = [0]
        while True:
            choice = int(choices.best[walk[-1]])
            child = by_token.get((walk[-1], choice))
            if child is None or choice in eog:
                break
            walk.append(child)
        n_accepted = len(walk) - 1
        kept = [draft[i - 1] for i in walk[1:]] + [int(choices.best[walk[-1]])]
        views.add(choices.rows(walk), len(kept), len(paths) + 1)
        target.keep_path(walk)
        drafter.truncate(min(drafter.n_past, len(context) + n_accepted))
        context += kept
        n_emitted += len(kept)
        step_drafted.append(len(paths))
        step_accepted.append(n_accepted)
        if kept[-1] in eog:
            stop_reason = "eos"
            break

    return Generation(
        output_ids=tuple(context[len(prompt_ids):]),
        stop_reason=stop_reason,
        prefill_s=prefilled - start,
        decode_s=time.perf_counter() - prefilled,
        step_drafted=tuple(step_drafted),
        step_accepted=tuple(step_accepted),
        view=views.view(n_emitted),
    )
