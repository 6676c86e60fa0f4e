"""Shared fixtures: the committed tiny pair, loaded once per session in real llama.cpp.

Every test uses n_threads=1: ggml's worker threads busy-wait, and with two cores a second
thread next to any other load makes tiny models orders of magnitude slower.
"""

from pathlib import Path

import pytest

from crossrt.pairs import load_pair
from crossrt.runtime import RuntimeOptions, open_runtime

REPO = Path(__file__).resolve().parent.parent
TINY_PAIR = REPO / "models" / "pairs" / "tiny.toml"


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
