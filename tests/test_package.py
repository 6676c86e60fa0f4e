"""crossrt as a package: pyproject.toml lists every package and ships the built-in data, and the
wheel, installed into a fresh virtual environment, runs the tiny pair from a folder outside the
checkout (its model files made in the cache folder, as an installed crossrt says to)."""

import fnmatch
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
BUILTIN_DATA = ("pairs", "claims", "sweeps", "templates")  # models/ folders an install ships


def _package_folder(name: str) -> Path:
    """The folder setuptools reads package name from (its package-dir mapping, else the name's)."""
    mapped = max((key for key in SETUPTOOLS["package-dir"] if name == key or name.startswith(key + ".")), key=len)
    return REPO / SETUPTOOLS["package-dir"][mapped] / Path(*name[len(mapped):].split(".")[1:])


def _source_modules() -> list[str]:
    """Every module of the source tree by the name it installs under (backends/ as crossrt.backends)."""
    names = [".".join(path.relative_to(REPO).with_suffix("").parts) for path in sorted((REPO / "crossrt").rglob("*.py"))]
    names += [f"crossrt.backends.{path.stem}" for path in sorted((REPO / "backends").glob("*.py"))]
    return [name.removesuffix(".__init__") for name in names]


def test_every_package_is_listed():
    listed = set(SETUPTOOLS["packages"])
    found = {".".join(path.parent.relative_to(REPO).parts) for path in (REPO / "crossrt").rglob("__init__.py")}
    found |= {"crossrt.backends"} if (REPO / "backends" / "__init__.py").is_file() else set()
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    data = listed - found  # folders of data only, each there
    assert all(_package_folder(name).is_dir() and not (_package_folder(name) / "__init__.py").exists()
               for name in data), sorted(data)


def test_every_builtin_data_file_ships():
    patterns = SETUPTOOLS["package-data"]["crossrt.data.models"]
    files = [path.relative_to(REPO / "models").as_posix() for kind in BUILTIN_DATA
             for path in (REPO / "models" / kind).rglob("*") if path.is_file()]
    assert files and not [name for name in files if not any(fnmatch.fnmatch(name, p) for p in patterns)]


# ---- the wheel, installed ---------------------------------------------------------------------

def _run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(arg) for arg in args], capture_output=True, text=True, timeout=180, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the fresh environment, the environment variables to run it with): the wheel of a
    copy of the source tree installed there, with the test environment's packages as its
    dependencies (a .pth file: no network) but not its editable crossrt."""
    root = tmp_path_factory.mktemp("package")
    source = root / "source"  # a copy: the build writes build/ and *.egg-info beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("crossrt", "backends", "models"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                  "-w", root / "wheels", source])
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (root / "wheels").glob("crossrt-*.whl")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv]).check_returncode()
    python = venv / "bin" / "python"
    # Installed before the .pth exists, so pip sees no other crossrt to replace.
    done = _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel])
    assert done.returncode == 0, done.stdout + done.stderr
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    (Path(purelib) / "test-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(CROSSRT_CACHE=str(root / "cache"), OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    return wheel, venv, env


@pytest.mark.slow
def test_the_wheel_ships_every_package_and_the_builtin_data_but_no_model_files(installed):
    names = zipfile.ZipFile(installed[0]).namelist()
    assert {"crossrt/speculative/lookup/__init__.py", "crossrt/backends/llama_cpp.py",
            "crossrt/data/prompts/builtin.jsonl", "crossrt/data/models/pairs/tiny.toml", "crossrt/data/models/claims/community.toml",
            "crossrt/data/models/templates/tiny-chat.jinja"} <= set(names)
    assert not [name for name in names if name.endswith((".gguf", ".safetensors"))]


@pytest.mark.slow
def test_every_module_imports_from_the_wheel(installed, tmp_path):
    _, venv, env = installed
    script = ("import importlib, sys\n"
              f"for name in {_source_modules()!r}:\n"
              "    module = importlib.import_module(name)\n"
              f"    assert module.__file__.startswith({str(venv)!r}), (name, module.__file__)\n"
              "print('ok')")
    result = _run([venv / "bin" / "python", "-c", script], cwd=tmp_path, env=env)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


@pytest.mark.slow
def test_installed_crossrt_runs_the_tiny_pair_outside_the_checkout(installed, tmp_path):
    _, venv, env = installed
    run = [venv / "bin" / "crossrt", "run", "--pair", "tiny", "--max-new-tokens", "8", "--threads", "1"]
    # No model files are shipped: the first run makes the tiny pair in the cache, saying so.
    result = _run(run, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    made = f"making tiny in {Path(env['CROSSRT_CACHE']) / 'models' / 'tiny'} (first use): " \
           f"{venv / 'bin' / 'python'} -m crossrt.builders.tinypair"
    assert made in result.stderr, result.stderr
    assert (Path(env["CROSSRT_CACHE"]) / "models" / "tiny" / "target.f32.gguf").read_bytes() == \
        (REPO / "models" / "tiny" / "target.f32.gguf").read_bytes()  # same seed, same libraries
    assert (tmp_path / "runs" / "tiny-llama-cpp-k4.json").is_file()
    # A built-in claims file by name, its pair named relative to it, as from a checkout.
    claims = _run([venv / "bin" / "crossrt", "reproduce", "community", "--claim", "tiny-llama-cpp-k4",
                   "--max-new-tokens", "8"], cwd=tmp_path, env=env)
    assert claims.returncode == 0 and "1 reproduced" in claims.stdout, claims.stdout + claims.stderr
