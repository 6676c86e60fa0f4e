"""The command line's shared option groups (crossrt/cli/options.py): one declaration of the
numerics and device options building the same RuntimeOptions in every command that loads models,
the strategy options of `crossrt run` and `crossrt simulate`, one-line refusals; and the sweep's
k and strategy settings (a pair's [defaults] k, a k policy as an axis) on the tiny pair."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.cli.analysis import simulate_command
from crossrt.cli.compare import parity
from crossrt.cli.options import RUNTIME_FIELDS, STRATEGY_OPTIONS, runtime_options_of, strategy_of
from crossrt.cli.reproduce import reproduce
from crossrt.errors import SettingsError
from crossrt.inputs.pairs import DEFAULT_K, load_pair, manifest_path, run_k, run_spec_type
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import RuntimeOptions, RuntimeUnavailable, runtime_class
from crossrt.speculative.strategies import Strategy
from crossrt.sweep.plan import load_sweep
from crossrt.sweep.runner import Executor, run_sweep
from crossrt.sweep.store import SweepStore

RUN = main.commands["run"]
LOADING = {"run": RUN, "parity": parity, "simulate": simulate_command, "reproduce": reproduce}
ARGS = {"reproduce": ["claims.toml"]}  # its one required argument, never read while parsing
NUMERICS = ["--threads", "2", "--n-ctx", "512", "--n-gpu-layers", "3", "--gpu-split", "3,1", "--f32-kv-cache",
            "--no-flash-attn", "--dtype", "float16"]


def _params(command, args):
    with command.make_context(command.name, list(args)) as ctx:
        return ctx.params


def _declared(command, names):
    return {param.name: (tuple(param.opts), tuple(param.secondary_opts), repr(param.type), param.default,
                         param.help) for param in command.params if param.name in names}


@pytest.mark.parametrize("name", sorted(LOADING))
def test_every_command_that_loads_models_declares_the_runtime_options_once_and_alike(name):
    command = LOADING[name]
    assert _declared(command, RUNTIME_FIELDS) == _declared(RUN, RUNTIME_FIELDS)
    assert set(RUNTIME_FIELDS) <= {param.name for param in command.params}


@pytest.mark.parametrize("name", sorted(LOADING))
def test_every_command_builds_the_same_runtime_options(name):
    given = runtime_options_of(_params(LOADING[name], ARGS.get(name, []) + NUMERICS))
    assert given == RuntimeOptions(n_ctx=512, threads=2, n_gpu_layers=3, gpu_split=(3.0, 1.0), f32_kv_cache=True,
                                   flash_attn=False, dtype="float16")
    assert runtime_options_of(_params(LOADING[name], ARGS.get(name, []))) == RuntimeOptions()


def test_run_and_simulate_name_their_pair_alike():
    names = {"pair_name", "target", "drafter"}
    assert _declared(simulate_command, names) == _declared(RUN, names) and len(_declared(RUN, names)) == 3
    result = CliRunner().invoke(main, ["simulate", "--pair", "tiny", "--target", "t.gguf"])
    assert result.exit_code == 1 and "give either --pair, or both --target and --drafter" in result.output


def test_run_help_offers_drafting_k_policy_and_acceptance():
    result = CliRunner().invoke(main, ["run", "--help"])
    assert result.exit_code == 0
    for option in ("--drafting [model|prompt-lookup|hf-prompt-lookup|llama-ngram-simple|llama-ngram-map-k|"
                   "llama-ngram-map-k4v|llama-ngram-mod|llama-ngram-cache|vllm-ngram|tree]", "--k-policy [fixed|content|online|confidence]",
                   "--acceptance [greedy|relaxed]", "--content-k", "--k-max", "--min-p1", "--top-m", "--delta",
                   "--tree", "--ngram-max", "--ngram-min", "--executable"):
        assert option in result.output


def test_simulate_names_the_strategies_as_run_does():
    # simulate declares its own --tree (repeatable, best:N too); the rest is the same group.
    names = set(STRATEGY_OPTIONS) - {"tree"}
    assert _declared(simulate_command, names) == _declared(RUN, names)


@pytest.mark.parametrize("args, message", [
    (["--content-k", "code=7"], "--content-k is for --k-policy content"),
    (["--k-policy", "content", "--content-k", "code=seven"], "give TYPE=K pairs, e.g. code=7,prose=3"),
    (["--k-policy", "content", "--content-k", "poetry=3"], "content types are code, prose"),
    (["--top-m", "3"], "--top-m is for --acceptance relaxed"),
    (["--k-policy", "confidence"], "min_p1"),
])
def test_a_bad_strategy_is_a_one_line_error(args, message, tmp_path):
    result = CliRunner().invoke(main, ["run", "--pair", "tiny", "--out", str(tmp_path / "r.json"), *args])
    assert result.exit_code == 1
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--drafting", "prompt-lookup"], "crossrt simulate replays a drafter model's drafts"),
    (["--acceptance", "relaxed", "--top-m", "2"], "holds greedy steps only"),
    (["--drafting", "tree"], "name the trees to simulate with --tree"),
])
def test_simulate_refuses_what_its_oracle_cannot_replay(args, message):
    result = CliRunner().invoke(main, ["simulate", "--pair", "tiny", *args])
    assert result.exit_code == 1
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_executable_is_for_runtimes_that_run_a_program(tmp_path):
    result = CliRunner().invoke(main, ["run", "--pair", "tiny", "--executable", "/bin/true",
                                       "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 1
    assert "runtime 'llama-cpp' runs in crossrt's process" in result.output


def test_strategy_of_builds_what_it_is_given():
    assert strategy_of({}) == Strategy()
    assert strategy_of({"k_policy": "content", "content_k": "code=7,prose=3"}) == Strategy(
        k_policy="content", content_k=(("code", 7), ("prose", 3)))
    with pytest.raises(SettingsError):
        strategy_of({"k_max": 4})


def test_the_k_of_a_run(tmp_path):
    tiny = load_pair(manifest_path("tiny"))
    assert run_k(tiny, 6) == 6 and run_k(tiny) == tiny.defaults["k"]
    bare = _pair_with_k(tmp_path, 4)
    bare.write_text(bare.read_text().split("[defaults]")[0])  # a manifest stating no k
    assert run_k(load_pair(bare)) == DEFAULT_K


def _pair_with_k(folder: Path, k: int) -> Path:
    """The tiny pair's models under a manifest whose [defaults] k is k."""
    tiny = manifest_path("tiny")
    text = tiny.read_text().replace('"../', f'"{tiny.parent}/../').replace("k = 4", f"k = {k}")
    path = folder / "tiny-k.toml"
    path.write_text(text)
    return path


def test_a_sweep_takes_each_pairs_k_and_spec_type_as_run_does(tmp_path):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[axes]\npair = ["tiny", "gemma3-270m-ngram"]\nruntime = "llama-server"\nmode = "native"\n')
    for planned in load_sweep(sweep).cells:
        pair = load_pair(manifest_path(planned.cell.pair))
        assert planned.cell.k == run_k(pair) and planned.cell.spec_type == run_spec_type(pair)
    assert {planned.cell.spec_type for planned in load_sweep(sweep).cells} == {"draft", "ngram-simple"}


def test_a_sweep_takes_the_pairs_k_and_strategy_axes(tmp_path):
    pair = _pair_with_k(tmp_path, 3)
    prompts = {p.id: p for p in load_prompts("builtin")}
    (tmp_path / "one.jsonl").write_text(json.dumps({"id": "code-fib", "category": "code",
                                                    "prompt": prompts["code-fib"].text}) + "\n")
    sweep = tmp_path / "sweep.toml"
    sweep.write_text(f"""
name = "strategies"
[axes]
pair = "{pair.name}"
prompts = "one.jsonl"
max_new_tokens = 12
k_policy = ["fixed", "online"]
k_max = 5
""")
    loaded = load_sweep(sweep)
    cells = {planned.cell.k_policy: planned.cell for planned in loaded.cells}
    assert set(cells) == {"fixed", "online"} and all(cell.k == 3 for cell in cells.values())
    assert not any(planned.skipped for planned in loaded.cells)
    assert cells["online"].strategy == Strategy(k_policy="online", k_max=5)
    # k_max belongs to the online policy: the fixed cell keeps the default strategy, and its id.
    assert cells["fixed"].strategy == Strategy() and "k_max" not in cells["fixed"].params()
    store = SweepStore(tmp_path / "store")
    progress = run_sweep(loaded, store, Executor())
    assert progress.total == 2 and not progress.failed
    records = {cell.meta["params"].get("k_policy", "fixed"): cell.record() for cell in store.stored()}
    assert records["online"].params.k_policy == "online" and records["online"].params.k_max == 5
    assert records["fixed"].params.k_policy == "fixed" and records["fixed"].params.k == 3
    for record in records.values():
        assert all(r.ok and r.lossless for r in record.results)
    # The index names each cell's strategy, so a query can group by it.
    _, rows = store.query("SELECT k_policy, drafting, acceptance, lossy, tau FROM cells ORDER BY k_policy")
    assert [row[:4] for row in rows] == [("fixed", "model", "greedy", False), ("online", "model", "greedy", False)]
    assert all(row[4] > 1 for row in rows)


def test_a_native_cell_with_drafting_rules_its_runtime_lacks_is_skipped(tmp_path):
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('[axes]\nruntime = ["llama-server", "llama-spec-cli", "transformers", "vllm"]\n'
                     'mode = "native"\ndraft_n_min = 1\ndraft_p_min = 0.5\n')
    for planned in load_sweep(sweep).cells:
        try:
            rules = runtime_class(planned.cell.runtime).drafting_rules
        except RuntimeUnavailable:  # not importable here: a worker elsewhere may run it
            assert planned.skipped is None
            continue
        if {"n_min", "p_min"} <= set(rules):
            assert planned.skipped is None
        else:
            assert "native mode has no" in planned.skipped and "drafting rule" in planned.skipped
