"""vLLM's ngram method, natively and reproduced (docs/ngram.md, docs/vllm.md): VllmNgram proposes
what vLLM's own numba kernel proposes, and `crossrt run --runtime transformers --schedule vllm
--drafting vllm-ngram` equals `crossrt run --runtime vllm --mode native --drafting vllm-ngram` id
for id and count for count on the tiny-hd64 pair (vLLM's CPU attention refuses the committed
pair's head size), on prompts that repeat so that the lookup finds something."""

import json
import random
import subprocess

import pytest
from click.testing import CliRunner

from crossrt.backends import vllm_process
from crossrt.builders.tinypair import build_pair
from crossrt.cli import main
from crossrt.inputs.prompts import load_prompts
from crossrt.run.repeating import repeating, write_jsonl
from crossrt.records.record_json import load_record
from crossrt.speculative.lookup.vllm_ngram import VllmNgram, propose_tokens
from crossrt.run.runtime import RuntimeOptions, availability, open_runtime

needs_vllm = pytest.mark.skipif(availability("vllm") is not None, reason=str(availability("vllm")))
needs_transformers = pytest.mark.skipif(availability("transformers") is not None,
                                        reason=str(availability("transformers")))
K, MAX_NEW, NGRAM_MAX, NGRAM_MIN = 4, 23, 3, 1

# vLLM's kernel from its installed source, compiled by numba as vLLM compiles it, without
# importing vllm itself (torch and its config: seconds); cases on stdin, drafts on stdout.
VLLM_KERNEL = """
import ast, importlib.util, json, os, sys
import numpy as np
from numba import jit
path = os.path.join(os.path.dirname(importlib.util.find_spec("vllm").origin), "v1", "spec_decode",
                    "ngram_proposer.py")
name = "_find_longest_matched_ngram_and_propose_tokens"
source = ast.parse(open(path).read())
function = next(node for node in source.body if isinstance(node, ast.FunctionDef) and node.name == name)
space = {"np": np, "jit": jit}
exec(compile(ast.Module([function], []), path, "exec"), space)
json.dump([space[name](np.array(ids, dtype=np.int32), *rest).tolist() for ids, *rest in json.load(sys.stdin)],
          sys.stdout)
"""


def test_hand_cases_read_from_the_source():
    text = [5, 3, 7, 2, 3, 6, 1, 2, 3]
    assert propose_tokens(text, 1, 3, 100, 3) == [6, 1, 2]  # the longest suffix that recurs: [2, 3]
    assert propose_tokens(text, 3, 3, 100, 3) == []  # none of at least 3 recurs
    assert propose_tokens(text, 1, 1, 100, 3) == [7, 2, 3]  # [3]: its earliest occurrence, not its latest
    assert propose_tokens([4, 4], 1, 1, 100, 5) == [4]  # the copy ends where the text ends
    assert propose_tokens(text, 1, 3, len(text) + 1, 3) == [6]  # cut at max_model_len
    assert VllmNgram(3, 1).propose(text, 0).tokens == ()  # nothing scheduled: no lookup


@needs_vllm
def test_the_proposer_is_vllms_own_kernel_on_random_texts():
    """Texts over 4 tokens repeat often: overlapping matches, matches longer than
    prompt_lookup_max, ties between occurrences, drafts ending with the text or at max_model_len."""
    draws = random.Random(0)
    cases = []
    for _ in range(3000):
        ids = [draws.randrange(4) for _ in range(draws.randrange(1, 30))]
        ngram_min = draws.randrange(1, 5)
        max_model_len = draws.choice([len(ids) + draws.randrange(0, 4), 1_000_000])
        cases.append([ids, ngram_min, draws.randrange(ngram_min, 7), max_model_len, draws.randrange(1, 9)])
    theirs = json.loads(subprocess.run([str(vllm_process.PYTHON), "-c", VLLM_KERNEL], input=json.dumps(cases),
                                       capture_output=True, text=True, check=True, timeout=120).stdout)
    assert sum(1 for draft in theirs if draft) > 500  # the cases draft, not only refuse
    for case, draft in zip(cases, theirs, strict=True):
        assert propose_tokens(*case) == draft, case


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """tiny-hd64, prompts that repeat (a built-in prompt, the target's greedy continuation, the
    prompt again), and a context that the longest of them fills, prompt and budget: near its end
    vLLM cuts drafts at max_model_len and drafts zeros where the last pass came too close to it."""
    folder = tmp_path_factory.mktemp("tiny-hd64-ngram")
    build_pair(folder, preset="tiny-hd64")
    manifest = folder / "tiny-hd64.toml"
    manifest.write_text('name = "tiny-hd64"\n[target]\nhf = "target-hf"\ngguf = "target.f32.gguf"\n'
                        '[drafter]\nhf = "drafter-hf"\ngguf = "drafter.f32.gguf"\n')
    with open_runtime("llama-cpp", RuntimeOptions(threads=1, f32_kv_cache=True)).load(
            folder / "target.f32.gguf") as target:
        prompts = repeating(target, load_prompts("builtin")[::3], 24)
        longest = max(len(target.tokenize(prompt.text)) for prompt in prompts)
    write_jsonl(prompts, folder / "prompts.jsonl")
    return manifest, longest + MAX_NEW


def run(pair, out, *how):
    # k 4 at a budget of 23: last steps draft past the budget, which vLLM counts and then cuts.
    manifest, n_ctx = pair
    result = CliRunner().invoke(main, ["run", "--pair", str(manifest), *how, "--drafting", "vllm-ngram",
                                       "--ngram-max", str(NGRAM_MAX), "--ngram-min", str(NGRAM_MIN), "--k", str(K),
                                       "--max-new-tokens", str(MAX_NEW), "--n-ctx", str(n_ctx), "--threads", "1",
                                       "--prompts", str(manifest.parent / "prompts.jsonl"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return load_record(out)


@needs_vllm
@needs_transformers
def test_vllms_ngram_natively_and_reproduced_id_for_id_and_count_for_count(pair, tmp_path):
    native = run(pair, tmp_path / "native.json", "--runtime", "vllm", "--mode", "native")
    params = native.params
    assert (params.mode, params.schedule, params.spec_type, params.k) == ("native", "vllm", "ngram", K)
    assert (params.drafting, params.ngram_max, params.ngram_min) == ("vllm-ngram", NGRAM_MAX, NGRAM_MIN)
    assert native.pair.drafter.loaded == ()  # no drafter model loaded or read
    assert any(f"prompt_lookup_max {NGRAM_MAX}" in note and f"prompt_lookup_min {NGRAM_MIN}" in note
               for note in native.notes), native.notes
    for result in native.results:
        assert result.ok and result.lossless, result.error
        assert result.counters.identity_violations(K) == []
    # Lookups that find something: drafts made and accepted, and passes without a draft.
    assert sum(r.counters.accepted for r in native.results) > 0
    assert sum(r.counters.unverified for r in native.results) > len(native.results)

    driven = run(pair, tmp_path / "driven.json", "--runtime", "transformers", "--schedule", "vllm")
    assert (driven.params.drafting, driven.params.ngram_max, driven.params.ngram_min) == \
        ("vllm-ngram", NGRAM_MAX, NGRAM_MIN)
    for ours, theirs in zip(native.results, driven.results, strict=True):
        assert ours.prompt_ids == theirs.prompt_ids and ours.output_ids == theirs.output_ids, ours.prompt_id
        assert ours.counters == theirs.counters, ours.prompt_id  # per-step lists included

    parity = CliRunner().invoke(main, ["parity", str(tmp_path / "native.json"), str(tmp_path / "driven.json")])
    assert parity.exit_code == 0, parity.output
    assert "vllm/native vs transformers/driven" in parity.output and "counters compared" in parity.output
