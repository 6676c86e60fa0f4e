"""Per-token traces of driven runs, on the tiny pair in real llama.cpp."""

import json
import math

import numpy as np
import pytest

from crossrt.errors import SettingsError
from crossrt.speculative import loop
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules, Rows, RuntimeOptions
from crossrt.records.schema import RecordError
from crossrt.records.record_json import load_record
from crossrt.records.trace import TraceRecorder, load_trace, read_traces, row_stats, save_traces, trace_path

PROMPTS = load_prompts("builtin")[:3]
K = 4
MAX_NEW = 32


def traced(target, drafter, ids, k=K, max_new=MAX_NEW, schedule=loop.SCHEDULE):
    recorder = TraceRecorder()
    generation = loop.speculative_generate(target, drafter, ids, DraftRules(k), max_new, schedule, recorder)
    return generation, recorder.finish()


def rescored(session, prompt_ids, output_ids):
    """Statistics of the rows that predict each output token, scored in one pass."""
    session.truncate(0)
    session.eval(prompt_ids[:-1], Rows.NONE)
    return row_stats(session.eval([prompt_ids[-1], *output_ids[:-1]], Rows.ALL).copy())


def test_row_stats_match_their_definitions():
    rows = np.array([[0.0, 0.0, 0.0, 0.0], [3.0, 1.0, -np.inf, 1.0]], dtype=np.float32)
    entropy, p1, margin = row_stats(rows).T
    assert entropy[0] == pytest.approx(math.log(4)) and p1[0] == pytest.approx(0.25) and margin[0] == 0
    weights = np.array([math.exp(3), math.exp(1), 0, math.exp(1)]) / (math.exp(3) + 2 * math.exp(1))
    expected = -sum(w * math.log(w) for w in weights if w > 0)
    assert entropy[1] == pytest.approx(expected, rel=1e-6) and p1[1] == pytest.approx(weights[0], rel=1e-6)
    assert margin[1] == pytest.approx(2.0)


@pytest.mark.parametrize("schedule", loop.TRACED_SCHEDULES)
@pytest.mark.parametrize("prompt", PROMPTS, ids=[p.id for p in PROMPTS])
def test_trace_leaves_the_run_alone_and_matches_rescoring(tiny_sessions, prompt, schedule):
    target, drafter = tiny_sessions
    ids = target.tokenize(prompt.text)
    plain = loop.speculative_generate(target, drafter, ids, DraftRules(K), MAX_NEW, schedule)
    generation, trace = traced(target, drafter, ids, schedule=schedule)
    assert generation.output_ids == plain.output_ids
    assert (generation.step_drafted, generation.step_accepted) == (plain.step_drafted, plain.step_accepted)
    assert list(trace.step_drafted) == list(plain.step_drafted)
    assert list(trace.step_accepted) == list(plain.step_accepted)
    assert trace.n_tokens == len(plain.output_ids)

    # Each token's statistics are those of the target row that produced it (batches differ,
    # so float noise remains, ~1e-7 here; neighbouring rows differ by ~1e-4 or more)...
    target_stats = rescored(target, ids, plain.output_ids)
    np.testing.assert_allclose(trace.target_entropy, target_stats[:, 0], rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(trace.target_p1, target_stats[:, 1], rtol=0, atol=1e-6)
    np.testing.assert_allclose(trace.target_margin, target_stats[:, 2], rtol=0, atol=1e-4)
    assert np.all(trace.target_margin > 0)
    # ...and a proposed token's drafter probability is the drafter's at the same context (the
    # draft before it matched the output), NaN exactly where the step drafted nothing for it.
    proposed = trace.proposed()
    assert np.array_equal(np.isnan(trace.drafter_p1), ~proposed)
    drafter_p1 = rescored(drafter, ids, plain.output_ids)[:, 1]
    np.testing.assert_allclose(trace.drafter_p1[proposed], drafter_p1[proposed], rtol=0, atol=1e-6)
    full = sum(1 for d, a in zip(plain.step_drafted, plain.step_accepted) if d == a)
    assert int((~proposed).sum()) == full
    assert int(trace.accepted().sum()) == sum(plain.step_accepted)


def test_traces_only_for_the_crossrt_and_hf_schedules(tiny_sessions, tiny_pair, tmp_path):
    target, drafter = tiny_sessions
    with pytest.raises(SettingsError, match="traces are recorded by the crossrt and hf-assisted"):
        loop.speculative_generate(target, drafter, [5, 6], DraftRules(K), 8, "llama-server", TraceRecorder())
    request = RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(K), 8,
                         tmp_path / "run.json", schedule="llama-spec-simple", trace=True)
    with pytest.raises(SettingsError, match="driven mode with the crossrt or hf-assisted schedule"):
        run_pair(request, PROMPTS[:1])


def request(tiny_pair, out, trace=True, **changes):
    return RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(K), MAX_NEW, out,
                      trace=trace, **changes)


def test_driver_writes_traces_beside_the_record_and_resume_keeps_them(tiny_pair, tmp_path):
    out = tmp_path / "run.json"
    run_pair(request(tiny_pair, out), PROMPTS[:1])
    assert json.loads(out.read_text())["trace"] == "run.trace.npz" == trace_path(out).name
    first = load_trace(out)[PROMPTS[0].id]
    record = run_pair(request(tiny_pair, out, resume=True), PROMPTS[:2])
    traces = load_trace(out, record)
    assert list(traces) == [p.id for p in PROMPTS[:2]]
    for name in ("step_drafted", "target_entropy", "drafter_p1"):
        np.testing.assert_array_equal(getattr(traces[PROMPTS[0].id], name), getattr(first, name))
    # Resumed without tracing: the record keeps its traces and traces no new prompt.
    record = run_pair(request(tiny_pair, out, trace=False, resume=True), PROMPTS)
    assert record.trace == "run.trace.npz" and set(load_trace(out)) == {p.id for p in PROMPTS[:2]}


def test_untraced_record_has_no_trace_field(tiny_pair, tmp_path):
    out = tmp_path / "plain.json"
    run_pair(request(tiny_pair, out, trace=False), PROMPTS[:1])
    assert "trace" not in json.loads(out.read_text())
    assert load_record(out).trace is None and load_trace(out) == {}
    assert not trace_path(out).exists()


def test_a_trace_that_does_not_belong_to_the_record_is_refused(tiny_pair, tmp_path):
    out = tmp_path / "run.json"
    run_pair(request(tiny_pair, out), PROMPTS[:2])
    traces = read_traces(trace_path(out))
    # An entry for a prompt the record does not hold (written just before a crash) is left out.
    traces["not-in-record"] = traces[PROMPTS[0].id]
    save_traces(traces, trace_path(out))
    assert set(load_trace(out)) == {p.id for p in PROMPTS[:2]}
    # Another prompt's trace under this prompt's id is caught by its counters.
    traces[PROMPTS[0].id] = traces[PROMPTS[1].id]
    save_traces(traces, trace_path(out))
    with pytest.raises(RecordError, match="does not match the record's counters"):
        load_trace(out)
    trace_path(out).unlink()
    with pytest.raises(RecordError, match="which is missing"):
        load_trace(out)


def test_eos_step_traces_the_eos_token(tiny_sessions):
    """The prompt "b." is followed by EOS at once (models/tiny/README.md)."""
    target, drafter = tiny_sessions
    generation, trace = traced(target, drafter, target.tokenize("b."))
    assert generation.stop_reason == "eos" and trace.n_tokens == len(generation.output_ids)
    assert trace.target_p1[-1] > 0.5
