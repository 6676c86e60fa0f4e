"""scripts/build_llama_tools keeps its build for the machine's other clones (crossrt's cache,
llama-builds/KEY) and a second clone asking for the same source and flags copies it instead of
compiling. Checked in a clone made here (the script, its flags file and shims' sources, the
unpacked sdist and the binding's wheel this checkout already has), so nothing is compiled: the
copy must be the real build, runnable, and a clone that built seeds the cache in turn."""

import os
import shutil
import subprocess

import pytest

from conftest import REPO

TOOLS = REPO / ".cache" / "llama-tools"
BIN = TOOLS / "build" / "bin"
pytestmark = pytest.mark.skipif(not (BIN / "llama-server").is_file(), reason="llama.cpp not built: run scripts/setup")


def _clone(folder):
    """A clone of what the script reads, its build tree empty."""
    (folder / "scripts").mkdir(parents=True)
    for name in ("build_llama_tools", "llama_tools_flags.cmake", "llama_log_flush.c", "llama_system_info.c"):
        shutil.copy2(REPO / "scripts" / name, folder / "scripts" / name)
    tools = folder / ".cache" / "llama-tools"
    tools.mkdir(parents=True)
    sdist = next(TOOLS.glob("llama_cpp_python-*/"))
    (tools / sdist.name).symlink_to(sdist, target_is_directory=True)  # read only: no compile happens
    shutil.copytree(TOOLS / "wheel", tools / "wheel")
    return folder


def _build(clone, cache):
    return subprocess.run([str(clone / "scripts" / "build_llama_tools")], cwd=clone, capture_output=True, text=True,
                          env={**os.environ, "CROSSRT_CACHE": str(cache), "PATH": os.environ["PATH"]}, timeout=120)


def test_a_second_clone_copies_the_machines_build_and_a_built_clone_seeds_it(tmp_path):
    cache = tmp_path / "cache"
    first, second = _clone(tmp_path / "first"), _clone(tmp_path / "second")
    key = subprocess.run([str(first / "scripts" / "build_llama_tools"), "--cache-key"], cwd=first,
                         capture_output=True, text=True, check=True).stdout.strip()
    assert key == subprocess.run([str(second / "scripts" / "build_llama_tools"), "--cache-key"], cwd=second,
                                 capture_output=True, text=True, check=True).stdout.strip()  # not the clone's path
    shared = cache / "llama-builds" / key
    shared.mkdir(parents=True)
    shutil.copytree(BIN, shared / "bin", symlinks=True)  # as a clone that built this would have kept it
    (shared / "complete").touch()

    done = _build(first, cache)
    assert done.returncode == 0, done.stderr
    assert "copied from this machine's build" in done.stderr and "building llama.cpp" not in done.stderr
    server = first / ".cache" / "llama-tools" / "build" / "bin" / "llama-server"
    assert subprocess.run([str(server), "--version"], capture_output=True, timeout=30).returncode == 0
    again = _build(first, cache)
    assert "already built" in again.stderr, again.stderr

    shutil.rmtree(shared)  # the machine's copy gone: the clone that has the build keeps it again
    assert "kept for this machine's other clones" in _build(first, cache).stderr
    assert (shared / "complete").is_file() and (shared / "bin" / "libllama.so").exists()
    done = _build(second, cache)
    assert done.returncode == 0 and "copied from this machine's build" in done.stderr, done.stderr


def test_what_the_probe_turned_off_on_this_cpu_is_carried_to_the_next_clone(tmp_path):
    """A clone's fallback flags (setup's probe writes them where kernels fault) are kept for the
    machine and copied into a clone that has none, where the build and the probe read them. Its
    first line names other flags than these runs', so no build here uses them."""
    cache = tmp_path / "cache"
    first, second = _clone(tmp_path / "first"), _clone(tmp_path / "second")
    fallback = "-DOTHER=1 | another cpu\n{}\n-DGGML_AVX512=OFF\n"
    (first / ".cache" / "llama-tools" / "fallback-flags").write_text(fallback)
    key = subprocess.run([str(first / "scripts" / "build_llama_tools"), "--cache-key"], cwd=first,
                         capture_output=True, text=True, check=True).stdout.strip()
    shutil.copytree(BIN, cache / "llama-builds" / key / "bin", symlinks=True)
    (cache / "llama-builds" / key / "complete").touch()
    for clone in (first, second):
        done = _build(clone, cache)
        assert done.returncode == 0 and "copied from this machine's build" in done.stderr, done.stderr
    assert (second / ".cache" / "llama-tools" / "fallback-flags").read_text() == fallback
