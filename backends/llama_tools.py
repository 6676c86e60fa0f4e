"""llama.cpp's own tools (llama-server, llama-speculative-simple): where they are, which build
they are, and how that build spells the flags crossrt passes.

Both native llama.cpp runtimes use this one reading of a tool, so a build is found, named and
adapted to the same way whichever tool runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from crossrt.backends.llama_build_probe import with_build_note
from crossrt.backends.llama_cpp import BUILD_BIN, VENDORED_COMMIT, system_info
from crossrt.errors import SettingsError
from crossrt.run.runtime import RuntimeUnavailable

# Built by scripts/build_llama_tools from scripts/llama_system_info.c: preloaded into a tool, it
# prints the tool's llama_print_system_info() and ends the run before any model loads.
SYSTEM_INFO_SHIM = BUILD_BIN / "libcrossrt_system_info.so"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_tool(name: str, explicit: Optional[Path] = None) -> Optional[Path]:
    """The tool to run: explicit if given (None when it is not an executable file), else the
    repository's build, else the one on PATH."""
    if explicit is not None:
        return Path(explicit) if _executable(Path(explicit)) else None
    if _executable(BUILD_BIN / name):
        return BUILD_BIN / name
    found = shutil.which(name)
    return Path(found) if found else None


def _has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", help_text, re.M) is not None


@dataclass(frozen=True)
class Flags:
    """Flag names of one build: the draft options were renamed (--draft-max -> --spec-draft-n-max,
    ...), builds with the new names also need --spec-type to draft at all, and -fa took a value.
    Options an older build lacks are None."""

    n_max: str
    n_min: str
    p_min: str
    spec_type: Optional[str]
    no_ui: Optional[str]
    cache_ram: Optional[str]
    flash_attn_takes_value: bool
    # --swa-full: a full-size cache for sliding-window layers, as llama_context_default_params()
    # (swa_full = true) gives the in-process runtime. Without it the tools keep a window-sized
    # cache, and llama-server then splits every prompt into up to three decodes to checkpoint it
    # (tools/server/server-context.cpp, checkpoint_offsets {4 + n_ubatch, 4}).
    swa_full: Optional[str] = None
    # Every --spec-ngram-* flag the build has: the n-gram types' own sizes (-simple-size-n,
    # -map-k-size-m, -mod-n-match, ...), which replaced one shared set (--spec-ngram-size-n) that
    # later builds still list, removed (backends/llama_server.py passes them from crossrt's settings).
    spec_ngram: frozenset[str] = frozenset()

    @classmethod
    def from_help(cls, text: str) -> "Flags":
        new = "--spec-draft-n-max" in text
        if not new and "--draft-max" not in text:
            raise RuntimeUnavailable("this llama.cpp tool has no draft-model flags "
                                     "(neither --spec-draft-n-max nor --draft-max in --help)")
        return cls(
            n_max="--spec-draft-n-max" if new else "--draft-max",
            n_min="--spec-draft-n-min" if new else "--draft-min",
            p_min="--spec-draft-p-min" if new else "--draft-p-min",
            spec_type="--spec-type" if _has_flag(text, "--spec-type") else None,
            no_ui="--no-webui" if _has_flag(text, "--no-webui") else None,
            cache_ram="--cache-ram" if _has_flag(text, "--cache-ram") else None,
            flash_attn_takes_value=re.search(r"--flash-attn \[on\|off", text) is not None,
            swa_full="--swa-full" if _has_flag(text, "--swa-full") else None,
            spec_ngram=frozenset(re.findall(r"(?<![\w-])--spec-ngram-[a-z0-9-]*[a-z0-9]", text)),
        )


@dataclass(frozen=True)
class Build:
    path: Path
    version: str  # e.g. "0.5.0-dev"
    commit: Optional[str]  # None when the build does not know it (a source tree without git)
    flags: Flags
    # llama_print_system_info() of the libraries the tool loads (backends, CPU features): what
    # tells two builds' kernels apart. None when it cannot be read (no shim built, a static build).
    system_info: Optional[str] = None


def _system_info(path: Path) -> Optional[str]:
    if not SYSTEM_INFO_SHIM.is_file():
        return None
    environment = dict(os.environ, LD_PRELOAD=" ".join(filter(None, [str(SYSTEM_INFO_SHIM),
                                                                     os.environ.get("LD_PRELOAD")])))
    # No model: a tool the shim cannot wrap then stops at loading it.
    try:
        done = subprocess.run([str(path), "-m", os.devnull],
                              capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                              env=environment)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^system_info: (.*)$", done.stdout, re.M)
    if done.returncode != 0 or not match:
        return None
    return with_build_note(system_info(match.group(1)), path.parent)


@lru_cache(maxsize=8)
def probe(path: Path) -> Build:
    """Version, commit, flag names (`--version`, `--help`) and system info of the tool at path."""
    outputs = []
    for flag in ("--version", "--help"):
        try:
            done = subprocess.run([str(path), flag], capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeUnavailable(f"cannot run {path} {flag}: {error}") from None
        outputs.append(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeUnavailable(f"{path} {flag} exited with {done.returncode}: {outputs[-1][-500:]}")
    # New builds print "version: 0.5.0-dev (build 0, commit unknown)", old ones "version: 4567 (abcdef12)".
    match = re.search(r"version: (\S+)(?: \((?:build \S+, )?(?:commit )?([0-9a-f]{7,40}|unknown)\))?", outputs[0])
    if match is None:
        raise RuntimeUnavailable(f"{path} --version printed no version: {outputs[0][-300:]!r}")
    commit = match.group(2) if match.group(2) not in (None, "unknown") else None
    # Built here, a tool knows its commit from the sdist's git metadata (7 digits) where git runs;
    # without git it does not. Either way it is the binding's commit, spelled as the binding's.
    if (commit is None and path.resolve().parent == BUILD_BIN.resolve()) or \
            (commit is not None and VENDORED_COMMIT.startswith(commit)):
        commit = VENDORED_COMMIT
    return Build(path, match.group(1), commit, Flags.from_help(outputs[1]), _system_info(path))


def log_tail(path: Path, lines: int) -> str:
    """The last lines of a tool's log (read from its end: debug logs grow large)."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 16384))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# crossrt's spec types as llama.cpp's tools' --spec-type values (common/arg.cpp at 0c1e57098).
LLAMA_SPEC_TYPES = {"draft": "draft-simple", "mtp": "draft-mtp", "eagle3": "draft-eagle3", "dflash": "draft-dflash",
                    "dspark": "draft-dspark", "ngram-simple": "ngram-simple", "ngram-map-k": "ngram-map-k",
                    "ngram-map-k4v": "ngram-map-k4v", "ngram-mod": "ngram-mod", "ngram-cache": "ngram-cache"}


def llama_spec_type(spec_type: str) -> str:
    if spec_type not in LLAMA_SPEC_TYPES:
        raise SettingsError(f"llama.cpp has no spec type {spec_type!r}; it has: {', '.join(LLAMA_SPEC_TYPES)}")
    return LLAMA_SPEC_TYPES[spec_type]


def refuse_unfed_head(target: Path, spec_type: str, where: str) -> None:
    """A head spec type on a target whose llama.cpp graph cannot feed it, refused before the
    tool loads it (the graph would abort on a GGML_ASSERT)."""
    from crossrt.inputs.gguf_file import gguf_metadata
    from crossrt.inputs.head_targets import refuse_unfeedable
    from crossrt.run.runtime import HEAD_SPEC_TYPES

    if spec_type in HEAD_SPEC_TYPES and str(target).endswith(".gguf"):
        architecture = str(gguf_metadata(Path(target)).get("general.architecture", ""))
        refuse_unfeedable(architecture, "llama.cpp", spec_type, where)
