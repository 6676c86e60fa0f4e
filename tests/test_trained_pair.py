"""The committed trained pair (models/trained): the same weights in llama.cpp and transformers,
lossless greedy speculative decoding, code accepted more often than prose, and a trainer whose
first steps are reproducible. Nothing here trains the pair itself (scripts/train_tiny_pair.py)."""

import dataclasses

import numpy as np
import pytest

from crossrt.builders import tinytrain
from crossrt.run.prompt_run import run_prompt
from crossrt.builders.model_files import LlamaShape
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules, RuntimeOptions, Rows, open_runtime
from crossrt.records.schema import Summary

from conftest import REPO

TRAINED_PAIR = REPO / "models" / "pairs" / "trained.toml"
PROMPTS = load_prompts(str(REPO / "models" / "trained" / "prompts.jsonl"))
K = 4
MAX_NEW = 64  # crossrt run's default, as in docs/trained-pair.md
# docs/trained-pair.md measures tau(code) - tau(prose) = MEASURED_GAP at k = 4 on these
# prompts; the assertion leaves room for another CPU's last bits to move a few acceptances.
MEASURED_GAP = 0.49
GAP_SLACK = 0.15
# F32 KV cache, no flash attention: llama.cpp's default F16 cache flips one prose output at a
# near-tie (top-2 margin 1.7e-4) between the batched check and plain decoding.
PRECISE = RuntimeOptions(n_ctx=512, threads=1, f32_kv_cache=True, flash_attn=False)


@pytest.fixture(scope="module")
def trained_pair():
    return load_pair(TRAINED_PAIR)


@pytest.fixture(scope="module")
def llama_sessions(trained_pair):
    runtime = open_runtime("llama-cpp", PRECISE)
    sessions = tuple(runtime.load(trained_pair.path(role, "gguf")) for role in ("target", "drafter"))
    yield sessions
    for session in sessions:
        session.close()


@pytest.fixture(scope="module")
def results(llama_sessions):
    target, drafter = llama_sessions
    return [run_prompt(target, drafter, prompt, DraftRules(K), MAX_NEW) for prompt in PROMPTS]


def test_prompt_set_has_both_categories():
    counts = {c: sum(p.category == c for p in PROMPTS) for c in ("code", "prose")}
    assert counts["code"] >= 10 and counts["prose"] >= 10 and sum(counts.values()) == len(PROMPTS)


def test_speculative_output_is_lossless(results):
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert [r.prompt_id for r in results if not r.lossless] == []
    # Trained text depends on its prompt and draws on much of the vocabulary (232 distinct
    # tokens in 1,536 when measured), though tiny models fall into loops.
    assert len({r.output_ids for r in results}) == len(results)
    assert len(set().union(*(r.output_ids for r in results))) > 150


def test_code_is_accepted_more_often_than_prose(results):
    code, prose = (Summary.of([r for r in results if r.category == c]) for c in ("code", "prose"))
    assert 1.0 < prose.tau < code.tau < K + 1
    assert code.tau - prose.tau >= MEASURED_GAP - GAP_SLACK
    assert code.alpha > prose.alpha


def test_transformers_runs_the_same_weights(trained_pair, llama_sessions):
    """F32 weights both sides and llama.cpp's precise settings: its F16 cache and CPU flash
    attention alone move logits by more than a converter bug could hide behind."""
    hf = open_runtime("transformers", PRECISE)
    picked = [next(p for p in PROMPTS if p.category == c) for c in ("code", "prose")]
    for theirs, role in zip(llama_sessions, ("target", "drafter")):
        ours = hf.load(trained_pair.path(role, "hf"))
        for prompt in picked:
            ids = ours.tokenize(prompt.text)
            assert ids == theirs.tokenize(prompt.text)
            ours.truncate(0)
            theirs.truncate(0)
            ours_logits, theirs_logits = ours.eval(ids, Rows.ALL), theirs.eval(ids, Rows.ALL).copy()
            assert np.abs(ours_logits - theirs_logits).max() < 1e-4
            assert (ours_logits.argmax(-1) == theirs_logits.argmax(-1)).all()


def test_training_steps_are_deterministic():
    """Two short runs from one seed give identical weights, another seed other ones; the
    distilled objective too."""
    shape = LlamaShape("drafter", 32, 1, 2, 1, 64)
    stream = np.random.default_rng(0).integers(2, 64, 4000)
    data = {"train": stream, "code": stream[:200], "prose": stream[200:400]}
    settings = tinytrain.TrainSettings(steps=3, batch=2, context=32, lr=3e-3, warmup=2, seed=7,
                                       distilled=False)

    def weights(settings, teacher=None):
        model, metrics = tinytrain.train(shape, 64, data, settings, log=lambda line: None,
                                         teacher=teacher)
        return model, tinytrain.weights_of(model), metrics

    teacher, first, metrics = weights(settings)
    _, again, _ = weights(settings)
    _, other, _ = weights(dataclasses.replace(settings, seed=8))
    assert first.keys() == again.keys() and all(np.array_equal(first[n], again[n]) for n in first)
    assert not np.array_equal(first["lm_head.weight"], other["lm_head.weight"])
    assert set(metrics) == {"train", "code", "prose"}

    distilled = dataclasses.replace(settings, distilled=True)
    _, student, metrics = weights(distilled, teacher)
    _, student_again, _ = weights(distilled, teacher)
    assert all(np.array_equal(student[n], student_again[n]) for n in student)
    assert 0.0 <= metrics["code agreement"] <= 1.0
