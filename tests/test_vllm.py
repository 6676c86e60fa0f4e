"""The vllm runtime: vLLM's CPU build (scripts/setup_vllm, .venv-vllm) running its own
draft-model speculative decoding, its statistics read into crossrt's counters.

The real runs use the tiny pair's design at head size 64 (`tiny-hd64`, built here: vLLM's CPU
attention refuses the committed pair's 16), k = 4, two prompts of 16 tokens, one thread. They
are skipped, with the reason, where vLLM is not installed or this CPU cannot run it; what
needs no vLLM (refusals, the folder vLLM reads, the counting) runs everywhere.
"""

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.backends import vllm
from crossrt.builders.tinypair import build_pair
from crossrt.cli import main
from crossrt.backends.vllm_memory import check_engines, engine_needs
from crossrt.inputs.pairs import load_pair
from crossrt.run.memory import GIB, LIMIT_ENV, MemoryShort
from crossrt.errors import SettingsError
from crossrt.records.record_json import load_record
from crossrt.run.runtime import DraftRules, RuntimeFailure, RuntimeOptions, RuntimeUnavailable, availability

from conftest import REPO, assert_clean_error

needs_vllm = pytest.mark.skipif(availability("vllm") is not None, reason=str(availability("vllm")))
needs_transformers = pytest.mark.skipif(availability("transformers") is not None,
                                        reason=str(availability("transformers")))
K, MAX_NEW = 4, 16
PROMPTS = {"code": "def fibonacci(n):\n    if n < 2:", "prose": "The river runs through the old town"}


def test_runtimes_names_the_fix_when_vllm_is_not_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm, "STAMP", tmp_path / ".venv-vllm" / "missing-stamp")
    reason = availability("vllm")
    assert reason is not None and "scripts/setup_vllm" in reason and vllm.VERSION in reason
    result = CliRunner().invoke(main, ["runtimes"])
    assert result.exit_code == 0
    assert any(line.split()[:2] == ["vllm", "no"] and "scripts/setup_vllm" in line
               for line in result.output.splitlines()), result.output
    assert "vllm" not in CliRunner().invoke(main, ["runtimes", "--usable"]).output.split()


def test_the_tiny_pairs_head_size_is_refused_before_vllm_starts(tmp_path):
    tiny = REPO / "models" / "tiny"
    runtime = vllm.VllmRuntime(RuntimeOptions(threads=1))
    with pytest.raises(RuntimeUnavailable, match="head size 16"):
        runtime.open_native(tiny / "target-hf", tiny / "drafter-hf", DraftRules(K), tmp_path)
    assert not list(tmp_path.iterdir())  # no worker was started: no log was written


def test_run_on_the_tiny_pair_is_one_line_naming_why(tmp_path):
    result = CliRunner().invoke(main, ["run", "--pair", "tiny", "--runtime", "vllm", "--mode", "native",
                                       "--max-new-tokens", "4", "--out", str(tmp_path / "tiny.json")])
    # Where vLLM is installed, the head size; where not, the fix.
    assert_clean_error(result, "head size 16" if availability("vllm") is None else "scripts/setup_vllm")


def test_gpu_options_and_other_dtypes_are_refused():
    with pytest.raises(RuntimeUnavailable, match="CPU build"):
        vllm.VllmRuntime(RuntimeOptions(n_gpu_layers=99))
    with pytest.raises(SettingsError, match="float32"):
        vllm.VllmRuntime(RuntimeOptions(dtype="int8"))


def test_drafting_rules_vllm_lacks_are_refused(tmp_path):
    tiny = REPO / "models" / "tiny"
    runtime = vllm.VllmRuntime(RuntimeOptions(threads=1))
    with pytest.raises(SettingsError, match="no n_min or p_min"):
        runtime.open_native(tiny / "target-hf", tiny / "drafter-hf", DraftRules(K, n_min=1), tmp_path)


@needs_transformers
def test_a_folder_without_architectures_is_given_the_causal_lm_class(monkeypatch, tmp_path):
    """What a GGUF conversion by transformers looks like (no `architectures`): vLLM would take
    it for a pooling model. The folder vLLM reads names the class and links the rest."""
    monkeypatch.setenv("CROSSRT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "converted"
    shutil.copytree(REPO / "models" / "tiny" / "target-hf", folder)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    out = vllm.vllm_folder(folder)
    assert out != folder and json.loads((out / "config.json").read_text()) == {**config,
                                                                                 "architectures": ["LlamaForCausalLM"]}
    assert (out / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
    assert vllm.vllm_folder(folder) == out  # made once
    assert vllm.vllm_folder(REPO / "models" / "tiny" / "target-hf") == REPO / "models" / "tiny" / "target-hf"


def reply(per_step_accepted, output_len, k=K, per_pos=None, engine_accepted=None, plain=0):
    """A worker's reply as vLLM 0.32.0 gives it, for a run of output_len tokens with plain
    decodes (passes without draft tokens) besides the steps."""
    accepted = sum(per_step_accepted)
    per_pos = per_pos if per_pos is not None else [sum(1 for a in per_step_accepted if a > i) for i in range(k)]
    return {"output_ids": list(range(output_len)), "finish_reason": "length", "prefill_s": 0.1, "decode_s": 0.2,
            "request": {"per_step_accepted": list(per_step_accepted), "per_step_drafted": [k] * len(per_step_accepted),
                        "num_draft_tokens": k * len(per_step_accepted), "histogram": []},
            "totals": {"vllm:spec_decode_num_drafts": len(per_step_accepted),
                       "vllm:spec_decode_num_draft_tokens": k * len(per_step_accepted),
                       "vllm:spec_decode_num_accepted_tokens": accepted if engine_accepted is None else engine_accepted,
                       "vllm:spec_decode_num_accepted_tokens_per_pos": per_pos,
                       "vllm:inter_token_latency_seconds": len(per_step_accepted) + plain}}


def test_counting_first_token_from_prefill_and_the_tokens_cut_at_the_budget():
    # 1 token from the prefill, then steps of 3, 5 and 2 (accepted + 1): 11 made, 9 kept.
    counters = vllm.translate(reply([2, 4, 1], 9), K, tuple(range(9)))
    assert (counters.steps, counters.drafted, counters.accepted, counters.emitted) == (3, 12, 7, 9)
    assert (counters.unverified, counters.cut) == (1, 2)
    assert counters.accepted_per_pos == (3, 2, 1, 1)
    assert counters.tau == 1 + 7 / 3  # vLLM's mean acceptance length: bonus in, prefill token out
    # The ngram method's empty drafts are plain decodes: passes that are no steps, unverified.
    counters = vllm.translate(reply([2, 4, 1], 11, plain=2), K, tuple(range(11)))
    assert (counters.steps, counters.unverified, counters.cut, counters.emitted) == (3, 3, 2, 11)


def test_counts_that_disagree_stop_the_run():
    with pytest.raises(RuntimeFailure, match="engine counters"):
        vllm.translate(reply([2, 4, 1], 9, engine_accepted=6), K, tuple(range(9)))
    with pytest.raises(RuntimeFailure, match="per position"):
        vllm.translate(reply([2, 4, 1], 9, per_pos=[3, 3, 1, 0]), K, tuple(range(9)))
    with pytest.raises(RuntimeFailure, match="tokens cut"):  # more cut than one step can give
        vllm.translate(reply([4, 4, 4], 9), K, tuple(range(9)))
    with pytest.raises(RuntimeFailure, match="fewer than the 3 steps"):
        vllm.translate(reply([2, 4, 1], 9, plain=-1), K, tuple(range(9)))


@pytest.fixture(scope="module")
def hd64_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-hd64")
    build_pair(folder, preset="tiny-hd64")
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"id": name, "category": name, "prompt": text}) + "\n"
                                                  for name, text in PROMPTS.items()))
    manifest = folder / "tiny-hd64.toml"
    manifest.write_text('name = "tiny-hd64"\n[target]\nhf = "target-hf"\ngguf = "target.f32.gguf"\n'
                        '[drafter]\nhf = "drafter-hf"\ngguf = "drafter.f32.gguf"\n[defaults]\nk = 4\n')
    return manifest


def run(pair: Path, runtime: str, mode: str, out: Path, *more: str):
    result = CliRunner().invoke(main, ["run", "--pair", str(pair), "--runtime", runtime, "--mode", mode,
                                       "--k", str(K), "--max-new-tokens", str(MAX_NEW), "--threads", "1",
                                       "--prompts", str(pair.parent / "prompts.jsonl"), "--out", str(out), *more])
    assert result.exit_code == 0, result.output
    return load_record(out)


@pytest.fixture(scope="module")
def vllm_run(hd64_pair, tmp_path_factory):
    """(the record's path, the record) of one vLLM run on the tiny-hd64 pair."""
    out = tmp_path_factory.mktemp("runs") / "vllm.json"
    return out, run(hd64_pair, "vllm", "native", out)


def assert_vllm_counts(result, k):
    counters = result.counters
    assert counters.identity_violations(k) == []
    assert counters.emitted == len(result.output_ids) and counters.unverified == 1
    assert counters.step_drafted == (k,) * counters.steps  # vLLM drafts k every step
    assert 0 <= counters.cut <= k


@needs_vllm
def test_vllm_native_writes_per_prompt_counters_and_ids(vllm_run):
    _, record = vllm_run
    assert record.runtime.name == "vllm" and record.runtime.version == vllm.VERSION
    assert "torch" in record.runtime.build and "vLLM kernels" in record.runtime.system_info
    assert record.params.schedule == "vllm" and record.params.mode == "native"
    assert [r.prompt_id for r in record.results] == list(PROMPTS)
    for result in record.results:
        assert result.ok and result.lossless, result.error
        assert_vllm_counts(result, K)
        assert result.timings.prefill_s > 0 and result.timings.decode_s > 0


@needs_vllm
@needs_transformers
def test_vllm_counts_step_for_step_as_its_schedule_simulated_from_vllms_source(vllm_run, hd64_pair):
    """crossrt/simulate/schedule_sims.py's `vllm` schedule, written from vLLM's source apart from this
    runtime, on an oracle of the same weights computed in transformers: every step's drafted
    and accepted counts must be the run's."""
    out, _ = vllm_run
    result = CliRunner().invoke(main, ["simulate", "--pair", str(hd64_pair), "--runtime", "transformers",
                                       "--prompts", str(hd64_pair.parent / "prompts.jsonl"),
                                       "--max-new-tokens", str(MAX_NEW), "--max-k", str(K), "--against", str(out)])
    assert result.exit_code == 0, result.output


@needs_vllm
@needs_transformers
def test_the_driven_vllm_schedule_on_transformers_is_vllms_run(vllm_run, hd64_pair, tmp_path):
    """Same F32 weights: the tiny design's margins are several logits, far above the numerics
    of two runtimes, so greedy outputs are equal token for token, and the driven loop's vllm
    schedule (crossrt/speculative/schedules.py) with the drafter model counts as vLLM does, step for step."""
    driven = run(hd64_pair, "transformers", "driven", tmp_path / "transformers.json", "--schedule", "vllm")
    assert driven.params.schedule == vllm_run[1].params.schedule == "vllm"
    for ours, theirs in zip(vllm_run[1].results, driven.results, strict=True):
        assert ours.prompt_ids == theirs.prompt_ids
        assert ours.baseline_ids == theirs.baseline_ids and ours.output_ids == theirs.output_ids
        assert ours.counters == theirs.counters


@needs_vllm
@pytest.mark.slow
def test_the_real_model_runs_natively_on_vllm(real_pair, tmp_path):
    """Gemma 3 270M (head size 256, sliding-window and full-attention layers) through crossrt's
    float32 conversion of its GGUFs: one prompt, 8 tokens, k = 7 (minutes: two engines load)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "fib", "category": "code", "prompt": "def fibonacci(n):"}) + "\n")
    out = tmp_path / "real.json"
    result = CliRunner().invoke(main, ["run", "--pair", "gemma3-270m", "--runtime", "vllm", "--mode", "native",
                                       "--k", "7", "--max-new-tokens", "8", "--threads", "1",
                                       "--prompts", str(prompts), "--out", str(out)])
    assert result.exit_code == 0, result.output
    (only,) = load_record(out).results
    assert only.ok and only.prompt_ids[0] == 2 and 1 <= len(only.output_ids) <= 8  # Gemma's BOS first
    assert_vllm_counts(only, 7)


def worker_children(drafter: bool) -> list[int]:
    """Live vLLM workers under this test process (its children, or its vLLM zygote's), with or
    without a drafter: the processes whose stderr is an engine's log."""
    parents, logs = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
            if fields[0] != "Z":
                logs[int(entry)] = os.path.basename(os.readlink(f"/proc/{entry}/fd/2"))
        except OSError:
            continue
    found = []
    for pid, log in logs.items():
        ancestor = parents[pid]
        while ancestor in parents and ancestor != os.getpid():
            ancestor = parents[ancestor]
        if ancestor == os.getpid() and log == ("vllm-speculative.log" if drafter else "vllm-baseline.log"):
            found.append(pid)
    return found


@needs_vllm
def test_a_worker_killed_while_loading_is_named_by_its_signal(hd64_pair, tmp_path):
    """A real vLLM worker killed by SIGKILL while it loads (the OOM killer's signal, sent from
    here): the failure names the engine and the signal, never an exit code, and the other
    engine's worker is stopped too."""
    pair = load_pair(hd64_pair)
    killed = []

    def kill_the_baseline_worker():
        deadline = time.monotonic() + 300
        while not killed and time.monotonic() < deadline:
            for pid in worker_children(drafter=False):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_baseline_worker)
    killer.start()
    try:
        with pytest.raises(RuntimeFailure, match=r"^vLLM's baseline engine was killed by SIGKILL while "
                                                 r"loading[^;]*; log "):
            vllm.VllmRuntime(RuntimeOptions(threads=1)).open_native(
                pair.path("target", "hf"), pair.path("drafter", "hf"), DraftRules(K), tmp_path)
    finally:
        killer.join()
    assert killed and worker_children(drafter=True) == [] and worker_children(drafter=False) == []


def test_engines_are_counted_and_each_suggestion_fits(hd64_pair, monkeypatch):
    """backends/vllm_memory.py, without vLLM: both engines fit or not against CROSSRT_MEMORY_LIMIT,
    one alone that does not fit is refused in one line, and what it suggests (a smaller KV
    reserve, bfloat16) fits."""
    pair = load_pair(hd64_pair)
    target, drafter = pair.path("target", "hf"), pair.path("drafter", "hf")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    options = RuntimeOptions(threads=1)
    needs, halved = engine_needs(target, drafter, options), engine_needs(target, drafter, options, "bfloat16")
    assert needs[1] > needs[0] > halved[0] and needs[0] > 3 * GIB
    monkeypatch.setenv(LIMIT_ENV, str(needs[0] - GIB // 2))
    with pytest.raises(MemoryShort, match=r"^not enough memory for vLLM's baseline engine in float32: .* short; "
                                          r"would fit: VLLM_CPU_KVCACHE_SPACE=2$"):
        check_engines(needs, [0], options, halved)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    check_engines(engine_needs(target, drafter, options), [0], options, halved)
    monkeypatch.setenv(LIMIT_ENV, str(sum(needs) - 1))
    check_engines(needs, [1], options, halved)
    with pytest.raises(MemoryShort, match="baseline engine and speculative engine"):
        check_engines(needs, [0, 1], options, halved)
