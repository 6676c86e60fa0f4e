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
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from crossrt.builders.eagle3 import Eagle3Head, TargetShape
from crossrt.builders.head_settings import Eagle3Settings
from crossrt.errors import CrossrtError

VENDORED_TREE = (Path(__file__).resolve().parents[2] / ".cache" / "llama-tools" / "llama_cpp_python-0.3.36"
                 / "vendor" / "llama.cpp")
GGUF_NAME = "eagle3.gguf"


class HeadFilesError(CrossrtError, ValueError):
    """A head's files cannot be written, converted or read, said for the user."""


def speculators_config(shape: TargetShape, settings: Eagle3Settings) -> dict:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
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


def convert_to_gguf(folder: Path, target_folder: Path, output: Path) -> None:
    """folder's head as GGUF at output, by the vendored converter (it imports sentencepiece even
    for BPE vocabularies: the hf extra installs it)."""
    converter = VENDORED_TREE / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise HeadFilesError(f"llama.cpp's converter is missing at {converter}: run scripts/setup")
    done = subprocess.run([sys.executable, str(converter), str(folder), "--target-model-dir", str(target_folder),
                           "--outfile", str(output), "--outtype", "f32"], capture_output=True, text=True)
    if done.returncode != 0 or not output.is_file():
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise HeadFilesError(f"llama.cpp's converter could not write {output.name} from {folder}: {tail}")
