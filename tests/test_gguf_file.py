"""crossrt.inputs.gguf_file against gguf-py's own reader on the tiny target: the same metadata, the
same tensors at the same places; a damaged file is a ValueError naming where it stops."""

import mmap
import struct

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from crossrt.inputs.gguf_file import Kind, encode_field, read_layout

from conftest import REPO

TINY = REPO / "models" / "tiny" / "target.f32.gguf"


def test_layout_matches_gguf_py():
    reader = GGUFReader(TINY)
    with open(TINY, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        layout = read_layout(data)
        theirs = {name: field for name, field in reader.fields.items() if not name.startswith("GGUF.")}
        assert list(layout.fields) == list(theirs)
        for name, field in layout.fields.items():
            value = theirs[name].contents()
            assert field.value == (value.tolist() if isinstance(value, np.ndarray) else value), name
            # A pair re-encoded with its own value is the bytes it was read from.
            assert encode_field(field, field.value, layout.order) == data[field.start:field.end], name
        assert [(t.name, t.ggml_type, t.nbytes) for t in layout.tensors] == \
               [(t.name, int(t.tensor_type), int(t.n_bytes)) for t in reader.tensors]
        for ours, tensor in zip(layout.tensors, reader.tensors, strict=True):
            assert ours.dims == tuple(int(d) for d in tensor.shape)
            assert layout.data_start + ours.offset == tensor.data_offset


def test_damaged_files_name_the_problem(tmp_path):
    whole = TINY.read_bytes()
    with pytest.raises(ValueError, match="tensor .* runs past the end of the file"):
        read_layout(whole[:-4096])
    with pytest.raises(ValueError, match="GGUF magic invalid"):
        read_layout(b"GGML" + whole[4:])
    assert read_layout(whole[:-4096], tensors=False).fields["general.architecture"].value == "llama"


def _pairs(version: int, *pairs: tuple[str, int]) -> bytes:
    """A tensor-less GGUF header of uint32 key/value pairs, little-endian."""
    head = b"GGUF" + struct.pack("<IQQ", version, 0, len(pairs))
    return head + b"".join(struct.pack("<Q", len(key)) + key.encode() + struct.pack("<II", 4, value)
                           for key, value in pairs)


def test_unsupported_versions_and_duplicate_keys_are_refused():
    assert read_layout(_pairs(3, ("a", 1), ("b", 2)), tensors=False).fields["b"].value == 2
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_layout(_pairs(1, ("a", 1)), tensors=False)
    with pytest.raises(ValueError, match="duplicate key a"):
        read_layout(_pairs(3, ("a", 1), ("a", 2)), tensors=False)


def test_value_kinds_are_gguf_pys():
    """gguf_file names GGUF's value types itself, not importing gguf-py in every process."""
    assert {kind.name: int(kind) for kind in Kind} == {kind.name: int(kind) for kind in GGUFValueType}
