"""Run records: round trip through JSON with validation, and rejection of bad records."""

import copy
import dataclasses
import json

import pytest

from crossrt.run.prompt_run import run_prompt
from crossrt.inputs.pairs import pair_info
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules
from crossrt.records.schema import Counters, CountsDoNotAddUp, RecordError, RunParams, RunRecord
from crossrt.records.record_json import load_record, record_from_json, record_to_json, save_record


@pytest.fixture(scope="module")
def record(tiny_pair, llama_runtime, tiny_sessions):
    target, drafter = tiny_sessions
    params = RunParams(k=3, greedy=True, max_new_tokens=24, mode="driven", spec_type="draft",
                       schedule="crossrt", n_ctx=512, draft_n_min=3, draft_p_min=0.0)
    record = RunRecord(llama_runtime.info(), pair_info(tiny_pair, "gguf"), params)
    for prompt in load_prompts("builtin")[:3]:
        record = record.with_result(run_prompt(target, drafter, prompt, DraftRules(3), 24))
    return record.with_result(type(record.results[0]).failed("too-long", "prose", "does not fit", [0, 5]))


def test_round_trip(record, tmp_path):
    path = tmp_path / "run.json"
    save_record(record, path)
    assert load_record(path) == record
    data = json.loads(path.read_text())
    assert data["schema_version"] == 1
    overall = data["summary"]["overall"]
    assert overall["tau"] == pytest.approx(overall["emitted"] / overall["steps"])
    assert overall["tau"] == pytest.approx(1 + overall["accepted"] / overall["steps"])
    assert overall["failed"] == 1 and overall["prompts"] == 4


def test_summary_is_a_ratio_of_sums(record):
    done = [r for r in record.results if r.ok]
    summary = record.summary()
    assert summary.alpha == sum(r.counters.accepted for r in done) / sum(r.counters.drafted for r in done)
    assert summary.lossless == len(done)


def mutated(record, change):
    data = copy.deepcopy(record_to_json(record))
    change(data)
    return data


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("params"), "'params' is a required property"),
    (lambda d: d["results"][0]["counters"].update(steps=-1), "results/0/counters/steps"),
    (lambda d: d.update(schema_version=99), r"written by a newer crossrt \(schema 99; this one reads 1\)"),
    (lambda d: d.update(schema_version=0), "schema_version"),
    (lambda d: d["results"][0].update(status="done"), "results/0/status"),
    (lambda d: d["results"][0]["derived"].update(tau=9.0), "tau is 9.0 but the counters give"),
    (lambda d: d["summary"]["overall"].update(accepted=0), "summary: accepted"),
])
def test_malformed_record_is_rejected(record, change, message):
    with pytest.raises(RecordError, match=message):
        record_from_json(mutated(record, change))


def test_counter_identities_are_checked_on_write_and_read(record, tmp_path):
    first = record.results[0]
    broken_counters = dataclasses.replace(first.counters, emitted=first.counters.emitted + 1)
    broken = record.with_result(dataclasses.replace(first, counters=broken_counters))
    with pytest.raises(RecordError, match="emitted .* != steps .* accepted"):
        save_record(broken, tmp_path / "run.json")
    with pytest.raises(RecordError, match="emitted .* != steps .* accepted"):
        record_from_json(record_to_json(broken))


def test_unreadable_files_give_clear_errors(tmp_path):
    with pytest.raises(RecordError, match="no run record at"):
        load_record(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(RecordError, match="is not JSON"):
        load_record(tmp_path / "bad.json")


def test_counters_from_steps_derive_totals_and_refuse_what_does_not_add_up():
    counters = Counters.from_steps((4, 4, 2), (4, 1, 0), emitted=8, k=4)
    assert (counters.steps, counters.drafted, counters.accepted) == (3, 10, 5)
    assert counters.accepted_per_pos == (2, 1, 1, 1) and counters.tau == 1 + 5 / 3
    # One token too many for 3 steps and 5 accepted: a run that counted wrong.
    with pytest.raises(CountsDoNotAddUp, match=r"emitted 9 != steps 3 \+ accepted 5") as error:
        Counters.from_steps((4, 4, 2), (4, 1, 0), emitted=9, k=4)
    assert len(error.value.problems) == 1
    with pytest.raises(CountsDoNotAddUp, match=r"drafted 10 <= k\*steps 9"):
        Counters.from_steps((4, 4, 2), (4, 1, 0), emitted=8, k=3)
