"""The real public model (Gemma 3 270M Q4_K_M, fetched by scripts/setup, with its layer-skip
drafter) through the llama.cpp runtimes, and a diagnosis that names the cause of every split.
Which prompt splits where depends on the CPU, threads and kernels (near-ties break differently
on AVX2 and AVX-512), so nothing here names a split: every split found must have a numerics
cause, a swapped model must not, and a tokenization split (a run of spaces) is one everywhere.
One thread, a few prompts, short outputs."""

import dataclasses
import json

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.compare.census import NUMERICS_VARIANTS, SERVER_TWIN, generated_prompts, take_census
from crossrt.compare.diagnosis import Explainer, explain_record
from crossrt.compare.diff import diff_records, render_diff
from crossrt.compare.parity import labelled
from crossrt.inputs.pairs import load_pair
from crossrt.records.record_json import load_record, save_record
from crossrt.compare.replay import Replayer
from crossrt.compare.splits import NUMERICS
from crossrt.sweep.store import SweepStore

from conftest import REPO

PAIR = REPO / "models" / "pairs" / "gemma3-270m.toml"
PROMPTS = [{"id": "fruits", "category": "structured", "prompt": "Here is a list of five fruits:\n1."},
           {"id": "science", "category": "prose", "prompt": "Photosynthesis is the process by which plants"},
           {"id": "story", "category": "prose", "prompt": "Once upon a time, in a small village by the sea,"}]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def real_pair():
    pair = load_pair(PAIR)
    for role in ("target", "drafter"):
        path = pair.path(role, "gguf")  # PairError naming the file when scripts/setup has not fetched it
        assert path.stat().st_size > 100_000_000
    return pair


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "real.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def driven(real_pair, prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("driven") / "driven.json"
    result = run("run", "--pair", PAIR, "--prompts", prompts, "--max-new-tokens", 16, "--out", out)
    assert result.exit_code == 0, result.output
    return out


def native_and_twin(runtime: str, schedule: str, prompts, folder):
    """A native runtime's run of the module's prompts and its schedule driven in-process (the twin)."""
    native, twin = folder / "native.json", folder / "twin.json"
    assert run("run", "--pair", PAIR, "--prompts", prompts, "--max-new-tokens", 16, "--runtime", runtime,
               "--mode", "native", "--out", native).exit_code == 0
    assert run("run", "--pair", PAIR, "--prompts", prompts, "--max-new-tokens", 16, "--schedule", schedule,
               "--out", twin).exit_code == 0
    return native, twin


@pytest.fixture(scope="module")
def server_runs(real_pair, prompts, tmp_path_factory):
    """llama-server natively and its twin."""
    return native_and_twin("llama-server", "llama-server", prompts, tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def spec_runs(real_pair, prompts, tmp_path_factory):
    """llama-speculative-simple natively and its twin."""
    return native_and_twin("llama-spec-cli", "llama-spec-simple", prompts, tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def schedules_parity(server_runs, driven, spec_runs):
    """One parity of the native runs of two schedules and crossrt's own: llama-server natively
    (its twin left out, so its splits are re-scored), llama-speculative-simple natively with its
    driven twin, and the driven run. --no-tau-gap: the runs' schedules differ, so parity would
    add tau gap lines, whose oracle (every prompt decoded again by target and drafter in
    llama.cpp, ~12 CPU-s here) no test here reads: what is asserted is the headlines, the
    counters compared and that nothing fails or is left unexplained, which the gap lines never
    change (they are information, not a verdict). Parity's tau gap lines are asserted in
    tests/test_tau_gap.py, and on the real model's heads in tests/test_heads.py."""
    report = run("parity", server_runs[0], driven, *spec_runs, "--no-logits", "--no-tau-gap")
    return report


def test_every_lossless_failure_has_a_numerics_cause(driven):
    record = load_record(driven)
    with Replayer() as replay:
        splits = explain_record("llama-cpp/driven", record, Explainer(replay=replay))
    assert len(splits) == sum(not r.lossless for r in record.results)
    for split in splits:
        assert split.numerics, split.render()
        assert split.verdict.near and all(side.gap is not None and not side.gap.at_least for side in split.sides)
        speculative, baseline = split.sides
        assert baseline.pass_tokens == 1  # the baseline decodes one token at a time
        assert (speculative.token, speculative.other) == (baseline.other, baseline.token)
    report = run("diff", driven)
    assert report.exit_code == 0
    assert report.output.count("verdict: batch-shape numerics") == len(splits)


def test_parity_notes_every_split_and_strict_fails_exactly_those(driven):
    record = load_record(driven)
    split = [r.prompt_id for r in record.results if not r.lossless]
    explained = run("parity", driven, "--no-logits")
    assert explained.exit_code == 0, explained.output
    assert f"vs its baseline: 3 prompts: {3 - len(split)} identical, {len(split)} explained" in explained.output
    assert explained.output.count("NOTE ") == len(split) and "FAIL" not in explained.output
    strict = run("parity", driven, "--no-logits", "--strict")
    assert strict.exit_code == (1 if split else 0)
    assert sorted(line.split(", ")[1].split(":")[0] for line in strict.output.splitlines()
                  if line.startswith("FAIL")) == sorted(split)


def _honest(output: str) -> None:
    assert "FAIL" not in output and "unexplained" not in output and "disagreement" not in output, output


def test_llama_server_finishes_every_prompt_and_every_split_is_explained(server_runs, schedules_parity, tmp_path):
    """llama-server on a sliding-window model: with its prompt in one decode (--swa-full, as the
    in-process cache), its counts fit its schedule. Its splits are explained by the driven
    llama-server schedule's pass views where that twin emitted the same ids, and by its passes
    re-scored in-process where no twin did (against crossrt's own schedule: the module's parity of
    schedules, where llama-spec-cli's runs are compared too)."""
    native, twin = server_runs
    record = load_record(native)
    assert all(r.ok and r.unfit_counts is None and r.counters.identity_violations(7) == [] for r in record.results)
    reports = {twin: run("parity", native, twin, "--no-logits"), "driven": schedules_parity}
    for report in reports.values():
        assert report.exit_code == 0, report.output
        _honest(report.output)
        assert "llama-server/native vs its baseline: 3 prompts:" in report.output and ", 0 failed" in report.output
    assert "counters compared" in reports[twin].output
    # One more accepted token on one prompt, every identity kept: llama-server and its in-process
    # twin share the build and kernels, so no drafter near-tie may excuse the count.
    edited = tmp_path / "edited.json"
    save_record(with_one_more_accepted(load_record(native)), edited)
    report = run("parity", edited, twin, "--no-logits")
    assert report.exit_code == 1, report.output
    assert "counters unexplained" in report.output and "drafter numerics" not in report.output, report.output


def with_one_more_accepted(record):
    """record with one prompt's count edited consistently: accepted + 1 and cut + 1 (so
    emitted = steps + accepted + unverified - cut still holds), drafted and the per-position
    counts kept consistent, the totals rewritten by save_record."""
    index = next(i for i, r in enumerate(record.results) if r.ok and r.counters.accepted < r.counters.drafted)
    counters = record.results[index].counters
    per = list(counters.accepted_per_pos or ())
    if per:
        bump = next((i for i in range(1, len(per)) if per[i] < per[i - 1]),
                    0 if per[0] < counters.steps else len(per))
        per = per + [0] if bump == len(per) else per
        per[bump] += 1
    edited = dataclasses.replace(counters, accepted=counters.accepted + 1, cut=counters.cut + 1,
                                 accepted_per_pos=tuple(per) if counters.accepted_per_pos is not None else None)
    assert edited.identity_violations(record.params.k) == []
    results = list(record.results)
    results[index] = dataclasses.replace(results[index], counters=edited)
    return dataclasses.replace(record, results=tuple(results))


def test_every_split_of_the_real_model_has_a_numerics_cause(driven, server_runs, tmp_path):
    """The split census (crossrt/compare/census.py) of the real model: six prompts through llama.cpp
    under every numerics variant (F16 and F32 KV cache, flash attention off, llama-server natively
    and its schedule driven), a numerics cause for every split, which prompts split where left to
    the machine. The first three are the module's prompts, whose F16-cache, llama-server and twin
    runs are the module's own (the other tests read them too); three generated ones run every
    variant. One batch of the six: a variant the module ran runs the generated three and its
    record is joined to the module's, the others run all six at once (one load, one comparison
    of every run, where two batches loaded and compared twice). 16 tokens, as every real-model
    run here: a comparison ends at its first split, so a prompt gives at most one split per run
    and per pair of runs at any length."""
    made = dict(zip(("f16-kv", "server", "server-schedule"), (driven, *server_runs)))
    generated = generated_prompts(1, 3)
    variants = NUMERICS_VARIANTS + (SERVER_TWIN,)
    assert {v.name: (v.runtime, v.mode, v.options) for v in variants if v.name in made} == {
        "f16-kv": ("llama-cpp", "driven", ()), "server": ("llama-server", "native", ()),
        "server-schedule": ("llama-cpp", "driven", ("--schedule", "llama-server"))}  # as the fixtures ran them

    def run_one(variant, batch, out):
        given = [json.loads(line) for line in batch.read_text().splitlines()]
        assert given == PROMPTS + generated
        if variant.name in made:
            batch = out.with_suffix(".jsonl")
            batch.write_text("".join(json.dumps(p) + "\n" for p in generated))
        result = run("run", "--pair", PAIR, "--runtime", variant.runtime, "--mode", variant.mode, "--prompts", batch,
                     "--max-new-tokens", 16, "--out", out, *variant.options)
        assert result.exit_code == 0, result.output
        record = load_record(out)
        if variant.name in made:
            record = load_record(made[variant.name]).with_results(record.results)
        assert [r.prompt_id for r in record.results] == [p["id"] for p in given]
        return record

    census = take_census(run_one, tmp_path, variants, max_batches=1, prompts_of=lambda number: PROMPTS + generated)
    print("\n" + census.render())  # pytest -s: this machine's census
    assert census.failures == [], "\n".join(census.failures[:5])
    assert census.unexplained() == 0
    assert all(cause in NUMERICS for (_, cause) in census.causes)
    assert census.prompts == 6


def test_llama_spec_cli_equals_its_driven_schedule_on_the_real_model(spec_runs, schedules_parity):
    """llama-speculative-simple natively, its driven twin and crossrt's driven run in one parity
    (the module's, with llama-server's native run beside them)."""
    report = schedules_parity
    assert report.exit_code == 0, report.output
    _honest(report.output)
    assert "llama-spec-cli/native vs llama-cpp/driven (twin.json): 3 prompts:" in report.output
    assert "counters compared" in report.output


def test_a_swapped_model_is_a_disagreement(real_pair, driven, tmp_path):
    """The 15-block cut standing in as the target: the same vocabulary, another function. On the
    module's first prompt, against the driven run's own result for it (its record cut to that
    prompt, nothing re-run): another function parts from the model on any prompt, far from a
    near-tie, so one shows it, and `crossrt diff`'s verdict re-scores each prompt on both targets
    and the drafter they share (their verification paths, rollback and noise), where three
    prompts cost twice what one does."""
    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps(PROMPTS[0]) + "\n")
    one = tmp_path / "driven.json"
    record = load_record(driven)
    save_record(dataclasses.replace(record, results=record.results[:1]), one)
    swapped = tmp_path / "swapped.json"
    cut = REPO / ".cache" / "models" / "gemma3-270m-q4_k_m-blocks15.gguf"
    assert run("run", "--target", cut, "--drafter", real_pair.path("drafter", "gguf"), "--prompts", first,
               "--max-new-tokens", 16, "--out", swapped).exit_code == 0
    report = run("diff", one, swapped)
    assert report.exit_code == 1  # parity's verdict: the weights are another model's
    assert "part at baseline token" in report.output
    assert "verdict: disagreement" in report.output and "verdict: near-tie" not in report.output
    assert "weights: not the same model" in report.output
    # diff ends with parity's verdict on the same records (one compare_safely): its FAIL lines
    # are parity's, read here rather than computing that verdict a second time.
    assert report.output.strip().splitlines()[-1].startswith("parity: FAILED")
    failed = {line.split(", ")[1].split(":")[0] for line in report.output.splitlines()
              if line.startswith("FAIL") and "(swapped.json)" in line and ", " in line}
    assert failed == {PROMPTS[0]["id"]}, report.output  # a disagreement or far logits


def test_llama_cpp_and_transformers_agree_in_distribution_and_a_run_of_spaces_splits_tokenization(
        real_pair, tmp_path):
    """transformers loads the same Q4_K_M GGUF dequantized: logits differ by whole logits where
    llama.cpp quantizes activations, so parity checks KL divergence, and passes on it; a run of
    40 spaces is tokenized differently by the two (a tokenization split, named as such, by the
    diff `crossrt diff` prints: diff_records, without the parity verdict the command appends,
    which is the one asserted above and cost as much again). --no-float-control: what is asserted
    is QUANTIZED's bounds and the two splits' names; the float control (F32 scorings of both runs,
    9-10 CPU-s here in two of three measurements) is asserted on the real model by
    tests/test_planted.py, where llama.cpp's clean run and transformers' pass it."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "capital", "category": "prose", "prompt": "The capital of France is"}) + "\n"
                       + json.dumps({"id": "spaces", "category": "structured", "prompt": "x =" + " " * 40 + "1"}) + "\n")
    report = run("parity", "--pair", PAIR, "--runtimes", "llama-cpp,transformers", "--modes", "driven",
                 "--prompts", prompts, "--k", 4, "--max-new-tokens", 6, "--out-dir", tmp_path, "--no-float-control")
    assert "2/2 within tolerance" in report.output, report.output
    assert "quantized weights: llama.cpp quantizes activations too" in report.output
    assert "FAIL transformers/driven vs its baseline, spaces: tokenizes the prompt text differently" in report.output
    assert report.exit_code == 1 and report.output.count("FAIL ") == 1
    paths = [tmp_path / f"gemma3-270m-{runtime}-driven-k4.json" for runtime in ("llama-cpp", "transformers")]
    (label_a, a), (label_b, b) = labelled([load_record(path) for path in paths], [str(path) for path in paths])
    diff = render_diff(diff_records(label_a, a, label_b, b))
    assert "spaces: part at prompt position 3" in diff
    assert "verdict: tokenization or template: prompt ids differ from position 3 before generation" in diff


def test_native_ngram_drafting_drafts_at_most_k_and_every_prompt_counts(tmp_path):
    """llama-server's ngram-simple drafts the m-gram after a matched n-gram: 48 tokens by default
    (past k, which broke drafted <= k * steps), and only m-grams at least n = 12 long. crossrt
    sets m = k and n = min(12, k): drafts of at most k, and drafting at all at k = 7. A prompt
    that repeats itself, so the n-gram lookup has something to find."""
    prompts = tmp_path / "repeat.jsonl"
    prompts.write_text(json.dumps({"id": "count", "category": "code",
                                   "prompt": "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\n"
                                             "for i in range(10):\n"}) + "\n")
    out = tmp_path / "ngram.json"
    result = run("run", "--pair", "gemma3-270m-ngram", "--runtime", "llama-server", "--mode", "native",
                 "--prompts", prompts, "--max-new-tokens", 32, "--out", out)
    assert result.exit_code == 0, result.output
    (prompt,) = load_record(out).results
    assert prompt.ok and prompt.lossless, prompt.error
    counters = prompt.counters
    assert counters.steps > 0 and counters.accepted > 0 and counters.drafted <= 7 * counters.steps
    assert any("--spec-ngram-simple-size-m 7" in note for note in load_record(out).notes)


def test_a_sweep_of_the_real_pair_equals_crossrt_run_cell_for_cell(real_pair, driven, tmp_path):
    """Two cells of one runtime share a loaded model in one process (LoadedModels): each equals
    a `crossrt run` of its own, prompt for prompt, id for id, count for count. One prompt, the
    module's first: what sharing the load could change shows in the second cell's first prompt
    (a model a cell left in another state), and the k = 7 cell is held to the driven run's own
    result for it, so only the k = 3 run is made again."""
    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps(PROMPTS[0]) + "\n")
    sweep = tmp_path / "real.toml"
    sweep.write_text(f'name = "real-k"\n[axes]\npair = ["{PAIR}"]\nruntime = ["llama-cpp"]\nmode = ["driven"]\n'
                     f'k = [3, 7]\nprompts = "{first}"\nmax_new_tokens = 16\n')
    result = run("sweep", "run", sweep, "--dir", tmp_path / "store")
    assert result.exit_code == 0, result.output
    cells = {cell.meta["params"]["k"]: cell.record() for cell in SweepStore(tmp_path / "store").stored()}
    assert sorted(cells) == [3, 7]
    result = run("run", "--pair", PAIR, "--prompts", first, "--max-new-tokens", 16, "--k", 3,
                 "--out", tmp_path / "k3.json")
    assert result.exit_code == 0, result.output
    alone_k7 = load_record(driven).results[:1]
    for swept, alone in ((cells[3], load_record(tmp_path / "k3.json").results), (cells[7], alone_k7)):
        assert [(r.prompt_id, r.status, r.output_ids, r.baseline_ids, r.counters) for r in swept.results] == \
            [(r.prompt_id, r.status, r.output_ids, r.baseline_ids, r.counters) for r in alone]
        assert all(r.ok for r in swept.results) and sum(r.counters.steps for r in swept.results) > 0
