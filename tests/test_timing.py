"""Timings a user can quote (crossrt/records/timing.py, run --repeat): each prompt run N times,
baseline then speculative, interleaved and timed here; spreads over the repetitions read from
the record. Real tiny-pair runs."""

import dataclasses
import json
import statistics

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.records import timing
from crossrt.records.record_json import load_record
from crossrt.run.driver import repeated

from conftest import TINY_PAIR

RUN = ("run", "--pair", str(TINY_PAIR), "--max-new-tokens", "12", "--threads", "1", "--n-ctx", "256")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def record_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("timing") / "rep.json"
    result = invoke(*RUN, "--repeat", 3, "--out", out)
    assert result.exit_code == 0, result.output
    return out


def test_every_prompt_ran_three_times_with_its_baselines_timed_here(record_path):
    record = load_record(record_path)
    assert record.params.repeat == 3
    for result in record.results:
        assert len(result.repeats) == 3 and result.repeats[0] == result.timings
        assert len({t.decode_s for t in result.repeats}) > 1  # three timings, not one copied
        assert result.baseline_source is None or result.baseline_source.origin == "decoded"
    data = json.loads(record_path.read_text())
    assert data["params"]["repeat"] == 3 and all(len(r["repeats"]) == 3 for r in data["results"])


def test_spreads_are_over_repetitions(record_path):
    results = load_record(record_path).results
    per_repetition = [sum(len(r.output_ids) for r in results) / sum(r.repeats[i].decode_s for r in results)
                      for i in range(3)]
    spread = timing.tokens_per_s(results)
    assert spread.n == 3 and spread.mean == pytest.approx(statistics.fmean(per_repetition))
    assert spread.std == pytest.approx(statistics.stdev(per_repetition))
    ttft = timing.ttft_ms(results)
    prefills = sorted(1000 * t.prefill_s for r in results for t in r.repeats)
    assert prefills[0] <= ttft.p50 <= ttft.p90 <= prefills[-1]
    assert timing.repetition_count(results) == 3 and timing.speedup(results).n == 3


def test_a_run_without_repeat_reads_as_one_repetition(tmp_path):
    out = tmp_path / "once.json"
    assert invoke(*RUN, "--out", out).exit_code == 0
    record = load_record(out)
    assert record.params.repeat == 1 and all(r.repeats == () for r in record.results)
    assert "repeat" not in json.loads(out.read_text())["params"]
    assert timing.repetition_count(record.results) == 1 and timing.tokens_per_s(record.results).std == 0.0
    again = invoke(*RUN, "--out", out, "--resume", "--repeat", 2)  # other settings: refused, named
    assert again.exit_code != 0 and "repeat" in again.output, again.output


def test_a_repetition_that_emits_other_tokens_fails_its_prompt(record_path):
    first = load_record(record_path).results[0]
    other = dataclasses.replace(first, output_ids=first.output_ids[:-1])
    assert repeated(first, [first, first]).repeats == (first.timings,) * 3
    failed = repeated(first, [first, other])
    assert not failed.ok and "run 3 of this prompt: other tokens or counts than the first" in failed.error


def test_a_drafter_whose_state_outlives_a_prompt_is_not_repeated(tmp_path):
    result = invoke(*RUN, "--schedule", "llama-server", "--drafting", "llama-ngram-map-k", "--ngram-max", 2,
                    "--repeat", 2, "--out", tmp_path / "map.json")
    assert result.exit_code != 0
    assert "llama-ngram-map-k's state lasts across prompts on llama-cpp" in result.output, result.output


def test_show_gives_the_timings_table_in_every_format(record_path):
    shown = invoke("show", record_path)
    assert shown.exit_code == 0 and "timings over repetitions" in shown.output and "TTFT p50 ms" in shown.output
    rows = json.loads(invoke("show", record_path, "--timings", "--format", "json").output)
    results = load_record(record_path).results
    every = next(row for row in rows if row["category"] == "ALL")
    assert every["repetitions"] == 3 and every["runtime"] == "llama-cpp" and every["drafting"] == "model"
    assert every["tokens_per_s"] == pytest.approx(timing.tokens_per_s(results).mean)
    assert every["tpot_p90_ms"] == pytest.approx(timing.tpot_ms(results).p90)
    csv_text = invoke("show", record_path, "--format", "csv")
    assert "TTFT" not in csv_text.stdout and "crossrt show --timings" in csv_text.stderr
