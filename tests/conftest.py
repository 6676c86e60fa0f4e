"""Shared fixtures: the committed tiny pair, loaded once per session in real llama.cpp.

Every test uses n_threads=1: ggml's worker threads busy-wait, and with two cores a second
thread next to any other load makes tiny models orders of magnitude slower.
"""

import re
import signal
from pathlib import Path

import pytest

from crossrt.inputs.pairs import PairError, load_pair
from crossrt.run.runtime import RuntimeOptions, open_runtime

REPO = Path(__file__).resolve().parent.parent
TINY_PAIR = REPO / "models" / "pairs" / "tiny.toml"
REAL_PAIR = REPO / "models" / "pairs" / "gemma3-270m.toml"


@pytest.fixture(scope="session")
def tiny_pair():
    return load_pair(TINY_PAIR)


@pytest.fixture(scope="session")
def llama_runtime():
    return open_runtime("llama-cpp", RuntimeOptions(n_ctx=512, threads=1))


@pytest.fixture(scope="session")
def tiny_sessions(tiny_pair, llama_runtime):
    """(target, drafter) llama.cpp sessions of the tiny F32 pair."""
    return (llama_runtime.load(tiny_pair.path("target", "gguf")),
            llama_runtime.load(tiny_pair.path("drafter", "gguf")))


@pytest.fixture(scope="session")
def real_pair():
    """Gemma 3 270M Q4_K_M and its 17-block layer-skip drafter, GGUF files that scripts/setup
    fetches and writes into .cache/models (git-ignored)."""
    pair = load_pair(REAL_PAIR)
    try:
        for role in ("target", "drafter"):
            pair.path(role, "gguf")
    except PairError as error:
        pytest.fail(f"{error}; run scripts/setup to fetch the real model", pytrace=False)
    return pair


def assert_clean_error(result, message: str, exit_codes=(1, 2)) -> None:
    """A CliRunner result that ended in crossrt's own error: the exit code, the message, and no
    exception but click's exit. CliRunner never prints a traceback, so its exception is what
    tells a caught error from a bug."""
    assert result.exit_code in exit_codes, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert re.search(message, result.output), result.output


def with_sigint() -> None:
    """Popen's preexec_fn for a crossrt the test will Ctrl-C: a job a non-interactive shell
    starts in the background inherits SIGINT ignored, and Python keeps an ignored SIGINT
    ignored, so the signal would do nothing (run that way, the interrupt tests failed)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
