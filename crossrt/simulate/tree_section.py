"""`crossrt simulate --tree`'s study of static draft trees on one pair: the rank oracles, every
tree simulated, the ceiling table, and real tree-verification runs checked step for step against
the simulator (`--run-trees`). crossrt/cli/analysis.py prints it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from crossrt.records.metrics import Totals
from crossrt.speculative import loop
from crossrt.run.runtime import DraftRules, ModelSession, Runtime
from crossrt.speculative.tree import Tree
from crossrt.simulate.ceiling import Ceiling, ceilings, check_chain, parse_tree, tree_results
from crossrt.simulate.oracle import Oracle, Simulation
from crossrt.simulate.trees import RankOracle, build_rank_oracle, simulate_tree


@dataclass(frozen=True)
class TreeRun:
    """Real tree-verification runs of one tree over the prompts, against the simulator."""

    tree: str
    prompts: int
    # Prompts whose output is the target's greedy output (a quantized model's verification batch
    # can break a near-tie differently, docs/real-models.md), and of those, the prompts whose
    # steps equal the simulator's (a drafter near-tie can rank differently in the oracle's pass).
    lossless: int
    as_simulated: int
    emitted: int
    steps: int
    decode_s: float
    greedy_decode_s: float  # plain greedy decoding of the same tokens, same session settings
    not_lossless: tuple[str, ...] = ()  # prompt ids whose output left the greedy output
    not_as_simulated: tuple[str, ...] = ()  # lossless prompt ids whose steps differ from the simulator's

    @property
    def totals(self) -> Totals:
        """What the record's metrics read (each step of a tree accepts emitted - steps in all)."""
        return Totals(self.steps, 0, self.emitted - self.steps, self.emitted, self.decode_s, self.emitted,
                      self.greedy_decode_s)


@dataclass(frozen=True)
class TreeSection:
    ranks: tuple[RankOracle, ...]
    trees: tuple[Tree, ...]
    results: tuple
    ceiling: tuple[Ceiling, ...]
    chain_mismatch: tuple[str, ...]  # prompts where the width-1 tree and the chain simulator differ
    runs: tuple[TreeRun, ...]

    def as_json(self) -> dict:
        return {"trees": [{"label": t.label, "paths": [list(p) for p in t.paths]} for t in self.trees],
                "tree_results": [r.as_json() for r in self.results],
                "ceiling": [dataclasses.asdict(c) for c in self.ceiling],
                "tree_runs": [dataclasses.asdict(r) for r in self.runs],
                "chain_mismatch": list(self.chain_mismatch)}


def max_tree_rows(specs: Sequence[str], budget: int) -> int:
    """The widest verify pass the trees can need (best:N trees are fitted later), for the cost model."""
    widest = budget
    for spec in specs:
        width, x, depth = spec.partition("x")
        if spec.startswith("best:") and spec[5:].isdigit():
            widest = max(widest, int(spec[5:]))
        elif x and width.isdigit() and depth.isdigit():
            widest = max(widest, sum(int(width) ** d for d in range(1, int(depth) + 1)))
        elif Path(spec).is_file():
            widest = max(widest, Tree.from_file(Path(spec)).n_nodes)
    return widest + 1


def tree_section(drafter: ModelSession, oracles: Sequence[Oracle], sim: Simulation, specs: Sequence[str],
                 k: int, budget: int, top_b: int, max_depth: int) -> TreeSection:
    ranks = tuple(build_rank_oracle(drafter, oracle, top_b) for oracle in oracles)
    trees = tuple(parse_tree(spec, ranks, max_depth) for spec in specs)
    return TreeSection(ranks, trees, tuple(tree_results(ranks, trees, sim.costs)),
                       tuple(ceilings(sim, ranks, k, budget, top_b, max_depth)),
                       tuple(check_chain(ranks, oracles, min(k, max_depth))), ())


def run_trees(section: TreeSection, runtime: Runtime, target_path: Path, target: ModelSession,
              drafter: ModelSession) -> TreeSection:
    """Each tree run for real on the runtime's tree session of the target (Runtime.load_tree),
    step for step against the simulator, timed against plain greedy decoding on the target's
    session."""
    widest = max(len(tree.leaves()) for tree in section.trees)
    greedy = {r.prompt_id: loop.greedy_generate(target, r.prompt_ids, r.max_new_tokens).decode_s for r in section.ranks}
    runs = []
    with runtime.load_tree(target_path, widest) as tree_target:
        for tree in section.trees:
            emitted = steps = 0
            spent = 0.0
            not_lossless, not_as_simulated = [], []
            for rank in section.ranks:
                real = loop.speculative_generate(tree_target, drafter, rank.prompt_ids, DraftRules(tree.depth),
                                                 rank.max_new_tokens, tree=tree)
                sim = simulate_tree(rank, tree)
                if real.output_ids != rank.output:
                    not_lossless.append(rank.prompt_id)
                elif (real.step_drafted, real.step_accepted) != (sim.step_drafted, sim.step_accepted):
                    not_as_simulated.append(rank.prompt_id)
                emitted += len(real.output_ids)
                steps += len(real.step_accepted)
                spent += real.decode_s
            lossless = len(section.ranks) - len(not_lossless)
            runs.append(TreeRun(tree.label, len(section.ranks), lossless, lossless - len(not_as_simulated), emitted,
                                steps, spent, sum(greedy.values()), tuple(not_lossless), tuple(not_as_simulated)))
    return dataclasses.replace(section, runs=tuple(runs))
