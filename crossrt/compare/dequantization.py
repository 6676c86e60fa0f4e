"""gguf-py's dequantization checked against ggml's own, on the GGUFs a parity compares.

The float control compares llama.cpp on a GGUF's float twin with transformers on its GGUF
conversion: both dequantize with gguf-py (crossrt/builders/float_twin.py), so an error there
(a scale off by 2% in one type's table) makes both scorings the same wrong function and passes
the float control. This check dequantizes sampled rows of every tensor of each quantized type
with gguf-py and with the to_float of the llama.cpp build that runs the GGUF itself
(backends/ggml_dequantize.py): both compute the same products of the same integers, so they
agree to float32 rounding; anything more is a finding about the shared dequantization.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Sequence

import numpy as np

from crossrt.compare.verification import PathCheck
from crossrt.inputs.gguf_file import file_layout
from crossrt.records.schema import RunRecord

DEQUANTIZATION = "dequantization"
ROWS = 8  # rows sampled per tensor, spread over it
TENSORS = 4  # tensors sampled per quantized type
ULPS = 4.0  # float32 rounding allowed, in units of the largest value's last place
F32, F16 = 0, 1


def check_file(path: Path, runs: tuple[str, ...]) -> PathCheck:
    from gguf import GGMLQuantizationType, quants

    from crossrt.backends.ggml_dequantize import library_path, to_float

    worst: dict[str, float] = {}
    findings, blocks = [], 0
    layout = file_layout(path)  # read already where the float control asked whether path is float
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        by_type: dict[int, list] = {}
        for tensor in layout.tensors:
            if tensor.ggml_type not in (F32, F16):
                by_type.setdefault(tensor.ggml_type, []).append(tensor)
        for ggml_type, tensors in sorted(by_type.items()):
            name = GGMLQuantizationType(ggml_type).name
            for tensor in tensors[:: max(1, len(tensors) // TENSORS)][:TENSORS]:
                rows = int(np.prod(tensor.dims[1:])) if len(tensor.dims) > 1 else 1
                row_bytes = tensor.nbytes // rows
                start = layout.data_start + tensor.offset
                for row in sorted(set(np.linspace(0, rows - 1, min(rows, ROWS)).round().astype(int))):
                    offset = start + row * row_bytes
                    raw = np.frombuffer(data[offset:offset + row_bytes], dtype=np.uint8)  # a copy: the map closes
                    ours = np.asarray(quants.dequantize(raw.reshape(1, -1), GGMLQuantizationType(ggml_type)),
                                      dtype=np.float32).reshape(-1)
                    theirs = to_float(raw.tobytes(), ggml_type, tensor.dims[0])
                    if theirs is None:
                        break
                    blocks += 1
                    scale = float(np.abs(theirs).max()) or 1.0
                    error = float(np.abs(ours - theirs).max()) / scale
                    worst[name] = max(worst.get(name, 0.0), error)
                    if error > ULPS * np.finfo(np.float32).eps and not any(tensor.name in f for f in findings):
                        findings.append(f"{path.name}: gguf-py dequantizes {tensor.name} ({name}) otherwise than "
                                        f"ggml ({library_path()}): max difference {error:.3g} of the row's largest "
                                        f"value at row {row}: the float twin and transformers' conversion share it, "
                                        "so the float control cannot see it")
    summary = (f"{blocks} rows of {len(worst)} quantized types: largest difference "
               + (", ".join(f"{name} {error:.2g}" for name, error in worst.items()) or "none")
               + f" of each row's largest value (bound {ULPS:g} float32 ulps)")
    return PathCheck(DEQUANTIZATION, (f"gguf-py on {path.name}", "ggml's to_float"), (runs, ()), 0,
                               tuple(findings), summary)


def dequantization_checks(runs: Sequence[tuple[str, RunRecord]]) -> tuple[PathCheck, ...]:
    """One check per quantized GGUF target of the runs (float files have nothing to check)."""
    from crossrt.builders.float_twin import is_float

    files: dict[str, list[str]] = {}
    for label, record in runs:
        path = record.pair.target.path if not record.imported and record.pair.target else None
        if path and path.endswith(".gguf") and Path(path).is_file() and not is_float(Path(path)):
            files.setdefault(path, []).append(label)
    return tuple(check_file(Path(path), tuple(labels)) for path, labels in files.items())
