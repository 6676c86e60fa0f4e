"""Whether two runs' model files hold the same weights, tensor by tensor.

The float control (crossrt/compare/control.py) compares two runtimes as the same function, which
they are only when they load the same weights: one GGUF file, or a GGUF and a transformers folder
that holds its dequantization (crossrt's own conversion, a user's folder named `hf = ...` beside
the `gguf = ...` in a pair manifest). So before comparing logits, the weights are compared:

- all tensors equal (to float32 rounding): the control runs;
- some equal and some not: one copy of the model is not the other (a block's weights edited,
  a conversion that got one tensor wrong): a failure that names the tensors;
- none equal, or other tensor names: another precision or quantization of the model, or another
  model: the float control cannot make them one function, and the verdict says so.

A GGUF is compared with a transformers folder through transformers' own conversion of it (the
transformers runtime's cached dequantization, made when missing), so both sides use
transformers' tensor names; two GGUFs are compared by their dequantized tensors.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

SAME = 1e-6  # relative RMS difference within which two tensors are the same weights (float32 arithmetic)


@dataclass(frozen=True)
class WeightsMatch:
    tensors: int  # tensors both hold
    differing: tuple[tuple[str, float], ...]  # (name, relative RMS difference) beyond SAME
    unmatched: tuple[str, ...] = ()  # names only one side holds
    retyped: int = 0  # tensors that differ where the two GGUFs store them in different types (precision)

    @property
    def same(self) -> bool:
        return not self.differing and not self.unmatched and not self.retyped

    @property
    def partly(self) -> bool:
        """Some tensors stored alike differ while most are equal: one copy edited, not another
        precision (which rounds every tensor it stores differently)."""
        return bool(self.differing) and not self.unmatched and len(self.differing) <= self.tensors // 2

    @property
    def wrong(self) -> bool:
        """Not one model: other tensors, or one copy edited."""
        return bool(self.unmatched) or self.partly

    def describe(self) -> str:
        if self.same:
            return f"the same weights ({self.tensors} tensors equal)"
        if self.unmatched:
            return (f"not the same model: {len(self.unmatched)} tensor name(s) in one only "
                    f"(first {self.unmatched[0]})")
        if not self.differing:
            return (f"another precision of the same model ({self.retyped} of {self.tensors} tensors stored in other "
                    "types)")
        worst = sorted(self.differing, key=lambda d: -d[1])[:3]
        listed = ", ".join(f"{name} ({difference:.2%})" for name, difference in worst)
        return (f"{len(self.differing)} of {self.tensors} tensors differ (relative RMS difference; largest: "
                f"{listed})")


def _gguf_tensors(path: Path) -> Iterator[tuple[str, tuple[int, np.ndarray]]]:
    from crossrt.builders.float_twin import dequantized
    from crossrt.inputs.gguf_file import read_layout

    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        layout = read_layout(data)
        for tensor in layout.tensors:
            yield tensor.name, (tensor.ggml_type, dequantized(data, layout.data_start + tensor.offset, tensor))


def _folder_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        from crossrt.errors import ModelError
        raise ModelError(f"{folder} has no .safetensors weights to compare")
    return files


def _folder_tensors(folder: Path) -> Iterator[tuple[str, tuple[None, np.ndarray]]]:
    from safetensors import safe_open

    for file in _folder_files(folder):
        with safe_open(file, "pt") as tensors:
            for name in tensors.keys():
                yield name, (None, tensors.get_tensor(name).float().numpy().reshape(-1))


def _as_folder(path: Path) -> Path:
    """A GGUF's weights as transformers names them: the transformers runtime's conversion."""
    from crossrt.backends.transformers import dequantized_folder, load_model
    from crossrt.backends.transformers_conversion import conversion_files
    from crossrt.run.runtime import RuntimeOptions

    folder = dequantized_folder(path)
    if conversion_files(folder, path) is None:  # checked against its digests where it exists
        load_model(path, RuntimeOptions())  # converts and caches
    return folder


def _difference(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    scale = float(np.sqrt(np.mean(a.astype(np.float64) ** 2))) or 1.0
    return float(np.sqrt(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))) / scale


def compare_weights(a: Path, b: Path) -> WeightsMatch:
    """a's weights against b's (module docstring)."""
    a, b = Path(a), Path(b)
    if a.suffix == ".gguf" and b.suffix == ".gguf":
        first, second = dict(_gguf_tensors(a)), _gguf_tensors(b)
    else:
        first = dict(_folder_tensors(a if a.suffix != ".gguf" else _as_folder(a)))
        second = _folder_tensors(b if b.suffix != ".gguf" else _as_folder(b))
    differing, unmatched, both, retyped = [], [], 0, 0
    for name, (kind, values) in second:
        other = first.pop(name, None)
        if other is None:
            unmatched.append(name)
            continue
        both += 1
        difference = _difference(other[1], values)
        if difference > SAME and other[0] != kind:
            retyped += 1
        elif difference > SAME:
            differing.append((name, difference))
    # A tied output head is stored once by one writer and twice by another: not a difference.
    unmatched = [name for name in unmatched + list(first) if not name.endswith("lm_head.weight")]
    return WeightsMatch(both, tuple(differing), tuple(unmatched), retyped)
