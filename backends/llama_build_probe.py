"""Does the llama.cpp build run on the machine it was built on? Setup's probe, and its fallbacks.

scripts/build_llama_tools compiles with GGML_NATIVE=ON: ggml builds every kernel the compiler
sees and runs them on quantized weights. On Intel Xeons reporting AMX (the CPUs of many cloud CI
runners) ggml's AMX kernels fault there: SIGSEGV on `ldtilecfg` in the binding, SIGILL in
llama-speculative-simple (llama.cpp PR #26954, issues #20824 and #28756; docs/build-probe.md).
The compiler cannot tell, nor can cpuid: only running the kernels does. So after every build,
setup runs this probe, each check in a child process so that a fault ends the child, not setup:
a small model built like the tiny pair (n_embd 256, so every quantized type keeps its own kernels)
quantized by llama.cpp to Q4_K_M, Q8_0 and Q4_0, decoded through the in-process binding on one
thread and on two (AMX asks the kernel for its tile state per thread), and through
llama-speculative-simple. A check that dies by a signal turns off the kernels that faulted:
AMX first (`-mno-amx-*`, every AVX-512 kernel kept), then the native instruction set
(GGML_NATIVE=OFF); setup rebuilds and probes again, and says in one line what it turned off and
why. A build that passed is not probed again on the same CPU.

    python -m crossrt.backends.llama_build_probe [CMAKE FLAGS...]   # scripts/setup runs it
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from crossrt.backends.llama_cpp import BUILD_BIN

ROOT = BUILD_BIN.parents[1]  # .cache/llama-tools
RECORD = ROOT / "probe.json"  # the last probe's outcome, for setup, `crossrt runtimes` and records
# Read by scripts/build_llama_tools: the flags it adds, and why (elsewhere for tests only).
FALLBACK = Path(os.environ.get("CROSSRT_LLAMA_FALLBACK_FLAGS", ROOT / "fallback-flags"))
BUILD_STAMP = BUILD_BIN.parent / "crossrt-cmake-flags"  # written by scripts/build_llama_tools
MODELS = ROOT / "probe-models"
QUANT_TYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
               "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
CHECK_TIMEOUT_S = 300  # a tiny model decodes in well under a second; a hang is a fault too
# Set by tests only: the probe's in-process check executes an illegal instruction (a real SIGILL,
# as a foreign or faulty kernel gives) before it loads anything.
FAULT_HOOK = "CROSSRT_PROBE_TEST_SIGILL"


@dataclass(frozen=True)
class Fallback:
    """Kernels a build leaves out, the CMake flags that do it, and the reason."""

    name: str  # "AMX", "native instruction set"
    flags: tuple[str, ...]


# In the order they are tried. `-mno-amx-*` wins over -march=native whatever their order on the
# command line (GCC keeps explicitly given ISA flags), so the build keeps every other kernel. They
# go to ggml-cpu alone (scripts/llama_tools_flags.cmake), the one library with AMX code (compilers
# emit AMX only for its intrinsics): the rebuild recompiles ~10% of llama.cpp in place, not all.
AMX_OFF = Fallback("AMX", ("-DCROSSRT_GGML_CPU_OPTIONS=-mno-amx-tile;-mno-amx-int8;-mno-amx-bf16",))
NATIVE_OFF = Fallback("native instruction set", ("-DGGML_NATIVE=OFF",))


@dataclass(frozen=True)
class Check:
    """One probe run: what ran, and how it ended."""

    name: str  # e.g. "Q4_K_M in-process, 2 threads"
    returncode: Optional[int]  # None: it hung past CHECK_TIMEOUT_S and was killed
    tail: str  # the last lines it printed

    @property
    def signal_name(self) -> Optional[str]:
        if self.returncode is None:
            return "a hang (killed)"
        return signal.Signals(-self.returncode).name if self.returncode < 0 else None

    @property
    def passed(self) -> bool:
        return self.returncode == 0


@dataclass(frozen=True)
class ProbeRecord:
    """probe.json: the build and CPU it probed, how it went, what was turned off before it."""

    key: str
    passed: bool
    system_info: str
    turned_off: tuple[str, ...]  # fallbacks the build was made with, by name
    reason: str  # why they were turned off ("" when none were)
    failures: tuple[str, ...]  # "check: signal", for a build that failed and was kept


class ProbeError(Exception):
    """The probe could not run (not a fault of the kernels: a missing build, a broken model)."""


def cpu_identity() -> str:
    """What a native build depends on: the CPU's model name and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = sorted({line for line in text.splitlines() if line.startswith(("model name", "flags"))})
    # As scripts/build_llama_tools computes it: grep | LC_ALL=C sort -u | sha256sum
    return hashlib.sha256("".join(line + "\n" for line in lines).encode()).hexdigest()[:16]


def probe_key() -> str:
    """The build (its flags, its CPU library) on this CPU: a change in any probes again."""
    try:
        flags = BUILD_STAMP.read_text().strip()
        library = (BUILD_BIN / "libggml-cpu.so").stat().st_mtime_ns
    except OSError as error:
        raise ProbeError(f"no llama.cpp build to probe ({error}): run scripts/build_llama_tools") from None
    return hashlib.sha256(f"{flags}\n{library}\n{cpu_identity()}".encode()).hexdigest()[:16]


def read_record() -> Optional[ProbeRecord]:
    try:
        data = json.loads(RECORD.read_text())
        return ProbeRecord(**{**data, "turned_off": tuple(data["turned_off"]),
                              "failures": tuple(data["failures"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def build_note() -> Optional[str]:
    """For a llama.cpp record's system_info and `crossrt runtimes`: kernels turned off after a
    failed probe, or a build kept although it failed one; None for a build that passed as built."""
    record = read_record()
    if record is None:
        return None
    if record.turned_off:
        return f"crossrt build: {', '.join(record.turned_off)} off ({record.reason})"
    if not record.passed:
        return f"crossrt build: failed its probe, kept as asked ({'; '.join(record.failures)})"
    return None


def with_build_note(system_info: str, library_dir: Path) -> str:
    """system_info of libraries in library_dir, with the probe's note where they are crossrt's
    own build: two records built with and without a kernel then differ where parity looks."""
    note = build_note() if library_dir.resolve() == BUILD_BIN.resolve() else None
    return f"{system_info} | {note}" if note else system_info


# ------------------------------------------------------------------- the checks (children)

def _illegal_instruction() -> None:
    """Execute ud2: the process dies by SIGILL, as it does on a kernel its CPU cannot run."""
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    page = libc.mmap(None, 4096, 0x1 | 0x2 | 0x4, 0x02 | 0x20, -1, 0)  # rwx, private | anonymous
    ctypes.memmove(page, b"\x0f\x0b", 2)
    ctypes.CFUNCTYPE(None)(page)()


def _decode(model: Path, threads: int) -> None:
    """Child: load a quantized model in-process and decode a prompt, then token by token."""
    if os.environ.get(FAULT_HOOK):
        _illegal_instruction()
    import numpy as np

    from crossrt.backends.llama_cpp import LlamaCppRuntime
    from crossrt.run.runtime import Rows, RuntimeOptions

    with LlamaCppRuntime(RuntimeOptions(n_ctx=256, threads=threads)).load(model) as session:
        ids = session.tokenize("def fibonacci(n):\n    return")
        logits = session.eval(ids, Rows.LAST)
        for _ in range(4):
            logits = session.eval([int(np.argmax(logits[-1]))], Rows.LAST)
        if not np.isfinite(logits).all():
            raise SystemExit("non-finite logits")


def _quantize(source: Path, out: Path, type_name: str) -> None:
    """Child: llama.cpp's own quantization, as `llama-quantize` does it."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, QUANT_TYPES[type_name]), 1
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to {type_name}")


# ------------------------------------------------------------------- the probe (parent)

def _run(name: str, command: Sequence[str]) -> Check:
    try:
        done = subprocess.run(list(command), capture_output=True, timeout=CHECK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as expired:
        return Check(name, None, (expired.stderr or b"").decode(errors="replace")[-400:])
    # A tiny model's output is any bytes, not always UTF-8.
    return Check(name, done.returncode, (done.stdout + done.stderr).decode(errors="replace")[-400:])


def _child(*args: str) -> list[str]:
    return [sys.executable, "-m", "crossrt.backends.llama_build_probe", "--child", *args]


def probe_models() -> dict[str, tuple[Path, Path]]:
    """(target, drafter) per quantized type, built once into .cache/llama-tools/probe-models."""
    from crossrt.builders.tinypair import build_pair

    if not (MODELS / "target.f32.gguf").is_file():
        build_pair(MODELS, preset="probe", seed=0)
    models = {}
    for type_name in QUANT_TYPES:
        paths = tuple(MODELS / f"{role}.{type_name.lower()}.gguf" for role in ("target", "drafter"))
        for role, path in zip(("target", "drafter"), paths):
            if not path.is_file():
                check = _run(f"quantize {role} to {type_name}",
                             _child("quantize", str(MODELS / f"{role}.f32.gguf"), str(path), type_name))
                if not check.passed:
                    raise ProbeError(f"could not quantize the probe model to {type_name}: {check.tail.strip()[-200:]}")
        models[type_name] = paths
    return models


def _spec_tool() -> Optional[list[str]]:
    """llama-speculative-simple with what its build needs to draft with a model (newer builds
    ask for the drafting method: backends/llama_tools.py, Flags)."""
    from crossrt.backends.llama_tools import probe as read_tool

    path = BUILD_BIN / "llama-speculative-simple"
    if not path.is_file():
        return None
    spec_type = read_tool(path).flags.spec_type
    return [str(path)] + ([spec_type, "draft-simple"] if spec_type else [])


def run_checks(models: dict[str, tuple[Path, Path]], threads: Sequence[int] = (1, 2)) -> list[Check]:
    """Every check, each in a child process; a fault fails its check and the probe goes on."""
    checks, tool = [], _spec_tool()
    for type_name, (target, drafter) in models.items():
        for n in threads:
            checks.append(_run(f"{type_name} in-process, {n} thread{'s' * (n > 1)}",
                               _child("decode", str(target), str(n))))
        if tool is not None:
            checks.append(_run(f"{type_name} llama-speculative-simple, {max(threads)} threads", tool + [
                "-m", str(target), "-md", str(drafter), "-p", "def fibonacci(n):", "-n", "8", "-c", "256",
                "--temp", "0", "-t", str(max(threads)), "-td", str(max(threads)), "-ngl", "0", "-ngld", "0"]))
    return checks


def next_fallback(system_info: str, turned_off: Sequence[str], requested: Sequence[str]) -> Optional[Fallback]:
    """The kernels to turn off after a faulted probe; None when nothing is left to turn off.
    Flags the user gave win: AMX asked for explicitly is kept (with a warning), a non-native
    build stays as asked."""
    asked = " ".join(requested).lower()
    if "amx" in asked:
        return None
    if AMX_OFF.name not in turned_off and "AMX" in system_info:
        return AMX_OFF
    if NATIVE_OFF.name not in turned_off and "ggml_native" not in asked:
        return NATIVE_OFF
    return None


def read_fallbacks(requested: Sequence[str]) -> tuple[list[str], str]:
    """Fallbacks in force for these requested flags on this CPU (names), and their reason."""
    try:
        lines = FALLBACK.read_text().splitlines()
    except OSError:
        return [], ""
    if len(lines) < 3 or lines[0] != fallback_key(requested):
        return [], ""
    header = json.loads(lines[1])
    return list(header["turned_off"]), header["reason"]


def fallback_key(requested: Sequence[str]) -> str:
    """Matched by scripts/build_llama_tools: the flags it was asked for, and this CPU."""
    return f"{' '.join(requested)} | {cpu_identity()}"


def write_fallbacks(requested: Sequence[str], fallbacks: Sequence[Fallback], reason: str) -> None:
    """Line 1: the key; line 2: names and reason; then one CMake flag per line."""
    flags = [flag for fallback in fallbacks for flag in fallback.flags]
    header = json.dumps({"turned_off": [f.name for f in fallbacks], "reason": reason})
    FALLBACK.write_text("\n".join([fallback_key(requested), header, *flags]) + "\n")


def current_system_info() -> str:
    """The build's system_info, read in a child: after a rebuild this process still holds the
    libraries it loaded before it."""
    done = _run("system info", [sys.executable, "-c", "from crossrt.backends.llama_cpp import llama_cpp, system_info;"
                                "print(system_info(llama_cpp.llama_print_system_info().decode()))"])
    if not done.passed:
        raise ProbeError(f"the binding cannot load the build: {done.tail.strip()[-300:]}")
    return done.tail.strip().splitlines()[-1]


def probe(requested: Sequence[str], rebuild: Sequence[str], say=print) -> ProbeRecord:
    """Probe the build; on a fault turn kernels off, rebuild (the `rebuild` command, given the
    requested flags) and probe again. Returns what was written to probe.json."""
    by_name = {f.name: f for f in (AMX_OFF, NATIVE_OFF)}
    while True:
        key = probe_key()
        known = read_record()
        if known is not None and known.key == key:
            say(f"llama.cpp build already probed on this CPU: {'passed' if known.passed else 'failed, kept'}")
            return known
        turned_off, reason = read_fallbacks(requested)
        system_info = current_system_info()
        failed = [c for c in run_checks(probe_models()) if not c.passed]
        faults = [c for c in failed if c.signal_name]
        if failed and not faults:  # a Python error, a refused model: not the kernels
            raise ProbeError(f"the probe's {failed[0].name} failed: {failed[0].tail.strip()[-300:]}")
        if not faults:
            record = ProbeRecord(key, True, system_info, tuple(turned_off), reason, ())
            break
        cause = f"the probe died by {faults[0].signal_name} in {faults[0].name}"
        fallback = next_fallback(system_info, turned_off, requested)
        if fallback is None:
            record = ProbeRecord(key, False, system_info, tuple(turned_off), reason,
                                 tuple(f"{c.name}: {c.signal_name}" for c in faults))
            say(f"warning: llama.cpp's build faults on this CPU ({cause}) and crossrt turns nothing "
                "more off (CMAKE_ARGS asks for these kernels): runs that reach them will crash")
            break
        turned_off.append(fallback.name)
        reason = f"{cause} with {fallback.name} built"
        write_fallbacks(requested, [by_name[name] for name in turned_off], reason)
        say(f"llama.cpp: turning off {fallback.name} kernels ({reason}); rebuilding")
        if subprocess.run([*rebuild, *requested]).returncode != 0:
            raise ProbeError(f"the rebuild without {fallback.name} failed")
    RECORD.write_text(json.dumps(asdict(record), indent=1) + "\n")
    return record


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["--child"]:
        kind, *rest = argv[1:]
        if kind == "decode":
            _decode(Path(rest[0]), int(rest[1]))
        else:
            _quantize(Path(rest[0]), Path(rest[1]), rest[2])
        return 0
    rebuild = [str(Path(__file__).resolve().parents[1] / "scripts" / "build_llama_tools")]
    try:
        record = probe(list(argv), rebuild)
    except ProbeError as error:
        print(f"llama.cpp build probe: {error}", file=sys.stderr)
        return 1
    note = build_note()
    print(f"llama.cpp build probe: {'passed' if record.passed else 'failed'}" + (f"; {note}" if note else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
