"""crossrt diff on real llama.cpp runs: near-ties on a random pair, real disagreements on a
swapped model, and the same verdict as crossrt parity's on the same runs."""

import json

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.compare.diff import diff_records
from crossrt.compare.parity import compare_records
from crossrt.records.record_json import load_record
from crossrt.builders.tinypair import build_pair

from conftest import REPO

# Prompts on which the grammar-free random pair's F32 and F16 weights part (near-ties), and
# prompts on which they agree; found by running 120 random prompts.
PROMPTS = {"agrees-1": "river value code light", "agrees-2": "light storm import code light the storm night the",
           "parts-1": "code house a night", "parts-2": "list return house code river return return the return storm river",
           "parts-3": "river market", "parts-4": "import river class day def value"}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def random_records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("random")
    build_pair(folder, preset="random", seed=0)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "category": "prose", "prompt": p}) + "\n" for i, p in PROMPTS.items()))
    for precision in ("f32", "f16"):
        result = run("run", "--target", folder / f"target.{precision}.gguf", "--drafter", folder / f"drafter.{precision}.gguf",
                     "--prompts", prompts, "--max-new-tokens", 40, "--out", folder / f"{precision}.json")
        assert result.exit_code == 0, result.output
    return folder / "f32.json", folder / "f16.json"


def test_f16_weights_part_at_near_ties(random_records):
    a, b = (load_record(path) for path in random_records)
    report = diff_records("f32", a, "f16", b)
    assert set(report.agreeing) == {"agrees-1", "agrees-2"}
    assert {d.prompt_id for d in report.divergences} == {"parts-1", "parts-2", "parts-3", "parts-4"}
    assert 1e-4 < report.noise < 1e-2  # F16 rounding of weights, measured on common tokens
    for divergence in report.divergences:
        assert report.verdict(divergence).startswith("near-tie")
        first, second = divergence.views
        assert first.chosen != second.chosen
        # Each runtime's choice is the other's runner-up: a swap of two near-equal candidates.
        assert second.chosen in [c.token_id for c in first.top[:2]]
        assert first.margin < 0.01 and second.margin < 0.01


def test_diff_command_prints_candidates_and_verdicts(random_records):
    result = run("diff", *random_records)
    parity = run("parity", *random_records)
    # One verdict: diff closes with parity's line on the same records, and exits as parity does.
    assert result.output.strip().splitlines()[-1] == parity.output.strip().splitlines()[-1]
    assert result.exit_code == parity.exit_code
    assert "2 prompts agree, 4 part" in result.output
    assert result.output.count("verdict: near-tie (cross-runtime numerics)") == 4
    assert "top-5:" in result.output and "text before:" in result.output


def test_a_different_model_is_a_disagreement(tmp_path):
    models = REPO / "models" / "tiny"
    for name, target in (("tiny", models / "target.f32.gguf"), ("swapped", models / "drafter.f32.gguf")):
        assert run("run", "--target", target, "--drafter", models / "drafter.f32.gguf", "--max-new-tokens", 16,
                   "--out", tmp_path / f"{name}.json").exit_code == 0
    result = run("diff", tmp_path / "tiny.json", tmp_path / "swapped.json")
    assert result.exit_code == 1
    assert "verdict: disagreement: the runs do not compute the same function (not the same model" in result.output
    assert "verdict: near-tie" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("parity: FAILED")


def test_diff_and_parity_give_one_verdict(random_records):
    """The same near-tie verdict (crossrt/speculative/numerics.py) in both commands, on the same runs."""
    a, b = (load_record(path) for path in random_records)
    report = diff_records("f32", a, "f16", b)
    comparisons = {c.prompt_id: c for c in compare_records(a, b, labels=("f32", "f16"))}
    assert report.divergences
    for divergence in report.divergences:
        near = report.verdict(divergence).startswith("near-tie")
        parity_says = comparisons[divergence.prompt_id]
        assert parity_says.ok == near, (report.verdict(divergence), parity_says)
        assert bool(parity_says.explained) == near
        assert divergence.link.verdict.flip == pytest.approx(
            float(next(line.split("flip ")[1].split()[0] for line in parity_says.explained + parity_says.problems
                       if "flip " in line)), rel=1e-2)
