"""An oracle (crossrt/simulate/oracle.py) as the one loop's target and drafter, so the simulator
runs loop.speculative_generate itself and follows every schedule as it is written.

Under greedy acceptance a run stays on the target's greedy output, so the oracle knows every
choice the loop asks for: after prompt + output[:e], the target chooses extended[e], and a
draft's token i is verified against extended[e + i] while the draft so far matched (nothing
past the first mismatch is read). A drafter model's chain at that context is the oracle's row
e, stopped where its ChainStops would stop the real drafter's (the same rules, read from the
probabilities the oracle kept). A static tree's step reads a rank oracle (crossrt/simulate/trees.py):
the node whose rank path is the output's ranks holds the output's token, every other node one
the target never chooses, and the target's rows along that path choose the output.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

import numpy as np

from crossrt.errors import SettingsError
from crossrt.speculative.acceptance import Proposal
from crossrt.speculative.drafters import ChainStops, draft_chain
from crossrt.speculative.numerics import Choices
from crossrt.speculative.tree import Tree
from crossrt.run.runtime import Rows

NO_ROWS = np.empty((0, 0), dtype=np.float32)
NO_TOKEN = -1  # a tree node off the output's path: no vocabulary's id, so never the target's choice


class OracleTarget:
    """The target's choices along prompt_ids + extended (the greedy output and what follows it), as
    the part of the session contract the loop uses (speculative/session.py: eval, eval_choices, truncate,
    n_past, n_ctx). n_ctx: the run's context, where a schedule cuts drafts at it (None: it never
    binds); it refuses nothing, as the what-if of a run that would not fit is still read;
    detokenize: the target's, for a content k policy."""

    def __init__(self, prompt_ids: Sequence[int], extended: Sequence[int], eog_ids: frozenset[int],
                 n_ctx: Optional[int] = None, detokenize: Optional[Callable[[Sequence[int]], str]] = None):
        self.n_ctx = sys.maxsize if n_ctx is None else n_ctx
        self.eog_ids = eog_ids
        self.n_past = 0
        self.prompt_length = len(prompt_ids)
        self.extended = tuple(extended)
        self.choices = np.asarray(self.extended, dtype=np.int64)
        self.none = np.full(len(self.extended), -1, dtype=np.int64)  # no runner-up, no margin: never read
        self.margins = np.zeros(len(self.extended), dtype=np.float32)
        self.empty = ((),) * len(self.extended)
        self.detokenizer = detokenize

    def eval(self, tokens: Sequence[int], rows: Rows) -> np.ndarray:
        """A prefill (Rows.NONE): the choices are eval_choices'."""
        if rows is not Rows.NONE:
            raise SettingsError("an oracle holds the target's choices, not its logits: call eval_choices")
        self.n_past += len(tokens)
        return NO_ROWS

    def eval_choices(self, tokens: Sequence[int], rows: Rows) -> tuple[np.ndarray, Choices]:
        """The choice after the last token (Rows.LAST), or at each token while tokens[1:] follow the
        greedy output (Rows.ALL; -1 after the first that does not)."""
        first = self.n_past + 1 - self.prompt_length  # the output position the first row chooses
        self.n_past += len(tokens)
        n = len(tokens)
        if rows is Rows.LAST:
            first, n = first + n - 1, 1
            best = self.choices[first:first + 1]
        else:
            y, matched = self.extended, 0
            while matched < n - 1 and tokens[matched + 1] == y[first + matched]:
                matched += 1
            best = self.choices[first:first + n].copy()
            best[matched + 1:] = -1
        return NO_ROWS, Choices(best, self.none[:n], self.margins[:n], self.empty[:n], self.empty[:n])

    def truncate(self, n_keep: int) -> None:
        self.n_past = min(self.n_past, max(0, n_keep))

    def detokenize(self, ids: Sequence[int]) -> str:
        if self.detokenizer is None:
            raise SettingsError("this oracle's simulation was given no detokenizer (a content k policy needs one)")
        return self.detokenizer(ids)


class _CachelessDrafter:
    """The cache side of the loop's drafter contract, for an oracle: no sessions, nothing to
    fill, mirror or crop (the oracle's rows stay), no proposals past the budget."""

    sessions: tuple = ()
    past_budget = False

    def prefill(self, ids: Sequence[int]) -> None:
        """Nothing cached."""

    def mirror(self, n_keep: int, batch: Sequence[int]) -> None:
        """Nothing cached to mirror."""

    def keep(self, n_keep: int) -> None:
        """Nothing cached past the context."""


class OracleDrafter(_CachelessDrafter):
    """A drafter's greedy chains, read from the oracle's rows (drafts: row e after prompt +
    output[:e]; p10, p1: each token's top-10 and full-softmax probabilities) and stopped by stops
    as the loop's ModelDrafter is; calls counts one pass per token read, as it does. head: the rows
    are a head's (crossrt/simulate/head_rows.py), proposed under a head's rules instead: up to
    k tokens while sure, a draft shorter than n_min dropped, then cut to the step's limit, as
    speculative/head_drafter.py's drafters propose."""

    def __init__(self, prompt_length: int, drafts: np.ndarray, p10: Optional[np.ndarray], p1: np.ndarray,
                 stops: ChainStops, head: Optional[tuple[int, int]] = None):
        self.prompt_length, self.stops = prompt_length, stops
        self.tokens = drafts.tolist()
        self.probabilities = p10 if stops.top10 else p1
        self.calls = 0
        self.head = head  # (k, n_min) of a head's rules
        self.own_n_min = head is not None

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        row = len(context) - self.prompt_length
        tokens, probabilities = self.tokens[row], self.probabilities[row]
        if self.head is not None:
            return self._head_draft(tokens, probabilities, n_max)

        def read(draft: Sequence[int]) -> Optional[int]:
            self.calls += 1
            return None if self.stops.below(probabilities[len(draft)]) else tokens[len(draft)]

        return draft_chain(n_max, self.stops.ends, read)

    def _head_draft(self, tokens: Sequence[int], probabilities, n_max: int) -> Proposal:
        k, n_min = self.head
        if n_max <= 0:
            return Proposal.chain(())
        self.calls += 1
        draft = []
        while len(draft) < k and not self.stops.below(probabilities[len(draft)]):
            draft.append(tokens[len(draft)])
        return Proposal.chain(draft[:n_max] if len(draft) >= n_min else ())


class OracleTreeTarget(OracleTarget):
    """OracleTarget as the loop's tree session (loop.TreeSession): from the root, the child holding
    the output's next token is on the output's path and its row chooses the token after; every
    other row chooses NO_TOKEN (none of them is read). Siblings hold distinct tokens, as a drafter's
    distinct ranks do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Per tree shape, kept for the run: each node's children, and the runner-ups, margins and
        # close candidates a row never has (a run drafts a few cuts of one tree).
        self.shapes: dict[tuple[int, ...], tuple] = {}

    def eval_tree(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """The tree session's logits, which the loop checks a tree target has: an oracle has none."""
        raise SettingsError("an oracle holds the target's choices, not its logits: call eval_tree_choices")

    def eval_tree_choices(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[np.ndarray, Choices]:
        """The choice at each node (parents[i] < i, as loop.verify_tree is given them)."""
        n, parents = len(tokens), tuple(parents)
        shape = self.shapes.get(parents)
        if shape is None:
            children: list[list[int]] = [[] for _ in range(n)]
            for node in range(1, n):
                children[parents[node]].append(node)
            shape = self.shapes[parents] = (children, np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.float32),
                                            ((),) * n)
        children, none, margins, empty = shape
        y, position = self.extended, self.n_past + 1 - self.prompt_length
        best = np.full(n, NO_TOKEN, dtype=np.int64)
        node: Optional[int] = 0
        while node is not None and position < len(y):
            choice = best[node] = y[position]
            node = next((child for child in children[node] if tokens[child] == choice), None)
            position += 1
        return NO_ROWS, Choices(best, none, margins, empty, empty)

    def keep_path(self, nodes: Sequence[int]) -> None:
        self.n_past += len(nodes)


class OracleTreeDrafter(_CachelessDrafter):
    """TreeDrafter (speculative/drafters.py) on a rank oracle: each step the tree cut to the
    step's depth, the node on the output's ranks after the context holding the output's
    token, the others NO_TOKEN; calls counts TreeDrafter's passes, one per node with children."""

    own_n_min = False

    def __init__(self, prompt_length: int, output: Sequence[int], ranks: np.ndarray, tree: Tree):
        self.prompt_length, self.output, self.ranks = prompt_length, tuple(output), ranks.tolist()
        self.cuts, self.depth = tree.cuts, tree.depth
        self.calls = 0

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        tree = self.cuts[min(self.depth, n_max)]
        if tree is None:
            return Proposal.chain(())
        self.calls += tree.internal
        tokens = [NO_TOKEN] * tree.n_nodes
        path: tuple[int, ...] = ()
        for position in range(len(context) - self.prompt_length, len(self.output)):
            path += (self.ranks[position],)
            node = tree.nodes.get(path)
            if node is None:
                break
            tokens[node - 1] = self.output[position]
        return Proposal(tuple(tokens), tree.parents)
