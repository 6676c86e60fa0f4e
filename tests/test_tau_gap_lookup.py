"""Tau gaps of runs that draft by lookup (docs/analysis.md, docs/ngram.md), on real runs of the tiny
F32 pair: every lookup of LOOKUPS replayed on the target's oracle equals the one loop's run step
for step under each schedule the loop runs it with; the gap between n-gram runs, and between an
n-gram run and a drafter-model run, has "drafter algorithm" as its own part, exactly 0 between
runs that draft the same way, and the parts add up to the gap exactly."""

import dataclasses
import itertools
import re
from fractions import Fraction

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.compare.tau_gap import METRICS, PARTS, ExactCounts, build_oracles, tau_gap
from crossrt.errors import ComparisonError, SettingsError
from crossrt.inputs.prompts import Prompt, load_prompts
from crossrt.records.record_json import save_record
from crossrt.run import loop
from crossrt.run.driver import RunRequest, run_pair
from crossrt.run.lookup import LOOKUPS
from crossrt.run.runtime import DraftRules, RuntimeOptions, availability
from crossrt.run.schedules import SCHEDULES
from crossrt.run.strategies import Strategy
from crossrt.simulate.drafting import REPLAYED, Drafting, record_drafting, simulate_drafting
from crossrt.simulate.oracle import build_oracle

BUDGET = 24
OPTIONS = RuntimeOptions(n_ctx=512, threads=1)


@pytest.fixture(scope="module")
def prompts(tiny_sessions):
    """Three built-in prompts, each followed by the target's greedy continuation and the prompt
    again, so lookups find something (as scripts/repeating_prompts.py)."""
    target, _ = tiny_sessions
    found = []
    for prompt in load_prompts("builtin")[::4]:
        seen = loop.greedy_generate(target, target.tokenize(prompt.text), 16).output_ids
        found.append(Prompt(prompt.id, prompt.category, prompt.text + target.detokenize(seen) + "\n" + prompt.text))
    return found


def runs_under(name: str) -> list[str]:
    """The schedules the one loop runs lookup name with (loop.check_strategy accepts)."""
    found = []
    for schedule in SCHEDULES:
        try:
            loop.check_strategy(Strategy(drafting=name, ngram_max=2), schedule, DraftRules(4))
        except SettingsError:
            continue
        found.append(schedule)
    return found


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_every_lookup_replayed_on_the_oracle_is_the_loops_run(name, tiny_sessions, prompts):
    """ids, per-step lengths, unverified and cut equal, at a k that drafts past the budget's end
    (the last steps' caps); a schedule the replay does not follow is refused in one line."""
    target, _ = tiny_sessions
    schedules = runs_under(name)
    assert schedules, f"{name}: the loop runs it under no schedule"
    drafted = 0
    for schedule in schedules:
        for prompt in prompts:
            ids = target.tokenize(prompt.text)
            oracle = build_oracle(target, None, prompt.id, prompt.category, ids, BUDGET, 5)
            assert oracle.max_k == 0  # no drafter: the target's part alone
            if schedule not in REPLAYED or getattr(LOOKUPS[name], "per_run", False):
                with pytest.raises(SettingsError, match="replayed"):
                    simulate_drafting(oracle, schedule, DraftRules(5), Drafting(name, 2))
                continue
            real = loop.speculative_generate(target, None, ids, DraftRules(5), BUDGET, schedule,
                                             strategy=Strategy(drafting=name, ngram_max=2))
            sim = simulate_drafting(oracle, schedule, DraftRules(5), Drafting(name, 2))
            assert real.output_ids == oracle.output == sim.output
            assert (real.step_drafted, real.step_accepted, real.unverified, real.cut) == \
                (sim.step_drafted, sim.step_accepted, sim.unverified, sim.cut), (schedule, prompt.id)
            drafted += sim.drafted
    assert drafted > 0 or getattr(LOOKUPS[name], "per_run", False) or not set(schedules) & set(REPLAYED)


@pytest.fixture(scope="module")
def records(tiny_pair, prompts, tmp_path_factory):
    """n-gram runs of three lookups and two schedules, two n-gram lengths of one, and the drafter
    model, all at k 4; llama-server's own ngram-simple where it runs here."""
    folder = tmp_path_factory.mktemp("lookup-gap")
    plans = {"ngram-3": ("llama-server", DraftRules(4), Strategy(drafting="llama-ngram-simple", ngram_max=3)),
             "ngram-2": ("llama-server", DraftRules(4), Strategy(drafting="llama-ngram-simple", ngram_max=2)),
             "hf": ("hf-assisted", DraftRules(4), Strategy(drafting="hf-prompt-lookup", ngram_max=2)),
             "crossrt": ("crossrt", DraftRules(4), Strategy(drafting="prompt-lookup", ngram_max=3)),
             "model": ("llama-server", DraftRules(4, 0), Strategy())}
    runs = {name: run_pair(RunRequest(tiny_pair, "llama-cpp", OPTIONS, rules, BUDGET, folder / f"{name}.json",
                                      schedule=schedule, strategy=strategy), prompts)
            for name, (schedule, rules, strategy) in plans.items()}
    if availability("llama-server") is None:
        runs["server-native"] = run_pair(RunRequest(
            tiny_pair, "llama-server", OPTIONS, DraftRules(4), BUDGET, folder / "native.json", mode="native",
            strategy=Strategy(drafting="llama-ngram-simple", ngram_max=3)), prompts)
    return runs


@pytest.fixture(scope="module")
def oracles(tiny_sessions, records):
    return build_oracles(*tiny_sessions, list(records.values()))


def parts(gap):
    return {p.name: p.value for p in gap.parts}


def test_parts_add_up_and_the_drafter_algorithm_part_is_its_own(records, oracles):
    assert "drafter algorithm" in PARTS
    moved = 0
    for (name_a, a), (name_b, b) in itertools.permutations(records.items(), 2):
        same_drafting = record_drafting(a) == record_drafting(b)
        same_schedule = (a.params.schedule, a.params.k, a.params.draft_n_min, a.params.draft_p_min) == \
            (b.params.schedule, b.params.k, b.params.draft_n_min, b.params.draft_p_min)
        for gap in tau_gap(a, b, oracles, name_a, name_b):
            split = parts(gap)
            assert [p.name for p in gap.parts] == list(PARTS)
            for metric in METRICS:
                assert isinstance(gap.gap(metric), Fraction)
                assert sum(split[name][metric] for name in PARTS) == gap.gap(metric)
                if same_drafting:
                    assert split["drafter algorithm"][metric] == 0
                if same_schedule:
                    assert split["schedule and rules"][metric] == 0
            moved += split["drafter algorithm"]["tau"] != 0
        assert gap.lines()[0].startswith(f"tau gap {name_a} (")
    assert moved > 0


def test_the_drafter_algorithm_part_is_bs_schedule_with_as_drafting_against_bs(records, oracles):
    """ngram-simple under llama-server (A) against transformers' prompt lookup under hf-assisted
    (B): the part is B's schedule with A's lookup minus B's run simulated, both on A's ids."""
    a, b = records["ngram-3"], records["hf"]
    gap = tau_gap(a, b, oracles)[-1]
    on_a = [oracles[tuple(r.prompt_ids)] for r in a.results]

    def tau(drafting):
        runs = [simulate_drafting(o, "hf-assisted", DraftRules(4), drafting).counters(4) for o in on_a]
        return ExactCounts.of(runs).figures()["tau"]
    assert parts(gap)["drafter algorithm"]["tau"] == tau(Drafting("llama-ngram-simple", 3)) - \
        tau(Drafting("hf-prompt-lookup", 2))
    assert "(llama-server, llama-ngram-simple(n=3)) vs B (hf-assisted, hf-prompt-lookup(max=2))" in gap.lines()[0]


def test_llama_servers_own_ngram_simple_is_its_driven_reproduction(records, oracles):
    """The native record maps to llama-ngram-simple with its ngram_max: against its reproduction
    every part is 0, and against any run it splits as the reproduction does."""
    if "server-native" not in records:
        pytest.skip(f"llama-server does not run here: {availability('llama-server')}")
    native, driven = records["server-native"], records["ngram-3"]
    assert record_drafting(native) == Drafting("llama-ngram-simple", 3)
    assert all(value == 0 for p in tau_gap(native, driven, oracles)[-1].parts for value in p.value.values())
    for other in ("hf", "model"):
        assert tau_gap(native, records[other], oracles)[-1].parts == tau_gap(driven, records[other], oracles)[-1].parts


def test_a_drafting_without_a_replay_is_refused_in_one_line(records, oracles):
    a, b = records["model"], records["ngram-3"]

    def changed(record, **params):
        return dataclasses.replace(record, params=dataclasses.replace(record.params, **params))
    for record, message in [(changed(a, spec_type="ngram-cache"), "drafts by spec type ngram-cache, which no lookup"),
                            (changed(a, drafting="tree", tree="2x2"), "drafts a tree (2x2)"),
                            (changed(b, schedule="sglang"), "schedule 'sglang': a lookup's run is replayed under")]:
        with pytest.raises(ComparisonError, match=re.escape(message)) as refused:
            tau_gap(record, a, oracles)
        assert "\n" not in str(refused.value)


def test_parity_and_the_report_show_the_part(records, tmp_path):
    """`crossrt parity` prints it in every gap line, the report draws it in the waterfall and
    its markdown tables name it."""
    paths = []
    for name in ("ngram-3", "hf", "model"):
        paths.append(tmp_path / f"{name}.json")
        save_record(records[name], paths[-1])
    parity = CliRunner().invoke(main, ["parity", *map(str, paths), "--no-logits", "--html", str(tmp_path / "p.html")])
    assert parity.exit_code == 0, parity.output
    heads = [line for line in parity.output.splitlines() if line.startswith("tau gap ") and ", ALL (" in line]
    assert len(heads) == 3 and all(" + drafter algorithm " in line for line in heads), parity.output
    page = (tmp_path / "p.html").read_text()
    assert "drafter algorithm" in page.split('id="tau-gap"')[1]
    report = CliRunner().invoke(main, ["report", *map(str, paths), "-o", str(tmp_path / "r.md")])
    assert report.exit_code == 0, report.output
    assert "| drafter algorithm |" in (tmp_path / "r.md").read_text()
