"""AIPerf's per-request export kept as prompts (issue 57, item 7): one prompt per request in the
order AIPerf issued them, or matched to a prompts file, by each request's text in AIPerf's
inputs.json or else by position; parity against crossrt's endpoint record of the same prompts
compares the counters request by request and labels the token ids not compared.

Fixtures: the real AIPerf 0.13.0 run against vLLM 0.32.0 (aiperf-vllm-real-records.jsonl) and a
constructed inputs.json and prompts file for it (aiperf-vllm-real-inputs-constructed.json's header
says how it was written). The endpoint record is crossrt's own `run --runtime endpoint` against a
server answering in vLLM's formats (as tests/test_endpoint.py's, which says why: vLLM does not run
in this suite), whose /tokenize is the tiny pair's own tokenizer; the AIPerf export of the same
prompts is written from the real export's lines."""

import copy
import json
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.backends.endpoint import local_vocabulary
from crossrt.cli import main
from crossrt.inputs.pairs import load_pair
from crossrt.records.record_json import load_record
from crossrt.run.runtime import availability

from conftest import TINY_PAIR, assert_clean_error, refused_in_one_line, set_at, vllm_metrics_text
from test_endpoint import FormatServer

FIXTURES = Path(__file__).parent / "fixtures" / "import"
RECORDS = FIXTURES / "aiperf-vllm-real-records.jsonl"
INPUTS = FIXTURES / "aiperf-vllm-real-inputs-constructed.json"
PROMPTS = FIXTURES / "aiperf-prompts-constructed.jsonl"
ORDER = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]  # session_00000c ran prompt ORDER[c] (INPUTS' header)


def lines():
    return [json.loads(line) for line in RECORDS.read_text().splitlines() if line.startswith("{")]


def inputs_json():
    return json.loads("\n".join(line for line in INPUTS.read_text().splitlines() if not line.startswith("#")))


def written(tmp_path, items, name="profile_export.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(item) for item in items) + "\n")
    return path


def run_import(folder, path, *args):
    """`crossrt import PATH --from aiperf ARGS`, its record written in folder as out-N.json."""
    out = folder / f"out-{len(list(folder.glob('out-*.json')))}.json"
    result = CliRunner().invoke(main, ["import", str(path), "--from", "aiperf", "--out", str(out), *args])
    return result, out


def imported(folder, path, *args):
    result, out = run_import(folder, path, *args)
    assert result.exit_code == 0, result.output
    return load_record(out), result.output, out


def prompt_ids():
    return [json.loads(line)["id"] for line in PROMPTS.read_text().splitlines()]


def test_each_request_is_a_prompt_in_the_order_aiperf_issued_them(tmp_path):
    """One result per profiled request, ordered by session_num whatever the lines' order (AIPerf
    writes a record as it completes, so concurrent requests finish out of order), each with its
    own spec_decode_acceptance record's counts; the warm-up request is left out."""
    profiled = [line for line in lines() if line["metadata"]["benchmark_phase"] == "profiling"]
    shuffled = [lines()[0], *random.Random(5).sample(profiled, len(profiled))]
    record, _, _ = imported(tmp_path, written(tmp_path, shuffled))
    assert [r.prompt_id for r in record.results] == [f"request-{i}" for i in range(10)]
    for result, line in zip(record.results, profiled):
        counts = line["spec_decode_acceptance"]
        assert (result.counters.steps, result.counters.drafted, result.counters.accepted, result.counters.emitted) == \
            (counts["num_spec_steps"], counts["num_draft_tokens"], counts["num_accepted_draft_tokens"],
             counts["completion_tokens"])
        assert result.counters.unverified == 1 and result.output_ids == ()
    assert record.summary().steps == 59 and len(record.results) == 10


def test_requests_match_a_prompts_file_by_their_text_in_inputs_json(tmp_path):
    """The export carries no input text: each request's conversation_id and turn_index find its
    payload in inputs.json, whose text names the prompt. inputs.json beside the export is read
    without --inputs; a prompts file in another order matches the same way."""
    folder = tmp_path / "artifacts"
    folder.mkdir()
    export = written(folder, lines())
    (folder / "inputs.json").write_text(INPUTS.read_text())
    record, _, _ = imported(tmp_path, export, "--prompts", str(PROMPTS))
    ids = prompt_ids()
    sessions = [line["metadata"]["conversation_id"] for line in lines()[1:]]
    assert [r.prompt_id for r in record.results] == [ids[ORDER[int(s[-1])]] for s in sessions]
    assert record.results[0].category == "code" and any("matched to --prompts by text" in n for n in record.notes)
    by_id = {r.prompt_id: r.counters.steps for r in record.results}
    reversed_prompts = tmp_path / "reversed.jsonl"
    reversed_prompts.write_text("\n".join(reversed(PROMPTS.read_text().splitlines())) + "\n")
    again, _, _ = imported(tmp_path, export, "--prompts", str(reversed_prompts))
    assert {r.prompt_id: r.counters.steps for r in again.results} == by_id


def test_without_inputs_json_requests_match_by_position(tmp_path):
    record, _, _ = imported(tmp_path, RECORDS, "--prompts", str(PROMPTS))
    assert [r.prompt_id for r in record.results] == prompt_ids()
    assert any("matched to --prompts by position" in note for note in record.notes)


def test_a_missing_request_is_labelled_by_text_and_one_line_by_position(tmp_path):
    every = lines()
    export = written(tmp_path, every[:4] + every[5:])  # session_num 3 (session_000004) never ran
    record, output, _ = imported(tmp_path, export, "--prompts", str(PROMPTS), "--inputs", str(INPUTS))
    unran = prompt_ids()[ORDER[4]]
    assert len(record.results) == 9 and unran not in {r.prompt_id for r in record.results}
    said = [line for line in output.splitlines() if "no request ran them" in line]
    assert len(said) == 1 and f"1 of the 10 prompts of --prompts: no request ran them ({unran})" in said[0]
    result, _ = run_import(tmp_path, export, "--prompts", str(PROMPTS))
    assert_clean_error(result, r"9 requests and 10 prompts in --prompts: without AIPerf's inputs.json \(--inputs\) "
                               "requests are matched by position")


@pytest.mark.parametrize("change, message", [
    (lambda items, inputs: inputs["data"][1]["payloads"][0].update(prompt=["a text no prompt has"]),
     r"export line \d+: its text 'a text no prompt has' is no prompt's of --prompts"),
    (lambda items, inputs: inputs["data"][2]["payloads"][0].update(prompt=inputs["data"][1]["payloads"][0]["prompt"]),
     r"export line \d+ and export line \d+ both ran prompt '\w+': one result per prompt"),
    (lambda items, inputs: inputs["data"].pop(3), r"conversation 'session_000003' turn 0 is not in inputs.json"),
    (lambda items, inputs: items[2]["metadata"].pop("conversation_id"), r"no metadata.conversation_id"),
    (lambda items, inputs: inputs["data"][0]["payloads"][0].update(prompt=["one", "two"]), r"'prompt' is not one text"),
    (lambda items, inputs: inputs["data"][0]["payloads"].__setitem__(0, {"input": "x"}),
     r"has neither a 'prompt' \(completions\) nor a user message \(chat\)"),
    (lambda items, inputs: inputs.update(data={"session_000000": []}), r"no 'data' list of sessions"),
    (lambda items, inputs: inputs["data"].__setitem__(0, {"session_id": 7, "payloads": []}), r"is not a session"),
    (lambda items, inputs: items[3]["metadata"].update(session_num=items[2]["metadata"]["session_num"]),
     r"export line 3 and line 4 are both session_num 1, turn 0: not one benchmark's export"),
])
def test_requests_that_do_not_pair_with_the_prompts_are_one_line(tmp_path, change, message):
    items, inputs = lines(), inputs_json()
    change(items, inputs)
    (tmp_path / "in.json").write_text(json.dumps(inputs))
    result, out = run_import(tmp_path, written(tmp_path, items), "--prompts", str(PROMPTS), "--inputs",
                             str(tmp_path / "in.json"))
    assert_clean_error(result, message)
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_any_field_of_inputs_json_of_another_type_is_a_record_or_one_line(tmp_path):
    """Each field of inputs.json's first session replaced by a value of another JSON type (or a
    NaN, a huge number): the import keeps a valid record (a field crossrt does not read) or is
    refused in one line."""
    inputs = inputs_json()
    export, refused = written(tmp_path, lines()), 0
    spots = [("data",), ("data", 0), ("data", 0, "session_id"), ("data", 0, "payloads"), ("data", 0, "payloads", 0),
             ("data", 0, "payloads", 0, "prompt"), ("data", 0, "payloads", 0, "prompt", 0),
             ("data", 0, "payloads", 0, "max_tokens")]
    odds = ("x", [], {}, None, -1, float("nan"), 10 ** 40)
    for number, (spot, odd) in enumerate((spot, odd) for spot in spots for odd in odds):
        damaged = copy.deepcopy(inputs)
        set_at(damaged, spot, odd)
        (tmp_path / f"in{number}.json").write_text(json.dumps(damaged))
        result, out = run_import(tmp_path, export, "--prompts", str(PROMPTS), "--inputs",
                                 str(tmp_path / f"in{number}.json"))
        refused += refused_in_one_line(result, out, (spot, odd))
    assert refused == 7 * (len(spots) - 1)  # all but max_tokens, which crossrt does not read


def test_a_chat_payloads_last_user_message_is_its_text(tmp_path):
    """AIPerf's chat endpoint writes `messages` (content a string, or {"type": "text"} parts); the
    turn is the last user message."""
    inputs = inputs_json()
    for session in inputs["data"]:
        text = session["payloads"][0].pop("prompt")[0]
        session["payloads"][0]["messages"] = [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": [{"type": "text", "text": text}]}]
    (tmp_path / "chat.json").write_text(json.dumps(inputs))
    record, _, _ = imported(tmp_path, written(tmp_path, lines()), "--prompts", str(PROMPTS), "--inputs",
                            str(tmp_path / "chat.json"))
    assert record.results[0].prompt_id == prompt_ids()[ORDER[1]]


@pytest.mark.parametrize("spot, value", [
    (("spec_decode_acceptance", "num_spec_steps"), float("nan")),
    (("spec_decode_acceptance", "num_spec_steps"), 10 ** 30),
    (("spec_decode_acceptance", "num_accepted_draft_tokens"), -3),
    (("spec_decode_acceptance", "completion_tokens"), "32"),
    (("spec_decode_acceptance", "acceptance_histogram"), [1, 2]),
    (("metadata", "session_num"), -1),
    (("metadata", "session_num"), float("inf")),
    (("metadata", "turn_index"), "0"),
    (("metadata", "conversation_id"), 5),
    (("metadata", "conversation_id"), "x" * 5000),
])
def test_hostile_values_of_a_request_are_refused_in_one_line(tmp_path, spot, value):
    items = lines()
    items[4][spot[0]][spot[1]] = value
    path = tmp_path / "hostile.jsonl"
    path.write_text("\n".join(json.dumps(item) for item in items))  # NaN and Infinity as Python writes them
    result, out = run_import(tmp_path, path, "--prompts", str(PROMPTS), "--inputs", str(INPUTS))
    assert_clean_error(result, r"export line 5")
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_prompts_of_an_export_that_keeps_no_requests_are_refused(tmp_path):
    result, _ = run_import(tmp_path, FIXTURES / "aiperf-vllm-real-aggregate.json", "--k", "7", "--prompts",
                           str(PROMPTS))
    assert_clean_error(result, "--prompts and --inputs match the requests of profile_export.jsonl; this is an "
                               "aggregate, which keeps none apart")
    result = CliRunner().invoke(main, ["import", str(FIXTURES / "vllm-log-pr24127.log"), "--from", "vllm-log",
                                       "--prompts", str(PROMPTS), "--out", str(tmp_path / "x.json")])
    assert_clean_error(result, r"--prompts and --inputs name the prompts of a per-request export \(aiperf\)")


# ---- parity against crossrt's endpoint record of the same prompts ------------------------------

K, BUDGET = 3, 8
# Per prompt, in the order the run sends them: the speculative server's per-step accepted draft
# tokens (k = 3, vLLM's counting: emitted 8 = 1 + steps + accepted - cut).
STEPS = {"alpha": [3, 2], "beta": [2, 3, 0], "gamma": [1, 1, 1, 1]}
TEXTS = {"alpha": "The quick brown fox", "beta": "def add(a, b):\n", "gamma": "Lists of colours:\n1."}


def vllm_format_routes(tokenize, speculative: bool):
    """vLLM 0.32's answers as tests/test_endpoint.py's vllm_routes, with the tiny pair's own
    tokenizer behind /tokenize (the endpoint checks the server tokenizes as the pair's target) and
    each prompt's counts from STEPS, in the order the prompts come."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "generation": 0, "pos": [0] * K}
    plan = iter(STEPS.values())

    def complete(body):
        output = [(sum(body["prompt"]) + j) % 200 + 10 for j in range(BUDGET)]
        totals["generation"] += BUDGET
        if speculative:
            steps = next(plan)
            totals.update(drafts=totals["drafts"] + len(steps), draft_tokens=totals["draft_tokens"] + K * len(steps),
                          accepted=totals["accepted"] + sum(steps))
            totals["pos"] = [n + sum(1 for a in steps if a > i) for i, n in enumerate(totals["pos"])]
        return 200, {"id": "cmpl-1", "object": "text_completion", "model": "tiny",
                     "choices": [{"index": 0, "text": "", "finish_reason": "length", "token_ids": output}],
                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": BUDGET}}

    def metrics(_):
        return 200, vllm_metrics_text(totals, speculative)

    return {"/version": lambda _: (200, {"version": "0.32.0"}),
            "/v1/models": lambda _: (200, {"object": "list", "data": [{"id": "tiny", "object": "model",
                                                                     "owned_by": "vllm", "max_model_len": 512}]}),
            "/tokenize": lambda body: (200, {"tokens": tokenize(body["prompt"]), "max_model_len": 512}),
            "/v1/completions": complete, "/metrics": metrics}


def aiperf_export(steps_of: dict, folder: Path) -> Path:
    """AIPerf's profile_export.jsonl and inputs.json of the same prompts, written from the real
    export's lines (a warm-up, then one profiled request per prompt, in AIPerf's field names)."""
    real = lines()
    items, sessions = [copy.deepcopy(real[0])], []
    for number, (name, steps) in enumerate(steps_of.items()):
        item = copy.deepcopy(real[1])
        conversation = f"session_{number:06d}"
        item["metadata"].update(session_num=number, conversation_id=conversation, turn_index=0)
        accepted = sum(steps)
        item["spec_decode_acceptance"] = {
            "engine": "vllm", "mean_acceptance_length": 1 + accepted / len(steps),
            "draft_acceptance_rate": accepted / (K * len(steps)),
            "acceptance_histogram": {str(j): steps.count(j) for j in sorted(set(steps))},
            "num_accepted_draft_tokens": accepted, "num_draft_tokens": K * len(steps), "num_spec_steps": len(steps),
            "num_spec_tokens": K, "completion_tokens": BUDGET, "per_step_accepted": steps,
            "per_step_drafted": [K] * len(steps)}
        item["metrics"] = {key: value for key, value in item["metrics"].items() if not key.startswith("spec_decode")}
        item["metrics"]["usage_completion_tokens"] = {"value": BUDGET, "unit": "tokens"}
        items.append(item)
        sessions.append({"session_id": conversation, "payloads": [{"prompt": [TEXTS[name]], "model": "tiny",
                                                                   "stream": False, "max_tokens": BUDGET}]})
    (folder / "inputs.json").write_text(json.dumps({"data": sessions}))
    return written(folder, items)


@pytest.fixture(scope="module")
def endpoint_record(tmp_path_factory):
    """crossrt's record of the three prompts on a vLLM-format server, as `crossrt run --runtime
    endpoint` writes it (its baseline from a second, plain server)."""
    folder = tmp_path_factory.mktemp("endpoint")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": name, "category": "prose", "prompt": text}) + "\n"
                               for name, text in TEXTS.items()))
    _, tokenize = local_vocabulary(load_pair(TINY_PAIR).path("target", "gguf"))
    spec, plain = (FormatServer(vllm_format_routes(lambda text: list(tokenize(text)), flag)) for flag in (True, False))
    out = folder / "endpoint.json"
    try:
        result = CliRunner().invoke(main, ["run", "--runtime", "endpoint", "--mode", "native", "--pair",
                                           str(TINY_PAIR), "--k", str(K), "--max-new-tokens", str(BUDGET),
                                           "--prompts", str(prompts), "--url", spec.url, "--baseline-url", plain.url,
                                           "--out", str(out)])
    finally:
        spec.shutdown(), plain.shutdown()
    assert result.exit_code == 0, result.output
    return out, prompts


# The tiny pair's tokenizer behind the server's /tokenize is llama.cpp's (llama-cpp-python).
needs_llama_cpp = pytest.mark.skipif(availability("llama-cpp") is not None,
                                     reason=f"llama-cpp not usable: {availability('llama-cpp')}")


def parity(*records):
    return CliRunner().invoke(main, ["parity", "--no-logits", "--no-float-control", "--counters-only",
                                     *map(str, records)])


@needs_llama_cpp
def test_parity_compares_the_imported_requests_prompt_by_prompt_with_the_endpoint_record(endpoint_record, tmp_path):
    endpoint, prompts = endpoint_record
    assert [(r.counters.steps, r.counters.accepted, r.counters.cut) for r in load_record(endpoint).results] == \
        [(2, 5, 0), (3, 5, 1), (4, 4, 1)]
    _, _, out = imported(tmp_path, aiperf_export(STEPS, tmp_path), "--prompts", str(prompts), "--max-new-tokens",
                         str(BUDGET))
    result = parity(endpoint, out)
    assert result.exit_code == 0, result.output
    assert "aiperf/native: 3 prompts: 3 identical, 0 explained, 0 failed, 0 not comparable; counters compared" in \
        result.output, result.output
    # Without --counters-only the same pair compared no token ids, and says why.
    plain = CliRunner().invoke(main, ["parity", "--no-logits", "--no-float-control", str(endpoint), str(out)])
    assert plain.exit_code == 1 and "no token ids: imported from aiperf" in plain.output, plain.output


@needs_llama_cpp
def test_parity_names_the_one_request_whose_counts_differ_and_the_one_missing(endpoint_record, tmp_path):
    endpoint, prompts = endpoint_record
    planted = {**STEPS, "beta": [2, 2, 1]}  # the same 5 accepted and 8 emitted, drafted in 3 steps of other lengths
    planted["gamma"] = [1, 2, 1]  # 4 accepted in 3 steps, not 4
    _, _, out = imported(tmp_path, aiperf_export(planted, tmp_path), "--prompts", str(prompts), "--max-new-tokens",
                         str(BUDGET))
    result = parity(endpoint, out)
    assert result.exit_code == 1
    failed = [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert failed == ["FAIL endpoint/native vs aiperf/native, gamma: steps: 4 vs 3; drafted: 12 vs 9; cut: 1 vs 0"], \
        result.output
    del planted["beta"]
    folder = tmp_path / "missing"
    folder.mkdir()
    _, _, out = imported(folder, aiperf_export(planted, folder), "--prompts", str(prompts), "--max-new-tokens",
                         str(BUDGET))
    result = parity(endpoint, out)
    assert "FAIL endpoint/native vs aiperf/native, beta: missing from aiperf/native" in result.output, result.output
