"""ggml's own dequantization (each type's to_float in the llama.cpp build crossrt runs), read
through ctypes: the independent reference that gguf-py's tables are checked against
(crossrt/compare/dequantization.py), since crossrt's float twins and transformers' GGUF loader
both dequantize with gguf-py."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Optional

import numpy as np

from crossrt.run.runtime import RuntimeUnavailable

BUILD_BIN = Path(__file__).resolve().parents[1] / ".cache" / "llama-tools" / "build" / "bin"
TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


class _TypeTraits(ctypes.Structure):
    # struct ggml_type_traits in ggml/include/ggml.h at the vendored commit
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p), ("from_float_ref", ctypes.c_void_p)]


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    folder = Path(os.environ.get("LLAMA_CPP_LIB_PATH", BUILD_BIN))
    path = folder / "libggml-base.so"
    if not path.is_file():
        raise RuntimeUnavailable(f"ggml's library is not built ({path}): run scripts/setup")
    library = ctypes.CDLL(str(path))
    library.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    library.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return library


def library_path() -> str:
    return _library()._name


def to_float(raw: bytes, ggml_type: int, elements: int) -> Optional[np.ndarray]:
    """raw (whole blocks of ggml_type) as float32 by ggml's own to_float; None where ggml has
    no to_float for the type."""
    traits = _library().ggml_get_type_traits(ggml_type).contents
    if not traits.to_float:
        return None
    out = np.empty(elements, dtype=np.float32)
    source = ctypes.create_string_buffer(bytes(raw), len(raw))
    TO_FLOAT(traits.to_float)(ctypes.cast(source, ctypes.c_void_p), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                              elements)
    return out
