"""One vLLM engine, run with the Python of vLLM's own environment (.venv-vllm), answering
crossrt's vllm runtime (backends/vllm.py) one request at a time over a pipe.

    .venv-vllm/bin/python backends/vllm_worker.py CONFIG_JSON

vLLM pins a transformers that crossrt's environment cannot share, so this script imports
nothing of crossrt: it reads a JSON config (model folder, context, dtype, and vLLM's
speculative_config as crossrt wrote it, or null for the plain baseline), builds `vllm.LLM`, and
then answers JSON lines on stdin with JSON lines on the stdout it was started with; everything
vLLM prints goes to stderr, which the runtime keeps as a log.

    {"op": "tokenize", "text": ...}                  -> {"ids": [...]}
    {"op": "generate", "prompt_ids": [...], "max_new_tokens": N}
        -> {"output_ids", "finish_reason", "prefill_s", "decode_s", "request": {...} or null,
            "totals": {...}}

Each generate is one request on an otherwise idle engine, greedy, with the request's own
speculative statistics ("request": vLLM's per-request metrics at level "detailed": accepted
and drafted per verification step, in order) and the engine's counters before and after it
("totals": the deltas of vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens
and _num_accepted_tokens_per_pos), so the runtime can check one against the other, and the
request's target passes after its first token (the delta of vllm:inter_token_latency_seconds'
count: one observation per engine step that gave the request tokens, drafted or not).
"""

import gc
import json
import os
import sys
import time
import types

# Python puts this script's folder first on sys.path, and crossrt's backends/transformers.py
# beside it would then be imported as transformers.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != HERE]

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
DECODE_PASSES = "vllm:inter_token_latency_seconds"  # a histogram: its count


def engine_totals(llm) -> dict:
    """The engine's speculative counters since it started (all zero without a drafter)."""
    totals = {name: 0 for name in (*COUNTERS, DECODE_PASSES)}
    totals[PER_POS] = []
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            totals[metric.name] = int(metric.value)
        elif metric.name == PER_POS:
            totals[PER_POS] = [int(v) for v in metric.values]
        elif metric.name == DECODE_PASSES:
            totals[DECODE_PASSES] = int(metric.count)
    return totals


def deltas(before: dict, after: dict) -> dict:
    per_pos = [a - b for a, b in zip(after[PER_POS], before[PER_POS] or [0] * len(after[PER_POS]))]
    return {**{name: after[name] - before[name] for name in (*COUNTERS, DECODE_PASSES)}, PER_POS: per_pos}


def system_info() -> str:
    """What ran: torch's CPU capability, the vLLM kernel library its engine loads, the CPU's name."""
    import torch

    # The engine process picks its kernels as vllm/platforms/cpu.py (import_kernels) does.
    if not torch.cpu._is_avx512_supported():
        kernels = "vllm._C_AVX2"
    else:
        kernels = "vllm._C (AVX-512 BF16)" if torch.cpu._is_avx512_bf16_supported() else "vllm._C_AVX512"
    cpu = ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    except OSError:
        pass
    return (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}; vLLM kernels {kernels}; "
            f"CPU {cpu or 'unknown'}; {os.cpu_count()} logical CPUs")


def build(config: dict):
    import vllm.renderers.hf
    from vllm import LLM

    # This process renders nothing (token ids in, detokenize off) and tokenizes from one
    # thread, one request at a time, so two things vLLM's renderer does at start buy nothing,
    # and cost 9 of an engine's 27 CPU-s on Gemma 3 (a 262k-token vocabulary): deep-copying the
    # tokenizer into a thread-safe pool (renderer_num_workers + 1 copies, at least 2; the
    # renderer keeps the tokenizer itself, as vLLM does for one that is not a fast tokenizer),
    # and warming up chat rendering (loading the model's processor, a second tokenizer load).
    vllm.renderers.hf.maybe_make_thread_pool = lambda tokenizer, copies=1: tokenizer
    vllm.renderers.hf.HfRenderer.warmup = lambda self, chat_params: None
    # HfRenderer.__init__ copies the tokenizer only so that maybe_make_thread_pool's change in
    # place leaves vLLM's cached one alone ("Ensure the og tokenizer is never modified"), and
    # copying vLLM's cached tokenizer builds it again (its __reduce__ is get_cached_tokenizer:
    # the whole vocabulary read and scanned, 0.5 CPU-s on Gemma 3): with the pool gone, the copy
    # guards nothing. That __init__ is the module's only use of copy.
    vllm.renderers.hf.copy = types.SimpleNamespace(copy=lambda tokenizer: tokenizer)

    speculative = {}
    if config["speculative"] is not None:
        speculative = {"speculative_config": config["speculative"], "per_request_spec_decode_metrics": "detailed"}
    return LLM(model=config["model"], dtype=config["dtype"], max_model_len=config["n_ctx"], seed=0,
               # CUDA graphs and torch.compile do not apply on the CPU; eager skips their warm-up.
               enforce_eager=True,
               # The model runs in this process (with VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the
               # runtime): vLLM's default starts an engine-core process and a worker process,
               # each importing vLLM and torch again (~14 CPU-s apiece here), for one CPU worker.
               distributed_executor_backend="uni",
               # Every prompt prefills whole: a cached prefix from an earlier prompt would change
               # its prefill time, and crossrt compares runs prompt by prompt.
               enable_prefix_caching=False,
               # The drafter proposes for one KV cache group only: a drafter with sliding-window
               # and full-attention layers (Gemma 3) needs them in one group, as full attention
               # with the window kept in the attention itself.
               disable_hybrid_kv_cache_manager=True,
               disable_log_stats=False, **speculative)


def generate(llm, prompt_ids: list, max_new_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, detokenize=False)
    before = engine_totals(llm)
    result = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], params, use_tqdm=False)[0]
    after = engine_totals(llm)
    completion = result.outputs[0]
    stats = result.metrics  # engine-core timestamps (monotonic) of this request
    metrics = completion.spec_decode_metrics
    return {
        "output_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        # scheduled -> first token: the prefill step; first -> last token: the decode steps.
        "prefill_s": stats.first_token_ts - stats.scheduled_ts,
        "decode_s": stats.last_token_ts - stats.first_token_ts,
        "request": None if metrics is None else {
            "per_step_accepted": list(metrics.per_step_accepted),
            "per_step_drafted": list(metrics.per_step_drafted),
            "num_draft_tokens": metrics.num_draft_tokens,
            "histogram": list(metrics.histogram),
        },
        "totals": deltas(before, after),
    }


def main(config: dict) -> None:
    """config: the engine's (the module's docstring); run as a script, or in a child forked by
    backends/vllm_zygote.py, which has made these imports already."""
    # Replies go to the stdout this process was started with; vLLM's own printing, and that of
    # the engine processes it starts (which inherit fd 1), goes to the log on stderr.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    start = time.perf_counter()
    import torch
    import transformers
    import vllm
    import vllm.renderers.hf  # noqa: F401 - build's, imported here to be frozen with the rest

    # What the imports made (~5,000 modules' objects) lives as long as the process: frozen, the
    # full collections vLLM runs while it loads (7 on the tiny pairs) skip it: 2.6 of an engine's
    # 4 CPU-s of building on tiny-hd64 (a zygote's child inherits its zygote's frozen objects).
    gc.freeze()
    llm = build(config)
    tokenizer = llm.get_tokenizer()
    replies.write(json.dumps({"ready": True, "load_s": time.perf_counter() - start, "vllm": vllm.__version__,
                              "torch": torch.__version__, "transformers": transformers.__version__,
                              "system_info": system_info()}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "tokenize":
                reply = {"ids": list(tokenizer.encode(request["text"], add_special_tokens=True))}
            else:
                reply = generate(llm, request["prompt_ids"], request["max_new_tokens"])
        except Exception as error:  # noqa: BLE001 - any engine error goes back to crossrt, which stops the run
            reply = {"error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
