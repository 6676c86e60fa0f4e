"""Built-in prompt suites and the loaders for crossrt's and published prompt files.

The Spec-Bench, MT-Bench and HumanEval files below are hand-written in the published formats
(Spec-Bench data/spec_bench/question.jsonl and MT-Bench question.jsonl: question_id, category,
turns, MT-Bench adding reference on some; HumanEval: task_id, prompt, entry_point,
canonical_solution, test, shipped as HumanEval.jsonl.gz), with our own text, not the datasets'.
"""

import gzip
import json
import os
import re
import threading

import pytest

from crossrt.inputs.prompts import (BUILTIN_SUITES, CATEGORIES, PromptError, load_prompts, relabel,
                             source_relative_to, split_source)

SPEC_BENCH = [
    {"question_id": 81, "category": "writing",
     "turns": ["Write a postcard from a seaside town.", "Now make it rhyme."]},
    {"question_id": 161, "category": "translation", "turns": ["Translate into French: the cat sleeps."]},
    {"question_id": 401, "category": "math_reasoning", "turns": ["If 3 pens cost 4.50, what do 7 cost?"]},
]
MT_BENCH = [
    {"question_id": 101, "category": "math", "turns": ["What is 17 times 23?", "And 17 times 24?"],
     "reference": ["391", "408"]},
    {"question_id": 121, "category": "coding", "turns": ["Write a function that reverses a string."]},
]
HUMAN_EVAL = [
    {"task_id": "HumanEval/0", "prompt": "def double(x: int) -> int:\n    \"\"\"Return twice x.\"\"\"\n",
     "entry_point": "double", "canonical_solution": "    return 2 * x\n",
     "test": "def check(candidate):\n    assert candidate(2) == 4\n"},
    {"task_id": "HumanEval/1", "prompt": "def is_even(n: int) -> bool:\n    \"\"\"True when n is even.\"\"\"\n",
     "entry_point": "is_even", "canonical_solution": "    return n % 2 == 0\n",
     "test": "def check(candidate):\n    assert candidate(4)\n"},
]


def jsonl(path, items):
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def test_each_category_suite_has_twenty_short_prompts_of_its_category():
    for category in CATEGORIES:
        prompts = load_prompts(category)
        assert len(prompts) >= 20, category
        assert {p.category for p in prompts} == {category}
        assert all(re.fullmatch(rf"{category}-\d\d", p.id) for p in prompts)
        assert all(0 < len(p.text) < 300 for p in prompts)
        assert len({p.text for p in prompts}) == len(prompts)  # no prompt twice


def test_categories_suite_is_every_category_with_unique_ids():
    every = load_prompts("categories")
    assert [p.category for p in every] == [c for c in CATEGORIES for _ in load_prompts(c)]
    assert len({p.id for p in every}) == len(every) >= 100
    assert set(BUILTIN_SUITES) == {"builtin", "categories", *CATEGORIES}


def test_builtin_suite_is_unchanged():
    builtin = load_prompts("builtin")
    assert len(builtin) == 10
    assert [p.category for p in builtin].count("structured") == 2


def test_category_prompts_fit_a_small_context(tiny_sessions):
    """With a 512-token context and up to 256 new tokens, every prompt must stay under 256."""
    target, _ = tiny_sessions
    longest = max(len(target.tokenize(p.text)) for p in load_prompts("categories"))
    assert longest < 256


def test_spec_bench_first_turn_category_and_prefixed_ids(tmp_path):
    prompts = load_prompts(f"specbench:{jsonl(tmp_path / 'question.jsonl', SPEC_BENCH)}")
    assert [p.id for p in prompts] == ["specbench-81", "specbench-161", "specbench-401"]
    assert [p.category for p in prompts] == ["writing", "translation", "math_reasoning"]
    assert prompts[0].text == "Write a postcard from a seaside town."


def test_mt_bench_ignores_reference_answers(tmp_path):
    prompts = load_prompts(f"mtbench:{jsonl(tmp_path / 'question.jsonl', MT_BENCH)}")
    assert [(p.id, p.category, p.text) for p in prompts] == [
        ("mtbench-101", "math", "What is 17 times 23?"),
        ("mtbench-121", "coding", "Write a function that reverses a string.")]


def test_human_eval_plain_and_gzipped(tmp_path):
    plain = jsonl(tmp_path / "HumanEval.jsonl", HUMAN_EVAL)
    packed = tmp_path / "HumanEval.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        prompts = load_prompts(f"humaneval:{path}")
        assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1"]
        assert {p.category for p in prompts} == {"code"}
        assert prompts[1].text.startswith("def is_even(n: int) -> bool:\n")


def test_crossrt_format_with_and_without_scheme(tmp_path):
    path = jsonl(tmp_path / "mine.jsonl", [{"id": "a", "category": "prose", "prompt": "Once"}])
    assert load_prompts(str(path)) == load_prompts(f"jsonl:{path}")
    assert split_source("C:/prompts/mine.jsonl") == ("jsonl", "C:/prompts/mine.jsonl")
    assert split_source("humaneval:data/h.jsonl") == ("humaneval", "data/h.jsonl")


@pytest.mark.parametrize("scheme, lines, message", [
    ("jsonl", [SPEC_BENCH[0]], "line 1: missing or empty string field(s) id, prompt (this looks like a "
                               "Spec-Bench or MT-Bench question.jsonl: use specbench:PATH"),
    ("jsonl", [HUMAN_EVAL[0]], "use humaneval:PATH"),
    ("specbench", [SPEC_BENCH[0], {"question_id": 82, "category": "writing", "turns": []}],
     "line 2: 'turns' must be a non-empty list"),
    ("specbench", [{"category": "writing", "turns": ["x"]}], "line 1: missing question_id"),
    ("mtbench", [MT_BENCH[0], {"question_id": 101, "category": "math", "turns": ["again"]}],
     "line 2: duplicate prompt id 'mtbench-101'"),
    ("mtbench", [{"question_id": 5, "turns": ["x"]}], "line 1: missing or empty string field 'category'"),
    ("humaneval", [{"task_id": "HumanEval/9"}], "line 1: missing or empty string field 'prompt'"),
    ("humaneval", [["not", "an", "object"]], "line 1: expected a JSON object, got list"),
])
def test_bad_files_name_the_file_and_line(tmp_path, scheme, lines, message):
    path = jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(PromptError) as error:
        load_prompts(f"{scheme}:{path}")
    assert str(path) in str(error.value) and message in str(error.value)


def test_unreadable_sources(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "a", "category": "code", "prompt": "x"}\n{"id": \n')
    with pytest.raises(PromptError, match=r"broken.jsonl line 2: not JSON"):
        load_prompts(str(broken))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PromptError, match="no prompts"):
        load_prompts(f"mtbench:{tmp_path / 'empty.jsonl'}")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(PromptError, match="cannot read"):
        load_prompts(f"humaneval:{tmp_path / 'bad.jsonl.gz'}")
    with pytest.raises(PromptError, match=r"not found: .*specbench:PATH"):
        load_prompts("specbench:missing/question.jsonl")


def test_relative_sources_and_relabelling(tmp_path):
    assert source_relative_to("code", tmp_path) == "code"
    assert source_relative_to("humaneval:h.jsonl", tmp_path) == f"humaneval:{tmp_path / 'h.jsonl'}"
    assert source_relative_to("/abs/p.jsonl", tmp_path) == "/abs/p.jsonl"
    relabelled = relabel(load_prompts(f"mtbench:{jsonl(tmp_path / 'q.jsonl', MT_BENCH)}"), "code")
    assert [(p.id, p.category) for p in relabelled] == [("mtbench-101", "code"), ("mtbench-121", "code")]


@pytest.mark.parametrize("runtime", ["llama-cpp", "transformers"])
def test_a_prompt_that_is_not_unicode_fails_alone_in_one_line(runtime, tmp_path):
    """JSON's "\\ud800" reads as a lone surrogate: no UTF-8 form for any tokenizer (it raised
    UnicodeEncodeError through crossrt before). That prompt fails with the reason; the run goes on."""
    from click.testing import CliRunner

    from crossrt.cli import main
    from crossrt.records.record_json import load_record

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "bad", "category": "prose", "prompt": "abc \\ud800 def"}\n'
                       '{"id": "good", "category": "prose", "prompt": "The river"}\n')
    out = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["run", "--pair", "tiny", "--runtime", runtime, "--prompts", str(prompts),
                                       "--max-new-tokens", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    bad, good = load_record(out).results
    assert (bad.status, good.status) == ("failed", "ok")
    assert bad.error == "the text is not valid Unicode: a lone surrogate '\\ud800' at character 4"


def test_a_pipe_is_read_as_a_prompt_file(tmp_path):
    """`--prompts <(cat f)` names a pipe, not a regular file (issue 58: it was "not found")."""
    fifo = tmp_path / "prompts"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text('{"id": "a", "category": "code", "prompt": "x = "}\n'))
    writer.start()
    prompts = load_prompts(str(fifo))
    writer.join()
    assert [(p.id, p.category) for p in prompts] == [("a", "code")]
