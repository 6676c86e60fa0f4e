"""Planted bugs: copies of a model with one bug of the kind runtime ports and conversions ship.

Parity is only worth its verdict if it fails a wrong model. Each Plant writes a copy of one
runtime's model (a transformers folder, or a GGUF file) with one realistic bug: a wrong
position-encoding base, a wrong attention scale, a normalization epsilon or activation that is
not the model's, one block's weights a few percent off, the KV cache's values off, the output
head scaled, BOS not added. The other runtime keeps the clean model, and `crossrt parity` must
fail (tests/test_planted.py, scripts/planted_bugs.py, docs/parity.md).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from crossrt.errors import CrossrtError
from crossrt.inputs.gguf_file import encode_field, read_layout


class PlantError(CrossrtError, ValueError):
    """A bug that cannot be planted in this model (no such setting or tensor)."""


@dataclass(frozen=True)
class Plant:
    """One kind of bug: what it models, where it lives, and how it is written into a copy.
    size: its strength (a factor's distance from 1, or a ratio), so a sweep can find the
    smallest size the check flags."""

    name: str
    area: str  # position encoding, attention, normalization, MLP, output head, KV cache, tokenization
    fmt: str  # "hf" (a transformers folder) or "gguf"
    describe: str
    default_size: float
    apply: Callable[[Path, Path, float], None]  # (source, output, size)

    def write(self, source: Path, output: Path, size: Optional[float] = None) -> Path:
        """The planted copy of source at output (a folder for "hf", a file for "gguf")."""
        self.apply(Path(source), Path(output), self.default_size if size is None else size)
        return Path(output)


# ---- transformers folders --------------------------------------------------------------------

WEIGHTS = "model.safetensors"
LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _copy_folder(source: Path, output: Path, config_edit=None, tensor_edit=None) -> None:
    """output: source's files, with config.json passed through config_edit and the weights through
    tensor_edit(name, tensor) -> tensor (only the weights file is rewritten when it changes)."""
    if not (source / "config.json").is_file() or not (source / WEIGHTS).is_file():
        raise PlantError(f"{source}: expected a transformers folder with config.json and {WEIGHTS}")
    output.mkdir(parents=True, exist_ok=False)
    for path in source.iterdir():
        if path.name not in ("config.json", WEIGHTS):
            shutil.copy2(path, output / path.name)
    config = json.loads((source / "config.json").read_text())
    if config_edit is not None:
        config_edit(config)
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tensor_edit is None:
        os.symlink((source / WEIGHTS).resolve(), output / WEIGHTS)
        return
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(source / WEIGHTS, "pt") as tensors:
        edited, changed = {}, 0
        for name in tensors.keys():
            tensor = tensors.get_tensor(name)
            new = tensor_edit(name, tensor)
            changed += new is not tensor
            edited[name] = new
        metadata = tensors.metadata()
    if not changed:
        raise PlantError(f"{source}: no tensor matched the plant")
    save_file(edited, output / WEIGHTS, metadata=metadata)


def _layers(config: dict) -> int:
    return int(config.get("num_hidden_layers") or config.get("text_config", {}).get("num_hidden_layers"))


def _middle_layer(source: Path) -> int:
    return _layers(json.loads((source / "config.json").read_text())) // 2


def _scale_tensors(pattern: str):
    """A tensor_edit maker: for a layer (None: every layer) and a size, multiplies by (1 + size)
    every tensor whose name matches pattern."""
    def for_layer(layer: Optional[int]):
        def for_size(size: float):
            def edit(name, tensor):
                match = LAYER.search(name)
                if re.search(pattern, name) and (layer is None or (match and int(match.group(1)) == layer)):
                    return tensor * (1.0 + size)
                return tensor
            return edit
        return for_size
    return for_layer


def _scale_config(key: str):
    """A config_edit multiplying every value of key, wherever it nests (rope_parameters per layer
    type), by size."""
    def make(size: float):
        def walk(node):
            found = 0
            if isinstance(node, dict):
                for name, value in node.items():
                    if name == key and isinstance(value, (int, float)) and not isinstance(value, bool):
                        node[name] = float(value) * size
                        found += 1
                    else:
                        found += walk(value)
            elif isinstance(node, list):
                found += sum(walk(item) for item in node)
            return found

        def edit(config):
            if not walk(config):
                raise PlantError(f"the model's config.json has no {key}")
        return edit
    return make


def _hf_plant(config_edit=None, tensor_edit=None, block: bool = False):
    def apply(source: Path, output: Path, size: float) -> None:
        tensors = tensor_edit
        if tensors is not None:
            layer = _middle_layer(source) if block else None
            tensors = tensors(layer)(size)
        _copy_folder(source, output, config_edit(size) if config_edit else None, tensors)
    return apply


def _activation(size: float):
    """size is unused: the exact (erf) GELU for the tanh approximation, or SiLU's neighbour GELU."""
    def edit(config):
        key = "hidden_activation" if "hidden_activation" in config else "hidden_act"
        config[key] = {"gelu_pytorch_tanh": "gelu", "silu": "gelu"}.get(config.get(key), "gelu_pytorch_tanh")
    return edit


def _attention_scale(source: Path, output: Path, size: float) -> None:
    """Scores times (1 + size): through query_pre_attn_scalar where the model has one (Gemma's
    query norm would undo a scaled query projection), else every query projection scaled."""
    config = json.loads((source / "config.json").read_text())
    if "query_pre_attn_scalar" in config:
        def edit(config):
            # An int in transformers' config: rounded, so the scale is within a percent of 1 + size.
            config["query_pre_attn_scalar"] = round(config["query_pre_attn_scalar"] / (1.0 + size) ** 2)
        _copy_folder(source, output, edit)
    else:
        _copy_folder(source, output, tensor_edit=_scale_tensors(r"q_proj\.weight$")(None)(size))


# ---- GGUF files ------------------------------------------------------------------------------

def _gguf_metadata_plant(suffix: str, transform: Callable[[object, float], object]):
    """A plant rewriting the GGUF metadata value whose key ends with suffix (the architecture's
    own key, e.g. gemma3.rope.freq_base); tensors are copied byte for byte."""
    def apply(source: Path, output: Path, size: float) -> None:
        with open(source, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            layout = read_layout(data)
            keys = [key for key in layout.fields if key.endswith(suffix)]
            if not keys:
                raise PlantError(f"{source} has no metadata key ending in {suffix}")
            with open(output, "xb") as out:
                start = 0
                for field in sorted(layout.fields.values(), key=lambda f: f.start):
                    out.write(data[start:field.start])
                    if field.key in keys:
                        out.write(encode_field(field, transform(field.value, size), layout.order))
                    else:
                        out.write(data[field.start:field.end])
                    start = field.end
                # Fields of the same type and size keep the tensor section where it was.
                out.write(data[start:])
    return apply


PLANTS = (
    Plant("rope-base", "position encoding", "hf", "every RoPE base (rope_theta) multiplied by size", 2.0,
          _hf_plant(config_edit=_scale_config("rope_theta"))),
    Plant("rope-base-gguf", "position encoding", "gguf", "the GGUF's rope.freq_base multiplied by size", 2.0,
          _gguf_metadata_plant(".rope.freq_base", lambda value, size: float(value) * size)),
    Plant("attention-scale", "attention", "hf", "attention scores scaled by 1 + size (a wrong 1/sqrt(d) or "
          "query_pre_attn_scalar)", 0.1, _attention_scale),
    Plant("norm-epsilon-gguf", "normalization", "gguf", "the GGUF's RMS-norm epsilon multiplied by size", 1000.0,
          _gguf_metadata_plant(".attention.layer_norm_rms_epsilon", lambda value, size: float(value) * size)),
    Plant("norm-weights", "normalization", "hf", "one block's input RMS-norm weights off by size", 0.05,
          _hf_plant(tensor_edit=_scale_tensors(r"input_layernorm\.weight$"), block=True)),
    Plant("mlp-weights", "MLP weights", "hf", "one block's MLP down projection off by size", 0.03,
          _hf_plant(tensor_edit=_scale_tensors(r"mlp\.down_proj\.weight$"), block=True)),
    Plant("block-weights", "MLP weights", "hf", "every weight of one block off by size", 0.03,
          _hf_plant(tensor_edit=_scale_tensors(r"\.weight$"), block=True)),
    Plant("activation", "MLP weights", "hf", "another activation function (exact GELU for the tanh "
          "approximation, GELU for SiLU)", 0.0, _hf_plant(config_edit=_activation)),
    Plant("kv-values", "KV cache", "hf", "the keys and values one block writes to its KV cache off by size "
          "(its k and v projections scaled)", 0.03,
          _hf_plant(tensor_edit=_scale_tensors(r"[kv]_proj\.weight$"), block=True)),
    Plant("output-head", "output head", "hf", "the final norm before the output head off by size", 0.03,
          _hf_plant(tensor_edit=_scale_tensors(r"(^|\.)norm\.weight$"))),
    Plant("no-bos-gguf", "tokenization", "gguf", "BOS not added to prompts (tokenizer.ggml.add_bos_token "
          "false)", 0.0, _gguf_metadata_plant("tokenizer.ggml.add_bos_token", lambda value, size: not value)),
)


def plant_named(name: str) -> Plant:
    for plant in PLANTS:
        if plant.name == name:
            return plant
    raise PlantError(f"no plant {name!r}; plants are {', '.join(p.name for p in PLANTS)}")


@dataclass(frozen=True)
class PairFiles:
    """A pair's files in both formats, as a manifest names them (gguf and hf per role)."""

    target_gguf: Path
    target_hf: Path
    drafter_gguf: Path
    drafter_hf: Path

    def manifest(self, folder: Path, name: str = "planted", k: int = 3) -> Path:
        """A pair manifest naming these files, written into folder."""
        path = Path(folder) / f"{name}.toml"
        path.write_text(f'name = "{name}"\n[target]\ngguf = "{Path(self.target_gguf).resolve()}"\n'
                        f'hf = "{Path(self.target_hf).resolve()}"\n[drafter]\n'
                        f'gguf = "{Path(self.drafter_gguf).resolve()}"\nhf = "{Path(self.drafter_hf).resolve()}"\n'
                        f'[defaults]\nk = {k}\n')
        return path

    def planted(self, plant: Plant, folder: Path, size: Optional[float] = None) -> "PairFiles":
        """These files with the target's copy in the plant's format replaced by a planted one
        written into folder: the other runtime keeps the clean model."""
        if plant.fmt == "hf":
            return dataclasses.replace(self, target_hf=plant.write(self.target_hf, Path(folder) / "target-planted",
                                                                   size))
        return dataclasses.replace(self, target_gguf=plant.write(self.target_gguf,
                                                                 Path(folder) / "target-planted.gguf", size))
