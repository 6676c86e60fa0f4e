"""How closely two runs' logits must agree, by what is compared.

One fixed logit tolerance cannot serve every comparison: F32 weights with an F32 KV cache agree
to ~1e-5 across llama.cpp and transformers, an F16 KV cache (llama.cpp's default) moves logits
by ~1e-3, and a quantized GGUF differs by whole logits between llama.cpp (which also quantizes
activations for its quantized matmuls) and transformers (which dequantizes the weights to F32),
and weights loaded in half precision (transformers' --dtype bfloat16/float16, the record's
runtime.dtype) round every weight to 8 or 11 significant bits, which moves logits by tenths.
So the class of the comparison picks the test, as llama.cpp's own tools do: a max absolute
difference for float weights, and for quantized weights the KL-divergence statistics
`llama-perplexity --kl-divergence` prints. Each bound is a few times what was measured
(docs/parity.md, docs/real-models.md); `--logit-tolerance` overrides the max difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from crossrt.errors import CrossrtError
from crossrt.compare.rescore import LogitAgreement, scoring_runtime
from crossrt.records.schema import RunRecord

F32_TYPES = ("F32", "float32", "torch.float32")
FLOAT_TYPES = F32_TYPES + ("F16", "BF16", "float16", "bfloat16", "torch.float16", "torch.bfloat16")
HALF_DTYPES = ("bfloat16", "float16")  # RunRecord.runtime.dtype of a run in half precision


@dataclass(frozen=True)
class Tolerance:
    """Bounds a LogitAgreement must meet; None: not checked."""

    reason: str
    max_abs_diff: Optional[float] = None
    kl_mean: Optional[float] = None
    kl_p99: Optional[float] = None
    top1: Optional[float] = None  # least share of positions with the same argmax, near-ties counted as the same
    near_tie_flip: float = 1e-3  # a divergence whose recorded flip is within this is numerics

    def problems(self, measured: LogitAgreement) -> list[str]:
        if measured.positions == 0:  # bounds met by no row at all would pass a check of nothing
            return ["nothing compared: no output rows scored by both"]
        found = []
        if self.max_abs_diff is not None and measured.max_abs_diff > self.max_abs_diff:
            found.append(f"max abs logit diff {measured.max_abs_diff:.3g} > {self.max_abs_diff:g}")
        if self.kl_mean is not None and measured.kl_mean > self.kl_mean:
            found.append(f"mean KL divergence {measured.kl_mean:.3g} > {self.kl_mean:g}")
        if self.kl_p99 is not None and measured.kl_p99 > self.kl_p99:
            found.append(f"p99 KL divergence {measured.kl_p99:.3g} > {self.kl_p99:g}")
        if self.top1 is not None and measured.top1_beyond_near_ties(self.near_tie_flip) < self.top1:
            found.append(f"same top-1 {measured.top1_beyond_near_ties(self.near_tie_flip):.3f} < {self.top1:g} "
                         f"(differing argmaxes within the near-tie flip {self.near_tie_flip:g} counted as the same)")
        return found

    def describe(self) -> str:
        bounds = [f"{name} {'>=' if name == 'same top-1' else '<='} {value:g}" for name, value in (
            ("max abs diff", self.max_abs_diff), ("mean KL", self.kl_mean), ("p99 KL", self.kl_p99),
            ("same top-1", self.top1)) if value is not None]
        return f"{', '.join(bounds)} ({self.reason})"


# Measured: tiny pair F32, F32 KV, flash attention off: max 1.9e-5 (docs/parity.md).
F32_EXACT = Tolerance("F32 weights, F32 KV cache, flash attention off", max_abs_diff=1e-4, near_tie_flip=1e-3)
# Measured: tiny pair F32 weights with llama.cpp's default F16 KV cache and flash attention: 3.5e-3.
F16_CACHE = Tolerance("float weights with an F16 KV cache or flash attention", max_abs_diff=1e-2,
                      near_tie_flip=5e-2)
# Measured on Gemma 3 270M Q4_K_M, llama.cpp against transformers' dequantized weights, 3 prompts
# x 16 tokens (docs/real-models.md): max abs diff 2.2, mean KL 5.1e-3, p99 KL 1.9e-2, same top-1
# 1.000; top-2 gap shifts p90 0.26, max 2.3. The two compute different functions (llama.cpp
# quantizes activations to 8 bits for its quantized matmuls): a split of their baselines was seen
# at a flip of 1.41 (docs/parity.md), so near-ties up to 3 logits are numerics here.
QUANTIZED = Tolerance("quantized weights: llama.cpp quantizes activations too, transformers dequantizes",
                      kl_mean=0.05, kl_p99=0.5, top1=0.9, near_tie_flip=3.0)
# One runtime computing in float32 from dequantized weights (transformers on a GGUF): one pass and
# one-token decodes differ by 1e-4 at most on Gemma 3 270M (docs/parity.md).
FLOAT_ONE_RUNTIME = Tolerance("float32 arithmetic in one runtime (dequantized weights)", max_abs_diff=1e-2,
                              near_tie_flip=1e-2)
# Quantized weights inside llama.cpp (in-process, llama-server, llama-speculative-simple: one
# commit, the same quantized kernels): only batch shapes and cache rounding differ. Flips seen on
# Gemma 3 270M Q4_K_M with the F16 cache: 0.07 to 0.31 (docs/real-models.md).
QUANTIZED_ONE_RUNTIME = Tolerance("quantized weights, the same llama.cpp kernels", kl_mean=0.05, kl_p99=0.5,
                                  top1=0.9, near_tie_flip=1.0)
# Measured: tiny pair, llama.cpp F32 against transformers in bfloat16 (docs/real-models.md,
# 13 prompts x 32 tokens along llama.cpp's greedy output): max abs diff 0.279 (its logits are
# large: the bound follows their scale), mean KL 5.9e-8 (worst prompt), p99 KL 8.6e-7, same top-1
# 1.000, top-2 gap shifts p99 0.26, max 0.38; float16 is ~8x closer (max abs diff 0.037).
HALF_WEIGHTS = Tolerance("float weights, one run's in half precision (bfloat16/float16)", max_abs_diff=1.0,
                         kl_mean=5e-7, kl_p99=1e-5, top1=0.99, near_tie_flip=1.0)
# Measured on Gemma 3 270M Q4_K_M, llama.cpp against transformers' bfloat16 dequantization
# (docs/real-models.md, 13 prompts x 32 tokens): mean KL 8.8e-3 (worst prompt), p99 KL 0.10, same
# top-1 0.938 (worst prompt), top-2 gap shifts p99 0.79, max 1.11, and a split of the two
# baselines at a flip of 1.52 logits: rounding the weights to bfloat16 adds little to the
# quantization's noise (float32: 8.7e-3, 0.13, 0.938, 0.79, 1.25), so QUANTIZED's bounds hold.
QUANTIZED_HALF = Tolerance("quantized weights, dequantized to half precision in one run",
                           kl_mean=0.05, kl_p99=0.5, top1=0.9, near_tie_flip=3.0)


def _same_kernels(a: RunRecord, b: RunRecord) -> bool:
    """Both runs computed on one runtime's kernels (llama.cpp's tools score in-process)."""
    try:
        return scoring_runtime(a.runtime) == scoring_runtime(b.runtime)
    except CrossrtError:  # a runtime that names no scorer: not known to share kernels
        return False


def _exact_numerics(record: RunRecord) -> bool:
    return record.runtime.kv_cache == "f32" and record.runtime.flash_attn is not True


def _dequantizes(record: RunRecord) -> bool:
    """The record's runtime computes in float, whatever file it loaded: its scorer does not run
    GGUFs as such (transformers dequantizes them), or the target is a float file."""
    from crossrt.run.runtime import runtime_class

    try:
        formats = runtime_class(scoring_runtime(record.runtime)).model_format
    except CrossrtError:
        return False
    return (formats if isinstance(formats, str) else formats[0]) != "gguf"


def batch_shape_ceiling(record: RunRecord) -> Tolerance:
    """The most a split of one run from its own baseline may flip and be batch-shape numerics,
    by the arithmetic the run did: a runtime that dequantizes computes in its dtype (float32:
    rounding of 1e-5 on these logits), whatever file it loaded; llama.cpp on a quantized GGUF
    runs its quantized kernels. A ceiling only: the measured noise sets the threshold below it
    (crossrt/compare/verification.py)."""
    if record.pair.target.quantization in FLOAT_TYPES or not _dequantizes(record):
        return tolerance_for(record, record)
    return HALF_WEIGHTS if record.runtime.dtype in HALF_DTYPES else FLOAT_ONE_RUNTIME


def tolerance_for(a: RunRecord, b: RunRecord, override: Optional[float] = None) -> Tolerance:
    """The tolerance for comparing the logits of runs a and b (module docstring)."""
    if override is not None:
        return Tolerance("--logit-tolerance", max_abs_diff=override, near_tie_flip=max(override, 1e-3))
    half = any(r.runtime.dtype in HALF_DTYPES for r in (a, b))
    if any(r.pair.target.quantization not in FLOAT_TYPES for r in (a, b)):
        if half:
            return QUANTIZED_HALF
        return QUANTIZED_ONE_RUNTIME if _same_kernels(a, b) else QUANTIZED
    if half:
        return HALF_WEIGHTS
    if all(_exact_numerics(r) and r.pair.target.quantization in F32_TYPES for r in (a, b)):
        return F32_EXACT
    return F16_CACHE
