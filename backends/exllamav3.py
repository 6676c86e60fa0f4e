"""exllamav3 (pinned 1.6.5) on CUDA: crossrt's driven loop over its forward pass with a Cache,
and exllamav3's own speculative Generator as the native mode (backends/exllamav3_native.py).

File:line references are to the exllamav3 1.6.5 wheel; docs/exllamav3.md lists them all.

- `import exllamav3` JIT-compiles its CUDA extension and fails without CUDA (ext.py), so this
  module never imports it at load time: check_available looks with find_spec only, and the
  package is imported inside the functions that run after the check has passed.
- Models: an EXL3 folder, or an unquantized HF folder, which exllamav3 loads directly with every
  weight cast to FP16 (float2half in modules/linear.py:247, rmsnorm.py:54, embedding.py:126).
  The KV cache is FP16 (cache/cache.py CacheLayer_fp16, the default layer type).
- A driven session owns one Cache and evaluates at explicit positions with the rectangular
  cache mode, batch_shape (1, capacity) and past_len = n_past (modules/attn.py:95-122), the mode
  exllamav3's own warmup drives (model/model.py:329-336): K/V rows are written from past_len on,
  so truncate only moves n_past back and the next evaluation overwrites the tail. Models with
  recurrent layers keep state outside the KV cache and cannot be cut back that way.
- The LM head is padded to a multiple of 128 columns (modules/linear.py:54, 77) and forward()
  returns them all: logits are sliced to config.vocab_size, as lm_head_argmax does
  (model/model.py:422). Rows.NONE runs model.prefill, which stops after the last layer with a
  KV cache (model/model.py:368) and never computes logits; Rows.LAST sets last_tokens_only,
  which narrows the state before the head (model/model_ls.py:369).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from crossrt.runtime import DraftRules, ModelSession, Rows, Runtime, RuntimeOptions, RuntimeUnavailable
from crossrt.schema import RuntimeInfo

PINNED_VERSION = "1.6.5"
PAGE_SIZE = 256  # exllamav3/constants.py:2; a Cache holds a multiple of it (cache/cache.py:117)
INSTALL_HINT = (f"on a machine with an NVIDIA GPU, pip install 'crossrt[exl3]' (exllamav3=={PINNED_VERSION}) "
                "with a CUDA build of torch>=2.6, nvcc and ninja for its JIT-compiled extension; "
                "scripts/gpu_check runs it there (docs/exllamav3.md)")


def _nvcc() -> Optional[str]:
    """The nvcc torch's extension build would run, looked up as exllamav3 does
    (util/cuda_flags.py:18-30)."""
    if os.environ.get("PYTORCH_NVCC"):
        return os.environ["PYTORCH_NVCC"]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def missing_requirements() -> list[str]:
    """What this machine lacks to run exllamav3, without importing it; empty when nothing."""
    problems = []
    if importlib.util.find_spec("torch") is None:
        problems.append("torch is not installed")
    else:
        import torch

        if torch.version.cuda is None:
            problems.append(f"torch {torch.__version__} is a build without CUDA")
        elif not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} sees no CUDA GPU")
    if importlib.util.find_spec("exllamav3") is None:
        problems.append("exllamav3 is not installed")
    elif importlib.util.find_spec("exllamav3_ext") is None:
        # No prebuilt extension: the first import compiles one (ext.py) with nvcc and ninja.
        if _nvcc() is None:
            problems.append("no nvcc (PATH or CUDA_HOME) to compile exllamav3's extension")
        if shutil.which("ninja") is None:
            problems.append("no ninja on PATH to run exllamav3's extension build")
    return problems


def page_round(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def use_per_device(shares: Sequence[float], totals_gib: Sequence[float]) -> list[float]:
    """--gpu-split shares as exllamav3's use_per_device, GiB per GPU (model/model.py:662 multiplies
    by 1024**3): the GPU with the largest share may use all its memory, the others the same
    fraction scaled by their share; 0 leaves a GPU out. exllamav3 fills the GPUs in order up to
    these caps (model/model_ls.py _load_autosplit), so the caps bound each GPU's part of the model
    rather than set it in proportion as llama.cpp's tensor_split does."""
    if len(shares) > len(totals_gib):
        raise ValueError(f"--gpu-split gives {len(shares)} shares but torch sees {len(totals_gib)} GPU(s)")
    top = max(shares)
    return [round(total * share / top, 3) for share, total in zip(shares, totals_gib)]


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
        raise ValueError(f"{path}: expected an EXL3 or HF model folder with config.json")
    try:
        config = config or exllamav3.Config.from_directory(str(path))
        if component not in config.model_classes:
            raise ValueError(f"{config.architecture} has no {component!r} component")
        return config, exllamav3.Model.from_config(config, component=component)
    except (AssertionError, KeyError, OSError, ValueError) as error:
        raise ValueError(f"exllamav3 could not read {path}: {error}") from None


def check_options(options: RuntimeOptions) -> None:
    """Refuse what exllamav3 cannot do before anything is loaded."""
    if options.f32_kv_cache:
        raise ValueError("exllamav3 keeps K/V in FP16 or quantized (cache/fp16.py, cache/quant.py): "
                         "it has no F32 KV cache; leave --f32-kv-cache off")


def load_with_cache(model, capacity: int, options: RuntimeOptions, max_history: int = 0, draft_model=None):
    """Load model's weights with a Cache of capacity tokens, created first so that loading
    allocates it (cache/cache.py:144-146), then warm it up before any Generator uses the cache
    (model/model.py:232), so Triton compilation does not land in the first prompt's timings."""
    import exllamav3
    import torch

    cache = exllamav3.Cache(model, max_num_tokens=capacity, max_history=max_history)
    split = {}
    if options.gpu_split:
        totals = [torch.cuda.get_device_properties(i).total_memory / 1024**3 for i in range(torch.cuda.device_count())]
        split = {"use_per_device": use_per_device(options.gpu_split, totals)}
    try:
        # Without a split, exllamav3 spreads the model over every visible GPU keeping 0.5 GiB
        # free on each (model/model.py:642-652).
        model.load(draft_model=draft_model, **split)
        failures = model.warmup(cache=cache, max_chunk_size=min(2048, capacity), max_batch_size=1,
                                long_context=False)
    except (AssertionError, RuntimeError, ValueError) as error:
        raise ValueError(f"exllamav3 could not load {model.config.directory}: {error}") from None
    if failures:
        raise ValueError(f"exllamav3 cannot run {model.config.directory}: warmup passes failed: {failures}")
    return cache


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
        self.n_ctx = n_ctx
        self.n_vocab = loaded.vocab_size
        self.eog_ids = loaded.eog_ids
        self._n_past = 0

    def _forward(self, tokens: Sequence[int], rows: Rows) -> np.ndarray:
        import torch
        from exllamav3.util import cuda_sync_active

        model = self._loaded.model
        input_ids = torch.tensor([list(tokens)], dtype=torch.long)
        params = {"attn_mode": "flash_attn", "cache": self._loaded.cache,
                  "batch_shape": (1, self._capacity), "past_len": self._n_past}
        if rows is Rows.NONE:
            model.prefill(input_ids, params)
            cuda_sync_active()  # nothing is read back to wait for it, and the loop times prefills
            logits = np.empty((0, self.n_vocab), dtype=np.float32)
        else:
            if rows is Rows.LAST:
                params["last_tokens_only"] = 1
            logits = model.forward(input_ids, params)[0, :, :self.n_vocab].float().cpu().numpy()
        return logits

    def truncate(self, n_keep: int) -> None:
        self._n_past = max(0, min(n_keep, self._n_past))

    def tokenize(self, text: str) -> list[int]:
        return self._loaded.tokenize(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        import torch

        # HF's byte-level decoding replaces a split multi-byte character.
        return self._loaded.tokenizer.decode(torch.tensor(list(ids), dtype=torch.long), decode_special_tokens=False)

    def close(self) -> None:
        """Free the weights and the cache's GPU memory; safe to call twice."""
        if self._loaded is not None:
            self._loaded.model.unload()
            self._loaded = None


class ExllamaV3Runtime(Runtime):
    name = "exllamav3"
    model_format = "exl3"
    modes = ("driven", "native")

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
            raise ValueError(f"{path} is a {config.architecture} drafter: it drafts only inside exllamav3's "
                             "Generator (--mode native)")
        if model.caps.get("recurrent_states"):
            raise ValueError(f"{config.architecture} has recurrent layers whose state the driven loop cannot "
                             "roll back: use --mode native")
        capacity = page_round(self.options.n_ctx)
        cache = load_with_cache(model, capacity, self.options)
        return ExllamaV3Session(text_model(config, model, cache), self.options.n_ctx, capacity)

    def open_native(self, target: Path, drafter: Path, rules: DraftRules, work_dir: Path):
        """exllamav3's Generator drafting as rules.spec_type says (a drafter model, a DFlash block
        drafter, the target's MTP head); it writes no files, so work_dir stays unused."""
        from crossrt.backends.exllamav3_native import open_generator_session

        return open_generator_session(Path(target), Path(drafter), rules, self.options)

    def info(self) -> RuntimeInfo:
        import torch

        gpus = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return RuntimeInfo(
            name=self.name,
            version=importlib.metadata.version("exllamav3"),
            build=f"torch {torch.__version__}, CUDA {torch.version.cuda}, {' + '.join(gpus)}",
            device="gpu",
            threads=None,  # exllamav3 computes on GPUs only
            gpu_split=self.options.gpu_split,
            kv_cache="f16",
        )
