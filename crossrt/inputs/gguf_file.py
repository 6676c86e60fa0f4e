"""GGUF files as crossrt reads them: the key/value metadata, and where each key/value pair and
each tensor lies in the file (the format: ggml's docs/gguf.md).

Parsed here with struct over the file's bytes rather than with gguf-py's GGUFReader, which
builds NumPy views of every element of every array when it opens a file: ~20 CPU-s for a
262,144-token vocabulary (Gemma 3) that this reads in ~0.3 s. Problems are ValueErrors (or
struct.errors) saying where the file stops making sense; gguf_metadata words them for the user
(PairError).
"""

from __future__ import annotations

import enum
import functools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from crossrt.errors import PairError


class Kind(enum.IntEnum):
    """GGUF's value types by gguf-py's names (its GGUFValueType, which tests/test_gguf_file.py
    checks this against): importing gguf-py for them costs every crossrt process ~0.07 CPU-s."""

    UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)


# GGUF value types that are scalars, as struct formats.
SCALARS = {Kind.UINT8: "B", Kind.INT8: "b", Kind.UINT16: "H", Kind.INT16: "h", Kind.UINT32: "I",
           Kind.INT32: "i", Kind.FLOAT32: "f", Kind.BOOL: "?", Kind.UINT64: "Q", Kind.INT64: "q",
           Kind.FLOAT64: "d"}
STRING, ARRAY = Kind.STRING, Kind.ARRAY
SUPPORTED_VERSIONS = (2, 3)  # as gguf-py's reader: version 1 laid counts out as 32-bit
DEFAULT_ALIGNMENT = 32  # when general.alignment is absent


@dataclass(frozen=True)
class Field:
    """One metadata pair: its value (arrays as lists), its GGUF type (and its items' type for an
    array), and the byte range of the whole pair, key included, for copying it unchanged."""

    key: str
    value: object
    value_type: int
    item_type: int | None
    start: int
    end: int


@dataclass(frozen=True)
class Tensor:
    """One tensor's description: offset counts from the start of the data section."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Layout:
    order: str  # struct's byte order: "<" or ">"
    version: int
    fields: dict[str, Field]
    tensors: tuple[Tensor, ...]
    alignment: int
    data_start: int


def read_layout(data, tensors: bool = True) -> Layout:
    """The layout of the GGUF file whose bytes are data (an mmap or bytes); with tensors=False
    only the metadata is read (tensors empty, data_start 0)."""
    if data[:4] != b"GGUF":
        raise ValueError("GGUF magic invalid")
    # Versions are small numbers, so a big-endian file shows its version in the high bytes.
    order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"
    version, n_tensors, n_kv = struct.unpack_from(order + "IQQ", data, 4)
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (versions {SUPPORTED_VERSIONS})")
    offset, fields = 24, {}
    for _ in range(n_kv):
        start = offset
        key, offset = _string(data, offset, order)
        if key in fields:  # a later pair must not silently replace the first (gguf-py refuses it too)
            raise ValueError(f"duplicate key {key} at byte {start}")
        value_type = struct.unpack_from(order + "I", data, offset)[0]
        item_type = struct.unpack_from(order + "I", data, offset + 4)[0] if value_type == ARRAY else None
        value, offset = _value(data, offset + 4, value_type, order)
        fields[key] = Field(key, value, value_type, item_type, start, offset)
    alignment = fields["general.alignment"].value if "general.alignment" in fields else DEFAULT_ALIGNMENT
    if not tensors:
        return Layout(order, version, fields, (), alignment, 0)
    from gguf import GGML_QUANT_SIZES  # a tensor type's block size and bytes per block

    infos = []
    for _ in range(n_tensors):
        name, offset = _string(data, offset, order)
        n_dims = struct.unpack_from(order + "I", data, offset)[0]
        dims = struct.unpack_from(order + "Q" * n_dims, data, offset + 4)
        ggml_type, tensor_offset = struct.unpack_from(order + "IQ", data, offset + 4 + 8 * n_dims)
        offset += 4 + 8 * n_dims + 12
        if ggml_type not in GGML_QUANT_SIZES:
            raise ValueError(f"tensor {name} has unknown type {ggml_type}")
        block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
        infos.append(Tensor(name, tuple(dims), ggml_type, tensor_offset,
                            int(np.prod(dims, dtype=np.int64)) // block_size * block_bytes))
    data_start = aligned(offset, alignment)
    for tensor in infos:
        if data_start + tensor.offset + tensor.nbytes > len(data):
            raise ValueError(f"tensor {tensor.name} runs past the end of the file")
    return Layout(order, version, fields, tuple(infos), alignment, data_start)


def file_layout(path: Path) -> Layout:
    """read_layout of the GGUF file at path, tensors included, read once per version of the file
    in a process: a parity asks it of one quantized target for the float control (is it float?)
    and the dequantization check (its tensors), ~0.3 CPU-s apiece on a 262,144-token vocabulary.
    Errors as read_layout's (and OSError)."""
    stat = os.stat(path)
    return _file_layout(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)  # a real model's layout holds its vocabulary's strings (~30 MB)
def _file_layout(path: str, size: int, mtime_ns: int) -> Layout:
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return read_layout(data)


def gguf_metadata(path: Path) -> dict[str, object]:
    """The GGUF key/value metadata of path (scalars, strings and arrays as lists), without tensors
    (read_layout: ~0.3 s for a 262,144-token vocabulary, where gguf-py's reader takes ~20).
    Read once per version of the file in a process: a run asks for the vocabulary, the
    quantization and the chat template in turn."""
    try:
        stat = os.stat(path)
    except OSError as error:
        raise PairError(f"{path} is not a readable GGUF file ({error.strerror or error})") from None
    return dict(_gguf_metadata(str(path), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _gguf_metadata(path: str, size: int, mtime_ns: int) -> dict[str, object]:
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return {key: field.value for key, field in read_layout(data, tensors=False).fields.items()}
    except (OSError, ValueError, struct.error) as error:  # UnicodeDecodeError is a ValueError
        raise PairError(f"{path} is not a readable GGUF file ({error}): it is damaged or truncated; "
                        "copy or convert it again") from None


def aligned(offset: int, alignment: int) -> int:
    return offset + (-offset) % alignment


def encode_string(text: str, order: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack(order + "Q", len(raw)) + raw


def encode_field(field: Field, value, order: str) -> bytes:
    """The pair field with another value of the same type: a scalar, or a list for an array of
    scalars or strings."""
    head = encode_string(field.key, order) + struct.pack(order + "I", field.value_type)
    if field.value_type in SCALARS:
        return head + struct.pack(order + SCALARS[field.value_type], value)
    if field.value_type == STRING:
        return head + encode_string(value, order)
    head += struct.pack(order + "IQ", field.item_type, len(value))
    if field.item_type in SCALARS:
        return head + np.asarray(value, np.dtype(order + SCALARS[field.item_type])).tobytes()
    if field.item_type == STRING:
        return head + b"".join(encode_string(item, order) for item in value)
    raise ValueError(f"{field.key}: arrays of type {field.item_type} cannot be rewritten")


def _string(data, offset: int, order: str) -> tuple[str, int]:
    length = struct.unpack_from(order + "Q", data, offset)[0]
    end = offset + 8 + length
    if end > len(data):
        raise ValueError(f"a string at byte {offset} runs past the end of the file")
    return data[offset + 8:end].decode("utf-8"), end


def _value(data, offset: int, value_type: int, order: str) -> tuple[object, int]:
    if value_type in SCALARS:
        fmt = order + SCALARS[value_type]
        return struct.unpack_from(fmt, data, offset)[0], offset + struct.calcsize(fmt)
    if value_type == STRING:
        return _string(data, offset, order)
    if value_type != ARRAY:
        raise ValueError(f"unknown GGUF value type {value_type} at byte {offset}")
    item_type, count = struct.unpack_from(order + "IQ", data, offset)
    offset += 12
    if item_type in SCALARS:
        dtype = np.dtype(order + SCALARS[item_type])
        if offset + count * dtype.itemsize > len(data):
            raise ValueError(f"an array at byte {offset} runs past the end of the file")
        return np.frombuffer(data, dtype, count, offset).tolist(), offset + count * dtype.itemsize
    if item_type == STRING:
        return _strings(data, offset, count, order)
    items = []
    for _ in range(count):
        item, offset = _value(data, offset, item_type, order)
        items.append(item)
    return items, offset


def _strings(data, offset: int, count: int, order: str) -> tuple[list[str], int]:
    """An array of count strings, read in one loop: a vocabulary is 262,144 of them on Gemma 3,
    and a call per string made reading its layout half a second."""
    length_at = struct.Struct(order + "Q").unpack_from
    size, items = len(data), []
    for _ in range(count):
        start = offset + 8
        offset = start + length_at(data, offset)[0]
        if offset > size:
            raise ValueError(f"a string at byte {start - 8} runs past the end of the file")
        items.append(data[start:offset].decode("utf-8"))
    return items, offset
