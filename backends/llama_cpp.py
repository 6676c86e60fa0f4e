"""llama.cpp in-process, through llama-cpp-python (pinned 0.3.36, vendoring llama.cpp 0c1e57098).

The session drives llama_decode through the low-level API with one reused batch and reads
logits with llama_get_logits, asking only for the output rows the loop needs. The high-level
`Llama.eval()` copies every row into `scores` and costs ~60 us of bookkeeping per call, which
is several percent of a step on small models (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from crossrt.errors import ModelError, PromptRefused, SettingsError
from crossrt.run.memory import check_gguf_fits
from crossrt.run.runtime import ModelSession, Rows, Runtime, RuntimeOptions, RuntimeUnavailable
from crossrt.records.schema import RuntimeInfo

# Where scripts/build_llama_tools builds llama.cpp once, for this binding and the native tools.
BUILD_BIN = Path(__file__).resolve().parents[1] / ".cache" / "llama-tools" / "build" / "bin"
# scripts/setup installs llama-cpp-python without a llama.cpp of its own; it loads libllama from
# LLAMA_CPP_LIB_PATH, read once at import, so the repository's build is named before the import.
if "LLAMA_CPP_LIB_PATH" not in os.environ and (BUILD_BIN / "libllama.so").is_file():
    os.environ["LLAMA_CPP_LIB_PATH"] = str(BUILD_BIN)

PINNED_VERSION = "0.3.36"
VENDORED_COMMIT = "0c1e57098"  # from llama-cpp-python's CHANGELOG for 0.3.36

_UNAVAILABLE = None  # why llama_cpp could not be imported, reported by check_available
try:
    import llama_cpp
    from llama_cpp import _internals
    from llama_cpp._logger import set_verbose
except ImportError:
    llama_cpp = _internals = None
    _UNAVAILABLE = ("llama-cpp-python is not installed: run scripts/setup, or "
                    f"pip install 'crossrt[llama]' (llama-cpp-python=={PINNED_VERSION})")
except (OSError, RuntimeError) as error:  # its loader's FileNotFoundError / RuntimeError
    llama_cpp = _internals = None
    _UNAVAILABLE = (f"llama-cpp-python cannot load llama.cpp ({error}): run scripts/build_llama_tools, "
                    "or set LLAMA_CPP_LIB_PATH to a directory holding libllama.so")


def vocab_model(path: Path):
    """llama-cpp-python's model of path with its vocabulary alone loaded (no weights), or
    RuntimeUnavailable saying why llama_cpp did not import."""
    if llama_cpp is None:
        raise RuntimeUnavailable(_UNAVAILABLE)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    return _internals.LlamaModel(path_model=str(path), params=params, verbose=False)


@functools.lru_cache(maxsize=1)
def _layer_input_functions() -> tuple[Callable, Callable]:
    """llama_set_embeddings_layer_inp and llama_get_embeddings_layer_inp of the loaded libllama,
    which exports them under their C++ names only (no extern "C" at the vendored commit)."""
    library = llama_cpp.llama_cpp._lib
    try:
        enable = library["_Z30llama_set_embeddings_layer_inpP13llama_contextjb"]
        read = library["_Z30llama_get_embeddings_layer_inpP13llama_contextj"]
    except AttributeError:
        raise SettingsError("this libllama has no layer-input capture (llama_set_embeddings_layer_inp): a head's "
                            f"driven run needs llama.cpp {VENDORED_COMMIT} or later") from None
    enable.argtypes, enable.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
    read.argtypes, read.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
    return enable, read


class LlamaCppSession(ModelSession):
    def __init__(self, path: Path, options: RuntimeOptions, n_outputs_max: int = 0, n_seq_max: int = 1):
        set_verbose(False)  # llama.cpp logs every graph reservation; keep errors only
        self.threads = options.threads
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = options.n_gpu_layers
        if options.gpu_split:
            # Kept alive on self: llama.cpp reads the array when the model loads.
            self._tensor_split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*options.gpu_split)
            model_params.tensor_split = self._tensor_split
        self._model = _internals.LlamaModel(path_model=str(path), params=model_params, verbose=False)

        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = options.n_ctx
        context_params.n_batch = options.n_ctx
        context_params.n_ubatch = min(options.n_ctx, 512)
        context_params.n_threads = options.threads
        context_params.n_threads_batch = options.threads
        context_params.n_outputs_max = n_outputs_max
        context_params.n_outputs_max_per_seq = n_outputs_max
        if n_seq_max > 1:
            # Tree verification (crossrt/speculative/loop.py, tree drafting): a token shared by several draft paths
            # belongs to all their sequences at once, which needs one KV stream for them all.
            context_params.n_seq_max = n_seq_max
            context_params.kv_unified = True
        context_params.no_perf = True
        context_params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if options.flash_attn
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        if options.f32_kv_cache:
            context_params.type_k = llama_cpp.GGML_TYPE_F32
            context_params.type_v = llama_cpp.GGML_TYPE_F32
        self._context = _internals.LlamaContext(model=self._model, params=context_params, verbose=False)
        self._ctx = self._context.ctx
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        # llama.cpp may round the context up; one batch must hold any evaluation that fits it,
        # so the usable context is the smaller of the two and the batch is allocated to match.
        self.n_ctx = min(llama_cpp.llama_n_ctx(self._ctx), llama_cpp.llama_n_batch(self._ctx))
        self._batch = llama_cpp.llama_batch_init(self.n_ctx, 0, 1)
        self.n_vocab = self._model.n_vocab()
        self.eog_ids = frozenset(t for t in range(self.n_vocab)
                                 if llama_cpp.llama_vocab_is_eog(self._model.vocab, t))
        self._add_bos = self._model.add_bos_token()
        self._path = path
        self._tap: Optional[tuple[tuple[int, ...], Callable]] = None  # tap_layers

    def tap_layers(self, layer_ids: Sequence[int], observer: Optional[Callable]) -> None:
        """As ModelSession's, through llama.cpp's own layer-input capture (what its EAGLE3
        drafting reads: src/llama-context.cpp), exported only under C++ names."""
        enable, _ = _layer_input_functions()
        if observer is not None:  # a graph that does not expose them aborts the process on its first decode
            from crossrt.inputs.gguf_file import gguf_metadata
            from crossrt.inputs.head_targets import refuse_unfeedable

            architecture = str(gguf_metadata(self._path).get("general.architecture", ""))
            refuse_unfeedable(architecture, "llama.cpp", "EAGLE3", f"runtime llama-cpp, {self._path.name}")
        for layer in self._tap[0] if self._tap else ():
            enable(self._ctx, layer, False)
        self._tap = None
        if observer is not None:
            for layer in layer_ids:
                enable(self._ctx, layer, True)
            self._tap = (tuple(layer_ids), observer)

    def input_embeddings(self):
        """The target's token embeddings as llama.cpp's get_rows reads them: token_embd.weight
        dequantized by gguf-py, whose tables follow ggml's (checked by parity's dequantization
        check). The file's layout is read by crossrt's reader: gguf-py's GGUFReader would first
        build a view of every vocabulary string (1.9 CPU-s for SmolLM2's 49,152; this 0.2)."""
        import mmap

        import torch
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        from crossrt.inputs.gguf_file import read_layout

        with open(self._path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            layout = read_layout(data)
            tensor = next((t for t in layout.tensors if t.name == "token_embd.weight"), None)
            if tensor is None:
                raise SettingsError(f"{self._path} has no token_embd.weight for a head to borrow")
            start = layout.data_start + tensor.offset
            raw = np.frombuffer(data, np.uint8, tensor.nbytes, start).copy()  # the map closes
        kind = GGMLQuantizationType(tensor.ggml_type)
        rows = dequantize(raw.reshape(self.n_vocab, -1), kind).reshape(self.n_vocab, -1)
        # A head that borrows this table as its LM head (a tied target) multiplies through ggml's
        # quantized matmul where it is quantized (crossrt/builders/dflash.py, q8_0).
        self.embeddings_quantized = kind.name not in ("F32", "F16", "BF16")
        return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))

    def _release(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
        self._context.close()
        self._model.close()

    def _forward(self, tokens: Sequence[int], rows: Rows) -> np.ndarray:
        n_tokens = len(tokens)
        batch = self._batch
        batch.n_tokens = n_tokens
        first_output = {Rows.NONE: n_tokens, Rows.LAST: n_tokens - 1, Rows.ALL: 0}[rows]
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = self._n_past + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i >= first_output
        code = llama_cpp.llama_decode(self._ctx, batch)
        if code != 0:
            raise PromptRefused(f"llama_decode returned {code} at position {self._n_past}")
        if self._tap is not None:
            _, layer_input = _layer_input_functions()
            width = llama_cpp.llama_model_n_embd(self._model.model)
            layers, observer = self._tap
            observer(self._n_past, tuple(tokens), np.concatenate(
                [np.ctypeslib.as_array(layer_input(self._ctx, layer), shape=(n_tokens, width)).copy()
                 for layer in layers], -1))
        n_rows = n_tokens - first_output
        if n_rows == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        pointer = llama_cpp.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, shape=(n_rows, self.n_vocab))

    def _drop(self, n_keep: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._memory, 0, n_keep, -1)

    def tokenize(self, text: str) -> list[int]:
        return self._model.tokenize(text.encode("utf-8"), add_bos=self._add_bos, special=True)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._model.detokenize(list(ids), special=False).decode("utf-8", errors="replace")


class LlamaCppRuntime(Runtime):
    name = "llama-cpp"
    model_format = "gguf"

    @classmethod
    def check_available(cls) -> None:
        if llama_cpp is None:
            raise RuntimeUnavailable(_UNAVAILABLE)

    @classmethod
    def build_notes(cls) -> list[str]:
        """The CPU kernels built, and what setup's probe said of them (backends/llama_build_probe.py)."""
        from crossrt.backends.llama_build_probe import read_record, with_build_note

        library = Path(os.environ.get("LLAMA_CPP_LIB_PATH", os.devnull))
        kernels = with_build_note(system_info(llama_cpp.llama_print_system_info().decode("utf-8", errors="replace")),
                                  library)
        record = read_record() if library.resolve() == BUILD_BIN.resolve() else None
        probed = ("not probed (scripts/setup probes it)" if record is None else
                  "passed its probe" if record.passed else "failed its probe, kept as CMAKE_ARGS asked")
        return [f"llama.cpp build {library}: {probed}", f"llama.cpp kernels: {kernels}"]

    def load(self, path: Path, n_outputs_max: int = 0) -> LlamaCppSession:
        """n_outputs_max > 0 caps the output rows per batch, as llama-speculative-simple does
        on its target context (1 + n_max); 0 leaves llama.cpp's default (n_batch)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        check_gguf_fits([path], self.options, self.name, gpu=llama_cpp.llama_supports_gpu_offload())
        try:
            return LlamaCppSession(path, self.options, n_outputs_max)
        except ValueError as error:
            raise ModelError(f"llama.cpp could not load {path}: {error}") from None

    def load_tree(self, path: Path, max_leaves: int) -> ModelSession:
        from crossrt.backends.llama_cpp_tree import load_tree_session  # its module imports this one

        return load_tree_session(self.options, path, max_leaves)

    def info(self) -> RuntimeInfo:
        from crossrt.backends.llama_build_probe import with_build_note  # it imports this module

        offloaded = self.options.n_gpu_layers > 0 and llama_cpp.llama_supports_gpu_offload()
        return RuntimeInfo(
            name=self.name,
            version=llama_cpp.__version__,
            build=VENDORED_COMMIT if llama_cpp.__version__ == PINNED_VERSION else None,
            device="gpu" if offloaded else "cpu",
            threads=self.options.threads,
            gpu_split=self.options.gpu_split,
            kv_cache="f32" if self.options.f32_kv_cache else "f16",
            flash_attn=self.options.flash_attn,
            system_info=with_build_note(system_info(llama_cpp.llama_print_system_info().decode("utf-8", errors="replace")),
                                        Path(os.environ.get("LLAMA_CPP_LIB_PATH", os.devnull))),
        )


def system_info(printed: str) -> str:
    """llama_print_system_info()'s text ("CPU : SSE3 = 1 | ... | REPACK = 1 | ") without the
    trailing separator: one form for the binding's and the tools' (llama_tools.probe)."""
    return printed.strip().removesuffix("|").rstrip()
