"""Planted bugs fail plain `crossrt parity`; the clean comparison passes (issue 46).

Each plant (crossrt/builders/plants.py) puts one realistic bug into one runtime's copy of the
model only: a transformers folder beside the clean GGUF, or a GGUF beside the clean folder, both
named in one pair manifest (`gguf = ...`, `hf = ...`), as a user compares a GGUF with an HF
folder. llama.cpp runs the GGUF, transformers the folder, and parity must exit 1 with a FAIL
that names what diverged (the float control's logits, the weights, the tokenization): never a
pass of splits labelled numerics. Nothing here depends on which prompt splits where.

A plant changes one runtime's copy only, so the other runtime's run is the clean pair's: each
planted kind runs the runtime its plant is in, and plain `crossrt parity` of that record and the
other runtime's record of the clean pair (run once per module) must fail.
"""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.builders.plants import PLANTS, PairFiles, plant_named
from crossrt.cli import main
from crossrt.run.isolation import IN_PROCESS

from conftest import REPO

TINY = REPO / "models" / "tiny"
PROMPTS = [{"id": "code", "category": "code", "prompt": "def add(a, b):\n    return"},
           {"id": "prose", "category": "prose", "prompt": "The river ran past the old mill and"}]
# What a FAIL line of a planted bug may name: the float control's logits, the weights, the ids.
NAMED = ("float control: logits beyond the noise control", "weights: not the same model",
         "tokenizes the prompt text differently", "prompt token ids differ")
TOKENS = 12  # new tokens per prompt on the tiny pair


def manifest(folder: Path, *files: Path) -> Path:
    return PairFiles(*files).manifest(folder)


def parity(pair: Path, folder: Path, tokens: int = TOKENS, *extra: str):
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return CliRunner().invoke(main, ["parity", "--pair", str(pair), "--runtimes", "llama-cpp,transformers",
                                     "--modes", "driven", "--prompts", str(prompts), "--max-new-tokens",
                                     str(tokens), "--out-dir", str(folder / "runs"), *extra], catch_exceptions=False)


def planted_pair(plant_name: str, folder: Path, *files: Path) -> Path:
    """The manifest whose one runtime's target copy holds the plant."""
    return PairFiles(*files).planted(plant_named(plant_name), folder).manifest(folder)


def assert_fails_by_name(result, plant_name):
    assert result.exit_code == 1, f"{plant_name} passed parity:\n{result.output}"
    fails = [line for line in result.output.splitlines() if line.startswith("FAIL ")]
    assert any(name in line for line in fails for name in NAMED), f"{plant_name}:\n" + "\n".join(fails)
    assert result.output.strip().splitlines()[-1].startswith("parity: FAILED")


@pytest.fixture(scope="module")
def tiny_clean(tmp_path_factory):
    """(parity's result, folder, {runtime name: its record}): `crossrt parity --pair` of the clean
    tiny pair, whose records are each planted kind's clean side."""
    folder = tmp_path_factory.mktemp("planted-tiny")
    pair = manifest(folder, TINY / "target.f32.gguf", TINY / "target-hf", TINY / "drafter.f32.gguf",
                    TINY / "drafter-hf")
    result = parity(pair, folder)
    records = {json.loads(path.read_text())["runtime"]["name"]: path for path in (folder / "runs").glob("*.json")}
    return result, folder, records


def test_the_clean_tiny_pair_passes_with_its_power_stated(tiny_clean):
    result, folder, records = tiny_clean
    assert result.exit_code == 0, result.output
    verdict = result.output.strip().splitlines()[-1]
    assert verdict.startswith("parity: OK") and "logits against a float control in 1 pair" in verdict
    assert "would catch logit noise of sigma" in verdict
    # ... and said in plain words (crossrt/compare/plain.py), once.
    said = [line for line in result.output.splitlines() if line.startswith("in plain words: would catch logit noise")]
    assert len(said) == 1 and "the logit checks would notice a run whose every logit was off by random noise" in said[0]
    # The cheaper mode says it is weaker: a verdict of the same two runs' records (running them
    # again would give the same records; the mode changes only the verdict).
    assert sorted(records) == ["llama-cpp", "transformers"], sorted((folder / "runs").glob("*.json"))
    cheaper = CliRunner().invoke(main, ["parity", *map(str, records.values()), "--no-float-control"],
                                 catch_exceptions=False)
    assert cheaper.exit_code == 0, cheaper.output
    assert "no float control (--no-float-control): a weaker check" in cheaper.output.strip().splitlines()[-1]


@pytest.mark.parametrize("plant_name", [p.name for p in PLANTS])
def test_each_planted_kind_fails_on_the_tiny_pair(plant_name, tiny_clean, tmp_path):
    """The planted copy runs on its format's runtime; the other runtime's run is the clean
    pair's (tiny_clean): the same files, prompts and settings, so running it again per kind
    would give the same record."""
    _, folder, records = tiny_clean
    pair = planted_pair(plant_name, tmp_path, TINY / "target.f32.gguf", TINY / "target-hf",
                        TINY / "drafter.f32.gguf", TINY / "drafter-hf")
    runtime, clean = ("transformers", "llama-cpp") if plant_named(plant_name).fmt == "hf" \
        else ("llama-cpp", "transformers")
    planted = CliRunner().invoke(main, ["run", "--pair", str(pair), "--runtime", runtime, "--prompts",
                                        str(folder / "prompts.jsonl"), "--max-new-tokens", str(TOKENS),
                                        "--out", str(tmp_path / "planted.json")], catch_exceptions=False)
    assert planted.exit_code == 0, planted.output
    assert_fails_by_name(CliRunner().invoke(main, ["parity", str(records[clean]), str(tmp_path / "planted.json")],
                                            catch_exceptions=False), plant_name)


@pytest.fixture(scope="module")
def gemma(real_pair):
    """The real model's GGUFs and transformers' float conversions of them (made by setup)."""
    from crossrt.backends.transformers import dequantized_folder

    target, drafter = real_pair.path("target", "gguf"), real_pair.path("drafter", "gguf")
    folders = dequantized_folder(target), dequantized_folder(drafter)
    if not all(folder.is_dir() for folder in folders):
        pytest.skip("the real model's conversions are made by scripts/setup (scripts/fetch_real_model)")
    return target, folders[0], drafter, folders[1]


# On the real model a parity costs ~50 s on one thread: the clean folder and three planted ones
# (two kinds that only the float control's logits can catch, the weights being the same, and one
# the weights check names) are compared in one parity of their records, so the clean llama.cpp
# side is run, scored and checked once. The exact GELU for Gemma's tanh approximation is not
# caught there (docs/parity.md).
REAL_PLANTS = ("rope-base", "attention-scale", "block-weights")
# One prompt on the real model: each plant is in the model's function, so every row of any prompt
# computes it (the RoPE base at every position past the first, the attention temperature wherever a
# row attends to more than one token, the block's weights in the weights check, read from the files
# whatever the prompt), and every check is row by row against its own noise control on the same
# rows; a second prompt repeated the same finding at the real model's cost per prompt (five runs,
# each scored, decoded and verified on its scorer). The tiny pair keeps both prompts.
REAL_PROMPTS = PROMPTS[:1]
# 6 new tokens on the real model, not the tiny pair's 12: for the same reason, every row shows each
# plant, far past its bound. Measured at 6 (12), the float control against llama.cpp's twin:
# rope-base max abs 16x (15x) its bound, mean KL 410x; attention-scale 27x (24x), KL 1100x;
# block-weights 8.7x (6.7x), KL 75x, and the weights check, which reads the files, names it at any
# length. Each further token only repeated the finding, on all five runs and scorers.
REAL_TOKENS = 6


@pytest.fixture(scope="module")
def real_verdict(gemma, tmp_path_factory):
    """(parity's result, folder): crossrt run of the clean GGUF on llama.cpp, of the clean folder
    and of each planted one (in a folder named by the plant) on transformers, then crossrt parity
    of the five records.

    In this process (CROSSRT_IN_PROCESS=1), not each run and scorer in one of its own: the same
    real runtimes compute the same records and verdict, but torch and transformers are imported
    once and Gemma's 262,144-token tokenizer, the same bytes in every folder, is read once (~4.5
    CPU-s a process) for the four transformers runs and the verdict's scorers: measured 109 -> 89
    CPU-s for the four real-model tests. What is asserted is the verdict, not the isolation
    (tests/test_isolation.py and tests/test_processes.py test that); the setting is this
    fixture's commands' alone."""
    target, target_hf, drafter, drafter_hf = gemma
    folder = tmp_path_factory.mktemp("planted-real")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in REAL_PROMPTS))
    clean = PairFiles(target, target_hf, drafter, drafter_hf)
    pairs = {"clean": clean.manifest(folder, name="clean")}
    for name in REAL_PLANTS:
        (folder / name).mkdir()
        pairs[name] = clean.planted(plant_named(name), folder / name).manifest(folder, name=name)

    def run(pair: Path, runtime: str, out: str) -> str:
        result = CliRunner().invoke(main, ["run", "--pair", str(pair), "--runtime", runtime, "--prompts", str(prompts),
                                           "--max-new-tokens", str(REAL_TOKENS), "--out", str(folder / out)])
        assert result.exit_code == 0, result.output
        return str(folder / out)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(IN_PROCESS, "1")
            records = [run(pairs["clean"], "llama-cpp", "llama-clean.json"),
                       run(pairs["clean"], "transformers", "hf-clean.json"),
                       *(run(pairs[name], "transformers", f"hf-{name}.json") for name in REAL_PLANTS)]
            verdict = CliRunner().invoke(main, ["parity", *records], catch_exceptions=False)
        yield verdict, folder
    finally:
        for name in REAL_PLANTS:
            shutil.rmtree(folder / name, ignore_errors=True)


def test_the_real_model_against_its_own_hf_folder_passes(real_verdict):
    result, folder = real_verdict
    lines = result.output.splitlines()
    headline = next(line for line in lines
                    if line.startswith("llama-cpp/driven") and f"hf-clean.json): {len(REAL_PROMPTS)} prompts" in line)
    assert ", 0 failed, 0 not comparable" in headline, headline
    # Every FAIL is a plant's: none between the clean runs, their scorings or their own baselines.
    fails = [line for line in lines if line.startswith("FAIL ")]
    assert fails and all(any(f"hf-{name}.json" in line or f"{name}/target-planted" in line for name in REAL_PLANTS)
                         for line in fails), "\n".join(fails)
    assert any(line.startswith("  float control: llama-cpp on ") and "target-planted" not in line
               for line in lines), result.output  # the clean pair's float control ran, and passed
    # The GGUF on llama.cpp, the folder on transformers: one vocabulary, by what its ids mean.
    records = [json.loads((folder / name).read_text()) for name in ("llama-clean.json", "hf-clean.json")]
    assert [record["pair"]["target"]["format"] for record in records] == ["gguf", "hf"]
    assert len({record["pair"]["target"]["vocab_fingerprint"] for record in records}) == 1


@pytest.mark.parametrize("plant_name", REAL_PLANTS)
def test_planted_kinds_fail_on_the_real_model(plant_name, real_verdict):
    result, _ = real_verdict
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1].startswith("parity: FAILED")
    fails = [line for line in result.output.splitlines() if line.startswith("FAIL ")
             and (f"hf-{plant_name}.json" in line or f"{plant_name}/target-planted" in line)]
    assert any(name in line for line in fails for name in NAMED), f"{plant_name}:\n" + "\n".join(fails)
