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

import functools
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

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
    from crossrt.inputs.gguf_file import file_layout

    layout = file_layout(path)  # read once in a process (the float control's is_float, the dequantization check)
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for tensor in layout.tensors:
            yield tensor.name, (tensor.ggml_type, dequantized(data, layout.data_start + tensor.offset, tensor))


def _folder_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        from crossrt.errors import ModelError
        raise ModelError(f"{folder} has no .safetensors weights to compare")
    return files


def _folder_tensors(files: Sequence[Path]) -> Iterator[tuple[str, tuple[None, np.ndarray]]]:
    from safetensors import safe_open

    for file in files:
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
    if np.array_equal(a, b):  # most tensors of an edited copy: no float64 copies of either
        return 0.0
    wide = a.astype(np.float64)
    scale = float(np.sqrt(np.mean(wide ** 2))) or 1.0
    wide -= b
    return float(np.sqrt(np.mean(wide ** 2))) / scale


def _sides(a: Path, b: Path) -> tuple[Path, Path]:
    """What is read of each side: both GGUFs, or both as transformers folders."""
    if a.suffix == ".gguf" and b.suffix == ".gguf":
        return a, b
    return tuple(path if path.suffix != ".gguf" else _as_folder(path) for path in (a, b))


def _identity(side: Path) -> tuple:
    """The weight files a side reads, each as (resolved path, size, mtime): a planted copy that
    edits only its config links the clean weights, and the clean folder is the GGUF's conversion."""
    files = [side] if side.suffix == ".gguf" else _folder_files(side)
    return tuple((str(file.resolve()), (stat := file.stat()).st_size, stat.st_mtime_ns) for file in files)


def _names(identity: tuple) -> list[str]:
    """The tensor names of the files an identity names, in the order _tensors gives them, from
    their headers alone."""
    files = [Path(path) for path, _, _ in identity]
    if files[0].suffix == ".gguf":
        from crossrt.inputs.gguf_file import file_layout

        return [tensor.name for tensor in file_layout(files[0]).tensors]
    from safetensors import safe_open

    names = []
    for file in files:
        with safe_open(file, "pt") as tensors:
            names += tensors.keys()
    return names


def _unmatched(first: Sequence[str], second: Sequence[str]) -> list[str]:
    """Names only one side holds, second's first; a tied output head is stored once by one
    writer and twice by another: not a difference."""
    ones, others = set(first), set(second)
    only = [name for name in second if name not in ones] + [name for name in first if name not in others]
    return [name for name in only if not name.endswith("lm_head.weight")]


def compare_weights(a: Path, b: Path) -> WeightsMatch:
    """a's weights against b's (module docstring). Sides that read the same files hold the same
    weights, not read; files already compared are not read again (a parity of n folders compares
    each pair of its scorings, most of them over the same files)."""
    first, second = _sides(Path(a), Path(b))
    identities = _identity(first), _identity(second)
    if identities[0] == identities[1]:
        return WeightsMatch(len(_names(identities[0])), ())
    return _compared(*identities)


def _tensors(identity: tuple) -> Iterator:
    """The tensors of the files an identity names, as _gguf_tensors or _folder_tensors give them."""
    files = [Path(path) for path, _, _ in identity]
    return _gguf_tensors(files[0]) if files[0].suffix == ".gguf" else _folder_tensors(files)


@functools.lru_cache(maxsize=8)
def _compared(identity_a: tuple, identity_b: tuple) -> WeightsMatch:
    """The weights of the files of identity_a (_identity) against those of identity_b. Other
    tensor names already say "not the same model", whatever the values: none are read then."""
    names = _names(identity_a), _names(identity_b)
    unmatched = _unmatched(*names)
    if unmatched:
        return WeightsMatch(len(set(names[0]) & set(names[1])), (), tuple(unmatched))
    first, second = dict(_tensors(identity_a)), _tensors(identity_b)
    differing, both, retyped = [], 0, 0
    for name, (kind, values) in second:
        other = first.pop(name, None)
        if other is None:  # a tied lm_head only (_unmatched)
            continue
        both += 1
        difference = _difference(other[1], values)
        if difference > SAME and other[0] != kind:
            retyped += 1
        elif difference > SAME:
            differing.append((name, difference))
    return WeightsMatch(both, tuple(differing), (), retyped)
