"""vLLM's drafter heads (spec types eagle3, dflash): the speculative_config and notes of a run
whose pair drafts with a head, read from vllm 0.32.0, and what is refused before any engine starts.

- eagle3: method "eagle3", the head's speculators folder (config.json + model.safetensors).
- dflash: method "dflash", z-lab's DFlashDraftModel folder (config.json with dflash_config's
  mask_token_id and target_layer_ids, model.safetensors without embeddings or LM head, which
  vLLM shares from the target). vLLM builds DFlashQwen3ForCausalLM (model_executor/models/
  qwen3_dflash.py) and reads the target's layer outputs target_layer_ids + 1 (as llama.cpp's
  GGUF ids), through the SupportsEagle3 capture of the target's model class. It ignores the
  drafter's block_size: a draft is one pass over k + 1 queries (the newest token, then k mask
  tokens; v1/spec_decode/dflash.py, set_inputs_first_pass), non-causal.
- vLLM's CPU build normalizes the context keys of every DFlash layer with layer 0's k_norm:
  DFlashQwen3Model._normalize_context_k passes the layers' k_norm weights stacked
  ([layers, head_dim]) to ops.rms_norm, whose CPU kernel (csrc/cpu/layernorm.cpp, rms_norm_impl)
  reads hidden_size weights, row 0, for every row. Its drafts therefore differ from llama.cpp's
  (unless the layers' k_norm weights are equal), and its counts are compared to nothing.
"""

from __future__ import annotations

from pathlib import Path

from crossrt.errors import ModelError, SettingsError
from crossrt.inputs.head_targets import HEAD_NAMES as NAMES, refuse_unfeedable

FOLDERS = {"eagle3": "the head's speculators folder", "dflash": "the drafter's z-lab DFlashDraftModel folder"}
DFLASH_NOTE = ("a draft is one non-causal pass over k + 1 queries (the newest token and k mask tokens; vLLM does "
               "not read the drafter's block_size); vLLM's CPU build normalizes every layer's context keys with "
               "layer 0's k_norm (DFlashQwen3Model._normalize_context_k: its rms_norm kernel reads one weight row), "
               "so its drafts differ from llama.cpp's and its counts are not compared")


def check_head(spec_type: str, target_config: dict, drafter: Path, drafter_config: dict, k: int) -> None:
    """Refuse a head vLLM cannot run as this run asks, before any engine starts."""
    name = NAMES[spec_type]
    refuse_unfeedable(target_config.get("model_type", ""), "vLLM", name, "runtime vllm")
    if spec_type == "eagle3":
        if "dflash_config" in drafter_config:
            raise SettingsError(f"{drafter} is a DFlash drafter (its config has dflash_config), not an EAGLE3 head: "
                                f"the pair's spec_type is 'dflash'")
        return
    dflash = drafter_config.get("dflash_config")
    if not isinstance(dflash, dict) or "mask_token_id" not in dflash or not dflash.get("target_layer_ids"):
        raise SettingsError(f"runtime vllm reads a DFlash drafter as z-lab's DFlashDraftModel folder, whose "
                            f"config.json states dflash_config's mask_token_id and target_layer_ids: not {drafter}")
    block = dflash.get("block_size", drafter_config.get("block_size"))
    if block is not None and k > int(block) - 1:
        raise SettingsError(f"vLLM drafts k tokens in one block of k + 1 and does not read the drafter's "
                            f"block_size {block}: k={k} would run blocks the drafter was not trained on; use "
                            f"--k {int(block) - 1} or less")
    layers = target_config.get("num_hidden_layers")
    if layers is not None and max(dflash["target_layer_ids"]) + 1 > int(layers):
        raise ModelError(f"{drafter}: dflash_config.target_layer_ids {dflash['target_layer_ids']} name layers "
                         f"the target's {layers} do not have")


def head_speculative(spec_type: str, drafter: Path, k: int) -> dict:
    """vLLM's speculative_config for the head in drafter, k tokens a draft."""
    return {"model": str(drafter), "num_speculative_tokens": k, "method": spec_type}


def head_note(spec_type: str, draft_model_note: str) -> str:
    """The speculative runs' note: the draft-model one, naming vLLM's method and what it reads."""
    note = draft_model_note.replace("draft_model speculative decoding", f"{NAMES[spec_type]} speculative "
                                    f"decoding (method {spec_type}, {FOLDERS[spec_type]})")
    return note + ("; " + DFLASH_NOTE if spec_type == "dflash" else "")
