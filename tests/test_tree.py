"""Tree verification on the tiny pair in real llama.cpp: the tree simulator against the chain
simulator and against real tree-verification runs, step for step."""

import json

import pytest

from crossrt.speculative import loop
from crossrt.backends.llama_cpp_tree import load_tree_session
from crossrt.errors import SettingsError
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules, RuntimeOptions
from crossrt.simulate.oracle import Policy, build_oracle, simulate
from crossrt.speculative.tree import Tree
from crossrt.simulate.trees import best_tree, build_rank_oracle, simulate_top_b, simulate_tree

from conftest import REPO

PROMPTS = load_prompts("builtin")
MAX_NEW = 40
MAX_K = 6
TOP_B = 4
TREES = [Tree.of("medusa-like", [[0], [0, 0], [1], [0, 1]]), Tree.full(2, 3), Tree.full(1, 4),
         Tree.of("deep", [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [1], [1, 0], [0, 1], [2]])]


@pytest.fixture(scope="module")
def oracles(tiny_sessions):
    target, drafter = tiny_sessions
    chains = [build_oracle(target, drafter, p.id, p.category, target.tokenize(p.text), MAX_NEW, MAX_K) for p in PROMPTS]
    assert chains, "no prompts: every loop over the oracles would pass vacuously"
    return chains, [build_rank_oracle(drafter, chain, TOP_B) for chain in chains]


@pytest.fixture(scope="module")
def tree_target(tiny_pair):
    with load_tree_session(RuntimeOptions(n_ctx=512, threads=1), tiny_pair.path("target", "gguf"), 8) as session:
        yield session


@pytest.mark.parametrize("k", range(1, MAX_K + 1))
def test_a_width_one_tree_is_the_chain(oracles, k):
    chains, ranks = oracles
    for chain, rank in zip(chains, ranks):
        assert rank.output == chain.output
        run, tree_run = simulate(chain, Policy(k)), simulate_tree(rank, Tree.full(1, k))
        assert (tree_run.step_drafted, tree_run.step_accepted, tree_run.drafter_calls) == \
            (run.step_drafted, run.step_accepted, run.drafter_calls), chain.prompt_id


@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.label)
def test_a_real_tree_run_is_greedy_and_counts_as_simulated(tiny_sessions, tree_target, oracles, tree):
    _, drafter = tiny_sessions
    _, ranks = oracles
    for rank in ranks:
        real = loop.speculative_generate(tree_target, drafter, rank.prompt_ids, DraftRules(tree.depth), MAX_NEW,
                                         tree=tree)
        assert real.output_ids == rank.output, rank.prompt_id
        sim = simulate_tree(rank, tree)
        assert (real.step_drafted, real.step_accepted) == (sim.step_drafted, sim.step_accepted), rank.prompt_id
        assert real.counters(tree.n_nodes).emitted == len(rank.output)


def test_a_real_width_one_tree_run_equals_the_chain_loop(tiny_sessions, tree_target, oracles):
    target, drafter = tiny_sessions
    _, ranks = oracles
    for rank in ranks:
        chain = loop.speculative_generate(target, drafter, rank.prompt_ids, DraftRules(3), MAX_NEW)
        tree = loop.speculative_generate(tree_target, drafter, rank.prompt_ids, DraftRules(3), MAX_NEW,
                                         tree=Tree.full(1, 3))
        assert (tree.output_ids, tree.step_drafted, tree.step_accepted) == \
            (chain.output_ids, chain.step_drafted, chain.step_accepted)


def test_wider_trees_accept_at_least_what_their_subtrees_do(oracles):
    _, ranks = oracles
    for rank in ranks:
        chain = simulate_tree(rank, Tree.full(1, 3))
        wide = simulate_tree(rank, Tree.full(2, 3))
        ceiling = simulate_top_b(rank, TOP_B, 3)
        assert wide.emitted == chain.emitted == ceiling.emitted == len(rank.output)
        assert ceiling.steps <= wide.steps <= chain.steps
    full = simulate_top_b(ranks[0], 2, 3)
    assert (full.step_drafted, full.step_accepted) == \
        (simulate_tree(ranks[0], Tree.full(2, 3)).step_drafted, simulate_tree(ranks[0], Tree.full(2, 3)).step_accepted)


def test_the_best_tree_fits_its_budget_and_beats_the_chain_of_its_size(oracles):
    _, ranks = oracles
    for budget in (1, 4, 8):
        tree = best_tree(ranks, budget, MAX_K)
        assert tree.n_nodes <= budget
        steps = sum(simulate_tree(r, tree).steps for r in ranks)
        assert steps <= sum(simulate_tree(r, Tree.full(1, budget)).steps for r in ranks) or budget > MAX_K


# The trained pair's drafter often has the target's token second or third, so its trees branch
# for real (the tiny pair's grammar rarely does); F32 KV cache, no flash attention, as its tests
# run it (a near-tie flips at llama.cpp's default F16 cache, tests/test_trained_pair.py).
TRAINED = load_prompts(str(REPO / "models" / "trained" / "prompts.jsonl"))[:6]
PRECISE = RuntimeOptions(n_ctx=256, threads=1, f32_kv_cache=True, flash_attn=False)


@pytest.fixture(scope="module")
def trained_runs():
    from crossrt.inputs.pairs import load_pair
    from crossrt.run.runtime import open_runtime
    pair = load_pair(REPO / "models" / "pairs" / "trained.toml")
    with open_runtime("llama-cpp", PRECISE).load(pair.path("target", "gguf")) as target, \
            open_runtime("llama-cpp", PRECISE).load(pair.path("drafter", "gguf")) as drafter, \
            load_tree_session(PRECISE, pair.path("target", "gguf"), 16) as tree_target:
        ranks = [build_rank_oracle(drafter, build_oracle(target, drafter, p.id, p.category, target.tokenize(p.text),
                                                         MAX_NEW, 1), TOP_B) for p in TRAINED]
        trees = [Tree.full(2, 3), best_tree(ranks, 12, MAX_K)]
        yield ranks, trees, {tree.label: [loop.speculative_generate(tree_target, drafter, r.prompt_ids,
                                                                  DraftRules(tree.depth), MAX_NEW, tree=tree)
                                          for r in ranks] for tree in trees}


def test_trained_pair_trees_branch_and_count_as_simulated(trained_runs):
    ranks, trees, runs = trained_runs
    for tree in trees:
        for rank, real in zip(ranks, runs[tree.label]):
            sim = simulate_tree(rank, tree)
            assert real.output_ids == rank.output, rank.prompt_id
            assert (real.step_drafted, real.step_accepted) == (sim.step_drafted, sim.step_accepted), rank.prompt_id
        chain_steps = sum(simulate_tree(r, Tree.full(1, tree.depth)).steps for r in ranks)
        assert sum(real.counters(tree.n_nodes).steps for real in runs[tree.label]) < chain_steps


def test_choice_lists_are_checked(tmp_path):
    listed = tmp_path / "choices.json"
    listed.write_text(json.dumps([[0], [0, 0], [1], [0, 1]]))
    assert Tree.from_file(listed).paths == ((0,), (1,), (0, 0), (0, 1))
    listed.write_text(json.dumps([[0], [1, 0]]))
    with pytest.raises(SettingsError, match="no parent"):
        Tree.from_file(listed)


def test_simulate_tree_and_analyze_ceiling_commands(tmp_path):
    """End to end on the tiny pair: simulate --tree with real tree runs matching step for step,
    then analyze --ceiling beside a record whose measured tau equals the chain column."""
    from click.testing import CliRunner

    from crossrt.cli.analysis import analyze, simulate_command
    from crossrt.cli.main import main as cli

    out = tmp_path / "sim.json"
    result = CliRunner().invoke(simulate_command, ["--pair", "tiny", "--max-k", "4", "--max-new-tokens", "24",
                                                   "--tree", "2x2", "--tree", "best:6", "--tree-budget", "6",
                                                   "--top-b", "4", "--run-trees", "--n-ctx", "256", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [(run["lossless"], run["as_simulated"]) for run in data["tree_runs"]] == \
        [(run["prompts"], run["prompts"]) for run in data["tree_runs"]]
    assert all(run["not_lossless"] == run["not_as_simulated"] == [] for run in data["tree_runs"])
    assert data["chain_mismatch"] == []
    record = tmp_path / "run.json"
    ran = CliRunner().invoke(cli, ["run", "--pair", "tiny", "--k", "4", "--max-new-tokens", "24", "--n-ctx", "256",
                                   "--out", str(record)])
    assert ran.exit_code == 0, ran.output
    shown = CliRunner().invoke(analyze, [str(record), "--ceiling", str(out)])
    assert shown.exit_code == 0, shown.output
    ceiling = {row["category"]: row for row in data["ceiling"]}
    line = next(l for l in shown.output.splitlines() if l.startswith("ALL ") and "k=" in l)
    measured, chain = line.split()[1:3]
    assert measured == chain == f"{ceiling[None]['chain_tau']:.2f}"
    from crossrt.cli.report import report
    page = tmp_path / "report.md"
    made = CliRunner().invoke(report, [str(record), "--ceiling", str(out), "-o", str(page)])
    assert made.exit_code == 0, made.output
    assert f"| ALL | {ceiling[None]['chain_tau']:.2f} | {ceiling[None]['best_k']} |" in page.read_text()
