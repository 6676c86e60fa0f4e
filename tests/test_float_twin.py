"""The float twin (crossrt/builders/float_twin.py): written once, verified by digest on every use,
rewritten when damaged, and no abandoned temporary file left behind (issue 58)."""

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants

from crossrt.builders import float_twin as twin_module
from crossrt.builders.float_twin import FloatTwinError, float_twin


def quantized_gguf(path):
    """A GGUF holding one Q8_0 tensor: enough for a twin (no model is loaded)."""
    writer = GGUFWriter(str(path), "llama")
    values = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_down.weight", quants.quantize(values, GGMLQuantizationType.Q8_0),
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_damaged_twin_is_written_again_and_an_abandoned_one_removed(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CROSSRT_CACHE", str(tmp_path / "cache"))
    source = quantized_gguf(tmp_path / "model.gguf")
    twin = float_twin(source)
    written = twin.read_bytes()
    assert float_twin(source) == twin and capfd.readouterr().err == ""  # intact: used as it is
    # Damaged in place at the same size and time, as a flipped block or a bad copy leaves it.
    stat = twin.stat()
    damaged = bytearray(written)
    damaged[-64:] = bytes(64)
    twin.write_bytes(bytes(damaged))
    os.utime(twin, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    abandoned = twin.with_name(f".{twin.name}.999999999.tmp")  # a writer killed mid-write
    abandoned.write_bytes(b"partial")
    twin_module._verified.clear()  # a new process: nothing hashed yet
    assert float_twin(source) == twin
    assert twin.read_bytes() == written
    assert "does not match its digest" in capfd.readouterr().err
    assert not abandoned.exists()


def test_a_twin_that_cannot_be_written_says_the_way_forward(tmp_path, monkeypatch):
    source = quantized_gguf(tmp_path / "model.gguf")
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("CROSSRT_CACHE", str(blocked))
    with pytest.raises(FloatTwinError, match=r"set CROSSRT_CACHE to a writable folder .* or pass --no-float-control"):
        float_twin(source)
