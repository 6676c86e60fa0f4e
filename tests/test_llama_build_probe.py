"""Setup's probe of the llama.cpp build (backends/llama_build_probe.py): the real build passes it
here; a probe whose child really dies by a signal (an illegal instruction executed, as a kernel
the CPU cannot run gives) turns kernels off, has llama.cpp rebuilt with the flags that do it, and
says so in one line. Which kernels fault depends on the CPU (AMX on some Intel Xeons; nothing on
the AMD machines this was written on), so the fault is made on purpose, not hoped for."""

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
from click.testing import CliRunner

from crossrt.backends import llama_build_probe as probe
from crossrt.cli import main

from conftest import REPO

# llama_print_system_info() as the vendored build prints it on a 2-core Xeon reporting AMX
# (../shared/runtime-facts.md, "AMX"): the kernels that faulted there are listed.
XEON_SYSTEM_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
                    "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | "
                    "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1")


@pytest.fixture(scope="module")
def models():
    return probe.probe_models()


def test_the_real_build_passes_every_check_here(models):
    """Q4_K_M, Q8_0 and Q4_0 through the binding (1 and 2 threads) and llama-speculative-simple."""
    checks = probe.run_checks(models)
    assert len(checks) == 9
    assert [c.name for c in checks if not c.passed] == [], [(c.name, c.returncode, c.tail) for c in checks]


def test_probe_models_keep_their_quantized_types(models):
    """Rows of 256, so no matmul falls back to another type (K-quants need rows of 256)."""
    from gguf import GGUFReader

    for type_name, (target, _) in models.items():
        types = {t.tensor_type.name for t in GGUFReader(target).tensors if len(t.shape) == 2}
        expected = {"Q4_K_M": {"Q4_K", "Q6_K"}, "Q8_0": {"Q8_0"}, "Q4_0": {"Q4_0"}}[type_name]
        assert types & expected and not types & {"F32", "F16", "Q5_0"} - expected, (type_name, types)


def test_a_check_that_really_dies_by_a_signal_is_a_fault(models, monkeypatch):
    monkeypatch.setenv(probe.FAULT_HOOK, "1")
    checks = probe.run_checks({"Q8_0": models["Q8_0"]}, threads=(1,))
    in_process = checks[0]
    assert in_process.returncode == -4 and in_process.signal_name == "SIGILL"
    assert not in_process.passed
    assert checks[1].passed  # the native tool is another process: the fault stayed in its child


def test_which_kernels_a_fault_turns_off():
    assert probe.next_fallback(XEON_SYSTEM_INFO, [], []) == probe.AMX_OFF
    assert probe.next_fallback(XEON_SYSTEM_INFO, ["AMX"], []) == probe.NATIVE_OFF
    assert probe.next_fallback(XEON_SYSTEM_INFO, ["AMX", "native instruction set"], []) is None
    # Asked for by the user: kept, with a warning rather than a silent rebuild.
    assert probe.next_fallback(XEON_SYSTEM_INFO, [], ["-DGGML_AMX_INT8=ON"]) is None
    assert probe.next_fallback("CPU : AVX2 = 1 | AVX512 = 1", [], ["-DGGML_NATIVE=OFF"]) is None


def test_the_amx_fallback_flags_really_drop_amx_where_the_compiler_would_build_it():
    """GCC keeps explicitly given ISA flags whatever -march follows, so -march=native on a
    Sapphire Rapids (here: its -march) builds no AMX code with the fallback's flags."""
    (flag,) = probe.AMX_OFF.flags
    assert flag.startswith("-DCROSSRT_GGML_CPU_OPTIONS=")  # ggml-cpu's own options: scripts/llama_tools_flags.cmake
    c_flags = flag.split("=", 1)[1].split(";")

    def macros(*flags):
        return subprocess.run(["gcc", *flags, "-dM", "-E", "-"], input="", capture_output=True, text=True,
                              check=True).stdout

    assert "__AMX_INT8__" in macros("-march=sapphirerapids")
    without = macros(*c_flags, "-march=sapphirerapids")
    assert "__AMX" not in without and "__AVX512VNNI__" in without


def test_a_faulting_probe_rebuilds_without_the_kernels_and_says_why(models, tmp_path, monkeypatch, capfd):
    """The whole loop on this machine, its children made to die by SIGILL every time: it turns
    off what is left to turn off, has scripts/build_llama_tools (here --print-flags: the flags it
    would rebuild with, not a 5-minute compile) take the fallback, and ends with a warning."""
    monkeypatch.setenv(probe.FAULT_HOOK, "1")
    monkeypatch.setattr(probe, "QUANT_TYPES", {"Q4_K_M": probe.QUANT_TYPES["Q4_K_M"]})  # one type is enough here
    monkeypatch.setattr(probe, "RECORD", tmp_path / "probe.json")
    monkeypatch.setattr(probe, "FALLBACK", tmp_path / "fallback-flags")
    monkeypatch.setenv("CROSSRT_LLAMA_FALLBACK_FLAGS", str(tmp_path / "fallback-flags"))
    requested = ["-DCROSSRT_PROBE_TEST=1"]
    said = []
    record = probe.probe(requested, [str(REPO / "scripts" / "build_llama_tools"), "--print-flags"], said.append)
    printed = capfd.readouterr().out.splitlines()

    expected = ["AMX", "native instruction set"] if "AMX" in probe.current_system_info() else ["native instruction set"]
    turning_off = [line for line in said if line.startswith("llama.cpp: turning off")]
    assert [line.split("turning off ")[1].split(" kernels")[0] for line in turning_off] == expected
    assert all("died by SIGILL in Q4_K_M in-process, 1 thread" in line for line in turning_off)
    # The rebuild takes the fallback's flags, before the requested ones (CMAKE_ARGS wins).
    assert printed.index("-DGGML_NATIVE=OFF") < printed.index("-DCROSSRT_PROBE_TEST=1")
    assert said[-1].startswith("warning: llama.cpp's build faults on this CPU")
    assert not record.passed and record.turned_off == tuple(expected)
    assert all(f.endswith(": SIGILL") for f in record.failures)
    assert json.loads((tmp_path / "probe.json").read_text())["passed"] is False


def test_setup_probe_is_done_once_per_build_and_cpu():
    """scripts/setup ran the probe: the record matches this build on this CPU, and a second
    probe only reads it."""
    done = subprocess.run([sys.executable, "-m", "crossrt.backends.llama_build_probe"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    again = subprocess.run([sys.executable, "-m", "crossrt.backends.llama_build_probe"],
                           capture_output=True, text=True, timeout=120)
    assert "already probed on this CPU: passed" in again.stdout
    record = probe.read_record()
    assert record is not None and record.key == probe.probe_key() and record.passed


def test_runtimes_and_records_say_how_the_build_was_made(tmp_path, monkeypatch):
    result = CliRunner().invoke(main, ["runtimes"])
    assert result.exit_code == 0, result.output
    assert "passed its probe" in result.output and "llama.cpp kernels: CPU :" in result.output
    # A build made after a fault carries it in system_info, which parity and the baseline store
    # read, so records built with and without a kernel never look alike.
    turned = probe.ProbeRecord("k", True, XEON_SYSTEM_INFO, ("AMX",), "the probe died by SIGSEGV in Q4_K_M", ())
    (tmp_path / "probe.json").write_text(json.dumps(asdict(turned)))
    monkeypatch.setattr(probe, "RECORD", tmp_path / "probe.json")
    noted = probe.with_build_note("CPU : AVX512 = 1", probe.BUILD_BIN)
    assert noted == "CPU : AVX512 = 1 | crossrt build: AMX off (the probe died by SIGSEGV in Q4_K_M)"
    assert probe.with_build_note("CPU : AVX512 = 1", tmp_path) == "CPU : AVX512 = 1"  # another build
