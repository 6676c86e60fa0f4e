"""exllamav3 (pinned 1.6.5) on CUDA: crossrt's driven loop over its forward pass with a Cache,
and exllamav3's own speculative Generator as the native mode (backends/exllamav3_native.py).

`import exllamav3` JIT-compiles its CUDA extension, so this module imports it only after
check_available (find_spec, no import) has passed. A driven session evaluates at explicit
positions in the rectangular cache mode, so truncate only moves n_past back; logits are sliced
from the padded head to vocab_size; evaluations run in chunks of min(2048, capacity).
Each rule with its file:line in the 1.6.5 wheel: docs/exllamav3.md, "Driven mode".
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from crossrt.errors import ModelError, SettingsError
from crossrt.run.runtime import DraftRules, ModelSession, Rows, Runtime, RuntimeOptions, RuntimeUnavailable
from crossrt.records.schema import RuntimeInfo

PINNED_VERSION = "1.6.5"
PAGE_SIZE = 256  # exllamav3/constants.py:2; a Cache holds a multiple of it (cache/cache.py:117)
MAX_CHUNK_SIZE = 2048  # the default of model.load and Generator (model/model.py:483, generator.py:47)
DEFAULT_CUDA_HOME = "/usr/local/cuda"  # torch's last guess for CUDA_HOME on Linux (cpp_extension._find_cuda_home)
GIB = 1024**3  # use_per_device is in GiB (model/model.py:662)
# safetensors dtypes exllamav3 loads narrower: FP32 weights become FP16 (loader/safetensors.py:842-843)
LOADED_ITEMSIZE = {"F64": 2, "F32": 2}
INSTALL_HINT = (f"on a machine with an NVIDIA GPU, pip install 'crossrt[exl3]' (exllamav3=={PINNED_VERSION}) "
                "with a CUDA build of torch>=2.6, nvcc and ninja for its JIT-compiled extension; "
                "scripts/gpu_check runs it there (docs/exllamav3.md)")


def cuda_home() -> Optional[str]:
    """torch's CUDA_HOME, found as torch.utils.cpp_extension does without importing it (that
    import prints a warning on machines without a GPU): CUDA_HOME or CUDA_PATH, else the folder
    above nvcc on PATH, else /usr/local/cuda when it exists."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    on_path = shutil.which("nvcc")
    if on_path:
        return os.path.dirname(os.path.dirname(on_path))
    return DEFAULT_CUDA_HOME if os.path.exists(DEFAULT_CUDA_HOME) else None


def nvcc_path() -> Optional[str]:
    """The nvcc exllamav3's extension build runs: its find_nvcc given torch's CUDA_HOME
    (ext.py:92-93, util/cuda_flags.py:18-30)."""
    if os.environ.get("PYTORCH_NVCC"):
        return os.environ["PYTORCH_NVCC"]
    for home in (cuda_home(), os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def missing_requirements() -> list[str]:
    """What this machine lacks to run exllamav3, without importing it; empty when nothing."""
    problems = []
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is None:
        problems.append("torch is not installed")
    else:
        version, cuda = _torch_build(torch_spec)
        if cuda is None:
            problems.append(f"torch {version} is a build without CUDA")
        else:
            import torch

            if not torch.cuda.is_available():
                problems.append(f"torch {version} sees no CUDA GPU")
    if importlib.util.find_spec("exllamav3") is None:
        problems.append("exllamav3 is not installed")
    elif importlib.util.find_spec("exllamav3_ext") is None:
        # No prebuilt extension: the first import compiles one (ext.py) with nvcc and ninja.
        if nvcc_path() is None:
            problems.append(f"no nvcc (PYTORCH_NVCC, CUDA_HOME, CUDA_PATH, PATH or {DEFAULT_CUDA_HOME}/bin) "
                            "to compile exllamav3's extension")
        if shutil.which("ninja") is None:
            problems.append("no ninja on PATH to run exllamav3's extension build")
    return problems


def _torch_build(spec) -> tuple[str, Optional[str]]:
    """torch's version and CUDA version, read from its torch/version.py (plain assignments) where
    torch is not imported yet: importing it costs ~3 CPU-s, and on a CPU-only build every command
    listing the usable runtimes paid that only to learn that exllamav3 cannot run."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__, sys.modules["torch"].version.cuda
    build: dict = {}
    version_file = Path(spec.submodule_search_locations[0]) / "version.py"
    try:
        exec(compile(version_file.read_text(), str(version_file), "exec"), build)
        return build["__version__"], build["cuda"]
    except (OSError, SyntaxError, ImportError, KeyError, TypeError):  # another layout: ask torch itself
        import torch

        return torch.__version__, torch.version.cuda


def page_round(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def chunk_size(capacity: int) -> int:
    return min(MAX_CHUNK_SIZE, capacity)


def chunk_plan(n_tokens: int, chunk: int, rows: Rows) -> list[tuple[int, int, Rows]]:
    """(start, end, rows) per forward pass of at most chunk tokens: logits only where the caller
    reads them (every chunk for Rows.ALL, the last one for Rows.LAST)."""
    bounds = [(start, min(start + chunk, n_tokens)) for start in range(0, n_tokens, chunk)]
    if rows is Rows.ALL:
        return [(start, end, Rows.ALL) for start, end in bounds]
    plan = [(start, end, Rows.NONE) for start, end in bounds]
    if rows is Rows.LAST:
        plan[-1] = (*bounds[-1], Rows.LAST)
    return plan


def loaded_tensor_bytes(folder: Path) -> dict[str, int]:
    """Bytes per tensor of a folder's *.safetensors as exllamav3 holds them, from the headers alone."""
    sizes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with path.open("rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            if entry["dtype"] in LOADED_ITEMSIZE:
                sizes[name] = LOADED_ITEMSIZE[entry["dtype"]] * math.prod(entry["shape"])
            else:
                sizes[name] = end - begin
    return sizes


def module_bytes(tensor_bytes: dict[str, int], keys: Sequence[str]) -> int:
    """Bytes of the first of keys (a module's key, then its alternatives, e.g. a tied head's
    embedding) that names any tensor: the tensor itself or those under "key."."""
    for key in keys:
        found = [size for name, size in tensor_bytes.items() if name == key or name.startswith(key + ".")]
        if found:
            return sum(found)
    return 0


def use_per_device(model_gib: float, shares: Sequence[float], totals_gib: Sequence[float]) -> list[float]:
    """--gpu-split shares as exllamav3's use_per_device for one model of model_gib (weights and
    cache). exllamav3 fills GPUs in order and moves on only when one is full (model/model_ls.py
    _load_autosplit, util/memory.py:60-80), so a GPU's share of the model is what it may take: the
    shares of model_gib, rounded up to 1 MiB, on every GPU but the last one with a share, which is
    left uncapped (its whole memory) to take what the estimate and layer boundaries leave. 0 leaves
    a GPU out."""
    if len(shares) > len(totals_gib):
        raise SettingsError(f"--gpu-split gives {len(shares)} shares but torch sees {len(totals_gib)} GPU(s)")
    last = max(i for i, share in enumerate(shares) if share > 0)
    limits = []
    for i, (share, total) in enumerate(zip(shares, totals_gib)):
        if i == last:
            limits.append(round(total, 3))
        else:
            limits.append(min(round(total, 3), math.ceil(model_gib * share / sum(shares) * 1024) / 1024))
    return limits


def gpu_memory_gib() -> list[float]:
    import torch

    return [torch.cuda.get_device_properties(i).total_memory / GIB for i in range(torch.cuda.device_count())]


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def adds_bos(folder: Path) -> bool:
    """Whether the model's own tokenizer starts a text with BOS, as HF's would: its
    tokenizer_config.json add_bos_token when set, else tokenizer.json's post-processor template.
    exllamav3 adds BOS only when asked (tokenizer/tokenizer.py:448, 521)."""
    config = _json(folder / "tokenizer_config.json")
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    processor = _json(folder / "tokenizer.json").get("post_processor") or {}
    steps = processor.get("processors", []) if processor.get("type") == "Sequence" else [processor]
    for step in steps:
        if step.get("type") == "TemplateProcessing":
            return "SpecialToken" in (step.get("single") or [{}])[0]
    return False


def build_model(path: Path, component: str = "text", config=None):
    """(config, model) of an exllamav3 or HF folder, weights not loaded yet; ValueError with the
    reason when exllamav3 cannot read it."""
    import exllamav3

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: expected an EXL3 or HF model folder with config.json")
    try:
        config = config or exllamav3.Config.from_directory(str(path))
        if component not in config.model_classes:
            raise ModelError(f"{config.architecture} has no {component!r} component")
        return config, exllamav3.Model.from_config(config, component=component)
    except (AssertionError, KeyError, OSError, ValueError) as error:
        raise ModelError(f"exllamav3 could not read {path}: {error}") from None


def check_options(options: RuntimeOptions) -> None:
    """Refuse what exllamav3 cannot do before anything is loaded."""
    if options.f32_kv_cache:
        raise SettingsError("exllamav3 keeps K/V in FP16 or quantized (cache/fp16.py, cache/quant.py): "
                         "it has no F32 KV cache; leave --f32-kv-cache off")


@dataclass(frozen=True)
class Placement:
    """What one model's load asked of exllamav3 under --gpu-split: its estimated size (weights as
    loaded plus its cache) and use_per_device, GiB per GPU; both None without a split (exllamav3's
    own placement)."""

    model: str
    size_gib: Optional[float]
    use_per_device: Optional[tuple[float, ...]]

    def describe(self) -> str:
        limits = "/".join(f"{gib:.3f}" for gib in self.use_per_device)
        return f"{self.model} ({self.size_gib:.3f} GiB) use_per_device {limits} GiB"


def model_size_gib(model, cache) -> float:
    """Weights of the modules exllamav3 places on GPUs (unquantized embeddings stay in system
    memory, modules/embedding.py:99-103) plus the cache's K/V (cache/fp16.py:92)."""
    tensor_bytes = loaded_tensor_bytes(Path(model.config.directory))
    weights = 0
    for module in model.modules:
        if module.caps.get("prefer_cpu"):
            continue
        alternatives = getattr(module, "alt_key", None) or []
        weights += module_bytes(tensor_bytes, [module.key, *([alternatives] if isinstance(alternatives, str)
                                                             else alternatives)])
    kv = sum(int(layer.storage_size()) for layer in cache.layers.values())
    return (weights + kv) / GIB


def load_with_cache(model, capacity: int, options: RuntimeOptions, max_history: int = 0, draft_model=None):
    """(cache, Placement): model's weights loaded with a Cache of capacity tokens, created first
    so that loading allocates it (cache/cache.py:144-146), for chunks of chunk_size(capacity) (the
    load prepares attention for one chunk on this cache, model/model_ls.py:104-115), then warmed
    up before any Generator uses the cache (model/model.py:232), so Triton compilation does not
    land in the first prompt's timings."""
    import exllamav3

    cache = exllamav3.Cache(model, max_num_tokens=capacity, max_history=max_history)
    chunk = chunk_size(capacity)
    placement, split = Placement(Path(model.config.directory).name, None, None), {}
    if options.gpu_split:
        size_gib = model_size_gib(model, cache)
        limits = use_per_device(size_gib, options.gpu_split, gpu_memory_gib())
        placement, split = Placement(placement.model, size_gib, tuple(limits)), {"use_per_device": limits}
    try:
        # Without a split, exllamav3 spreads the model over every visible GPU keeping 0.5 GiB
        # free on each (model/model.py:642-652).
        model.load(draft_model=draft_model, max_chunk_size=chunk, **split)
        failures = model.warmup(cache=cache, max_chunk_size=chunk, max_batch_size=1, long_context=False)
    except (AssertionError, RuntimeError, ValueError) as error:
        raise ModelError(f"exllamav3 could not load {model.config.directory}: {error}") from None
    if failures:
        raise ModelError(f"exllamav3 cannot run {model.config.directory}: warmup passes failed: {failures}")
    return cache, placement


@dataclass(frozen=True)
class TextModel:
    """A loaded model that tokenizes: what both modes need of the target."""

    model: object  # exllamav3.Model
    cache: object  # exllamav3.Cache
    tokenizer: object  # exllamav3.Tokenizer
    vocab_size: int
    eog_ids: frozenset[int]
    add_bos: bool

    def tokenize(self, text: str) -> list[int]:
        # encode_special_tokens: special-token texts in a prompt become those tokens, as llama.cpp
        # (special=True) and HF tokenizers parse them.
        return self.tokenizer.encode(text, add_bos=self.add_bos, encode_special_tokens=True)[0].tolist()


def text_model(config, model, cache) -> TextModel:
    import exllamav3

    tokenizer = exllamav3.Tokenizer.from_config(config)
    # The tokenizer adds the EOS ids of tokenizer_config.json and generation_config.json to the
    # config's list (tokenizer/tokenizer.py:201-216), so it is read after the tokenizer is made.
    return TextModel(model, cache, tokenizer, config.vocab_size, frozenset(config.eos_token_id_list),
                     adds_bos(Path(config.directory)))


class ExllamaV3Session(ModelSession):
    def __init__(self, loaded: TextModel, n_ctx: int, capacity: int):
        self._loaded = loaded
        self._capacity = capacity
        self._chunk = chunk_size(capacity)
        self.n_ctx = n_ctx
        self.n_vocab = loaded.vocab_size
        self.eog_ids = loaded.eog_ids

    def _forward(self, tokens: Sequence[int], rows: Rows) -> np.ndarray:
        import torch
        from exllamav3.util import cuda_sync_active

        model = self._loaded.model
        input_ids = torch.tensor([list(tokens)], dtype=torch.long)
        pieces = []
        for start, end, piece_rows in chunk_plan(len(tokens), self._chunk, rows):
            params = {"attn_mode": "flash_attn", "cache": self._loaded.cache,
                      "batch_shape": (1, self._capacity), "past_len": self._n_past + start}
            if piece_rows is Rows.NONE:
                model.prefill(input_ids[:, start:end], params)
                continue
            if piece_rows is Rows.LAST:
                params["last_tokens_only"] = 1
            pieces.append(model.forward(input_ids[:, start:end], params)[0, :, :self.n_vocab].float().cpu().numpy())
        if not pieces:
            cuda_sync_active()  # nothing is read back to wait for it, and the loop times prefills
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _drop(self, n_keep: int) -> None:
        """Nothing to free: positions at and after past_len are overwritten by the next forward."""

    def tokenize(self, text: str) -> list[int]:
        return self._loaded.tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        import torch

        # HF's byte-level decoding replaces a split multi-byte character.
        return self._loaded.tokenizer.decode(torch.tensor(list(ids), dtype=torch.long), decode_special_tokens=False)

    def _release(self) -> None:
        """Free the weights and the cache's GPU memory."""
        self._loaded.model.unload()
        self._loaded = None


class ExllamaV3Runtime(Runtime):
    name = "exllamav3"
    model_format = "exl3"
    modes = ("driven", "native")

    def __init__(self, options: RuntimeOptions):
        super().__init__(options)
        self._placements: list[Placement] = []

    @classmethod
    def check_available(cls) -> None:
        problems = missing_requirements()
        if problems:
            raise RuntimeUnavailable(f"exllamav3 cannot run here: {'; '.join(problems)}. Fix: {INSTALL_HINT}")

    def load(self, path: Path) -> ExllamaV3Session:
        """A driven session over one model; the GPU split and n_ctx come from the options
        (n_gpu_layers does not apply: exllamav3 runs every layer on a GPU)."""
        check_options(self.options)
        config, model = build_model(path)
        if model.caps.get("dflash_draft") or model.caps.get("mtp_draft"):
            raise SettingsError(f"{path} is a {config.architecture} drafter: it drafts only inside exllamav3's "
                             "Generator (--mode native)")
        if model.caps.get("recurrent_states"):
            raise SettingsError(f"{config.architecture} has recurrent layers whose state the driven loop cannot "
                             "roll back: use --mode native")
        capacity = page_round(self.options.n_ctx)
        cache, placement = load_with_cache(model, capacity, self.options)
        self._placements.append(placement)
        return ExllamaV3Session(text_model(config, model, cache), self.options.n_ctx, capacity)

    def open_native(self, target: Path, drafter: Path, rules: DraftRules, work_dir: Path):
        """exllamav3's Generator drafting as rules.spec_type says (a drafter model, a DFlash block
        drafter, an MTP head); it writes no files, so work_dir stays unused."""
        from crossrt.backends.exllamav3_native import open_generator_session

        session = open_generator_session(Path(target), Path(drafter), rules, self.options)
        self._placements.extend(session.placements)
        return session

    def info(self) -> RuntimeInfo:
        import torch

        gpus = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        build = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {' + '.join(gpus)}"
        if self.options.gpu_split and self._placements:
            # The shares become per-model memory limits: record the ones the loads used.
            build += "; " + "; ".join(placement.describe() for placement in self._placements)
        return RuntimeInfo(
            name=self.name,
            version=importlib.metadata.version("exllamav3"),
            build=build,
            device="gpu",
            threads=None,  # exllamav3 computes on GPUs only
            gpu_split=self.options.gpu_split,
            kv_cache="f16",
        )
