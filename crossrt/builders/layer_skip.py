"""Layer-skip drafters: a GGUF model cut to its first N blocks, drafting for the full model.

The cut model keeps the target's embeddings, output head and tokenizer byte for byte, so its
token ids mean what the target's mean, and its first N blocks compute what the target's
first N compute: it is the target skipping its last blocks (self-speculative decoding with
no training). Tensors are copied as raw bytes, so quantized types stay as they are.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from crossrt.errors import CrossrtError
from crossrt.inputs.gguf_file import Layout, Tensor, aligned, encode_field, encode_string, gguf_metadata, read_layout
from crossrt.inputs.pairs import PairError

BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")


class LayerSkipError(CrossrtError, ValueError):
    """An input, block count or output problem, with a message meant for the user."""


@dataclass(frozen=True)
class LayerSkip:
    """What a cut wrote: blocks kept of the source's, tensors kept and dropped, bytes written."""

    source: Path
    output: Path
    blocks: int
    source_blocks: int
    tensors_kept: int
    tensors_dropped: int
    size: int


def _check(source: Path, output: Path, blocks: int, overwrite: bool) -> tuple[str, int]:
    """The source's architecture and block count, once every argument is checked: from the
    metadata alone, so a wrong argument is reported before the slow full read of the file."""
    if not source.is_file():
        raise LayerSkipError(f"{source}: no such GGUF file")
    try:
        metadata = gguf_metadata(source)
    except PairError as error:
        raise LayerSkipError(str(error)) from None  # it says the file is damaged and what to do
    arch = metadata.get("general.architecture")
    total = metadata.get(f"{arch}.block_count")
    if not isinstance(total, int):
        raise LayerSkipError(f"{source} has no {arch}.block_count: not a block-layered model crossrt can cut")
    if not 1 <= blocks < total:
        raise LayerSkipError(f"cannot keep {blocks} blocks: {source} has {total}; keep 1 to {total - 1}")
    if output.resolve() == source.resolve():
        raise LayerSkipError(f"{output} is the input file; write the drafter to another path")
    if output.exists() and not overwrite:
        raise LayerSkipError(f"{output} exists; pass --overwrite to replace it")
    if not output.parent.is_dir():
        raise LayerSkipError(f"cannot write {output}: folder {output.parent} does not exist")
    return str(arch), total


def layer_skip(source: Path, output: Path, blocks: int, overwrite: bool = False) -> LayerSkip:
    """Write output: source with blocks blk.N.. dropped and <arch>.block_count set to N.

    Every other metadata pair is copied byte for byte, and every kept tensor's type and data.
    Per-layer arrays under the architecture's keys (one value per block, as some architectures
    store head counts) are cut to N values too. The file is written beside output and renamed
    into place, so an interrupted write never leaves a partial model at output. Read with
    crossrt.inputs.gguf_file, not gguf-py's reader, which takes ~20 s to open a 262,144-token
    vocabulary: a cut of Gemma 3 270M takes about a second.
    """
    source, output = Path(source), Path(output)
    arch, total = _check(source, output, blocks, overwrite)
    count_key = f"{arch}.block_count"
    temporary = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        with open(source, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                layout = read_layout(data)
            except (ValueError, struct.error) as error:
                # A file cut short fails on whichever tensor runs past its end.
                raise LayerSkipError(f"{source} is not a readable GGUF file (damaged or truncated?): {error}") \
                    from None
            kept = [t for t in layout.tensors
                    if not ((match := BLOCK_TENSOR.match(t.name)) and int(match.group(1)) >= blocks)]
            with open(temporary, "wb") as out:
                _write_cut(out, data, layout, kept, count_key, blocks, total, arch)
        os.replace(temporary, output)
    except OSError as error:
        raise LayerSkipError(f"cannot write {output}: {error.strerror or error}") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return LayerSkip(source, output, blocks, total, len(kept), len(layout.tensors) - len(kept),
                     output.stat().st_size)


def _write_cut(out, data, layout: Layout, kept: list[Tensor], count_key: str, blocks: int, total: int,
               arch: str) -> None:
    """The GGUF file of layout's metadata and the tensors kept, each tensor's data aligned as
    the format asks (the section starts, and every tensor's offset is a multiple of the file's
    alignment)."""
    order = layout.order
    out.write(b"GGUF" + struct.pack(order + "IQQ", layout.version, len(kept), len(layout.fields)))
    for field in layout.fields.values():
        if field.key == count_key:
            out.write(encode_field(field, blocks, order))
        elif field.item_type is not None and field.key.startswith(f"{arch}.") and len(field.value) == total:
            out.write(encode_field(field, field.value[:blocks], order))
        else:
            out.write(data[field.start:field.end])
    offsets, offset = [], 0
    for tensor in kept:
        offsets.append(offset)
        offset = aligned(offset + tensor.nbytes, layout.alignment)
    for tensor, tensor_offset in zip(kept, offsets, strict=True):
        out.write(encode_string(tensor.name, order) + struct.pack(order + "I", len(tensor.dims))
                  + struct.pack(order + "Q" * len(tensor.dims), *tensor.dims)
                  + struct.pack(order + "IQ", tensor.ggml_type, tensor_offset))
    data_start = aligned(out.tell(), layout.alignment)
    for tensor, tensor_offset in zip(kept, offsets, strict=True):
        out.write(b"\0" * (data_start + tensor_offset - out.tell()))
        start = layout.data_start + tensor.offset
        out.write(data[start:start + tensor.nbytes])

HF_BLOCK_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.")
WEIGHTS = "model.safetensors"


def layer_skip_folder(source: Path, output: Path, blocks: int) -> int:
    """Write the transformers folder output: the folder source cut to its first blocks blocks,
    as layer_skip cuts a GGUF file; returns the number of tensors dropped.

    config.json gets num_hidden_layers = blocks and every top-level list with one entry per
    block (Gemma 3's layer_types) cut to blocks entries; model.safetensors loses the tensors of
    layers blocks and up, keeping its metadata (the tied-weight aliases); every other file (the
    tokenizer, generation_config.json) is copied as it is. Made for the transformers runtime's
    conversion of a layer-skip drafter from its target's: the cut GGUF holds the target's
    metadata but the block count and the target's tensor bytes, so transformers' own conversion
    of it differs from the target's in exactly these places (checked on Gemma 3 270M,
    tests/test_transformers_gguf.py). The folder is written under a temporary name and renamed
    into place.
    """
    import json
    import shutil
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    source, output = Path(source), Path(output)
    config_file, weights = source / "config.json", source / WEIGHTS
    if not (config_file.is_file() and weights.is_file()):
        raise LayerSkipError(f"{source}: expected a transformers folder with config.json and {WEIGHTS}")
    config = json.loads(config_file.read_text())
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= blocks < total:
        raise LayerSkipError(f"cannot keep {blocks} blocks: {source} has {total}; keep 1 to {total - 1}"
                             if isinstance(total, int) else f"{source}/config.json has no num_hidden_layers")
    if output.exists():
        raise LayerSkipError(f"{output} exists; remove it to cut again")
    config = {key: value[:blocks] if isinstance(value, list) and len(value) == total else value
              for key, value in config.items()} | {"num_hidden_layers": blocks}
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}."))
    try:
        with safe_open(weights, "pt") as tensors:
            names = [name for name in tensors.keys()
                     if not ((match := HF_BLOCK_TENSOR.search(name)) and int(match.group(1)) >= blocks)]
            save_file({name: tensors.get_tensor(name) for name in names}, temporary / WEIGHTS,
                      metadata=tensors.metadata())
            dropped = len(tensors.keys()) - len(names)
        (temporary / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for path in source.iterdir():
            if path.name not in ("config.json", WEIGHTS):
                shutil.copy2(path, temporary / path.name)
        os.rename(temporary, output)
    except OSError as error:
        raise LayerSkipError(f"cannot write {output}: {error.strerror or error}") from None
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
    return dropped
