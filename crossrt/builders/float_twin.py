"""A GGUF model's float twin: the same file with every tensor dequantized to F32.

Parity's float control (docs/parity.md). llama.cpp on a quantized GGUF and transformers on its
dequantized weights compute different functions (llama.cpp's quantized matmuls quantize the
activations too), so their logits differ by whole logits and a bound wide enough for that
passes a wrong model. The twin holds exactly the weights transformers' GGUF loader makes of the
file (both dequantize with gguf-py's tables, which follow ggml's), with every metadata pair
copied byte for byte, so llama.cpp on the twin and transformers on the conversion are the same
function up to float rounding: a bug in either runtime shows against hundredths of a logit.
Written once per source file, keyed by its digest, in crossrt's cache folder.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import sys
from pathlib import Path

import numpy as np

from crossrt.errors import CrossrtError
from crossrt.inputs.gguf_file import aligned, encode_field, encode_string, file_layout, read_layout
from crossrt.inputs.pairs import cache_dir, sha256_of

F32 = 0  # ggml_type of a float32 tensor
ALL_F32 = 0  # general.file_type of a file whose tensors are all F32 (llama_ftype LLAMA_FTYPE_ALL_F32)


class FloatTwinError(CrossrtError, ValueError):
    """The source cannot be read or the twin cannot be written, said for the user."""


def float_twin_path(source: Path) -> Path:
    """Where the float twin of source is cached: keyed by the source's content."""
    return cache_dir() / "float-twins" / f"{sha256_of(source)}.f32.gguf"


def is_float(source: Path) -> bool:
    """Whether every tensor of source is F32 already (its own twin). Read once per version of
    the file in a process (file_layout): parity asks it of every run, and most runs share one
    file (~0.3 s apiece for a 262,144-token vocabulary's metadata)."""
    return all(t.ggml_type == F32 for t in file_layout(Path(source)).tensors)


def float_twin(source: Path) -> Path:
    """The F32 twin of the GGUF file source (source itself when it is all F32), written on first
    use under a temporary name and renamed into place, so an interrupted write is never read."""
    source = Path(source)
    try:
        if is_float(source):
            return source
    except (OSError, ValueError, struct.error) as error:
        raise FloatTwinError(f"{source} is not a readable GGUF file ({error}): cannot write its float twin") from None
    output = float_twin_path(source)
    digest_file = output.with_name(output.name + ".sha256")
    if output.is_file():
        if _intact(output, digest_file):
            return output
        sys.stderr.write(f"crossrt: the cached float twin {output} does not match its digest (damaged, or written "
                         "before twins had one): writing it again\n")
    temporary = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(output)
        with open(source, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data, \
                open(temporary, "wb") as out:
            _write_twin(out, data)
        digest = _sha256(temporary)
        os.replace(temporary, output)
        digest_file.write_text(digest + "\n")
        _verified.add((str(output), digest))
    except OSError as error:
        raise FloatTwinError(f"cannot write the float twin of {source} to {output}: {error.strerror or error}; "
                             "set CROSSRT_CACHE to a writable folder with room for it, or pass --no-float-control "
                             "(a weaker check)") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return output


_verified: set[tuple[str, str]] = set()  # (twin, digest) hashed whole in this process


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _intact(twin: Path, digest_file: Path) -> bool:
    """The twin's bytes are the ones written: its digest, written beside it, hashed whole once
    per process (a twin damaged in place, even at its size and time, gave parity a wrong verdict)."""
    try:
        expected = digest_file.read_text().strip()
    except OSError:
        return False
    if (str(twin), expected) in _verified:
        return True
    if _sha256(twin) != expected:
        return False
    _verified.add((str(twin), expected))
    return True


def _remove_abandoned(output: Path) -> None:
    """Temporary twins whose writer is gone (killed mid-write), so none lies there for ever."""
    for temporary in output.parent.glob(f".{output.name}.*.tmp"):
        pid = temporary.name[len(output.name) + 2:-len(".tmp")]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            temporary.unlink(missing_ok=True)


def dequantized(data, start: int, tensor) -> np.ndarray:
    """One tensor's values as float32, in the file's element order (ne0 fastest), tensor's data
    starting at byte start of data (the file, mapped). Always a copy: an F32 tensor would
    otherwise be a view of the mapping, which its reader closes."""
    from gguf import GGMLQuantizationType, quants

    raw = np.frombuffer(data, dtype=np.uint8, count=tensor.nbytes, offset=start)
    rows = int(np.prod(tensor.dims[1:])) if len(tensor.dims) > 1 else 1
    values = quants.dequantize(raw.reshape(rows, -1), GGMLQuantizationType(tensor.ggml_type))
    return np.array(values, dtype="<f4").reshape(-1)


def _write_twin(out, data) -> None:
    layout = read_layout(data)
    order = layout.order
    if order != "<":
        raise FloatTwinError("big-endian GGUF files are not supported for the float twin")
    sizes = [4 * int(np.prod(t.dims)) for t in layout.tensors]
    out.write(b"GGUF" + struct.pack(order + "IQQ", layout.version, len(layout.tensors), len(layout.fields)))
    for field in layout.fields.values():
        if field.key == "general.file_type":
            out.write(encode_field(field, ALL_F32, order))
        else:
            out.write(data[field.start:field.end])
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset = aligned(offset + size, layout.alignment)
    for tensor, tensor_offset in zip(layout.tensors, offsets, strict=True):
        out.write(encode_string(tensor.name, order) + struct.pack(order + "I", len(tensor.dims))
                  + struct.pack(order + "Q" * len(tensor.dims), *tensor.dims)
                  + struct.pack(order + "IQ", F32, tensor_offset))
    data_start = aligned(out.tell(), layout.alignment)
    for tensor, tensor_offset in zip(layout.tensors, offsets, strict=True):
        out.write(b"\0" * (data_start + tensor_offset - out.tell()))
        out.write(dequantized(data, layout.data_start + tensor.offset, tensor).tobytes())
