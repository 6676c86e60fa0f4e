"""Whether a run's models fit in memory, checked where they are about to load.

Every runtime calls check_fits with what it will hold per model (weights, and the KV cache for
n_ctx) against free RAM and each GPU's free memory, so what cannot fit is refused in one line
with what would fit, not found by the OOM killer minutes into a load. plan_processes runs a
runtime's processes together or one after the other; CROSSRT_MEMORY_LIMIT replaces the free
memory measured. What is counted, and why: docs/real-models.md, "The memory check".
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import mmap
import os
import re
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import click

from crossrt.errors import CrossrtError, SettingsError
from crossrt.inputs.file_facts import file_fact
from crossrt.inputs.gguf_file import read_layout

if TYPE_CHECKING:
    from crossrt.run.runtime import RuntimeOptions

LIMIT_ENV = "CROSSRT_MEMORY_LIMIT"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
SMALLER_DTYPE = {"float32": "bfloat16"}
GIB = 2 ** 30
# transformers' GGUF loader holds about 2.4 float32 copies of the weights at its peak, whatever
# dtype the model ends in: 3.23 GB of RSS converting Gemma 3 270M (1.07 GB of float32 weights)
# in float32 or in bfloat16, against 1.74 GB loading the float32 conversion (docs/real-models.md).
CONVERSION_PEAK = 2.4
MIN_CTX = 256  # a smaller context than this holds no real prompt and answer: not offered as a fit
ALL_LAYERS = 1 << 30  # gpu_layers for a runtime that puts a whole model on a GPU, as a large -ngl does


class MemoryShort(CrossrtError):
    """A run's models do not fit in the memory free on this machine: what, by how much (shortage),
    and what would (advice)."""

    def __init__(self, shortage: str, advice: str):
        super().__init__(f"{shortage}; {advice}")
        self.shortage = shortage


@dataclass(frozen=True)
class Footprint:
    """What one model holds once loaded: weights, and KV cache bytes per context position."""

    name: str
    weights: int
    kv_per_token: int
    n_layer: int

    def need(self, n_ctx: int) -> int:
        return self.weights + n_ctx * self.kv_per_token


def _gguf_footprint(path: Path, dtype: Optional[str], kv_bytes: int, converting: bool) -> Footprint:
    stat = path.stat()
    n_layer, kv_elements, stored, elements = file_fact(
        "gguf-counts-1", [path], lambda: _gguf_counts(str(path), stat.st_size, stat.st_mtime_ns))
    weights = stored if dtype is None else elements * DTYPE_BYTES[dtype]
    if converting:
        weights = int(elements * DTYPE_BYTES["float32"] * CONVERSION_PEAK)
    return Footprint(path.name, weights, kv_elements * kv_bytes, n_layer)


@functools.lru_cache(maxsize=16)
def _gguf_counts(path: str, size: int, mtime_ns: int) -> tuple[int, int, int, int]:
    """Blocks, KV cache elements per position, tensor bytes as stored and tensor elements of a
    GGUF file; read once per version of the file in a process (~0.1 CPU-s for Gemma 3's
    vocabulary), and kept on disk by its digest for the next (file_fact)."""
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        layout = read_layout(data)
    meta = {key: field.value for key, field in layout.fields.items()}
    arch = meta.get("general.architecture")

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    n_layer, n_embd, n_head = key("block_count"), key("embedding_length"), key("attention.head_count")
    if not (n_layer and n_embd and n_head):
        raise ValueError(f"no {arch}.block_count, embedding_length or attention.head_count")
    n_head = n_head if isinstance(n_head, list) else [n_head] * n_layer  # a list where layers differ
    heads_kv = key("attention.head_count_kv", n_head)
    heads_kv = heads_kv if isinstance(heads_kv, list) else [heads_kv] * n_layer
    head_k = key("attention.key_length", n_embd // n_head[0])
    head_v = key("attention.value_length", n_embd // n_head[0])
    return (n_layer, sum(heads_kv) * (head_k + head_v), sum(tensor.nbytes for tensor in layout.tensors),
            sum(_elements(tensor.dims) for tensor in layout.tensors))


def _elements(dims: Sequence[int]) -> int:
    count = 1
    for dim in dims:
        count *= dim
    return count


def _folder_footprint(folder: Path, dtype: str, kv_bytes: int) -> Footprint:
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") or config
    n_layer, n_head = text["num_hidden_layers"], text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // n_head
    elements = 0
    for weights in sorted(folder.glob("*.safetensors")):
        with open(weights, "rb") as handle:  # the header: 8 bytes of length, then JSON
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        elements += sum(_elements(info["shape"]) for name, info in header.items() if name != "__metadata__")
    kv = n_layer * text.get("num_key_value_heads", n_head) * 2 * head_dim * kv_bytes
    return Footprint(folder.name, elements * DTYPE_BYTES[dtype], kv, n_layer)


def footprint(path: Path, dtype: Optional[str], kv_cache: str, converting: bool = False) -> Footprint:
    """What path (a GGUF file, or a transformers folder) holds loaded: weights as stored
    (dtype None, GGUF only) or in dtype, and a KV cache of element type kv_cache; converting:
    a GGUF being dequantized (CONVERSION_PEAK), whatever dtype it ends in."""
    path = Path(path)
    try:
        if path.is_dir():
            return _folder_footprint(path, dtype or "float32", KV_BYTES[kv_cache])
        return _gguf_footprint(path, dtype, KV_BYTES[kv_cache], converting)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
        # The runtime's own load says what is wrong with the file; the check only cannot count it.
        raise Uncounted(f"{path}: {error}") from None


class Uncounted(Exception):
    """A model whose size cannot be read from its files: the check leaves it to the runtime's load."""


@dataclass(frozen=True)
class Device:
    label: str  # "RAM", "GPU 0", ...
    free: int
    source: str  # where free was read


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise SettingsError(f"{LIMIT_ENV}={text!r} is not a size: give bytes, or a number with K, M, G or T (e.g. 4G)")
    return int(float(match.group(1)) * 1024 ** "_KMGT".index((match.group(2) or "_").upper()))


def _limit() -> Optional[int]:
    value = os.environ.get(LIMIT_ENV)
    return parse_size(value) if value else None


def ram() -> Optional[Device]:
    """RAM free for a new model: MemAvailable (free memory plus what the kernel can reclaim)."""
    limit = _limit()
    if limit is not None:
        return Device("RAM", limit, LIMIT_ENV)
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    return Device("RAM", int(match.group(1)) * 1024, "MemAvailable") if match else None


def gpus() -> list[Device]:
    """Each GPU's free memory, in CUDA's device order: through torch where it is already
    imported (it applies CUDA_VISIBLE_DEVICES), else nvidia-smi; none found, no GPU is checked."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
        source = "torch.cuda.mem_get_info"
    else:
        try:
            listed = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                                    capture_output=True, text=True, timeout=30, check=True)
            free = [int(line) * 2 ** 20 for line in listed.stdout.split()]
        except (OSError, subprocess.SubprocessError, ValueError):
            return []
        source = "nvidia-smi"
    limit = _limit()
    return [Device(f"GPU {i}", free if limit is None else limit, source if limit is None else LIMIT_ENV)
            for i, free in enumerate(free)]


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB / 10 else f"{n / 2 ** 20:.1f} MiB"


@dataclass(frozen=True)
class _Plan:
    """Bytes per device for a set of footprints at one context size and placement."""

    needs: dict[str, float]
    kv_per_token: dict[str, float]

    def short(self, devices: dict[str, Device]) -> list[tuple[str, float]]:
        return [(label, need - devices[label].free) for label, need in self.needs.items()
                if label in devices and need > devices[label].free]


def _plan(models: Sequence[Footprint], n_ctx: int, gpu_layers: int, shares: Sequence[float]) -> _Plan:
    needs: dict[str, float] = {"RAM": 0.0}
    per_token: dict[str, float] = {"RAM": 0.0}
    total_share = sum(shares)
    for model in models:
        on_gpu = min(1.0, gpu_layers / model.n_layer) if shares else 0.0
        for label, part in [("RAM", 1.0 - on_gpu)] + [(f"GPU {i}", on_gpu * s / total_share)
                                                     for i, s in enumerate(shares)]:
            needs[label] = needs.get(label, 0.0) + part * model.need(n_ctx)
            per_token[label] = per_token.get(label, 0.0) + part * model.kv_per_token
    return _Plan(needs, per_token)


def _largest_ctx(models: Sequence[Footprint], gpu_layers: int, shares: Sequence[float],
                 devices: dict[str, Device]) -> int:
    plan = _plan(models, 0, gpu_layers, shares)  # weights alone
    room = [(devices[label].free - need) / plan.kv_per_token[label] for label, need in plan.needs.items()
            if label in devices and plan.kv_per_token[label] > 0]
    n_ctx = int(min(room, default=0))
    return n_ctx - n_ctx % 256 if n_ctx >= 512 else n_ctx


def check_fits(paths: Sequence[Path], n_ctx: int, *, runtime: str, kv_cache: str, dtype: Optional[str] = None,
               gpu_layers: int = 0, gpu_split: Optional[Sequence[float]] = None, converting: bool = False) -> None:
    """Raise MemoryShort when the models at paths, loaded together by runtime, do not fit.

    dtype: the element type the runtime loads weights in (None: a GGUF's own tensors);
    kv_cache: the KV cache's element type; gpu_layers: blocks of each model offloaded to GPUs
    (0: all in RAM), shared across GPUs by gpu_split (None: by their free memory); converting:
    the GGUFs are dequantized first, in RAM (footprint)."""
    if converting and gpu_layers > 0:  # dequantized in RAM first, then moved to the GPUs
        check_fits(paths, n_ctx, runtime=runtime, kv_cache=kv_cache, dtype=dtype, gpu_layers=gpu_layers,
                   gpu_split=gpu_split)
        gpu_layers = 0
    try:
        models = [footprint(path, dtype, kv_cache, converting) for path in paths]
    except Uncounted:
        return
    devices = {device.label: device for device in ([ram()] + (gpus() if gpu_layers > 0 else [])) if device}
    found = [device.free for label, device in devices.items() if label != "RAM"]
    shares = tuple(gpu_split)[:len(found)] if gpu_split else tuple(found)
    if not any(shares):
        shares = ()  # no GPU seen: the runtime runs on the CPU, or fails to offload by itself
    plan = _plan(models, n_ctx, gpu_layers, shares)
    short = plan.short(devices)
    if not short:
        return
    label, missing = max(short, key=lambda item: item[1])
    device = devices[label]
    what = " + ".join(model.name for model in models)
    weights = sum(model.weights for model in models)
    kv = sum(model.kv_per_token for model in models) * n_ctx
    where = f"on {runtime}" + (f" in {dtype}" if dtype else "") + (", converting the GGUF" if converting else "")
    fits = []
    smaller = SMALLER_DTYPE.get(dtype or "")
    if smaller:
        halved = [footprint(path, smaller, "bf16" if kv_cache == "f32" else kv_cache, converting) for path in paths]
        if not _plan(halved, n_ctx, gpu_layers, shares).short(devices):
            fits.append(f"--dtype {smaller} ({gib(sum(m.need(n_ctx) for m in halved))})")
    n_fit = _largest_ctx(models, gpu_layers, shares, devices)
    if n_fit >= MIN_CTX:
        fits.append(f"--n-ctx {n_fit} or less")
    if shares and len(shares) > 1:
        by_free = tuple(devices[f"GPU {i}"].free for i in range(len(shares)))
        if min(by_free) > 0 and tuple(shares) != by_free and not _plan(models, n_ctx, gpu_layers, by_free).short(devices):
            fits.append("--gpu-split " + ",".join(f"{free / min(by_free):.2g}" for free in by_free))
    advice = ("would fit: " + ", ".join(fits)) if fits else "nothing smaller in dtype, context or split fits: " \
        "a smaller model or quantization, or more memory"
    raise MemoryShort(
        f"not enough memory for {what} {where}: {gib(plan.needs[label])} on {label} (weights {gib(weights)} "
        f"and KV cache {gib(kv)} for n_ctx {n_ctx} in all) but {gib(device.free)} free ({device.source}), "
        f"{gib(missing)} short", advice)


def check_gguf_fits(paths: Sequence[Path], options: "RuntimeOptions", runtime: str, gpu: bool) -> None:
    """check_fits for llama.cpp's runtimes: a GGUF's own tensors, the KV cache --f32-kv-cache
    says, options.n_gpu_layers blocks offloaded where the build has a GPU (gpu)."""
    check_fits(paths, options.n_ctx, runtime=runtime, kv_cache="f32" if options.f32_kv_cache else "f16",
               gpu_layers=options.n_gpu_layers if gpu else 0, gpu_split=options.gpu_split)


def plan_processes(runtime: str, names: Sequence[str], check: Callable[[Sequence[int]], None]) -> bool:
    """Whether the processes called names (in the order they run one after the other) fit in
    memory all at once (True), or only one at a time (False: said once, on stderr). check(indices)
    raises MemoryShort when those processes together do not fit; a process that does not fit
    alone is refused with its own MemoryShort."""
    try:
        check(range(len(names)))
        return True
    except MemoryShort as together:
        for index in range(len(names)):
            check([index])
        click.echo(f"note: {runtime}'s {' and '.join(names)} do not fit in memory together ({together.shortage}), so "
                   f"they run one after the other: {', then '.join(names)}", err=True)
        return False



_held_here = threading.local()


@contextlib.contextmanager
def loading(lock_file: Optional[Path]):
    """Held while a run checks its models' memory and loads them, by the runs that share
    lock_file (parity --jobs starts its runs at once, each checking against memory free now):
    a second run's check waits until the first run's models are in memory, counted in what is
    free. None: nothing held. Re-entered freely by one thread."""
    depth = getattr(_held_here, "depth", 0)
    if lock_file is None:
        yield
        return
    if depth:
        _held_here.depth = depth + 1
        try:
            yield
        finally:
            _held_here.depth -= 1
        return
    Path(lock_file).parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(lock_file, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        _held_here.depth = 1
        yield
    finally:
        _held_here.depth = 0
        os.close(descriptor)  # releases the lock
