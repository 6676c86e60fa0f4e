"""Tau gaps of runs that draft by lookup (docs/analysis.md, docs/ngram.md), on real runs of the tiny
F32 pair: every lookup of LOOKUPS replayed on the target's oracle equals the one loop's run step
for step under each schedule the loop runs it with (vLLM's included, at a context the longest
prompt fills), and a lookup whose state outlives a prompt replayed through a run's prompts
equals the driven run prompt by prompt; the gap between n-gram runs, and between an n-gram run
and a drafter-model run, has "drafter algorithm" as its own part, exactly 0 between runs that
draft the same way, and the parts add up to the gap exactly."""

import dataclasses
import itertools
import re
from fractions import Fraction

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.compare.tau_gap import METRICS, PARTS, build_oracles, exact_figures, tau_gap
from crossrt.errors import ComparisonError, SettingsError
from crossrt.inputs.prompts import load_prompts
from crossrt.run.repeating import repeating
from crossrt.records.record_json import save_record
from crossrt.records.schema import PromptResult
from crossrt.speculative import loop
from crossrt.run.driver import RunRequest, run_pair
from crossrt.speculative.lookup import LOOKUPS
from crossrt.run.runtime import DraftRules, RuntimeOptions, availability, open_runtime
from crossrt.speculative.schedules import SCHEDULES
from crossrt.speculative.strategies import Strategy
from crossrt.simulate.drafting import Drafting, record_drafting, simulate_drafting, simulate_record
from crossrt.simulate.oracle import build_oracle
from crossrt.simulate.schedule_sims import record_rules

BUDGET = 24
OPTIONS = RuntimeOptions(n_ctx=512, threads=1)
PER_RUN = sorted(name for name, lookup in LOOKUPS.items() if lookup.per_run)
# ngram_max and k where a lookup runs at fixed values only (ngram-cache: 4 and 8), else 2 and 5.
SIZES = {"llama-ngram-cache": (4, 8)}


@pytest.fixture(scope="module")
def prompts(tiny_sessions):
    """Three built-in prompts, each followed by the target's greedy continuation and the prompt
    again, so lookups find something (as scripts/repeating_prompts.py)."""
    target, _ = tiny_sessions
    return repeating(target, load_prompts("builtin")[::4], 16)


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
    (the last steps' caps); one prompt is a run of its own, a lookup begun afresh."""
    target, _ = tiny_sessions
    schedules = runs_under(name)
    assert schedules, f"{name}: the loop runs it under no schedule"
    ngram_max, k = SIZES.get(name, (2, 5))
    drafted = 0
    for schedule in schedules:
        for prompt in prompts:
            ids = target.tokenize(prompt.text)
            oracle = build_oracle(target, None, prompt.id, prompt.category, ids, BUDGET, k)
            assert oracle.max_k == 0  # no drafter: the target's part alone
            real = loop.speculative_generate(target, None, ids, DraftRules(k), BUDGET, schedule,
                                             strategy=Strategy(drafting=name, ngram_max=ngram_max))
            sim = simulate_drafting(oracle, schedule, DraftRules(k), Drafting(name, ngram_max))
            assert real.output_ids == oracle.output == sim.output
            assert (real.step_drafted, real.step_accepted, real.unverified, real.cut) == \
                (sim.step_drafted, sim.step_accepted, sim.unverified, sim.cut), (schedule, prompt.id)
            drafted += sim.drafted
    assert drafted > 0


@pytest.fixture(scope="module")
def per_run_records(tiny_pair, prompts, tmp_path_factory):
    """Driven runs of each lookup whose state outlives a prompt, under llama-server (one drafter
    through the prompts) and llama-spec-simple (a process per prompt: each begins afresh)."""
    folder = tmp_path_factory.mktemp("per-run")
    runs = {}
    for name, schedule in itertools.product(PER_RUN, ("llama-server", "llama-spec-simple")):
        if schedule not in runs_under(name):
            continue
        ngram_max, k = SIZES.get(name, (2, 5))
        runs[name, schedule] = run_pair(RunRequest(tiny_pair, "llama-cpp", OPTIONS, DraftRules(k), BUDGET,
                                                   folder / f"{name}-{schedule}.json", schedule=schedule,
                                                   strategy=Strategy(drafting=name, ngram_max=ngram_max)), prompts)
    return runs


@pytest.mark.parametrize("name", PER_RUN)
def test_a_lookup_that_outlives_a_prompt_is_replayed_through_the_run(name, per_run_records, tiny_sessions):
    """The record's prompts replayed in its order, through one lookup under llama-server, count as
    the run did, prompt by prompt; there, a failed prompt before a compared one is refused in one
    line (its output unknown), while under llama-spec-simple, where each prompt begins afresh, the
    prompts after it are compared."""
    assert (name, "llama-server") in per_run_records
    for (_, schedule), record in ((key, r) for key, r in per_run_records.items() if key[0] == name):
        oracles = build_oracles(*tiny_sessions, [record])
        sims = simulate_record(record, oracles)
        assert [s.prompt_id for s in sims] == [r.prompt_id for r in record.results] and len(sims) == 3
        for result, sim in zip(record.results, sims):
            assert result.ok and tuple(result.output_ids) == sim.output
            assert result.counters == sim.counters(record.params.k), (schedule, result.prompt_id)  # per step too
        assert sum(sim.drafted for sim in sims) > 0
        if (name, schedule) == ("llama-ngram-map-k", "llama-server"):  # its maps carry over: afresh differs
            afresh = [simulate_drafting(oracles[tuple(r.prompt_ids)], schedule, record_rules(record),
                                        record_drafting(record)) for r in record.results]
            assert any(r.counters != sim.counters(record.params.k) for r, sim in zip(record.results, afresh))
        head = record.results[0]
        first = PromptResult.failed(head.prompt_id, head.category, "decode error", head.prompt_ids)
        failed = dataclasses.replace(record, results=(first, *record.results[1:]))
        if schedule != "llama-server":
            gap = tau_gap(failed, record, oracles)[-1]
            assert gap.prompts == 2 and all(value == 0 for p in gap.parts for value in p.value.values())
            continue
        with pytest.raises(ComparisonError, match=f"prompt {first.prompt_id} failed, and {name} keeps its state") \
                as refused:
            tau_gap(failed, record, oracles)
        assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def records(tiny_pair, prompts, tmp_path_factory):
    """n-gram runs of four lookups (ngram-map-k's state outlives a prompt) and two schedules, two
    n-gram lengths of one, and the drafter model, all at k 4; llama-server's own ngram-simple and
    ngram-map-k where it runs here."""
    folder = tmp_path_factory.mktemp("lookup-gap")
    plans = {"ngram-3": ("llama-server", DraftRules(4), Strategy(drafting="llama-ngram-simple", ngram_max=3)),
             "ngram-2": ("llama-server", DraftRules(4), Strategy(drafting="llama-ngram-simple", ngram_max=2)),
             "hf": ("hf-assisted", DraftRules(4), Strategy(drafting="hf-prompt-lookup", ngram_max=2)),
             "crossrt": ("crossrt", DraftRules(4), Strategy(drafting="prompt-lookup", ngram_max=3)),
             "map-k": ("llama-server", DraftRules(4), Strategy(drafting="llama-ngram-map-k", ngram_max=3)),
             "model": ("llama-server", DraftRules(4, 0), Strategy())}
    runs = {name: run_pair(RunRequest(tiny_pair, "llama-cpp", OPTIONS, rules, BUDGET, folder / f"{name}.json",
                                      schedule=schedule, strategy=strategy), prompts)
            for name, (schedule, rules, strategy) in plans.items()}
    if availability("llama-server") is None:
        for name, drafting in (("server-native", "llama-ngram-simple"), ("map-k-native", "llama-ngram-map-k")):
            runs[name] = run_pair(RunRequest(
                tiny_pair, "llama-server", OPTIONS, DraftRules(4), BUDGET, folder / f"{name}.json", mode="native",
                strategy=Strategy(drafting=drafting, ngram_max=3)), prompts)
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
                if gap.gap(metric) is None:  # a run with no step there (llama-server's, where no lookup drafts)
                    assert any(native["steps"] == 0 for native in (gap.native_a, gap.native_b))
                    continue
                assert isinstance(gap.gap(metric), Fraction)
                assert sum(split[name][metric] for name in PARTS) == gap.gap(metric)
                # Where a run kept the greedy output its replay is the run (one lookup through
                # ngram-map-k's run); where it did not, it counts as it ran: nothing is left over.
                assert split["residual"][metric] == 0
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
        return exact_figures(runs)["tau"]
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


def test_llama_servers_own_ngram_map_k_against_its_ngram_simple(records, oracles):
    """llama-server's ngram-map-k, whose maps last across the run's requests, replayed through the
    run: its counts are the native run's prompt by prompt, its driven reproduction differs in no
    part, and its gap to llama-server's ngram-simple splits with residual 0 (on the prompts whose
    output is greedy, the replay is the run; the others count as they ran)."""
    if "map-k-native" not in records:
        pytest.skip(f"llama-server does not run here: {availability('llama-server')}")
    native, driven = records["map-k-native"], records["map-k"]
    assert record_drafting(native) == Drafting("llama-ngram-map-k", 3)
    greedy = 0
    for result, sim in zip(native.results, simulate_record(native, oracles), strict=True):
        if tuple(result.output_ids) == sim.output:
            greedy += 1
            # llama-server reports no per-step lengths, only what they add up to
            assert result.counters == dataclasses.replace(sim.counters(native.params.k), step_drafted=None,
                                                          step_accepted=None), result.prompt_id
    assert greedy > 0 and sum(r.counters.drafted for r in native.results) > 0
    assert all(value == 0 for p in tau_gap(native, driven, oracles)[-1].parts for value in p.value.values())
    gap = tau_gap(native, records["server-native"], oracles)[-1]
    assert parts(gap)["residual"] == {metric: 0 for metric in METRICS}
    assert sum(parts(gap)[name]["tau"] for name in PARTS) == gap.gap("tau")
    assert "(llama-server, llama-ngram-map-k(n=3)) vs B (llama-server, llama-ngram-simple(n=3))" in gap.lines()[0]


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


@pytest.mark.skipif(availability("transformers") is not None, reason=str(availability("transformers")))
def test_a_vllm_schedule_run_is_replayed_at_its_context(tiny_pair, prompts, tmp_path):
    """`--runtime transformers --schedule vllm --drafting vllm-ngram` at a context the longest prompt
    and the budget fill, so that vLLM cuts drafts at max_model_len and drafts zeros near it: the
    replay at the record's n_ctx counts as the run did, prompt by prompt, and its gap to
    transformers' prompt lookup (under hf-assisted) splits with residual 0."""
    runtime = open_runtime("transformers", OPTIONS)
    with runtime.load(tiny_pair.path("target", "hf")) as target:
        n_ctx = max(len(target.tokenize(prompt.text)) for prompt in prompts) + BUDGET
        plans = {"vllm": ("vllm", Strategy(drafting="vllm-ngram", ngram_max=3, ngram_min=1)),
                 "hf": ("hf-assisted", Strategy(drafting="hf-prompt-lookup", ngram_max=2))}
        runs = {name: run_pair(RunRequest(tiny_pair, "transformers", RuntimeOptions(n_ctx=n_ctx, threads=1),
                                          DraftRules(4), BUDGET, tmp_path / f"{name}.json", schedule=schedule,
                                          strategy=strategy), prompts)
                for name, (schedule, strategy) in plans.items()}
        oracles = build_oracles(target, None, list(runs.values()))
    record = runs["vllm"]
    assert (record.params.schedule, record.params.n_ctx) == ("vllm", n_ctx)
    greedy = [result for result, sim in zip(record.results, simulate_record(record, oracles), strict=True)
              if tuple(result.output_ids) == sim.output and result.counters == sim.counters(record.params.k)]
    assert greedy and all(tuple(r.output_ids) != oracles[tuple(r.prompt_ids)].output
                          for r in record.results if r not in greedy)
    assert sum(r.counters.drafted for r in greedy) > 0
    # The context binds: replayed as if it never did, some prompt counts otherwise.
    unbound = dataclasses.replace(record, params=dataclasses.replace(record.params, n_ctx=None))
    assert any(r in greedy and r.counters != sim.counters(record.params.k)
               for r, sim in zip(record.results, simulate_record(unbound, oracles), strict=True))
    gap = tau_gap(record, runs["hf"], oracles)[-1]
    assert parts(gap)["residual"] == {metric: 0 for metric in METRICS}
    assert sum(parts(gap)[name]["tau"] for name in PARTS) == gap.gap("tau")
    assert "(vllm, vllm-ngram(1-3)) vs B (hf-assisted, hf-prompt-lookup(max=2))" in gap.lines()[0]
