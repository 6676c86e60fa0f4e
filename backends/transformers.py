"""HF transformers (torch), in-process: crossrt's driven loop over a model's forward pass, and
HF's own assisted generation as the native mode (backends/transformers_native.py).

Models load in --dtype from a transformers folder, or from a .gguf through transformers' GGUF
loader, whose slow dequantization is cached as a transformers folder per dtype, checked by its
files' digests on every load. A session keeps one DynamicCache and evaluates at explicit
positions, the same contract as on llama.cpp. The cache, dtypes and measured loads:
docs/real-models.md, "GGUF files in transformers" and "Half precision, per-dtype conversions".
(This is crossrt.backends.transformers: `import transformers` still means the package.)
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from crossrt.errors import ModelError, SettingsError
from crossrt.run.memory import ALL_LAYERS, check_fits
from crossrt.inputs.pairs import model_files
from crossrt.run.runtime import DTYPES, DraftRules, ModelSession, Rows, Runtime, RuntimeOptions, RuntimeUnavailable
from crossrt.records.schema import LoadedFile, RuntimeInfo
from crossrt.backends import transformers_plants
from crossrt.backends.transformers_conversion import (DIGESTS, conversion_files, dequantized_folder, each_gguf_read_once,
                                                      save_dequantized)


class _ImportedOnFirstUse:
    """A module imported when one of its attributes is first read. torch and transformers take
    ~3.5 CPU-s to import, and most processes that import this runtime's class only list runtimes
    or read its attributes (`crossrt runtimes --usable`, a parity matrix's parent process, which
    runs transformers in a child of its own)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self._name), attribute)


torch = _ImportedOnFirstUse("torch")
transformers = _ImportedOnFirstUse("transformers")

KV_CACHE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
INSTALL_HINT = "run scripts/setup, or pip install 'crossrt[hf]' (torch, transformers, accelerate)"
LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError)


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode on its device, the end-of-generation ids its configuration names
    (read before generation_config is replaced by a clean one), and its tokenizer: the one a
    GGUF conversion made, else the folder's, loaded on first use (re-scoring never tokenizes,
    and Gemma 3's tokenizer takes ~2 CPU-s to load)."""

    model: "transformers.PreTrainedModel"
    eog_ids: frozenset[int]
    folder: Path
    converted_tokenizer: Optional["transformers.PreTrainedTokenizerBase"] = None

    @functools.cached_property
    def tokenizer(self) -> "transformers.PreTrainedTokenizerBase":
        if self.converted_tokenizer is not None:
            return self.converted_tokenizer
        try:
            return _folder_tokenizer(self.folder)
        except LOAD_ERRORS as error:
            raise ModelError(f"transformers could not load the tokenizer of {self.folder}: {error}") from None


def device_of(options: RuntimeOptions) -> str:
    """"cuda" when layers are asked on the GPU and torch sees one: a transformers model runs
    whole on one device, so any n_gpu_layers > 0 means all of it, as a large value does in
    llama.cpp; without CUDA it stays on the CPU, as llama.cpp does."""
    return "cuda" if options.n_gpu_layers > 0 and torch.cuda.is_available() else "cpu"


def dtype_of(options: RuntimeOptions) -> str:
    """--dtype, else float32 on the CPU (half-precision matmuls are slow there, and float32 is
    what logit parity with llama.cpp's F32 models needs) and half precision on a GPU: bfloat16
    where it has bfloat16 kernels, float16 on older ones (a T4). One dtype serves both models
    of a run, so the default does not read each model's config."""
    if options.dtype is not None:
        if options.dtype not in DTYPES:
            raise SettingsError(f"transformers loads weights in {', '.join(DTYPES)}, not {options.dtype!r}")
        return options.dtype
    if device_of(options) == "cpu":
        return "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def load_model(path: Path, options: RuntimeOptions) -> LoadedModel:
    """Load a transformers folder (config.json) or a .gguf file, in dtype_of(options), on the
    options' device, once crossrt.run.memory has found room for it there.

    The model's generation_config is replaced by one holding only its special token ids, so
    model.generate() is plain greedy decoding whatever sampling or penalty settings the model
    ships with (a shipped repetition_penalty would otherwise change even greedy outputs).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    dtype, cached, tokenizer_source = dtype_of(options), None, None
    if path.suffix == ".gguf":
        cached, float32 = dequantized_folder(path, dtype), dequantized_folder(path)
        if (read := conversion_files(cached, path)) is not None:
            source, extra = cached, {}
        elif float32 != cached and (read := conversion_files(float32, path)) is not None:  # cast, not reading the GGUF
            source, extra, tokenizer_source = float32, {}, float32
        else:
            source, extra, read = path.parent, {"gguf_file": path.name}, model_files(path)
    elif (path / "config.json").is_file():
        source, extra, read = path, {}, model_files(path)
    else:
        raise ModelError(f"{path}: expected a transformers folder with config.json, or a .gguf file")
    if options.gpu_split:
        raise SettingsError("the transformers runtime runs a model on one device; --gpu-split is not supported")
    on_gpu = device_of(options) == "cuda"  # the whole model, on the first GPU
    check_fits([path], options.n_ctx, runtime="transformers", kv_cache=KV_CACHE[dtype], dtype=dtype,
               gpu_layers=ALL_LAYERS if on_gpu else 0, gpu_split=(1.0,), converting=bool(extra))
    torch.set_num_threads(options.threads)
    # Progress bars and load reports would interleave with crossrt's own progress output.
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    # The GGUF loader draws its own progress bar on stderr, with no switch to turn it off.
    quiet = contextlib.redirect_stderr(io.StringIO()) if extra else contextlib.nullcontext()
    try:
        # local_files_only: a path that is not a local model must fail here, never reach for a hub.
        with quiet, each_gguf_read_once() if extra else contextlib.nullcontext():
            model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype),
                                                                      local_files_only=True, **extra)
            converting = bool(extra) or tokenizer_source is not None
            tokenizer = _folder_tokenizer(tokenizer_source) if tokenizer_source else \
                transformers.AutoTokenizer.from_pretrained(source, local_files_only=True, **extra) if extra else None
    except LOAD_ERRORS as error:
        via = f" from its cached conversion {source} (delete it to convert again)" \
            if source in (cached, tokenizer_source) else ""
        raise ModelError(f"transformers could not load {path}{via}: {error}") from None
    if dtype == "float16":
        _check_float16_range(model.eval(), path)  # before caching a conversion that cannot run
    if converting:
        save_dequantized(model, tokenizer, cached, path)
    _read[(str(path.resolve()), dtype)] = read
    model.to(device_of(options)).eval()
    shipped = model.generation_config
    eog = _ids(shipped.eos_token_id) | _ids(model.config.get_text_config().eos_token_id)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=shipped.bos_token_id, eos_token_id=sorted(eog) or None,
        pad_token_id=shipped.pad_token_id if shipped.pad_token_id is not None else min(eog, default=None))
    return LoadedModel(model, frozenset(eog), cached if converting else source, tokenizer)


def _check_float16_range(model, path: Path) -> None:
    """Refuse a model whose activations pass float16's range (65,504): its logits are NaN and
    every greedy token would be id 0. Gemma 3 270M does at its 9th block on the BOS token alone
    (docs/real-models.md), so one BOS forward finds such a model before any prompt runs."""
    bos = model.config.get_text_config().bos_token_id
    probe = torch.tensor([[bos if isinstance(bos, int) else 0]], device=model.device)
    with torch.inference_mode():
        logits = model(input_ids=probe).logits
    if not torch.isfinite(logits).all():
        raise ModelError(f"{path} overflows float16 (its activations pass 65,504: the logits are NaN); "
                         "use --dtype bfloat16, or float32")


# What load_model read for a model file in a dtype, the last time in this process: the record
# names it (TransformersRuntime.loaded_files), after the run's models are loaded.
_read: dict[tuple[str, str], tuple[LoadedFile, ...]] = {}
# Files of a transformers folder that do not make its tokenizer (config.json is read for its
# model_type and tokenizer_class only).
NOT_TOKENIZER = {"config.json", "generation_config.json", "model.safetensors.index.json", DIGESTS}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_tokenizers: dict[tuple, "transformers.PreTrainedTokenizerBase"] = {}


def _folder_tokenizer(folder: Path):
    """The tokenizer of a transformers folder, loaded once per process for folders whose
    tokenizer files are the same bytes: a target and its layer-skip drafter share Gemma 3's
    262,144-token tokenizer, ~2 CPU-s to load. Tokenizers are only read by sessions (encode,
    decode, chat templates), so one object serves both."""
    config = json.loads((folder / "config.json").read_text())
    files = sorted((p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in folder.iterdir()
                   if p.is_file() and p.name not in NOT_TOKENIZER and not p.name.endswith(WEIGHT_SUFFIXES))
    key = (config.get("model_type"), config.get("tokenizer_class"), tuple(files))
    if key not in _tokenizers:
        with _parsed_once(folder / "tokenizer.json"):
            _tokenizers[key] = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return _tokenizers[key]


@contextlib.contextmanager
def _parsed_once(path: Path):
    """While transformers loads a tokenizer, json.load parses the file path once, not twice.

    For a tokenizer class that builds its backend from the file's vocabulary and merges (Gemma
    3's GemmaTokenizer), transformers 5.24 parses the whole tokenizer.json for its added tokens
    (_from_pretrained, where tokenizer_config.json has no added_tokens_decoder, as in the
    conversions save_pretrained writes) and again for the vocabulary and merges
    (convert_to_native_format): ~1 CPU-s each for Gemma 3's 33 MB file. Every read after the
    first gets the first's values: a new top-level dict and new added-token dicts each time, the
    parts a reader changes (the first pops "added_tokens" and each token's "id"); the rest, the
    vocabulary and merges, is only read or copied. The tokenizer is built from the same values.
    """
    parse, target, parsed = json.load, os.path.realpath(path), []

    def load(handle, **options):
        name = getattr(handle, "name", None)
        if options or not isinstance(name, str) or os.path.realpath(name) != target:
            return parse(handle, **options)
        if not parsed:
            parsed.append(parse(handle))
        value = parsed[0]
        if not isinstance(value, dict):
            return value
        fresh = dict(value)
        if isinstance(fresh.get("added_tokens"), list):
            fresh["added_tokens"] = [dict(t) if isinstance(t, dict) else t for t in fresh["added_tokens"]]
        return fresh

    json.load = load
    try:
        yield
    finally:
        json.load = parse


def synchronize(device: "torch.device") -> None:
    """Wait for queued GPU work, so a timer read next measures it; CPU work is already done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tokenize(tokenizer, text: str) -> list[int]:
    """Ids of text with the special tokens the tokenizer adds itself (BOS for llama-style ones);
    special-token texts in the prompt are parsed as those tokens, as llama.cpp does with special=True."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def chat_template_ids(tokenizer, messages: list[dict], template: str, variables: dict) -> list[int]:
    """transformers' own rendering and tokenization of a chat turn (apply_chat_template, which
    tokenizes the rendering with add_special_tokens=False), for crossrt's template parity."""
    return list(tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                              tokenize=True, return_dict=False, **variables))


class TransformersSession(ModelSession):
    def __init__(self, loaded: LoadedModel, options: RuntimeOptions):
        self._model = loaded.model
        self._loaded = loaded  # its tokenizer is loaded when first needed
        self._device = self._model.device
        self.eog_ids = loaded.eog_ids
        # Logits have one column per output row of the LM head, which can exceed the tokenizer.
        self.n_vocab = int(self._model.get_output_embeddings().weight.shape[0])
        self.n_ctx = options.n_ctx
        self._cache = self._new_cache()
        self._tap: Optional[tuple[tuple[int, ...], Callable]] = None  # tap_layers

    def tap_layers(self, layer_ids: Sequence[int], observer: Optional[Callable]) -> None:
        self._tap = None if observer is None else (tuple(layer_ids), observer)

    def input_embeddings(self) -> "torch.Tensor":
        return self._model.get_input_embeddings().weight

    def _new_cache(self) -> "transformers.DynamicCache":
        cache = transformers.DynamicCache(config=self._model.config)
        # Sliding-window layers drop old states unless told to keep them until the next crop,
        # which rolling back a rejected draft needs.
        cache.activate_past_recording()
        return cache

    def _forward(self, tokens: Sequence[int], rows: Rows) -> np.ndarray:
        n_tokens = len(tokens)
        input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self._device)
        positions = torch.arange(self._n_past, self._n_past + n_tokens, device=self._device).unsqueeze(0)
        tapped = {"output_hidden_states": True} if self._tap is not None else {}
        with torch.inference_mode():
            if rows is Rows.NONE:
                # The base model fills the cache without the LM head: no logits are computed.
                output = self._model.base_model(input_ids=input_ids, position_ids=positions, cache=self._cache,
                                                use_cache=True, **tapped)
                synchronize(self._device)  # nothing is read back to wait for it, and the loop times prefills
                logits = np.empty((0, self.n_vocab), dtype=np.float32)
            else:
                keep = 1 if rows is Rows.LAST else 0  # 0 keeps every row
                output = self._model(input_ids=input_ids, position_ids=positions, cache=self._cache,
                                     use_cache=True, logits_to_keep=keep, **tapped)
                logits = output.logits[0].float().cpu().numpy()
            if self._tap is not None:  # hidden_states[i]: the input to layer i
                layer_ids, observer = self._tap
                observer(self._n_past, tuple(tokens),
                         torch.cat([output.hidden_states[i][0] for i in layer_ids], -1).float().cpu().numpy())
        return logits

    def _drop(self, n_keep: int) -> None:
        if n_keep == 0:
            self._cache = self._new_cache()
        else:
            self._cache.crop(n_keep - self._n_past)  # transformers 5 crops by a negative count

    def _release(self) -> None:
        # The session holds the only references to its model and cache; on a GPU the caching
        # allocator keeps freed blocks until asked to give them back.
        self._model = self._cache = self._loaded = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def tokenize(self, text: str) -> list[int]:
        return tokenize(self._loaded.tokenizer, text)

    def chat_template_ids(self, messages: list[dict], template: str, variables: dict) -> list[int]:
        return chat_template_ids(self._loaded.tokenizer, messages, template, variables)

    def detokenize(self, ids: Sequence[int]) -> str:
        # Byte-level tokenizers already replace a split multi-byte character when decoding.
        return self._loaded.tokenizer.decode(list(ids), skip_special_tokens=True)


class TransformersRuntime(Runtime):
    name = "transformers"
    # A transformers folder when the pair names one, else the GGUF file, dequantized on load.
    model_format = ("hf", "gguf")
    modes = ("driven", "native")
    native_draftings = ("hf-prompt-lookup",)  # generate()'s prompt lookup

    @classmethod
    def check_available(cls) -> None:
        missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
        if missing:
            raise RuntimeUnavailable(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: "
                                     f"{INSTALL_HINT}")

    def load(self, path: Path) -> TransformersSession:
        transformers_plants.install(TransformersSession)  # a planted bug, only where asked for (tests)
        return TransformersSession(load_model(path, self.options), self.options)

    def open_native(self, target: Path, drafter: Path, rules: DraftRules, work_dir: Path, strategy=None):
        """HF's assisted generation, or its prompt lookup under a strategy drafting hf-prompt-lookup
        (no drafter loaded); it writes no logs or files, so work_dir stays unused."""
        from crossrt.backends.transformers_native import (AssistedSession, PromptLookupSession, check_lookup_rules,
                                                          check_rules)

        if strategy is not None:
            check_lookup_rules(rules, strategy)  # before loading the target, which takes a while on real ones
            return PromptLookupSession(load_model(target, self.options), rules, strategy, self.options)
        check_rules(rules)
        return AssistedSession(load_model(target, self.options), load_model(drafter, self.options), rules, self.options)

    def loaded_files(self, path: Path) -> Optional[tuple[LoadedFile, ...]]:
        """What the last load of path in this run's dtype read in this process: the GGUF file,
        or its cached conversion's files (checked), or the transformers folder's."""
        return _read.get((str(Path(path).resolve()), dtype_of(self.options)))

    def info(self) -> RuntimeInfo:
        return RuntimeInfo(
            name=self.name,
            version=transformers.__version__,
            build=f"torch {torch.__version__}",
            device="gpu" if device_of(self.options) == "cuda" else "cpu",
            threads=self.options.threads,
            gpu_split=None,
            kv_cache=KV_CACHE[dtype_of(self.options)],  # the cache takes the model's dtype
            dtype=dtype_of(self.options),
        )
