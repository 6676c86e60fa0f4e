"""What-if tree verification, exact for greedy decoding: static draft trees (crossrt/speculative/tree.py)
run by the one loop on the rank oracle (crossrt/simulate/oracle_sessions.py), the top-b ceiling,
and the best tree within a node budget.

A tree is a set of rank paths; a step accepts the longest run of the target's tokens whose
ranks under the drafter form a path, plus the bonus. One teacher-forced drafter pass gives every
on-path rank, for drafters conditioned on their prefix only. Under the crossrt chain schedule a
width-1 tree of depth k is the chain at k. Why it is exact, the costs and measured numbers:
docs/ceiling.md, "How the tree what-if works, and why it is exact for greedy".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from crossrt.errors import SettingsError
from crossrt.records.counts import Counts
from crossrt.records.metrics import Totals
from crossrt.run.runtime import DraftRules, ModelSession, Rows
from crossrt.speculative import loop
from crossrt.speculative.schedules import draft_cap
from crossrt.speculative.tree import RankPath, Tree
from crossrt.simulate.oracle import CHUNK, CostModel, Oracle, SimRun, by_category
from crossrt.simulate.oracle_sessions import OracleTreeDrafter, OracleTreeTarget


@dataclass(frozen=True, eq=False)
class RankOracle:
    """One prompt's target greedy output and, per output position j, the rank of output[j]
    among the drafter's candidates after prompt + output[:j] (top_b: not among the top-b)."""

    prompt_id: str
    category: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    output: tuple[int, ...]
    ranks: np.ndarray  # int16 (len(output),)
    top_b: int
    eog_ids: frozenset[int]


def token_rank(row: np.ndarray, token: int) -> int:
    """The rank of token in row: logits above it, then equal ones with a lower id (the order of
    a stable descending sort, which drafters.candidates picks by)."""
    value = row[token]
    return int(np.count_nonzero(row > value) + np.count_nonzero(row[:token] == value))


def build_rank_oracle(drafter: ModelSession, oracle: Oracle, top_b: int) -> RankOracle:
    """The rank oracle of a chain oracle's prompt and output: one teacher-forced drafter pass,
    in the chain oracle's chunks so that its first-token rows match."""
    if top_b < 1:
        raise SettingsError(f"top-b must be at least 1, got {top_b}")
    prompt_ids, output = oracle.prompt_ids, oracle.output
    ranks = np.full(len(output), top_b, dtype=np.int16)
    drafter.truncate(0)
    drafter.eval(prompt_ids[:-1], Rows.NONE)
    lasts = (prompt_ids[-1],) + output[:-1]
    for start in range(0, len(output), CHUNK):
        rows = drafter.eval(lasts[start:start + CHUNK], Rows.ALL)
        for offset, row in enumerate(rows):
            ranks[start + offset] = min(top_b, token_rank(row, output[start + offset]))
    return RankOracle(oracle.prompt_id, oracle.category, prompt_ids, oracle.max_new_tokens, output, ranks,
                      top_b, oracle.eog_ids)


def simulate_tree(oracle: RankOracle, tree: Tree) -> SimRun:
    """The steps a real tree-verification run of tree makes on the oracle's prompt: the one loop's
    tree path run on the rank oracle (OracleTreeTarget, OracleTreeDrafter)."""
    if max(max(p) for p in tree.paths) >= oracle.top_b:
        raise SettingsError(f"tree {tree.label} uses ranks from {oracle.top_b} on; the oracle stores ranks "
                            f"below top-b {oracle.top_b}")
    target = OracleTreeTarget(oracle.prompt_ids, oracle.output, oracle.eog_ids)
    drafts = OracleTreeDrafter(len(oracle.prompt_ids), oracle.output, oracle.ranks, tree)
    run = loop.speculative_generate(target, None, oracle.prompt_ids, DraftRules(tree.depth), oracle.max_new_tokens,
                                    tree=tree, drafts=drafts, what_if=True)
    return SimRun(oracle.prompt_id, oracle.category, run.step_drafted, run.step_accepted, run.drafter_calls)


def simulate_top_b(oracle: RankOracle, width: int, depth: int) -> SimRun:
    """The ceiling at top-b: accept while the target's token is among the drafter's width best
    (the full width-ary tree of depth, simulated without listing its nodes)."""
    # Walked here, not by the loop: the loop's drafter would list all width ** depth nodes.
    output, ranks, eog = oracle.output, oracle.ranks, oracle.eog_ids
    step_drafted, step_accepted = [], []
    calls = emitted = 0
    while emitted < len(output):
        cap = draft_cap(depth, oracle.max_new_tokens, emitted)
        accepted = 0
        while (accepted < cap and output[emitted + accepted] not in eog
               and ranks[emitted + accepted] < min(width, oracle.top_b)):
            accepted += 1
        step_drafted.append(sum(width ** d for d in range(1, cap + 1)))
        step_accepted.append(accepted)
        calls += sum(width ** d for d in range(cap))
        emitted += accepted + 1
    return SimRun(oracle.prompt_id, oracle.category, tuple(step_drafted), tuple(step_accepted), calls)


def best_tree(oracles: Sequence[RankOracle], budget: int, max_depth: int, label: Optional[str] = None) -> Tree:
    """The tree of at most budget nodes that accepts the most tokens on these oracles if every
    position started a step (Sequoia's positional assumption, measured rank acceptance): a
    node's worth is the number of positions whose next ranks begin with its path, so the best
    tree holds the budget's most frequent paths, and a parent is never rarer than its child."""
    counts: Counter = Counter()
    for oracle in oracles:
        ranks, output, eog = oracle.ranks, oracle.output, oracle.eog_ids
        for start in range(len(output)):
            path: RankPath = ()
            for j in range(start, min(start + max_depth, len(output))):
                if ranks[j] >= oracle.top_b or output[j] in eog:
                    break
                path += (int(ranks[j]),)
                counts[path] += 1
    chosen = sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget]
    if not chosen:
        return Tree(label or f"best {budget}", ((0,),))
    return Tree.of(label or f"best {budget}", chosen)


@dataclass(frozen=True, kw_only=True)
class TreeResult(Counts):
    """A tree's summed counts over one group of prompts (category None: all of them); drafted
    counts the nodes verified."""

    tree: str
    nodes: int
    depth: int
    category: Optional[str]
    verify_tokens: float  # mean tokens per target pass (1 + nodes verified)
    speedup: Optional[float]

    def as_json(self) -> dict[str, Any]:
        """As the simulation JSON has always had it: steps and emitted the only counts, then tau."""
        return {"tree": self.tree, "nodes": self.nodes, "depth": self.depth, "category": self.category,
                "steps": self.steps, "emitted": self.emitted, "tau": self.tau, "verify_tokens": self.verify_tokens,
                "speedup": self.speedup}


def summarize_tree(runs: Sequence[SimRun], costs: Optional[CostModel], label: str, nodes: int,
                   depth: int) -> list[TreeResult]:
    """One result per category (sorted), then one over every run; no speedup without costs or
    where a step verified more tokens than the cost model was measured for."""
    results = []
    for category, group in by_category(runs, lambda run: run.category):
        counts = sum((run.counts for run in group), Counts())
        timed = costs is not None and all(d < len(costs.verify_s) for run in group for d in run.step_drafted)
        # The record's metrics over the cost model's seconds (none: no speedup).
        totals = Totals(**counts.counted(), baseline_tokens=counts.emitted,
                        decode_s=sum(costs.speculative_s(run) for run in group) if timed else 0.0,
                        baseline_decode_s=costs.plain_s(counts.emitted) if timed else 0.0)
        results.append(TreeResult(**counts.counted(), tree=label, nodes=nodes, depth=depth, category=category,
                                  verify_tokens=1 + counts.drafted / counts.steps if counts.steps else 0.0,
                                  speedup=totals.speedup))
    return results
