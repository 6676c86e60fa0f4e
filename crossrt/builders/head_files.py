"""A drafter head's files, in the formats the runtimes read (docs/drafter-heads.md).

- speculators' format (vLLM's `speculative_config={"method": "eagle3", "model": FOLDER}`):
  config.json with `speculators_model_type`, `transformer_layer_config` (every Llama key spelled
  out: vLLM has no defaults there), and the settings runtimes default differently written at the
  top level, where both vLLM and llama.cpp's converter read them; model.safetensors with d2t as
  offsets.
- GGUF (llama.cpp's `-md FILE --spec-type draft-eagle3`), through the vendored
  convert_hf_to_gguf.py with `--target-model-dir` (the target's config.json and tokenizer: the
  GGUF carries the target's vocabulary), in F32 so every runtime computes the same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from crossrt.builders.eagle3 import Eagle3Head, TargetShape
from crossrt.builders.head_settings import DFlashSettings, Eagle3Settings
from crossrt.errors import CrossrtError

VENDORED_TREE = (Path(__file__).resolve().parents[2] / ".cache" / "llama-tools" / "llama_cpp_python-0.3.36"
                 / "vendor" / "llama.cpp")
GGUF_NAME = "eagle3.gguf"
GGUF_NAMES = {"eagle3": GGUF_NAME, "dflash": "dflash.gguf"}


class HeadFilesError(CrossrtError, ValueError):
    """A head's files cannot be written, converted or read, said for the user."""


def speculators_config(shape: TargetShape, settings: Eagle3Settings, verifier: str = "target") -> dict:
    """verifier: the target's name, for the record (vLLM is given the target itself)."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        # vLLM takes a config for speculators' only with speculators_config and no model_type.
        "speculators_version": "0.3.0",
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 7,
                                                     "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": verifier}},
        "draft_vocab_size": settings.draft_vocab,
        "norm_before_residual": settings.norm_before_residual,
        "norm_before_fc": False,
        "target_hidden_size": shape.hidden,
        "eagle_aux_hidden_state_layer_ids": list(settings.layer_ids),
        "transformer_layer_config": {
            "model_type": "llama", "vocab_size": shape.vocab, "hidden_size": shape.hidden,
            "intermediate_size": shape.intermediate, "num_hidden_layers": 1,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "rms_norm_eps": shape.eps, "rope_theta": shape.rope_theta, "hidden_act": "silu",
            "max_position_embeddings": shape.max_positions, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False,
        },
    }


def write_speculators(head: Eagle3Head, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(speculators_config(head.shape, head.settings), indent=1) + "\n")
    save_file(head.speculators_tensors(), str(folder / "model.safetensors"))


def zlab_config(shape: TargetShape, settings: DFlashSettings) -> dict:
    """z-lab's DFlashDraftModel config: dflash_config's mask token and target layers have no
    defaults in llama.cpp's converter; the draft's width is the target's (llama.cpp requires it)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": settings.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "hidden_act": "silu", "rms_norm_eps": shape.eps, "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.max_positions, "vocab_size": shape.vocab, "tie_word_embeddings": False,
        "attention_bias": False, "num_target_layers": shape.layers, "block_size": settings.block_size,
        "dflash_config": {"mask_token_id": settings.mask_token_id, "target_layer_ids": list(settings.layer_ids),
                          "block_size": settings.block_size},
        "torch_dtype": "float32",
    }


def write_zlab(drafter, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(zlab_config(drafter.shape, drafter.settings), indent=1) + "\n")
    save_file(drafter.zlab_tensors(), str(folder / "model.safetensors"))


def read_speculators(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A head folder's config and tensors; HeadFilesError names what is missing."""
    try:
        config = json.loads((folder / "config.json").read_text())
        tensors = load_file(str(folder / "model.safetensors"))
    except (OSError, ValueError) as error:
        raise HeadFilesError(f"{folder}: not a readable EAGLE3 head folder: {error}") from None
    if config.get("speculators_model_type") != "eagle3":
        raise HeadFilesError(f"{folder}/config.json: speculators_model_type is "
                             f"{config.get('speculators_model_type')!r}, not 'eagle3'")
    return config, tensors


def settings_of(config: dict) -> Eagle3Settings:
    """The settings a head folder states: norm_before_residual absent is refused, not defaulted,
    since vLLM and llama.cpp default it differently."""
    if "norm_before_residual" not in config:
        raise HeadFilesError("the head's config.json does not state norm_before_residual, which vLLM defaults "
                             "to true and llama.cpp to false: write it explicitly")
    return Eagle3Settings(tuple(config["eagle_aux_hidden_state_layer_ids"]), bool(config["norm_before_residual"]),
                          int(config["draft_vocab_size"]))


def _named_target(target_folder: Path, work: Path) -> Path:
    """target_folder as the converter reads it: DFlash picks the vocabulary's handler by the
    target's `architectures`, which transformers' conversion of a GGUF does not write; its other
    files are linked, not copied."""
    config = json.loads((target_folder / "config.json").read_text())
    if config.get("architectures"):
        return target_folder
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.get("model_type"), "LlamaForCausalLM")]
    for item in target_folder.iterdir():
        if item.name != "config.json":
            (work / item.name).symlink_to(item)
    (work / "config.json").write_text(json.dumps(config))
    return work


def convert_to_gguf(folder: Path, target_folder: Path, output: Path) -> None:
    """folder's head as GGUF at output, by the vendored converter (it imports sentencepiece even
    for BPE vocabularies: the hf extra installs it)."""
    converter = VENDORED_TREE / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise HeadFilesError(f"llama.cpp's converter is missing at {converter}: run scripts/setup")
    with tempfile.TemporaryDirectory(prefix="crossrt-target-") as work:
        done = subprocess.run([sys.executable, str(converter), str(folder), "--target-model-dir",
                               str(_named_target(target_folder, Path(work))), "--outfile", str(output),
                               "--outtype", "f32"], capture_output=True, text=True)
    if done.returncode != 0 or not output.is_file():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise HeadFilesError(f"llama.cpp's converter could not write {output.name} from {folder}: {tail}")
