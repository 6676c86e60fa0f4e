"""Shared fixtures: the committed tiny pair, loaded once per session in real llama.cpp.

Every test uses n_threads=1: ggml's worker threads busy-wait, and with two cores a second
thread next to any other load makes tiny models orders of magnitude slower. scripts/test runs
two pytest-xdist workers, one per core, so OpenMP and BLAS pools get one thread each too.
"""

import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from crossrt.inputs.pairs import PairError, cache_dir, load_pair
from crossrt.records.record_json import load_record
from crossrt.run.runtime import RuntimeOptions, open_runtime

REPO = Path(__file__).resolve().parent.parent
TINY_PAIR = REPO / "models" / "pairs" / "tiny.toml"
REAL_PAIR = REPO / "models" / "pairs" / "gemma3-270m.toml"
# Conversions for a runtime, keyed by their source's digest and written under a temporary name:
# the session's cache reads the user's (scripts/setup converted the real model there).
SHARED_CACHE = ("hf-from-gguf", "vllm-folders", "float-twins", "head-corpora")
THREAD_POOLS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def pytest_configure(config):
    import crash_report  # for scripts/test's pytest-xdist run

    plugins = [crash_report]
    if config.pluginmanager.hasplugin("xdist"):  # a plain pytest without it still runs every test
        import schedule_alone

        plugins.append(schedule_alone)
    for plugin in plugins:
        if not config.pluginmanager.has_plugin(plugin.__name__):
            config.pluginmanager.register(plugin, plugin.__name__)
    if not hasattr(config, "workerinput"):  # xdist's workers inherit the controller's environment
        for name in THREAD_POOLS:
            os.environ.setdefault(name, "1")
        session_cache(config)


def session_cache(config) -> None:
    """One $CROSSRT_CACHE for the session, shared by its workers and the crossrt processes tests
    start: a baseline is decoded once per session (the store's lock makes the other worker
    wait and read it) and never comes from an earlier session's code; the conversions and file
    digests already made are the user's."""
    user, folder = cache_dir(), Path(tempfile.mkdtemp(prefix="crossrt-test-cache-"))
    for name in SHARED_CACHE:
        try:
            (user / name).mkdir(parents=True, exist_ok=True)
            (folder / name).symlink_to(user / name, target_is_directory=True)
        except OSError:
            pass  # a read-only home: the session converts into its own folder
    if (user / "sha256.json").is_file():
        shutil.copyfile(user / "sha256.json", folder / "sha256.json")
    before = os.environ.get("CROSSRT_CACHE")
    os.environ["CROSSRT_CACHE"] = str(folder)

    def restore():
        shutil.rmtree(folder, ignore_errors=True)  # the links, not what they point to
        if before is None:
            os.environ.pop("CROSSRT_CACHE", None)
        else:
            os.environ["CROSSRT_CACHE"] = before

    config.add_cleanup(restore)


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


# What a reproduction must equal prompt by prompt (the n-gram tests): every counter, per position too.
REPRODUCED_COUNTERS = ("steps", "drafted", "accepted", "emitted", "unverified", "cut", "accepted_per_pos")


def assert_reproduced(ours, theirs) -> None:
    """Two records' prompts, in order and all of them, with the same output ids and counters."""
    for a, b in zip(ours.results, theirs.results, strict=True):
        assert a.output_ids == b.output_ids, a.prompt_id
        assert [getattr(a.counters, name) for name in REPRODUCED_COUNTERS] == \
            [getattr(b.counters, name) for name in REPRODUCED_COUNTERS], a.prompt_id


def vllm_metrics_text(totals: dict, speculative: bool) -> str:
    """/metrics as vLLM 0.32 writes it for a fake server's running totals (generation, drafts,
    draft_tokens, accepted, pos: accepted per draft position), as the endpoint tests serve it."""
    labels = '{engine="0",model_name="tiny"}'
    lines = [f"vllm:num_requests_running{labels} 0.0", f"vllm:num_requests_waiting{labels} 0.0",
             f"vllm:generation_tokens_total{labels} {totals['generation']}.0"]
    if speculative:
        lines += [f"vllm:spec_decode_num_drafts_total{labels} {totals['drafts']}.0",
                  f"vllm:spec_decode_num_draft_tokens_total{labels} {totals['draft_tokens']}.0",
                  f"vllm:spec_decode_num_accepted_tokens_total{labels} {totals['accepted']}.0"]
        lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="tiny",position="{i}"}} '
                  f"{n}.0" for i, n in enumerate(totals["pos"])]
    return "\n".join(lines) + "\n"


def set_at(tree, spot: tuple, value) -> None:
    """tree's entry at spot (a path of keys and indexes) replaced by value, in place."""
    for key in spot[:-1]:
        tree = tree[key]
    tree[spot[-1]] = value


def refused_in_one_line(result, out: Path, context) -> bool:
    """An import given a hostile value: True where it was refused in one line, else (exit 0)
    the record it wrote loads; anything else (a traceback) fails, naming context."""
    if result.exit_code == 0:
        load_record(out)
        return False
    assert isinstance(result.exception, SystemExit) and len(result.output.strip().splitlines()) == 1, \
        (context, result.output)
    return True
