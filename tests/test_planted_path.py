"""Bugs planted in one runtime's verification path only fail plain `crossrt parity` (issue 54).

Each plant (backends/transformers_plants.py) changes how transformers computes a call of more
than one token on a non-empty cache, the shape of a speculative step only: plain greedy
decoding stays exact, so the float control (a prompt pass and one-token decodes) cannot see it.
Parity must exit 1 with a FAIL naming the verification path (or the drafter's rollback); clean
runs pass under every numerics variant.
Nothing here depends on which prompt splits where.
"""

import json

import pytest
from click.testing import CliRunner

from crossrt.backends.transformers_plants import CALL_NOISE, PATH_PLANTS, PLANT_ENV
from crossrt.cli import main
from crossrt.compare.departures import departure_chance, poisson_tail

PROMPTS = [{"id": "code", "category": "code", "prompt": "def add(a, b):\n    return"},
           {"id": "prose", "category": "prose", "prompt": "The river ran past the old mill and"},
           {"id": "list", "category": "structured", "prompt": "- apples\n- pears\n-"}]
# What a FAIL line of a verification-path plant may name.
NAMED = {"drafter-rollback": ("a drafter state not rolled back after a rejection",)}
# The plant's drafter: the tiny pair's 2-layer model, not its 4-layer target (in every process,
# the re-scoring's too, which loads the drafter alone).
SIZED = {"drafter-rollback": "drafter-rollback:4"}
VERIFICATION_PATH = ("verification batches compute otherwise", "verification path")


def parity(folder, pair="tiny", tokens=16, *extra, prompts_given=PROMPTS):
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in prompts_given))
    return CliRunner().invoke(main, ["parity", "--pair", pair, "--runtimes", "llama-cpp,transformers",
                                     "--modes", "driven", "--prompts", str(prompts), "--max-new-tokens",
                                     str(tokens), "--out-dir", str(folder / "runs"), *extra], catch_exceptions=False)


def fails(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("FAIL ")]


@pytest.mark.parametrize("plant", [p.name for p in PATH_PLANTS])
def test_each_verification_path_plant_fails_on_the_tiny_pair(plant, tmp_path, monkeypatch):
    monkeypatch.setenv(PLANT_ENV, SIZED.get(plant, plant))
    result = parity(tmp_path)
    assert result.exit_code == 1, f"{plant} passed parity:\n{result.output}"
    named = NAMED.get(plant, VERIFICATION_PATH)
    assert any(name in line for line in fails(result) for name in named), f"{plant}:\n{result.output}"
    assert result.output.strip().splitlines()[-1].startswith("parity: FAILED")


@pytest.mark.parametrize("numerics", [(), ("--f32-kv-cache", "--no-flash-attn"), ("--flash-attn",),
                                      ("--threads", "2")])
def test_clean_runs_pass_under_each_numerics_variant(numerics, tmp_path, monkeypatch):
    monkeypatch.delenv(PLANT_ENV, raising=False)
    result = parity(tmp_path, "tiny", 16, *numerics)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # Each scorer's verification path checked, with its measured noise and power stated.
    assert sum(line.strip().startswith("verification batches:") for line in lines) == 2
    assert all("would catch logit noise" in line for line in lines if line.strip().startswith("verification batches:"))
    assert "verification batches of 2 scorers" in lines[-1]


def test_a_runtime_that_scores_the_same_input_twice_differently_is_nondeterministic(tmp_path, monkeypatch):
    monkeypatch.setenv(PLANT_ENV, CALL_NOISE.name)
    result = parity(tmp_path)
    assert result.exit_code == 1, result.output
    assert any("nondeterministic: transformers" in line for line in fails(result)), result.output


def test_the_departure_bound_follows_the_measured_noise():
    # A verification path whose gap shifts never reach a margin makes no departure plausible...
    assert departure_chance([0.5, 0.2, 0.9], [1e-5] * 50) == 0.0
    # ...and one whose shifts exceed every margin makes one certain.
    assert departure_chance([1e-6, 0.2], [1.0] * 50) == 1.0
    # Poisson tails: none observed is no surprise; five where 0.01 are expected is.
    assert poisson_tail(0, 0.01) == 1.0
    assert poisson_tail(5, 0.01) < 1e-9
    assert abs(poisson_tail(1, 2.0) - (1 - 2.718281828459045 ** -2)) < 1e-9


def test_verification_path_plants_fail_on_the_real_model(real_pair, tmp_path, monkeypatch):
    """Gemma 3 270M (18 layers, its drafter 17): transformers' multi-token calls on a cache at
    another attention temperature (the issue's own case), and its drafter not rolled back, whose
    outputs stay exact; llama.cpp clean. Both plants in one parity (the real model's cost once):
    the verification-batch check reads the target's scorer and the rollback check the drafter's,
    so each FAIL is its own plant's.

    One prompt: both plants are in every call of their shape, whatever the prompt (the query scale
    in every verification batch, the missing rollback after every rejected draft: 16 tokens at
    Gemma's k = 7 give two verification batches and two rejections on it), so more prompts only
    repeat the same rows' finding at the real model's cost per prompt (each one scored, decoded
    and verified on four scorers); llama.cpp's own checks read the same rows."""
    monkeypatch.setenv(PLANT_ENV, "attention-scale,drafter-rollback:18")
    result = parity(tmp_path, "gemma3-270m", 16, prompts_given=PROMPTS[:1])
    assert result.exit_code == 1, result.output
    for named in (VERIFICATION_PATH, NAMED["drafter-rollback"]):
        assert any(name in line for line in fails(result) for name in named), result.output
    rollback = [line for line in fails(result) if NAMED["drafter-rollback"][0] in line]
    assert all("the drafter on transformers" in line for line in rollback), result.output
    failed_checks = [line for line in result.output.splitlines() if line.startswith("  FAILED ")]
    assert failed_checks and not [line for line in failed_checks if "llama-cpp as run" in line], result.output


def test_an_error_in_the_shared_dequantization_is_found(real_pair, monkeypatch):
    """gguf-py dequantizes for both the float twin and transformers' conversion, so the float
    control cannot see an error there; ggml's own to_float, independent of it, does."""
    from gguf import quants

    from crossrt.compare.dequantization import check_file

    target = real_pair.path("target", "gguf")
    clean = check_file(target, ("llama-cpp/driven",))
    assert clean.ok and "Q8_0" in clean.summary, clean.summary
    original = quants.Q8_0.dequantize_blocks.__func__

    def two_percent_off(cls, blocks):
        return original(cls, blocks) * 1.02

    monkeypatch.setattr(quants.Q8_0, "dequantize_blocks", classmethod(two_percent_off))
    planted = check_file(target, ("llama-cpp/driven",))
    assert not planted.ok and "(Q8_0) otherwise than ggml" in planted.failure(), planted.summary
