"""MT-Bench's second turn (crossrt/run/second_turn.py) on the real tiny pair: the first answer is
the target's own greedy output on turn 1 (the baseline of a turn-1 run), made once into the
first-answers file and reused, a file made for something else refused, and `parity --turn 2`
feeding llama-cpp and transformers the same ids from one rendering of the whole conversation."""

import hashlib
import json

import pytest
from click.testing import CliRunner

from crossrt.inputs.chat_template import ChatRendering, apply_template, find_template, prompt_messages
from crossrt.cli import main
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record
from crossrt.run.runtime import RuntimeOptions, availability
from crossrt.run.second_turn import FirstAnswers, second_turn_prompts

from conftest import REPO, TINY_PAIR, assert_clean_error

SPEC_BENCH = REPO / "tests" / "fixtures" / "benchmarks" / "spec_bench_question.jsonl"
TOKENS = "16"


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    """Two MT-Bench questions (Spec-Bench's first 80 rows are MT-Bench's, two turns each)."""
    path = tmp_path_factory.mktemp("questions") / "question.jsonl"
    path.write_text("".join(SPEC_BENCH.read_text().splitlines(keepends=True)[:2]))
    return f"mtbench:{path}"


def invoke(*args):
    return CliRunner().invoke(main, [str(arg) for arg in args])


def run_turn(questions, out, *extra):
    result = invoke("run", "--pair", TINY_PAIR, "--prompts", questions, "--max-new-tokens", TOKENS, "--out", out,
                    "--overwrite", *extra)
    assert result.exit_code == 0, result.output
    return load_record(out)


def test_the_reader_keeps_the_second_turn(questions):
    first, second = load_prompts(questions)
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()[:2]]
    assert (first.text, first.later_turns) == (rows[0]["turns"][0], tuple(rows[0]["turns"][1:]))
    assert len(second.later_turns) == 1


@pytest.fixture(scope="module")
def turns(questions, tmp_path_factory):
    """A turn-1 run, then a turn-2 run making the first-answers file beside its record: the
    folder, both records and the file."""
    folder = tmp_path_factory.mktemp("turns")
    first = run_turn(questions, folder / "turn1.json")
    second = run_turn(questions, folder / "turn2.json", "--turn", "2")
    return folder, first, second, folder / "tiny-first-answers.jsonl"


def test_the_first_answer_is_the_targets_greedy_output_made_once(questions, turns):
    tmp_path, first, second, answers_file = turns
    answers = [json.loads(line) for line in answers_file.read_text().splitlines()]
    turn1 = {r.prompt_id: r for r in first.results}
    assert [a["id"] for a in answers] == list(turn1) == ["mtbench-81", "mtbench-82"]
    for answer in answers:
        assert tuple(answer["answer_ids"]) == turn1[answer["id"]].baseline_ids
        assert answer["prompt_sha256"] == turn1[answer["id"]].prompt_sha256
        assert answer["target_sha256"] == first.pair.target.sha256 and answer["max_new_tokens"] == int(TOKENS)
    assert [r.prompt_id for r in second.results] == ["mtbench-81-turn2", "mtbench-82-turn2"]
    assert all(r.ok for r in second.results)
    fmt = second.prompt_format
    assert (fmt.turn, fmt.templated) == (2, ("mtbench-81-turn2", "mtbench-82-turn2"))
    assert fmt.first_answers_sha256 == hashlib.sha256(answers_file.read_bytes()).hexdigest()
    assert first.prompt_format.turn == 1 and first.prompt_format.first_answers_sha256 is None

    # Again, through another command: the answers are read, not made again.
    before = (answers_file.read_bytes(), answers_file.stat().st_mtime_ns)
    again = run_turn(questions, tmp_path / "again.json", "--turn", "2", "--first-answers", answers_file)
    assert (answers_file.read_bytes(), answers_file.stat().st_mtime_ns) == before
    assert [r.prompt_ids for r in again.results] == [r.prompt_ids for r in second.results]


def test_the_conversation_is_rendered_whole(questions, tmp_path):
    pair = load_pair(TINY_PAIR)
    fed, rendering, _ = apply_template(load_prompts(questions), pair)
    answers = FirstAnswers(tmp_path / "answers.jsonl", RuntimeOptions(n_ctx=512, threads=1), int(TOKENS))
    prompts, _ = second_turn_prompts(fed, pair, rendering, answers)
    kept = json.loads((tmp_path / "answers.jsonl").read_text().splitlines()[0])
    question = load_prompts(questions)[0]
    messages = [{"role": "user", "content": question.text}, {"role": "assistant", "content": kept["text"]},
                {"role": "user", "content": question.later_turns[0]}]
    assert prompt_messages(prompts[0]) == messages
    template = ChatRendering(find_template(pair))
    assert prompts[0].text == template.fed_text(template.render(messages))
    assert prompts[0].text.startswith("### user:\n") and "### assistant:\n" in prompts[0].text


def test_a_file_made_for_something_else_is_refused(questions, turns, tmp_path):
    # The turn-2 run's answers (16 tokens), where the next run's record goes, as if made for it.
    answers_file = tmp_path / "tiny-first-answers.jsonl"
    answers_file.write_bytes(turns[3].read_bytes())
    kept = answers_file.read_text()
    result = invoke("run", "--pair", TINY_PAIR, "--prompts", questions, "--turn", "2", "--max-new-tokens", "8",
                    "--out", tmp_path / "short.json")
    assert_clean_error(result, "the answer to mtbench-81 was made for another --max-new-tokens")
    rows = [json.loads(line) for line in kept.splitlines()]
    rows[1]["target_sha256"] = "0" * 64
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = invoke("run", "--pair", TINY_PAIR, "--prompts", questions, "--turn", "2", "--max-new-tokens", TOKENS,
                    "--first-answers", other, "--out", tmp_path / "other.json")
    assert_clean_error(result, "the answer to mtbench-82 was made for another target model")
    other.write_text("not json\n")
    result = invoke("run", "--pair", TINY_PAIR, "--prompts", questions, "--turn", "2", "--first-answers", other,
                    "--out", tmp_path / "other.json")
    assert_clean_error(result, "other.jsonl line 1: not JSON")
    assert answers_file.read_text() == kept  # nothing made again


def test_parity_of_the_second_turn_across_runtimes(questions, tmp_path):
    if availability("transformers") is not None:
        pytest.skip(f"transformers not usable: {availability('transformers')}")
    out_dir = tmp_path / "runs"
    result = invoke("parity", "--pair", TINY_PAIR, "--runtimes", "llama-cpp,transformers", "--modes", "driven",
                    "--prompts", questions, "--turn", "2", "--max-new-tokens", TOKENS, "--f32-kv-cache",
                    "--no-flash-attn", "--out-dir", out_dir)
    assert result.exit_code == 0, result.output
    records = [load_record(out_dir / f"tiny-{runtime}-driven-k4.json") for runtime in ("llama-cpp", "transformers")]
    ids = [[(r.prompt_id, r.prompt_ids) for r in record.results] for record in records]
    assert ids[0] == ids[1] and [i for i, _ in ids[0]] == ["mtbench-81-turn2", "mtbench-82-turn2"]
    # transformers renders the whole conversation itself, and agrees token for token.
    assert all(r.ok and r.template_ids is None and r.own_prompt_ids is None for record in records for r in record.results)
    assert records[0].prompt_format == records[1].prompt_format
    assert (out_dir / "tiny-first-answers.jsonl").is_file()


def test_llama_server_renders_the_whole_conversation_too(questions, tmp_path):
    if availability("llama-server") is not None:
        pytest.skip(f"llama-server not usable: {availability('llama-server')}")
    out_dir = tmp_path / "runs"
    # --no-tau-gap: the two schedules differ, so parity would add tau gap lines, whose oracle (each
    # prompt decoded again in llama.cpp) nothing here reads: what is asserted is the ids fed, the
    # verdict. Parity's tau gap lines are asserted in tests/test_tau_gap.py.
    result = invoke("parity", "--pair", TINY_PAIR, "--runtimes", "llama-cpp,llama-server", "--prompts", questions,
                    "--turn", "2", "--max-new-tokens", TOKENS, "--out-dir", out_dir, "--no-tau-gap")
    assert result.exit_code == 0, result.output
    server = load_record(out_dir / "tiny-llama-server-native-k4.json")
    driven = load_record(out_dir / "tiny-llama-cpp-driven-k4.json")
    assert [r.prompt_ids for r in server.results] == [r.prompt_ids for r in driven.results]
    assert all(r.ok and r.template_ids is None for r in server.results)  # /apply-template of the conversation


def test_turn_two_needs_a_template_and_a_second_turn(questions, tmp_path):
    out = tmp_path / "run.json"
    assert_clean_error(invoke("run", "--pair", TINY_PAIR, "--prompts", questions, "--turn", "2", "--raw", "--out", out),
                       "--turn 2 renders a conversation through the chat template: not with --raw")
    assert_clean_error(invoke("run", "--pair", "tiny-f16", "--prompts", questions, "--turn", "2", "--out", out),
                       "--turn 2 needs a chat template")
    assert_clean_error(invoke("run", "--pair", TINY_PAIR, "--turn", "2", "--out", out),
                       "none of the prompts has a second turn")
    assert_clean_error(invoke("run", "--pair", TINY_PAIR, "--first-answers", tmp_path / "a.jsonl", "--out", out),
                       "--first-answers is for --turn 2")
    assert_clean_error(invoke("parity", "--pair", TINY_PAIR, "--turn", "3"), "Invalid value for '--turn'")
    assert not out.exists()
