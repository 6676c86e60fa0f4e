"""crossrt parity on real llama.cpp runs of the tiny pair: agreement, forced divergences,
logit checks that catch what tokens do not, saved baselines, CI outputs."""

import dataclasses
import json
import xml.etree.ElementTree as ElementTree

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.pairs import load_pair, pair_from_paths
from crossrt.compare.parity import compare_all, first_divergence, labelled
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules, RuntimeOptions
from crossrt.records.record_json import save_record

from conftest import REPO, TINY_PAIR

PROMPTS = load_prompts("builtin")[:4]


def make_record(tmp_path_factory, pair, name):
    out = tmp_path_factory.mktemp("runs") / f"{name}.json"
    request = RunRequest(pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(4), 24, out)
    run_pair(request, PROMPTS)
    return out


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    tiny = load_pair(TINY_PAIR)
    models = REPO / "models" / "tiny"
    return {
        "f32": make_record(tmp_path_factory, tiny, "f32"),
        "f32-again": make_record(tmp_path_factory, tiny, "f32-again"),
        "f16": make_record(tmp_path_factory, load_pair(REPO / "models" / "pairs" / "tiny-f16.toml"), "f16"),
        # The drafter standing in for the target: same vocabulary, different model.
        "swapped": make_record(tmp_path_factory, pair_from_paths(models / "drafter.f32.gguf",
                                                                 models / "drafter.f32.gguf"), "swapped"),
    }


def parity(*args):
    return CliRunner().invoke(main, ["parity", *map(str, args)], catch_exceptions=False)


def test_first_divergence_never_drops_the_tail():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert first_divergence([1, 9, 3], [1, 2, 3]) == 1
    assert first_divergence([], [4]) == 0


def test_identical_runs_agree_and_ci_reports_say_so(records, tmp_path):
    result = parity(records["f32"], records["f32-again"], "--junit", tmp_path / "p.xml", "--markdown", tmp_path / "p.md")
    assert result.exit_code == 0, result.output
    assert "4 prompts: 4 identical, 0 explained, 0 failed, 0 not comparable; counters compared" in result.output
    # The closing line says what was compared: ids in 2 x 4 lossless checks and 4 cross-run comparisons.
    # Both records are one scorer's (llama.cpp, the same numerics): its verification path is checked once.
    assert result.output.strip().splitlines()[-1] == ("parity: OK; compared token ids in 12 comparisons, "
                                                      "counters in 4 comparisons, logits in 4 comparisons, "
                                                      "verification batches of 1 scorer")
    suite = ElementTree.parse(tmp_path / "p.xml").getroot()
    # lossless x2, pair, logits; the scorer's verification batches and nondeterminism, its drafter's
    # rollback, each run's departures
    assert suite.get("failures") == "0" and int(suite.get("tests")) == 4 * 3 + 4 + 2 + 1 + 2
    assert (tmp_path / "p.md").read_text().startswith("## crossrt parity: passed")


def test_swapped_target_is_a_divergence(records, tmp_path):
    result = parity(records["f32"], records["swapped"], "--junit", tmp_path / "p.xml")
    assert result.exit_code == 1
    assert "outputs part at token" in result.output and "parity: FAILED" in result.output
    suite = ElementTree.parse(tmp_path / "p.xml").getroot()
    assert int(suite.get("failures")) >= 4


def test_logits_catch_a_difference_that_tokens_hide(records):
    """F16 weights give the same greedy tokens on the tiny pair, but logits ~1e-2 away."""
    strict = parity(records["f32"], records["f16"])
    assert strict.exit_code == 1
    assert "4 prompts: 4 identical, 0 explained, 0 failed" in strict.output and "logits: max abs logit diff 0.0" in strict.output
    assert parity(records["f32"], records["f16"], "--logit-tolerance", "0.05").exit_code == 0
    assert parity(records["f32"], records["f16"], "--no-logits").exit_code == 0


def test_saved_baseline_guards_an_upgrade(records):
    assert parity(records["f32"], "--against", records["f32-again"]).exit_code == 0
    changed = parity(records["f32"], "--against", records["swapped"])
    assert changed.exit_code == 1 and "(saved)" in changed.output


def test_non_lossless_run_and_missing_prompt_are_reported(records, tmp_path):
    from crossrt.records.record_json import load_record

    record = load_record(records["f32"])
    first = record.results[0]
    broken = dataclasses.replace(record, results=(dataclasses.replace(first, baseline_ids=first.baseline_ids[:-1]),))
    save_record(broken, tmp_path / "broken.json")
    result = parity(tmp_path / "broken.json", records["f32-again"], "--no-logits")
    assert result.exit_code == 1
    assert "not lossless" in result.output
    assert "missing from llama-cpp/driven (broken.json)" in result.output


def test_problems_name_both_runs(records):
    from crossrt.records.record_json import load_record

    runs = labelled([load_record(records["f32"]), load_record(records["swapped"])], ["a", "b"])
    failing = [c for c in compare_all(runs) if not c.ok]
    assert failing and all((c.run_a, c.run_b) == ("llama-cpp/driven (a)", "llama-cpp/driven (b)") for c in failing)


def test_matrix_skips_modes_a_runtime_lacks(tmp_path):
    result = CliRunner().invoke(main, ["parity", "--pair", str(TINY_PAIR), "--max-new-tokens", "8",
                                                       "--out-dir", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "skipped llama-cpp/native" in result.stderr
    assert (tmp_path / "tiny-llama-cpp-driven-k4.json").is_file()


def test_a_runtime_tokenizing_differently_is_reported(tmp_path):
    """Shared ids that are not what the runtime makes of the text (as when two tokenizers
    split a run of spaces differently): the record keeps the runtime's own ids, parity fails."""
    tiny = load_pair(TINY_PAIR)
    prompt = PROMPTS[0]
    out = tmp_path / "run.json"
    request = RunRequest(tiny, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(4), 8, out)
    own = run_pair(request, [prompt]).results[0].prompt_ids
    shared = own[:-1] + (own[-1] + 1,)
    record = run_pair(dataclasses.replace(request, overwrite=True, shared_prompt_ids={prompt.id: shared}), [prompt])
    result = record.results[0]
    assert result.prompt_ids == shared and result.own_prompt_ids == own
    report = parity(out, "--no-logits")
    assert report.exit_code == 1
    assert f"tokenizes the prompt text differently from the shared ids, from position {len(own) - 1}" in report.output


@pytest.mark.parametrize("changed", [{"drafting": "prompt-lookup", "ngram_max": 3, "ngram_min": 1},
                                     {"k_policy": "online", "k_max": 8}, {"spec_type": "ngram-simple"}])
def test_runs_that_draft_differently_under_one_schedule_are_not_counter_compared(records, changed):
    """One schedule, k and rules, but another drafting (a lookup, a k policy, a spec type): the
    counts of the two measure different things, so parity compares their ids, never their counters."""
    from crossrt.compare.parity import COUNTERS, IDS
    from crossrt.records.record_json import load_record

    record = load_record(records["f32"])
    other = dataclasses.replace(record, params=dataclasses.replace(record.params, **changed))
    same = [c for c in compare_all(labelled([record, load_record(records["f32-again"])], ["a", "b"]))
            if c.run_b != "its baseline"]
    differ = [c for c in compare_all(labelled([other, load_record(records["f32-again"])], ["a", "b"]))
              if c.run_b != "its baseline"]
    assert same and all(COUNTERS in c.compared for c in same)
    assert differ and all(COUNTERS not in c.compared and IDS in c.compared for c in differ)
    assert all(f"{next(iter(changed))} differs" in c.no_counters for c in differ)


def test_records_of_one_name_in_two_folders_keep_their_own_lines(records, tmp_path):
    """Two records both named r.json once shared one label, and their lines merged (issue 58)."""
    first, second = tmp_path / "a" / "r.json", tmp_path / "b" / "r.json"
    for source, target in ((records["f32"], first), (records["f32-again"], second)):
        target.parent.mkdir()
        target.write_bytes(source.read_bytes())
    result = parity(first, second, "--no-logits")
    assert result.exit_code == 0, result.output
    assert f"llama-cpp/driven ({first}) vs llama-cpp/driven ({second}): 4 prompts" in result.output, result.output


def test_a_record_written_again_is_still_the_same_record_and_a_device_is_not_read(records, tmp_path):
    copy = tmp_path / "copy.json"
    copy.write_text(json.dumps(json.loads(records["f32"].read_text()), indent=4, sort_keys=True))
    result = parity(records["f32"], copy)
    assert result.exit_code != 0 and "is given twice (the same record as" in result.output, result.output
    result = parity("/dev/zero", records["f32"])
    assert result.exit_code != 0 and "no run record at /dev/zero" in result.output, result.output
