"""The per-category ceiling of speculative decoding on a pair, from its oracles: tau of the chain
at the run's k, the best chain k, the best tree within a node budget, and the tau if the
target's token were always among the drafter's top-b (docs/ceiling.md). `crossrt simulate
--tree` computes it, `crossrt analyze --ceiling` prints it beside a record's measured tau, and
`crossrt report --ceiling` draws it (crossrt/report/ceiling.py).

The best tree is fitted on the prompts it is scored on (per category, and over all of them
for the overall row): an in-sample optimum, the most a static tree of that size could give on
these prompts, not a tree that was chosen before seeing them. The held-out column is honest
about that: the prompts are split in two folds (alternate prompts), a tree is fitted on each
fold and scored on the other, and the two scores' steps are summed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from crossrt.errors import SettingsError
from crossrt.simulate.oracle import CostModel, Policy, Simulation, simulate
from crossrt.speculative.tree import Tree
from crossrt.simulate.trees import RankOracle, TreeResult, best_tree, simulate_top_b, simulate_tree, summarize_tree


@dataclass(frozen=True)
class Ceiling:
    """One category's (None: all prompts) answers, tau bonus included; speedups predicted by
    the cost model (None where the cost model was not measured that wide)."""

    category: Optional[str]
    k: int
    chain_tau: Optional[float]  # the chain at k
    best_k: int
    best_k_tau: Optional[float]
    best_k_speedup: Optional[float]
    tree_budget: int
    tree_nodes: int
    tree_depth: int
    tree_tau: Optional[float]
    tree_speedup: Optional[float]
    tree_heldout_tau: Optional[float]  # two folds: a tree fitted on half the prompts, scored on the other half
    top_b: int
    top_b_depth: int
    top_b_tau: Optional[float]  # accepted while the target's token is among the drafter's top-b


def parse_tree(spec: str, ranks: Sequence[RankOracle], max_depth: int) -> Tree:
    """WxD (the full tree of width W and depth D), best:N (the best tree of at most N nodes on
    these oracles, depth at most max_depth), or a JSON choice-list file."""
    if spec.startswith("best:"):
        try:
            budget = int(spec.removeprefix("best:"))
        except ValueError:
            raise SettingsError(f"tree {spec!r}: best:N takes a node budget N") from None
        if budget < 1:
            raise SettingsError(f"tree {spec!r}: the node budget must be at least 1")
        return best_tree(ranks, budget, max_depth)
    width, x, depth = spec.partition("x")
    if x and width.isdigit() and depth.isdigit():
        return Tree.full(int(width), int(depth))
    if not Path(spec).is_file():
        raise SettingsError(f"tree {spec!r}: give WxD, best:N or a JSON choice-list file")
    return Tree.from_file(Path(spec))


def tree_results(ranks: Sequence[RankOracle], trees: Sequence[Tree], costs: CostModel) -> list[TreeResult]:
    """Every tree on every oracle, per category then overall."""
    return [result for tree in trees
            for result in summarize_tree([simulate_tree(r, tree) for r in ranks], costs, tree.label,
                                         tree.n_nodes, tree.depth)]


def ceilings(sim: Simulation, ranks: Sequence[RankOracle], k: int, budget: int, top_b: int,
             max_depth: int) -> list[Ceiling]:
    """The ceiling table: per category (sorted), then over all prompts."""
    if k > len(sim.by_k):
        raise SettingsError(f"k={k} is beyond the simulation's {len(sim.by_k)}")
    rows = []
    for index, chain in enumerate(sim.by_k[k - 1]):
        category = chain.category
        group = [r for r in ranks if category is None or r.category == category]
        best = sim.best_k[index]
        tree = best_tree(group, budget, max_depth, f"best {budget}")
        fitted = summarize_tree([simulate_tree(r, tree) for r in group], sim.costs, tree.label,
                                tree.n_nodes, tree.depth)[-1]
        held_out = []
        for fold in (0, 1):
            fit, score = group[fold::2], group[1 - fold::2]
            if fit and score:
                held = best_tree(fit, budget, max_depth)
                held_out += [simulate_tree(r, held) for r in score]
        held_out_tau = summarize_tree(held_out, None, "held out", budget, max_depth)[-1].tau
        top = summarize_tree([simulate_top_b(r, top_b, max_depth) for r in group], None, "top-b", 0, max_depth)[-1]
        rows.append(Ceiling(category, k, chain.tau, best.k, best.tau, best.speedup, budget, tree.n_nodes,
                            tree.depth, fitted.tau, fitted.speedup, held_out_tau, top_b, max_depth, top.tau))
    return rows


def load_ceilings(path: Path) -> list[Ceiling]:
    """The ceiling table a `crossrt simulate --tree ... --out` file holds."""
    try:
        data = json.loads(Path(path).read_text())
        return [Ceiling(**row) for row in data["ceiling"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SettingsError(f"{path}: not a simulate --tree result with a ceiling table ({error})") from None


def check_chain(ranks: Sequence[RankOracle], chain_oracles, k: int) -> list[str]:
    """Prompts where the width-1 tree of depth k and the chain simulator differ: none unless a
    near-tie scored differently in the two oracles' drafter passes."""
    by_id = {o.prompt_id: o for o in chain_oracles}
    return [r.prompt_id for r in ranks
            if simulate_tree(r, Tree.full(1, k)).step_accepted != simulate(by_id[r.prompt_id], Policy(k)).step_accepted]
