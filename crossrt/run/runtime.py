"""The contract a runtime implements, and the lazy registry of runtimes.

The registry maps a runtime's name to "module:Class" so that `import crossrt` never imports
llama_cpp, torch or exllamav3: a runtime's module is imported only when that runtime is used.

A runtime is given its options (RuntimeOptions) and, for its own speculative decoding, the
drafting rules (DraftRules); it loads models as sessions (crossrt/speculative/session.py), whose names
this module gives too, so a backend imports the whole contract from one place.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional, Union
from urllib.parse import urlsplit, urlunsplit

from crossrt.errors import CrossrtError, SettingsError
from crossrt.inputs.pairs import model_files
from crossrt.records.schema import LoadedFile, RuntimeInfo
from crossrt.speculative.draft_rules import HEAD_SPEC_TYPES, K_LIMIT, SPEC_TYPES, DraftRules
from crossrt.speculative.session import ModelSession, NativeGeneration, NativeSession, Rows

# The drafting rules' and the sessions' names are part of the contract a backend imports from here.
__all__ = ["DTYPES", "HEAD_SPEC_TYPES", "K_LIMIT", "RUNTIMES", "SPEC_TYPES", "DraftRules", "ModelSession", "NativeGeneration", "NativeSession",
           "Rows", "Runtime", "RuntimeFailure", "RuntimeOptions", "RuntimeUnavailable", "Server", "availability",
           "open_runtime", "runtime_class", "runtime_names", "usable_runtimes", "without_user_info"]

RUNTIMES: dict[str, str] = {
    "llama-cpp": "crossrt.backends.llama_cpp:LlamaCppRuntime",
    "llama-server": "crossrt.backends.llama_server:LlamaServerRuntime",
    "llama-spec-cli": "crossrt.backends.llama_spec_cli:LlamaSpecCliRuntime",
    "transformers": "crossrt.backends.transformers:TransformersRuntime",
    "exllamav3": "crossrt.backends.exllamav3:ExllamaV3Runtime",
    "vllm": "crossrt.backends.vllm:VllmRuntime",
    "endpoint": "crossrt.backends.endpoint:EndpointRuntime",
}


class RuntimeUnavailable(CrossrtError):
    """A runtime cannot run on this machine; the message says why and what would fix it."""


class RuntimeFailure(CrossrtError):
    """The runtime itself broke mid-run (a server that died, a tool that crashed): the run
    stops, keeping the prompts already finished. The message carries the runtime's log tail."""


DTYPES = ("float32", "bfloat16", "float16")  # RuntimeOptions.dtype, for the runtimes that choose one


@dataclass(frozen=True)
class RuntimeOptions:
    """Settings every runtime understands, normalized.

    gpu_split: relative shares of the model per GPU (e.g. (1, 1) for two equal GPUs),
    translated by each runtime into its own knob (llama.cpp's tensor_split, ...).
    f32_kv_cache: keep the KV cache in F32 for cross-runtime logit comparisons; the default
    F16 cache matches what llama.cpp's own tools use.
    dtype: the element type transformers loads weights in ("float32", "bfloat16", "float16";
    None: float32 on the CPU, half precision on a GPU); llama.cpp's runtimes run a GGUF's own
    tensor types and ignore it.
    """

    n_ctx: int = 2048
    threads: int = 1
    n_gpu_layers: int = 0
    gpu_split: Optional[tuple[float, ...]] = None
    f32_kv_cache: bool = False
    flash_attn: bool = True
    dtype: Optional[str] = None
    executable: Optional[Path] = None  # for runtimes that run a program (llama-server, ...)
    # The endpoint runtime's running servers (backends/endpoint.py): the speculative one, and a
    # plain one of the same target for the greedy baseline.
    url: Optional[str] = None
    baseline_url: Optional[str] = None

    def public(self) -> "RuntimeOptions":
        """These options as they may be written (a baseline store's key): the URLs without user
        info, which may hold a password."""
        return dataclasses.replace(self, url=without_user_info(self.url),
                                   baseline_url=without_user_info(self.baseline_url))


def without_user_info(url: Optional[str]) -> Optional[str]:
    """url without its user:password@ part and its query (a gateway's ?api_key=...), either of
    which may hold a secret: what crossrt shows and records of a server's address."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.username is None and parts.password is None and not parts.query:
        return url
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:  # not a number: Endpoint.parse refuses it, naming this URL
        port = None
    return urlunsplit((parts.scheme, host + (f":{port}" if port else ""), parts.path, "", parts.fragment))


@dataclass(frozen=True)
class Server:
    """A running server that a runtime attaches to (Runtime.attach_server), as a sweep or
    reproduce plans with it before any prompt runs."""

    url: str  # without user info
    # What it is: kind, version, model and the speculative settings it reports that stay put
    # while it runs; a sweep cell's id digests it, so another server makes other cells.
    identity: str
    k: Optional[int]  # the draft length it reports; None where it does not (yet)
    # The runtime's own attachment (what it asked the server), which a run within
    # crossrt.run.attach.reusing takes instead of asking again; None where planned without one.
    attachment: object = dataclasses.field(default=None, compare=False, repr=False)


class Runtime(abc.ABC):
    name: ClassVar[str]
    # Which file of a pair manifest this runtime loads: a format, or formats in order of preference.
    model_format: ClassVar[Union[str, tuple[str, ...]]]
    modes: ClassVar[tuple[str, ...]] = ("driven",)  # "driven" needs load(), "native" open_native()
    scored_by: ClassVar[Optional[str]] = None  # a native-only runtime's in-process sibling, for logits
    # The program this runtime starts (llama-server, llama-speculative-simple), which
    # RuntimeOptions.executable (the command line's --executable) names; None: it runs in-process.
    program: ClassVar[Optional[str]] = None
    # DraftRules' llama.cpp drafting rules its native mode honours: "n_min" (shorter drafts are
    # dropped), "p_min" (drafting stops below a drafter probability). Others refuse them.
    drafting_rules: ClassVar[tuple[str, ...]] = ()
    # Strategy draftings (crossrt/speculative/strategies.py) its native mode runs as its own, e.g.
    # transformers' prompt lookup as "hf-prompt-lookup": open_native is then given strategy=.
    native_draftings: ClassVar[tuple[str, ...]] = ()
    # Whether it attaches to a server the user runs (RuntimeOptions.url): that server fixes its own
    # draft length and numerics, and its counters are read around each request, so requests to
    # one server go one at a time (sweeps never run two of its cells at once).
    attaches: ClassVar[bool] = False
    # Whether open_native takes baseline_on_demand=True: its session then starts the baseline's
    # process only when start_baseline() is called or a baseline is decoded, not beside the
    # speculative one (a run whose baselines are all in the store never starts it).
    baseline_on_demand: ClassVar[bool] = False

    def __init__(self, options: RuntimeOptions):
        self.options = options

    def load(self, path: Path) -> ModelSession:
        """Load one model file or folder as a session for crossrt's driven loop; raise
        FileNotFoundError or ValueError with a clear message when it cannot be loaded."""
        raise RuntimeUnavailable(f"runtime {self.name!r} has no driven mode; use --mode native")

    def load_tree(self, path: Path, max_leaves: int) -> ModelSession:
        """Load a model as a tree session (its eval_tree verifies a draft tree of up to max_leaves
        leaves in one batch), for tree drafting; runtimes whose batches cannot say that refuse."""
        raise SettingsError(f"tree drafting verifies a tree in one batch, which needs a runtime's tree session: "
                            f"runtime {self.name!r} has none (llama-cpp has)")

    def open_native(self, target: Path, drafter: Path, rules: DraftRules, work_dir: Path) -> NativeSession:
        """Start the runtime's own speculative decoding of target with drafter under rules;
        logs and temporary files go under work_dir."""
        raise RuntimeUnavailable(f"runtime {self.name!r} has no native speculative mode; use --mode driven")

    @classmethod
    @abc.abstractmethod
    def check_available(cls) -> None:
        """Raise RuntimeUnavailable with the reason when this runtime cannot run here."""

    @abc.abstractmethod
    def info(self) -> RuntimeInfo:
        """Name, version, build and device, for the run record."""

    def loaded_files(self, path: Path) -> Optional[tuple[LoadedFile, ...]]:
        """What this runtime read for the model file path, each file with its sha256, for the
        record (ModelInfo.loaded), asked once the run's models are in: the file itself (a
        folder's files) unless the runtime reads a conversion of it; None where crossrt cannot
        know (a server it attaches to loaded files of its own)."""
        return None if self.attaches else model_files(path)

    @classmethod
    def attach_server(cls, url: str) -> Server:
        """The server at url as this runtime sees it (attaches only); RuntimeFailure or
        RuntimeUnavailable when nothing fit answers there."""
        raise SettingsError(f"--url {without_user_info(url)}: runtime {cls.name!r} attaches to no server")

    @classmethod
    def scorer(cls, info: RuntimeInfo) -> Optional[str]:
        """The in-process runtime that re-scores this runtime's record with info (a native-only
        runtime's sibling): scored_by, unless the record tells which weights ran."""
        return cls.scored_by

    @classmethod
    def build_notes(cls) -> list[str]:
        """Lines for `crossrt runtimes` on how a usable runtime was built (kernels, fallbacks)."""
        return []


def runtime_names() -> list[str]:
    return list(RUNTIMES)


def runtime_class(name: str) -> type[Runtime]:
    if name not in RUNTIMES:
        known = ", ".join(RUNTIMES)
        raise RuntimeUnavailable(f"unknown runtime {name!r}; known runtimes: {known}")
    module_name, class_name = RUNTIMES[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise RuntimeUnavailable(f"runtime {name!r} cannot be imported: {error}") from None
    return getattr(module, class_name)


def open_runtime(name: str, options: RuntimeOptions) -> Runtime:
    """The runtime called name, checked usable here; RuntimeUnavailable says why not.

    An explicit executable (--executable PATH: the runtime's program) or, for a runtime that
    attaches, a server (--url) replaces the default lookup that check_available makes; the runtime
    checks it itself when constructed. Other runtimes of the same command (a parity matrix with
    an attached server) are checked as always."""
    cls = runtime_class(name)
    if options.executable is None and not (cls.attaches and options.url is not None):
        cls.check_available()
    return cls(options)


def availability(name: str) -> Optional[str]:
    """None when runtime name is usable here, else the reason it is not."""
    try:
        runtime_class(name).check_available()
    except RuntimeUnavailable as error:
        return str(error)
    return None


def usable_runtimes() -> list[str]:
    """The runtimes usable here, in registry order."""
    return [name for name in runtime_names() if availability(name) is None]
