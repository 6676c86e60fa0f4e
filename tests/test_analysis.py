"""`crossrt analyze` and the analysis API, on traced tiny-pair runs in real llama.cpp."""

import json
import math

import pytest
from click.testing import CliRunner

from crossrt.analyze import analysis
from crossrt.cli.analysis import analyze
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.pairs import pair_from_paths
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules, RuntimeOptions

from conftest import REPO

PROMPTS = load_prompts("builtin")
K = 4


@pytest.fixture(scope="module")
def traced_run(tiny_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("analysis") / "run.json"
    request = RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(K), 40, out,
                         trace=True)
    record = run_pair(request, PROMPTS)
    return out, record, analysis.load_trace(out, record)


def steps_of(record, category=None):
    return [(d, a) for r in record.results if category in (None, r.category)
            for d, a in zip(r.counters.step_drafted, r.counters.step_accepted)]


def test_category_stats_add_up_to_the_record(traced_run):
    _, record, _ = traced_run
    stats = analysis.category_stats(record)
    assert [s.category for s in stats] == [*record.categories(), None]
    for entry in stats:
        summary = record.summary(entry.category)
        assert (entry.steps, entry.accepted, entry.tau, entry.alpha) == \
            (summary.steps, summary.accepted, summary.tau, summary.alpha)
        # Reached draft positions: the accepted ones plus each step's first rejection.
        assert entry.reached == sum(min(d, a + 1) for d, a in steps_of(record, entry.category))
        assert entry.accept_rate == pytest.approx(entry.accepted / entry.reached)
        assert entry.alpha < entry.accept_rate < 1


def test_position_acceptance_conditions_on_reaching_the_position(traced_run):
    _, record, _ = traced_run
    for category in [*record.categories(), None]:
        positions = analysis.position_acceptance(record, category)
        steps = steps_of(record, category)
        assert len(positions) == K
        for p in positions:
            assert p.reached == sum(1 for d, a in steps if a >= p.position and d > p.position)
            assert p.accepted == sum(1 for _, a in steps if a > p.position)
            assert p.rate == pytest.approx(p.accepted / p.reached)
        assert positions[0].reached == sum(1 for d, _ in steps if d > 0)


def test_entropy_and_confidence_buckets_cover_every_reached_position(traced_run):
    _, record, trace = traced_run
    assert set(trace) == {r.prompt_id for r in record.results}
    total = analysis.category_stats(record)[-1]
    for buckets in (analysis.entropy_acceptance(record, trace),
                    analysis.entropy_acceptance(record, trace, (0.0, 1e-5, math.inf)),
                    analysis.confidence_acceptance(record, trace)):
        assert sum(b.tokens for b in buckets) == total.reached
        assert sum(b.accepted for b in buckets) == total.accepted
    low, high = analysis.entropy_acceptance(record, trace, (0.0, 1e-5, math.inf))
    assert low.mean_entropy < 1e-5 <= high.mean_entropy and high.branching_low == pytest.approx(math.exp(1e-5))
    code = analysis.entropy_acceptance(record, trace, category="code")
    assert sum(b.tokens for b in code) == analysis.category_stats(record)[0].reached


def test_expected_tokens_is_the_geometric_sum():
    assert analysis.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert analysis.expected_tokens(1.0, 4) == 5
    assert analysis.expected_tokens(0.0, 7) == 1


def test_iid_fit_reports_both_estimates(traced_run):
    _, record, _ = traced_run
    for fit in analysis.iid_fit(record):
        assert fit.predicted_tau == pytest.approx(analysis.expected_tokens(fit.alpha, K))
        assert fit.error == pytest.approx(fit.predicted_tau - fit.measured_tau)
        assert fit.error_reached == pytest.approx(fit.predicted_tau_reached - fit.measured_tau)
        # a = alpha counts draft tokens after a rejection as failures: it underestimates tau.
        assert fit.predicted_tau < fit.measured_tau
        assert abs(fit.error_reached) < abs(fit.error)


def test_iid_fit_with_own_lengths_is_exact_for_a_perfect_drafter(tiny_pair, tmp_path):
    target = tiny_pair.path("target", "gguf")
    twin = pair_from_paths(target, target)
    request = RunRequest(twin, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(K), 17,
                         tmp_path / "twin.json")
    record = run_pair(request, PROMPTS[:2])
    fit = analysis.iid_fit(record)[-1]
    # Every draft accepted, the last step cut to the budget: tau < k + 1, and only the model
    # with each step's own draft length predicts it.
    assert fit.alpha == fit.accept_rate == 1 and fit.measured_tau < K + 1
    assert fit.predicted_tau == K + 1 and fit.error_reached == pytest.approx(0)


def test_analyze_prints_every_table(traced_run, tiny_pair, tmp_path):
    out, record, _ = traced_run
    result = CliRunner().invoke(analyze, [str(out)], catch_exceptions=False)
    assert result.exit_code == 0
    text = result.output
    assert f"trace run.trace.npz ({len(record.results)} prompts)" in text
    for heading in ("P(acc|reached)", "by draft position", "by the target's entropy", "drafter's top-1"):
        assert heading in text
    overall = next(line for line in text.splitlines() if line.startswith("ALL ") and "pos" not in line)
    assert f"{record.summary().tau:.2f}" in overall.split()
    untraced = tmp_path / "untraced.json"
    run_pair(RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(2), 8, untraced),
             PROMPTS[:1])
    both = CliRunner().invoke(analyze, [str(out), str(untraced)], catch_exceptions=False)
    assert both.exit_code == 0 and "no trace (run with --trace)" in both.output
    assert "pos 2" in both.output.split(str(untraced))[1]
    missing = CliRunner().invoke(analyze, [str(tmp_path / "none.json")])
    assert missing.exit_code == 1 and "no run record" in missing.output


def test_analyze_groups_a_benchmark_by_its_categories_or_by_content_type(tiny_pair, tmp_path):
    """Spec-Bench's own categories (the committed question.jsonl) kept in the record, and
    `--by content-type` files them under crossrt's: coding -> code, math_reasoning -> math,
    writing -> prose."""
    source = REPO / "tests" / "fixtures" / "benchmarks" / "spec_bench_question.jsonl"
    wanted = {"coding", "math_reasoning", "writing"}
    picked = [line for line in source.read_text(encoding="utf-8").splitlines()
              if json.loads(line)["category"] in wanted][::10][:6]
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(picked) + "\n", encoding="utf-8")
    out = tmp_path / "specbench.json"
    record = run_pair(RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=512, threads=1), DraftRules(K), 8, out),
                      load_prompts(f"specbench:{questions}"))
    assert set(record.categories()) == wanted
    own = CliRunner().invoke(analyze, [str(out)])
    by_type = CliRunner().invoke(analyze, [str(out), "--by", "content-type"])
    assert own.exit_code == by_type.exit_code == 0, own.output + by_type.output
    def first_column(output):
        return {line.split()[0] for line in output.splitlines() if line.strip()}

    assert wanted <= first_column(own.output) and not {"code", "math", "prose"} & first_column(own.output)
    assert {"code", "math", "prose"} <= first_column(by_type.output) and not wanted & first_column(by_type.output)
    grouped = analysis.grouped(record, "content-type")
    assert grouped.summary("code").steps == record.summary("coding").steps
