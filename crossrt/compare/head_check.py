"""Whether the runs that drafted with a head (spec types eagle3, dflash) read the same head.

One head is several files: llama.cpp reads its GGUF, vLLM and crossrt's loop its torch folder.
Each states the settings runtimes default differently (docs/drafter-heads.md): for EAGLE3 the
target layers it reads, norm_before_residual, norm_before_fc and its draft vocabulary (d2t:
offsets in the folder, absolute ids in the GGUF); for DFlash the target layers (z-lab's ids + 1
in the GGUF), the block size and the mask token. A setting that differs between what two runs read makes
their drafts differ for a reason no numerics explain, so it fails here, named, before any counts
are compared. Settings a file leaves unstated are read with the defaults of the runtime that read
it, since that is what it ran.
"""

from __future__ import annotations

import hashlib
import json
import mmap
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from crossrt.compare.verification import PathCheck
from crossrt.inputs.gguf_file import read_layout
from crossrt.records.schema import RunRecord
from crossrt.run.runtime import HEAD_SPEC_TYPES

HEAD_SETTINGS = "head settings"
# A folder's unstated norm_before_residual, by the runtime that read it: vLLM's speculators
# config defaults it to True, llama.cpp's converter and crossrt's head to False.
UNSTATED_NORM_BEFORE_RESIDUAL = {"vllm": True}


# A d2t tensor's GGML type -> its NumPy type (llama.cpp's converter writes I64).
GGUF_INTEGERS = {24: np.dtype(np.int8), 25: np.dtype(np.int16), 26: np.dtype(np.int32), 27: np.dtype(np.int64)}


def _d2t_digest(absolute: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(absolute, dtype=np.int64).tobytes()).hexdigest()[:16]


def gguf_head_settings(path: Path) -> dict[str, object]:
    """The head settings a GGUF states, read by crossrt's reader: gguf-py's GGUFReader first
    builds a view of every vocabulary string (~1.9 CPU-s a head file, twice a parity)."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        layout = read_layout(data)
        d2t = next((t for t in layout.tensors if t.name == "d2t"), None)
        if d2t is not None:
            kind = GGUF_INTEGERS[d2t.ggml_type].newbyteorder(layout.order)
            offsets = np.frombuffer(data, kind, d2t.nbytes // kind.itemsize, layout.data_start + d2t.offset).copy()
    fields = {key: field.value for key, field in layout.fields.items()}
    architecture = str(fields["general.architecture"])
    settings: dict[str, object] = {}
    if architecture == "dflash":
        settings["mask_token_id"] = fields.get("tokenizer.ggml.mask_token_id")
    for key in ("target_layers", "norm_before_residual", "norm_before_fc", "target_hidden_size", "block_size"):
        if f"{architecture}.{key}" in fields:
            settings[key] = fields[f"{architecture}.{key}"]
    if d2t is not None:
        settings["draft vocabulary"] = _d2t_digest(offsets)
    return settings


def folder_head_settings(folder: Path, runtime: str) -> dict[str, object]:
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    if "dflash_config" in config:  # z-lab's ids name layer outputs: the GGUF's, inputs of the next layer
        dflash = config["dflash_config"]
        return {"mask_token_id": dflash.get("mask_token_id"),
                "target_layers": [i + 1 for i in dflash.get("target_layer_ids", [])],
                "block_size": dflash.get("block_size", config.get("block_size", 16))}
    layers = config.get("transformer_layer_config", {})
    settings: dict[str, object] = {
        "target_layers": config.get("eagle_aux_hidden_state_layer_ids"),
        "norm_before_residual": config.get("norm_before_residual",
                                           UNSTATED_NORM_BEFORE_RESIDUAL.get(runtime, False)),
        "norm_before_fc": config.get("norm_before_fc", False),
        "target_hidden_size": config.get("target_hidden_size", layers.get("hidden_size")),
    }
    offsets = load_file(str(folder / "model.safetensors")).get("d2t")
    if offsets is not None:
        settings["draft vocabulary"] = _d2t_digest(offsets.astype(np.int64) + np.arange(offsets.size))
    return settings


def head_settings(path: Path, runtime: str) -> dict[str, object]:
    return folder_head_settings(path, runtime) if path.is_dir() else gguf_head_settings(path)


def head_checks(runs: Sequence[tuple[str, RunRecord]]) -> tuple[PathCheck, ...]:
    """One check over every run that drafted with a head: each setting equal across what they read."""
    read: list[tuple[str, str, dict[str, object]]] = []
    for label, record in runs:
        drafter = record.pair.drafter if not record.imported else None
        if record.params.spec_type not in HEAD_SPEC_TYPES or drafter is None or not Path(drafter.path).exists():
            continue
        read.append((label, Path(drafter.path).name, head_settings(Path(drafter.path), record.runtime.name)))
    if not read:
        return ()
    findings = []
    first_label, first_file, first = read[0]
    for label, name, settings in read[1:]:
        for key in sorted(set(first) | set(settings)):
            if first.get(key) != settings.get(key):
                findings.append(f"{label} read a head with {key} {_value(settings.get(key))} ({name}), {first_label} "
                                f"{_value(first.get(key))} ({first_file}): one head read otherwise by two runtimes")
    labels = tuple(label for label, _, _ in read)
    summary = (f"{len(read)} runs, {len({n for _, n, _ in read})} files: " +
               ", ".join(f"{key} {_value(value)}" for key, value in first.items()))
    return (PathCheck(HEAD_SETTINGS, (f"the head as {read[0][0]} read it", "as every other run read it"),
                      (labels, ()), 0, tuple(findings), summary),)


def _value(value: Optional[object]) -> str:
    return "unstated" if value is None else json.dumps(value) if not isinstance(value, str) else value
