"""The tau gap between two records split into named parts, on real runs of the tiny F32 pair:
the parts add up to the gap exactly, and each part takes what it names."""

import dataclasses
import itertools
from fractions import Fraction

import pytest

from crossrt.run.driver import RunRequest, run_pair
from crossrt.errors import ComparisonError
from crossrt.inputs.prompts import Prompt, load_prompts
from crossrt.run.runtime import DraftRules, RuntimeOptions, availability
from crossrt.simulate.schedule_sims import summarize_schedule
from crossrt.records.schema import Counters, ImportInfo
from crossrt.compare.tau_gap import METRICS, PARTS, build_oracles, exact_figures, pair_gaps, tau_gap

PROMPTS = load_prompts("builtin")[::2]
BUDGET = 24
OPTIONS = RuntimeOptions(n_ctx=512, threads=1)


@pytest.fixture(scope="module")
def records(tiny_pair, tmp_path_factory):
    """Driven runs of three schedules at k = 4 and 3, and llama-server natively where it runs."""
    folder = tmp_path_factory.mktemp("gap")
    runs = {}
    for name, schedule, rules in [("crossrt", "crossrt", DraftRules(4)),
                                  ("server", "llama-server", DraftRules(4, 0)),
                                  ("simple", "llama-spec-simple", DraftRules(3, 2, 0.9999))]:
        runs[name] = run_pair(RunRequest(tiny_pair, "llama-cpp", OPTIONS, rules, BUDGET, folder / f"{name}.json",
                                         schedule=schedule), PROMPTS)
    if availability("llama-server") is None:
        runs["server-native"] = run_pair(RunRequest(tiny_pair, "llama-server", OPTIONS, DraftRules(4, 0), BUDGET,
                                                    folder / "native.json", mode="native"), PROMPTS)
    return runs


@pytest.fixture(scope="module")
def oracles(tiny_sessions, records):
    return build_oracles(*tiny_sessions, list(records.values()))


def total(gap, metric):
    return sum(part.value[metric] for part in gap.parts)


def test_parts_add_up_to_the_gap_exactly_overall_and_per_category(records, oracles):
    for (name_a, a), (name_b, b) in itertools.permutations(records.items(), 2):
        gaps = tau_gap(a, b, oracles, name_a, name_b)
        assert [g.category for g in gaps] == sorted({p.category for p in PROMPTS}) + [None]
        for gap in gaps:
            assert [p.name for p in gap.parts] == list(PARTS)
            for metric in METRICS:
                assert isinstance(gap.gap(metric), Fraction) and total(gap, metric) == gap.gap(metric)
            assert gap.lines()[0].startswith(f"tau gap {name_a} (")


def test_on_the_f32_pair_every_gap_is_schedule_and_rules(records, oracles):
    """Every run emits the target's greedy output and its schedule's simulated counts here, so
    nothing is left for numerics or the residual: the residual is computed, and it is zero."""
    for (name_a, a), (name_b, b) in itertools.permutations(records.items(), 2):
        for gap in tau_gap(a, b, oracles, name_a, name_b):
            parts = {p.name: p.value for p in gap.parts}
            for metric in METRICS:
                assert parts["schedule and rules"][metric] == gap.gap(metric)
                assert all(parts[name][metric] == 0 for name in ("counting", "rendering", "numerics", "residual"))
    same = tau_gap(records["crossrt"], records["crossrt"], oracles)[-1]
    assert all(part.value[metric] == 0 for part in same.parts for metric in METRICS)


def with_result(record, prompt_id, **changes):
    result = next(r for r in record.results if r.prompt_id == prompt_id)
    return record.with_result(dataclasses.replace(result, **changes))


def test_the_residual_takes_counts_the_simulation_misses(records, oracles):
    """A run with the greedy output but other counts (here: another run's) is the residual's."""
    a, b = records["crossrt"], records["server"]
    target = PROMPTS[0].id
    other = next(r for r in records["simple"].results if r.prompt_id == target)
    changed = with_result(a, target, counters=other.counters)
    before, after = tau_gap(a, b, oracles)[-1], tau_gap(changed, b, oracles)[-1]
    parts = {p.name: p for p in after.parts}
    for metric in METRICS:
        assert parts["residual"].value[metric] == after.native_a[metric] - before.native_a[metric] != 0
        assert parts["residual"].by_run[1][metric] == 0 and parts["numerics"].value[metric] == 0
        assert total(after, metric) == after.gap(metric)


def test_numerics_takes_runs_that_left_the_greedy_output(records, oracles):
    a, b = records["crossrt"], records["server"]
    target = PROMPTS[1].id
    result = next(r for r in b.results if r.prompt_id == target)
    other = next(r for r in records["simple"].results if r.prompt_id == target)
    # B left the greedy output at its last token, and counted otherwise there.
    left = with_result(b, target, output_ids=result.output_ids[:-1] + ((result.output_ids[-1] + 1) % 500,),
                       counters=dataclasses.replace(other.counters, unverified=1, cut=1))
    before, after = tau_gap(a, b, oracles)[-1], tau_gap(a, left, oracles)[-1]
    parts = {p.name: p for p in after.parts}
    for metric in ("tau", "steps"):
        assert parts["numerics"].by_run[1][metric] == after.native_b[metric] - before.native_b[metric] != 0
        assert parts["numerics"].value[metric] == -parts["numerics"].by_run[1][metric]
        assert parts["residual"].value[metric] == 0 and total(after, metric) == after.gap(metric)


def test_rendering_is_one_schedule_on_both_runs_prompt_ids(tiny_pair, tiny_sessions, records, tmp_path):
    """B fed other ids for the same prompts (its own rendering): the rendering part is B's
    schedule on A's ids against B's schedule on B's ids."""
    a = records["crossrt"]
    rendered = [Prompt(p.id, p.category, p.text + " the") for p in PROMPTS]
    b = run_pair(RunRequest(tiny_pair, "llama-cpp", OPTIONS, DraftRules(4, 0), BUDGET, tmp_path / "b.json",
                            schedule="llama-server"), rendered)
    oracles = build_oracles(*tiny_sessions, [a, b])
    gap = tau_gap(a, b, oracles)[-1]
    on_a = [oracles[tuple(r.prompt_ids)] for r in a.results]
    on_b = [oracles[tuple(r.prompt_ids)] for r in b.results]
    rules = DraftRules(4, 0)
    expected = {}
    for metric, pick in (("tau", lambda r: r.tau), ("steps", lambda r: r.steps)):
        expected[metric] = pick(summarize_schedule(on_a, "llama-server", rules)[-1]) - \
            pick(summarize_schedule(on_b, "llama-server", rules)[-1])
    rendering = next(p for p in gap.parts if p.name == "rendering").value
    assert float(rendering["tau"]) == pytest.approx(expected["tau"], abs=1e-12)
    assert rendering["steps"] == expected["steps"]
    assert all(total(gap, metric) == gap.gap(metric) for metric in METRICS)


def test_counting_is_native_figure_against_normalized():
    unlisted = dict(accepted_per_pos=None, step_drafted=None, step_accepted=None)
    counters = [Counters(4, 16, 8, 13, **unlisted), Counters(6, 24, 12, 18, **unlisted)]
    figures = exact_figures(counters)
    assert type(figures["tau"]) is Fraction and figures["tau"] == 3 == exact_figures(counters, "llama-server")["tau"]
    assert exact_figures(counters, "exllamav3")["tau"] == Fraction(31, 10)  # new_tokens / rounds
    assert figures["alpha"] == Fraction(1, 2) and figures["steps"] == 10
    assert exact_figures([Counters(0, 0, 0, 1, **unlisted)])["tau"] is None


def test_counting_part_of_a_runtime_that_prints_emitted_per_step(records, oracles):
    """A llama-server run read as if its runtime printed emitted / steps: the first token from
    the prompt pass is then counted in tau, and the counting part is that, exactly."""
    a, b = records["crossrt"], records["server"]
    relabeled = dataclasses.replace(b, params=dataclasses.replace(b.params, schedule="exllamav3", draft_n_min=4))
    gap = tau_gap(a, relabeled, oracles)[-1]
    counting = next(p for p in gap.parts if p.name == "counting").value["tau"]
    counters = [r.counters for r in b.results if r.ok]
    steps, emitted = sum(c.steps for c in counters), sum(c.emitted for c in counters)
    assert counting == -(Fraction(emitted, steps) - exact_figures(counters)["tau"]) != 0
    assert total(gap, "tau") == gap.gap("tau")


def test_refusals(records, oracles, tiny_pair, tmp_path):
    a, b = records["crossrt"], records["server"]
    shorter = dataclasses.replace(b, params=dataclasses.replace(b.params, max_new_tokens=BUDGET - 1))
    with pytest.raises(ComparisonError, match="other token budgets"):
        tau_gap(a, shorter, oracles)
    imported = dataclasses.replace(b, imported=ImportInfo("vllm-log", "x.log", (), ()))
    with pytest.raises(ComparisonError, match="imported record"):
        tau_gap(a, imported, oracles)
    sglang = dataclasses.replace(b, params=dataclasses.replace(b.params, schedule="sglang"))
    with pytest.raises(ComparisonError, match="not simulated"):
        tau_gap(a, sglang, oracles)
    with pytest.raises(ComparisonError, match="no prompt in common"):
        tau_gap(a, dataclasses.replace(b, results=()), oracles)


def test_parity_lines_for_every_two_runs_whose_schedules_differ(records):
    runs = list(records.items())
    imported = dataclasses.replace(records["server"], imported=ImportInfo("vllm-log", "x.log", (), ()))
    gaps = pair_gaps(runs + [("imported", dataclasses.replace(imported, params=dataclasses.replace(
        imported.params, schedule="vllm", draft_n_min=4)))])
    lines = [line for gap in gaps for line in gap.lines()]
    heads = [line for line in lines if line.startswith("tau gap ") and ", ALL (" in line]
    differ = [(a, b) for i, (a, ra) in enumerate(runs) for b, rb in runs[i + 1:]
              if ra.params.schedule != rb.params.schedule]
    assert [line.split(", ALL")[0] for line in heads] == [
        f"tau gap {a} ({records[a].params.schedule}) vs {b} ({records[b].params.schedule})" for a, b in differ]
    categories = sorted({p.category for p in PROMPTS})
    assert sum(1 for line in lines if line.startswith("  alpha ")) == len(differ)
    assert sum(1 for line in lines if any(f", {c} (" in line for c in categories)) == len(differ) * len(categories)
    assert [line for line in lines if "imported" in line] == [
        f"tau gap {name} vs imported: not computed (imported: an imported record holds no prompts to simulate)"
        for name in records]


def test_parity_prints_the_tau_gap_before_its_verdict(records, tmp_path):
    from click.testing import CliRunner
    from crossrt.cli.compare import parity
    from crossrt.records.record_json import save_record

    paths = []
    for name in ("crossrt", "server"):
        paths.append(tmp_path / f"{name}.json")
        save_record(records[name], paths[-1])
    result = CliRunner().invoke(parity, [str(p) for p in paths] + ["--no-logits"])
    lines = result.output.strip().splitlines()
    gap = [line for line in lines if line.startswith("tau gap ")]
    assert result.exit_code == 0 and lines[-1].startswith("parity: OK; compared token ids in "), result.output
    assert gap[0].startswith("tau gap llama-cpp/driven (crossrt.json) (crossrt) vs llama-cpp/driven (server.json) "
                             "(llama-server), ALL (")
    assert " + schedule and rules " in gap[0] and " + residual +0.00" in gap[0]
    assert len(gap) == 1 + len({p.category for p in PROMPTS})
    # --no-tau-gap leaves the lines out and the verdict as it was.
    without = CliRunner().invoke(parity, [str(p) for p in paths] + ["--no-logits", "--no-tau-gap"])
    kept, gaps = without.output.strip().splitlines(), ("tau gap ", "  alpha ")
    assert without.exit_code == 0 and kept[-1] == lines[-1] and not [line for line in kept if line.startswith(gaps)]
    assert len(kept) == len([line for line in lines if not line.startswith(gaps)])  # the cost line's time aside
    # ... and from the --html page: its "Why tau differs" section is drawn only where gaps were computed.
    pages = {}
    for flags in ((), ("--no-tau-gap",)):
        pages[flags] = tmp_path / f"parity{len(flags)}.html"
        assert CliRunner().invoke(parity, [str(p) for p in paths] + ["--no-logits", "--html", str(pages[flags]),
                                                                     *flags]).exit_code == 0
    assert 'id="tau-gap"' in pages[()].read_text() and 'id="tau-gap"' not in pages[("--no-tau-gap",)].read_text()
