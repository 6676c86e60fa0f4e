"""Benchmark prompt files: Spec-Bench's real question.jsonl (tests/fixtures/benchmarks/README.md),
SPEED-Bench rows in its dataset card's schema, categories kept and mapped to content types, and
a Spec-Bench question templated and run on the tiny pair."""

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from crossrt.inputs.chat_template import apply_template
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.prompts import (CATEGORIES, SPEEDBENCH_PLACEHOLDER, PromptError, by_content_type, content_type,
                             load_prompts)
from crossrt.run.runtime import DraftRules, RuntimeOptions

from conftest import REPO

SPEC_BENCH = REPO / "tests" / "fixtures" / "benchmarks" / "spec_bench_question.jsonl"
SPEC_BENCH_COUNTS = {"writing": 10, "roleplay": 10, "reasoning": 10, "math": 10, "coding": 10, "extraction": 10,
                     "stem": 10, "humanities": 10, "translation": 80, "summarization": 80, "qa": 80,
                     "math_reasoning": 80, "rag": 80}
# SPEED-Bench's qualitative categories (its dataset card and NVIDIA's AIPerf guide).
SPEED_BENCH_CATEGORIES = ("coding", "humanities", "math", "multilingual", "qa", "rag", "reasoning", "roleplay",
                          "stem", "summarization", "writing")


def test_spec_bench_loads_with_its_categories():
    prompts = load_prompts(f"specbench:{SPEC_BENCH}")
    assert len(prompts) == 480
    assert Counter(p.category for p in prompts) == SPEC_BENCH_COUNTS
    assert prompts[0].id == "specbench-81" and prompts[0].text.startswith("Compose an engaging travel blog post")
    assert all(p.chat for p in prompts)
    assert {content_type(c) for c in SPEC_BENCH_COUNTS} == set(CATEGORIES)
    typed = Counter(p.category for p in by_content_type(prompts))
    assert typed == {"prose": 10 + 80 + 80 + 80 + 10 + 10, "chat": 10 + 10 + 80, "math": 10 + 80, "code": 10,
                     "structured": 10}


def _speed_bench_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"speedbench:{path}"


def _row(question_id, category, turns=None, **fields):
    """A row in the dataset card's schema; its text is one of Spec-Bench's real questions."""
    text = json.loads(SPEC_BENCH.read_text().splitlines()[0])["turns"]
    return {"question_id": question_id, "category": category, "sub_category": "", "turns": turns or text,
            "source": "", "src_id": "", "difficulty": "", "multiturn": True, **fields}


def test_speed_bench_rows(tmp_path):
    rows = [_row(f"q{i}", category) for i, category in enumerate(SPEED_BENCH_CATEGORIES)]
    prompts = load_prompts(_speed_bench_rows(tmp_path / "qualitative.jsonl", rows))
    assert [p.category for p in prompts] == list(SPEED_BENCH_CATEGORIES)
    assert prompts[0].id == "speedbench-q0" and all(p.chat for p in prompts)
    assert all(content_type(c) in CATEGORIES for c in SPEED_BENCH_CATEGORIES)
    # Nemo-Skills' prepare.py writes the filled rows with messages in place of turns.
    filled = {k: v for k, v in _row("m", "qa").items() if k != "turns"}
    filled["messages"] = [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]
    assert load_prompts(_speed_bench_rows(tmp_path / "filled.jsonl", [filled]))[0].text == "first"


def test_speed_bench_placeholder_is_refused(tmp_path):
    rows = [_row("p", "coding", [SPEEDBENCH_PLACEHOLDER + "\n\nx"]), _row("q", "qa"),
            _row("r", "rag", [SPEEDBENCH_PLACEHOLDER])]
    with pytest.raises(PromptError, match="line 1: 2 of 3 rows hold SPEED-Bench's placeholder.*the first: question p"):
        load_prompts(_speed_bench_rows(tmp_path / "t.jsonl", rows))


def _speed_bench_parquet(path, rows):
    """Rows written as parquet in the published file's column types (DuckDB; constructed rows,
    not SPEED-Bench's own: tests/fixtures/benchmarks/README.md says why none is committed)."""
    import duckdb

    path.parent.mkdir(parents=True, exist_ok=True)
    with duckdb.connect() as connection:
        connection.execute("CREATE TABLE t (question_id VARCHAR, category VARCHAR, sub_category VARCHAR, "
                           "turns VARCHAR[], source VARCHAR, src_id VARCHAR, difficulty VARCHAR, multiturn BOOLEAN)")
        connection.executemany("INSERT INTO t VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                               [[row[name] for name in ("question_id", "category", "sub_category", "turns", "source",
                                                        "src_id", "difficulty", "multiturn")] for row in rows])
        connection.execute(f"COPY t TO '{path}' (FORMAT parquet)")
    return f"speedbench:{path}"


def test_speed_bench_parquet_as_published(tmp_path):
    rows = [_row(f"q{i}", category) for i, category in enumerate(SPEED_BENCH_CATEGORIES)]
    prompts = load_prompts(_speed_bench_parquet(tmp_path / "qualitative" / "test-00000-of-00001.parquet", rows))
    assert [p.category for p in prompts] == list(SPEED_BENCH_CATEGORIES)
    assert prompts[0].id == "speedbench-q0" and prompts[0].text == rows[0]["turns"][0] and prompts[0].chat
    # A throughput config's folder names its input-length tier; its ids carry it.
    tier = load_prompts(_speed_bench_parquet(tmp_path / "throughput_8k" / "test-00000-of-00001.parquet",
                                             [_row("t1", "low_entropy")]))
    assert [(p.id, p.category) for p in tier] == [("speedbench-throughput_8k-t1", "low_entropy")]
    assert prompts[0].later_turns == tuple(rows[0]["turns"][1:]) and len(prompts[0].later_turns) == 1
    assert load_prompts(_speed_bench_rows(tmp_path / "throughput_1k.jsonl", [_row("t1", "mixed")]))[0].id == \
        "speedbench-throughput_1k-t1"
    masked = _speed_bench_parquet(tmp_path / "m.parquet", [_row("p", "qa", [SPEEDBENCH_PLACEHOLDER])])
    with pytest.raises(PromptError, match=r"m.parquet row 1: 1 of 1 rows hold SPEED-Bench's placeholder"):
        load_prompts(masked)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(PromptError, match="broken.parquet: cannot read as parquet"):
        load_prompts(f"speedbench:{tmp_path / 'broken.parquet'}")


def test_a_spec_bench_question_templated_on_the_tiny_pair(tiny_pair, tmp_path):
    questions = [p for p in load_prompts(f"specbench:{SPEC_BENCH}") if p.category == "coding"][:1]
    prompts, rendering, fmt = apply_template(questions, tiny_pair)
    request = RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=512, threads=1), DraftRules(4), 4,
                         tmp_path / "run.json", chat=rendering, prompt_format=fmt)
    (result,) = run_pair(request, prompts).results
    assert result.ok and result.category == "coding" and fmt.templated == (questions[0].id,)


@pytest.mark.skipif(not os.environ.get("CROSSRT_SPEEDBENCH_DIR"),
                    reason="SPEED-Bench's files are not reachable here (Hugging Face; NVIDIA's evaluation dataset "
                    "license keeps them out of the repository): set CROSSRT_SPEEDBENCH_DIR to a download of "
                    "nvidia/SPEED-Bench, filled in (specdec_bench or Nemo-Skills' prepare.py)")
def test_speed_bench_as_downloaded():
    """The real qualitative split, filled in: 880 questions, 80 in each of 11 categories."""
    root = Path(os.environ["CROSSRT_SPEEDBENCH_DIR"])
    path = next(root.glob("qualitative/*.parquet"), None) or root / "qualitative.jsonl"
    prompts = load_prompts(f"speedbench:{path}")
    assert len(prompts) == 880
    assert Counter(p.category for p in prompts) == {category: 80 for category in SPEED_BENCH_CATEGORIES}
