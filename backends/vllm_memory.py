"""What vLLM's engines hold in memory, counted before any starts (backends/vllm.py plans them
with crossrt.run.memory.plan_processes: together, one after the other, or refused).

An engine is one process with torch and vLLM imported: crossrt's worker
(backends/vllm_worker.py), which runs vLLM's `LLM` front end, its engine core and its one CPU
worker in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor) and holds the tokenizer,
the weights (in the run's dtype: vLLM casts the float32 folders crossrt gives it) and the KV
cache vLLM reserves whole at start (VLLM_CPU_KVCACHE_SPACE GiB).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

from crossrt.errors import SettingsError
from crossrt.inputs.gguf_file import gguf_metadata
from crossrt.inputs.pairs import PairError
from crossrt.run.memory import GIB, MemoryShort, Uncounted, footprint, gib, ram
from crossrt.run.runtime import RuntimeOptions

KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE: the KV cache vLLM reserves, in GiB (default 4)
# Measured by scripts/measure_memory.py (docs/vllm.md, "Memory"), anonymous memory of each
# engine's process beyond the weights and the KV reserve: 0.44 GiB on the tiny-hd64 pair
# (vocabulary 512; torch and vLLM imported); on Gemma 3 270M (262,144 tokens, float32) the
# baseline engine held up to 4.93 GiB and the speculative engine 7.29 GiB, what grows with the
# vocabulary (logits, sampler and tokenizer buffers) about 10,200 bytes per token for the target
# and 5,700 more for the drafter. Rounded up, so a plan errs on the side of one at a time.
ENGINE_OVERHEAD = GIB // 2
VOCAB_BYTES = {"target": 10_500, "drafter": 6_000}  # per vocabulary entry
ENGINES = ("baseline engine", "speculative engine")  # in the order they run one after the other


def dtype_of(options: RuntimeOptions) -> str:
    """--dtype, else float32: vLLM casts the float32 folders crossrt gives it on load."""
    return options.dtype or "float32"


def kv_reserve() -> int:
    """Bytes of KV cache one engine reserves (VLLM_CPU_KVCACHE_SPACE, whole GiB)."""
    value = os.environ.get("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    try:
        return int(value) * GIB
    except ValueError:
        raise SettingsError(f"VLLM_CPU_KVCACHE_SPACE={value!r}: vLLM takes a whole number of GiB") from None


def vocab_size(path: Path) -> int:
    """The vocabulary of a transformers folder (its config) or a GGUF (its tokenizer's tokens)."""
    if Path(path).is_dir():
        config = json.loads((Path(path) / "config.json").read_text())
        return int((config.get("text_config") or config)["vocab_size"])
    try:
        return len(gguf_metadata(path)["tokenizer.ggml.tokens"])
    except (PairError, KeyError, TypeError) as error:
        raise Uncounted(f"{path}: {error}") from None


def engine_needs(target: Path, drafter: Optional[Path], options: RuntimeOptions,
                 dtype: Optional[str] = None) -> tuple[int, int]:
    """Bytes the baseline engine (the target) and the speculative engine (target and drafter;
    drafter None: the ngram method, the target alone) hold once loaded: weights in the run's
    dtype (a GGUF's counted as its conversion will be), buffers that grow with the vocabulary
    (VOCAB_BYTES), the KV reserve and the process's own (ENGINE_OVERHEAD)."""
    dtype = dtype or dtype_of(options)
    held = [footprint(path, dtype, "f32").weights + VOCAB_BYTES[role] * vocab_size(path) if path is not None else 0
            for role, path in (("target", target), ("drafter", drafter))]
    fixed = ENGINE_OVERHEAD + kv_reserve()
    return fixed + held[0], fixed + held[0] + held[1]


def check_engines(needs: Sequence[int], which: Sequence[int], options: RuntimeOptions,
                  halved: Sequence[int]) -> None:
    """MemoryShort when the engines which (indices of ENGINES) do not fit in RAM free now, with
    what would: --dtype bfloat16 (halved: the needs in it), a smaller VLLM_CPU_KVCACHE_SPACE."""
    free = ram()
    need = sum(needs[i] for i in which)
    if free is None or need <= free.free:
        return
    fits = []
    if dtype_of(options) == "float32" and sum(halved[i] for i in which) <= free.free:
        fits.append(f"--dtype bfloat16 ({gib(sum(halved[i] for i in which))})")
    reserve = kv_reserve() // GIB
    cut = -(-(need - free.free) // (len(which) * GIB))  # whole GiB less per engine, rounded up
    smaller = reserve - cut
    if 1 <= smaller < reserve:
        fits.append(f"VLLM_CPU_KVCACHE_SPACE={smaller}")
    advice = ("would fit: " + ", ".join(fits)) if fits else \
        "nothing smaller in dtype or KV reserve fits: a smaller model, or more memory"
    raise MemoryShort(
        f"not enough memory for vLLM's {' and '.join(ENGINES[i] for i in which)} in {dtype_of(options)}: "
        f"{gib(need)} (per engine {gib(kv_reserve())} KV reserve and {gib(ENGINE_OVERHEAD)} of its process; the "
        f"rest weights and buffers the size of the vocabulary) but {gib(free.free)} free ({free.source}), {gib(need - free.free)} short", advice)
