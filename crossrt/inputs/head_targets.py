"""Which targets a runtime can feed a drafter head from (spec types eagle3, dflash): one place for
the facts, checked before anything loads (docs/drafter-heads.md).

A head reads the target's inputs to three layers. llama.cpp's graphs expose them only where the
model file sets `t_layer_inp` (llama, the qwen3 family, gemma4, gpt-oss, ...): its qwen2 and
gemma3 graphs abort with GGML_ASSERT(t_layer_inp[il] != nullptr) at the vendored commit. vLLM
needs the target's model class to implement SupportsEagle3 (llama and qwen2 do, gemma3 does not:
a RuntimeError from its model runner).
"""

from __future__ import annotations

from typing import Optional

from crossrt.errors import SettingsError

LLAMA_CPP_ASSERT = "llama.cpp's {arch} graph does not expose its layer inputs at the vendored commit " \
                   "(GGML_ASSERT t_layer_inp[il] != nullptr)"
UNFEEDABLE = {
    "llama.cpp": {"gemma3": LLAMA_CPP_ASSERT.format(arch="gemma3"), "gemma3_text": LLAMA_CPP_ASSERT.format(arch="gemma3"),
                  "qwen2": LLAMA_CPP_ASSERT.format(arch="qwen2")},
    "vLLM": {"gemma3": "vLLM's Gemma 3 does not implement SupportsEagle3",
             "gemma3_text": "vLLM's Gemma 3 does not implement SupportsEagle3"},
}

HEAD_NAMES = {"eagle3": "EAGLE3", "dflash": "DFlash"}  # a head spec type as people write it


def why_unfeedable(architecture: str, runtime: str) -> Optional[str]:
    """Why runtime ("llama.cpp", "vLLM") cannot feed a head from a target of architecture; None if it can."""
    return UNFEEDABLE[runtime].get(architecture)


def refuse_unfeedable(architecture: str, runtime: str, spec_type: str, where: str) -> None:
    reason = why_unfeedable(architecture, runtime)
    if reason is not None:
        head = HEAD_NAMES.get(spec_type.lower(), spec_type)
        article = "an" if head[:1].upper() in "AEIOU" else "a"
        raise SettingsError(f"{where}: a {architecture} target cannot feed {article} {head} head on {runtime}: "
                            f"{reason}")
