"""`crossrt import --from aiperf`: NVIDIA AIPerf's per-request export (one prompt per request)
and its aggregate, read from fixtures holding the numbers AIPerf's own test asserts for a real
profile of its mock server (each fixture's header cites it) and a real run against vLLM, and the
traps of its fields: a histogram without the bonus token, a rate that is a fraction in the record
and a percent in the metrics, warm-up and failed requests, another engine's counting. Requests
matched to prompts files and compared with endpoint records: test_import_aiperf_prompts.py."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli.imports import import_command
from crossrt.records.counts import Counts
from crossrt.records.record_json import load_record
from crossrt.records.schema import Counters, accepted_per_position

from conftest import assert_clean_error, refused_in_one_line, set_at

FIXTURES = Path(__file__).parent / "fixtures" / "import"
RECORDS = FIXTURES / "aiperf-records-mock.jsonl"
AGGREGATE = FIXTURES / "aiperf-aggregate-mock.json"


def imported(tmp_path, source, *args):
    out = tmp_path / "imported.json"
    result = CliRunner().invoke(import_command, [str(source), "--from", "aiperf", "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    return load_record(out)


def request_lines(path=RECORDS):
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def written(tmp_path, lines, name="records.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def summed(record) -> Counters:
    """A record's counters summed over its finished prompts (an aggregate import's one result)."""
    done = [r.counters for r in record.results if r.ok]
    per_pos = tuple(map(sum, zip(*(c.accepted_per_pos for c in done)))) if done[0].accepted_per_pos else None
    return Counters(**sum(done, Counts()).counted(), accepted_per_pos=per_pos, step_drafted=None, step_accepted=None,
                    unverified=sum(c.unverified for c in done), cut=sum(c.cut for c in done))


def test_per_request_records_are_one_prompt_each_and_sum_into_the_schema(tmp_path):
    record = imported(tmp_path, RECORDS)
    counters, lines = summed(record), request_lines()
    assert [r.prompt_id for r in record.results] == ["request-0", "request-1"]
    assert [(r.counters.steps, r.counters.accepted) for r in record.results] == [(8, 18), (8, 18)]
    assert (record.runtime.name, record.params.schedule, record.params.k) == ("aiperf", "vllm", 4)
    assert (counters.steps, counters.drafted, counters.accepted) == (16, 64, 36)
    # The histogram (steps accepting exactly j, bonus out) gives what the per-step lists give.
    steps = [n for line in lines for n in line["spec_decode_acceptance"]["per_step_accepted"]]
    assert counters.accepted_per_pos == accepted_per_position(steps, 4) == (14, 12, 8, 2)
    # AIPerf's own acceptance length (bonus in) and rate are crossrt's tau and alpha.
    assert counters.tau == lines[0]["metrics"]["spec_decode_acceptance_length"]["value"] == 3.25
    assert counters.alpha * 100 == lines[0]["metrics"]["spec_decode_draft_acceptance_rate"]["value"]
    # completion_tokens is null in the export: emitted follows the identity, and says so.
    assert "emitted" not in record.imported.given and counters.emitted == 16 + 36
    assert any("2 request(s), one prompt each" in note for note in record.notes)
    assert any("no output token ids" in note for note in record.notes)


def test_the_aggregate_export_imports_to_the_same_counters(tmp_path):
    per_request = summed(imported(tmp_path, RECORDS))
    record = imported(tmp_path, AGGREGATE, "--k", "4", "--overwrite")
    counters = record.results[0].counters
    assert (counters.steps, counters.drafted, counters.accepted, counters.accepted_per_pos) == \
        (per_request.steps, per_request.drafted, per_request.accepted, per_request.accepted_per_pos)
    result = CliRunner().invoke(import_command, [str(AGGREGATE), "--from", "aiperf", "--out",
                                                 str(tmp_path / "no-k.json")])
    assert_clean_error(result, "does not say the draft length: give --k")
    result = CliRunner().invoke(import_command, [str(AGGREGATE), "--from", "aiperf", "--k", "3", "--out",
                                                 str(tmp_path / "k3.json")])
    assert_clean_error(result, "--k 3, but a step accepted 4 draft tokens")


def test_completion_tokens_give_emitted_and_each_requests_prefill_token_is_unverified(tmp_path):
    """vLLM's counting (issue 47): each request's first token comes from the prefill (unverified 1)
    and the tokens accepted past its stop are cut: emitted = 1 + steps + accepted - cut. One
    request cut nothing (27 tokens), the other 3 (24): unverified 2, cut 3. Read before as
    'tokens beyond steps + accepted are unverified, a shortfall cut', it gave 1 and 2."""
    lines = request_lines()
    lines[0]["spec_decode_acceptance"]["completion_tokens"] = 1 + 8 + 18
    lines[1]["spec_decode_acceptance"]["completion_tokens"] = 1 + 8 + 18 - 3
    record = imported(tmp_path, written(tmp_path, lines))
    counters = summed(record)
    assert (counters.emitted, counters.unverified, counters.cut) == (51, 2, 3)
    assert [(r.counters.unverified, r.counters.cut) for r in record.results] == [(1, 0), (1, 3)]
    # AIPerf 0.13 also writes the response's usage among a request's metrics: read there too.
    for line in lines:
        completion = line["spec_decode_acceptance"].pop("completion_tokens")
        line["metrics"]["usage_completion_tokens"] = {"value": completion, "unit": "tokens"}
    again = summed(imported(tmp_path, written(tmp_path, lines, "usage.jsonl"), "--overwrite"))
    assert (again.emitted, again.unverified, again.cut) == (51, 2, 3)


@pytest.mark.parametrize("completion, message", [
    (1 + 8 + 18 + 1, r"completion_tokens 28 is more than vLLM's counting gives \(1 from the prefill \+ steps 8 \+ "
                     r"accepted 18\)"),
    (1 + 8 + 18 - 5, r"emitted 22: 5 tokens cut, more than k = 4"),
])
def test_completion_tokens_that_vllm_cannot_have_counted_are_refused(tmp_path, completion, message):
    lines = request_lines()
    for line in lines:
        line["spec_decode_acceptance"]["completion_tokens"] = 1 + 8 + 18
    lines[1]["spec_decode_acceptance"]["completion_tokens"] = completion
    result = CliRunner().invoke(import_command, [str(written(tmp_path, lines)), "--from", "aiperf", "--out",
                                                 str(tmp_path / "out.json")])
    assert_clean_error(result, message)


REAL = {name: FIXTURES / f"aiperf-vllm-real-{name}" for name in ("records.jsonl", "aggregate.json", "server-metrics.json")}


def test_a_real_aiperf_run_imports_to_one_set_of_counters_from_each_export(tmp_path):
    """A real AIPerf 0.13.0 run against vLLM 0.32.0's CPU server (Gemma 3 270M, 17-block drafter,
    k 7; how: each fixture's header): per request, its aggregate and its server metrics
    (server_metrics_export.json, refused before as 'export line 1: not JSON') give the same
    counters. With vLLM's counting each of the 10 requests has one unverified token (the
    prefill's) and cut = 1 + steps + accepted - emitted; the earlier reading gave unverified 1."""
    records = {name: imported(tmp_path / name.split(".")[0], path, *(["--k", "7"] if name == "aggregate.json" else []))
               for name, path in REAL.items()}
    counters = {name: summed(record) for name, record in records.items()}
    assert len(set(counters.values())) == 1, counters
    one = counters["records.jsonl"]
    assert (one.steps, one.drafted, one.accepted, one.emitted, one.unverified, one.cut) == (59, 413, 278, 320, 10, 27)
    assert one.accepted_per_pos == (48, 45, 42, 39, 36, 34, 34)
    assert {record.params.k for record in records.values()} == {7}
    # AIPerf's own token-weighted figures are crossrt's tau and alpha (its headline ones are means per request).
    aggregate = json.loads("\n".join(line for line in REAL["aggregate.json"].read_text().splitlines()
                                     if not line.startswith("#")))
    assert one.tau == pytest.approx(aggregate["spec_decode_token_weighted_acceptance_length"]["avg"], rel=1e-12)
    assert one.alpha * 100 == pytest.approx(aggregate["spec_decode_overall_draft_acceptance_rate"]["avg"], rel=1e-12)
    assert any("1 warm-up" in note for note in records["records.jsonl"].notes)


def test_a_server_metrics_export_without_vllms_counters_is_one_line(tmp_path):
    data = json.loads("\n".join(line for line in REAL["server-metrics.json"].read_text().splitlines()
                                if not line.startswith("#")))
    del data["metrics"]["vllm:spec_decode_num_drafts"]
    path = tmp_path / "no-drafts.json"
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(import_command, [str(path), "--from", "aiperf", "--out", str(tmp_path / "x.json")])
    assert_clean_error(result, r"an AIPerf server metrics export without vllm:spec_decode_num_drafts")


def test_metrics_alone_give_counts_and_left_out_requests_are_named(tmp_path):
    lines = request_lines()
    bare = {key: value for key, value in lines[0].items() if key != "spec_decode_acceptance"}
    warmup = {**lines[1], "metadata": {"benchmark_phase": "warmup"}}
    failed = {**lines[1], "error": {"code": 500, "type": "Internal Server Error", "message": "x"}}
    off = {"metadata": {"benchmark_phase": "profiling"}, "metrics": {"request_latency": {"value": 1.0, "unit": "ms"}}}
    record = imported(tmp_path, written(tmp_path, [bare, warmup, failed, off]), "--k", "4")
    counters = summed(record)
    assert (counters.steps, counters.drafted, counters.accepted) == (8, 32, 18)
    assert counters.accepted_per_pos is None and "accepted_per_pos" not in record.imported.given
    assert any("2 kept as failed (failed in AIPerf, or without statistics); left out: 1 warm-up" in note
               for note in record.notes)
    # The failed request and the one without statistics stay prompts, failed with why: parity names them.
    assert [(r.prompt_id, r.status) for r in record.results] == \
        [("request-0", "ok"), ("request-1", "failed"), ("request-2", "failed")]
    assert record.results[1].error == "the request failed in AIPerf (Internal Server Error: x)"
    assert record.results[2].error.startswith("no speculative decoding statistics in AIPerf's export")


@pytest.mark.parametrize("change, message", [
    # The metric is a percent (56.25); the record's rate a fraction (0.5625).
    (lambda line: line["metrics"]["spec_decode_draft_acceptance_rate"].update(value=0.5625),
     "draft acceptance rate 0.005625 is not 18 / 32"),
    # A histogram holding the bonus token (j + 1 per step) is not AIPerf's.
    (lambda line: line["spec_decode_acceptance"].update(
        acceptance_histogram={"1": 1, "2": 1, "3": 2, "4": 3, "5": 1}), "the histogram accepts 26 draft tokens, not 18"),
    (lambda line: line["spec_decode_acceptance"].update(mean_acceptance_length=2.25),
     "acceptance length 2.25 is not 1 \\+ 18 / 8"),
    (lambda line: line["spec_decode_acceptance"].update(per_step_accepted=[2, 3]), "per_step_accepted has 2 steps"),
    (lambda line: line["spec_decode_acceptance"].update(engine="sglang"), "engine 'sglang'; crossrt maps the counting"),
    (lambda line: line["spec_decode_acceptance"].update(num_spec_steps=8.5), "num_spec_steps is '8.5', not a count"),
    (lambda line: line["spec_decode_acceptance"].update(num_spec_tokens=5000), "num_spec_tokens 5000 is not a draft length"),
    (lambda line: line["spec_decode_acceptance"]["acceptance_histogram"].update({"-1": 0}), "histogram key '-1' is not"),
])
def test_inconsistent_records_are_refused(tmp_path, change, message):
    lines = request_lines()
    change(lines[1])
    result = CliRunner().invoke(import_command, [str(written(tmp_path, lines)), "--from", "aiperf", "--out",
                                                 str(tmp_path / "out.json")])
    assert_clean_error(result, f"line 2[:,] {message}")
    assert not (tmp_path / "out.json").exists()


def fields(value, path=()):
    """Every (path) into a JSON value: object keys and list indices."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield (*path, key)
        yield from fields(inner, (*path, key))


def test_any_field_of_another_type_is_a_record_or_one_line(tmp_path):
    """Each field of a request replaced by a value of another JSON type: the import keeps a valid
    record (a field crossrt does not read) or is refused in one line, never a traceback."""
    runner, refused = CliRunner(), 0
    spots = list(fields(request_lines()[1]))
    for number, (spot, odd) in enumerate((spot, odd) for spot in spots for odd in ("x", [], {}, None, -1)):
        lines = request_lines()
        set_at(lines[1], spot, odd)
        out = tmp_path / f"out{number}.json"
        result = runner.invoke(import_command, [str(written(tmp_path, lines)), "--from", "aiperf", "--out", str(out)])
        refused += refused_in_one_line(result, out, (spot, odd))
    assert refused > len(spots)  # most fields are read, and checked


def test_vllms_drafting_rules_are_stated_not_demanded(tmp_path):
    """vLLM drafts k tokens every step: the import states n_min k and p_min 0 itself (issue 47: a
    vLLM import needed llama.cpp's --draft-n-min and --draft-p-min to be compared), says so, and
    refuses rules vLLM does not have."""
    record = imported(tmp_path, RECORDS)
    assert (record.params.draft_n_min, record.params.draft_p_min) == (4, 0.0)
    assert any("draft_n_min 4 and draft_p_min 0 stated from vllm's counting" in note for note in record.notes)
    result = CliRunner().invoke(import_command, [str(RECORDS), "--from", "aiperf", "--draft-n-min", "2", "--out",
                                                 str(tmp_path / "n2.json")])
    assert_clean_error(result, r"--draft-n-min 2, --draft-p-min None: vllm drafts k = 4 tokens every step, it has no "
                               r"n_min or p_min rules")
