"""The llama-spec-cli runtime: llama.cpp's llama-speculative-simple on the tiny pair, against
the driven loop's "llama-spec-simple" schedule on the in-process binding at the same commit.

Needs the tool built by scripts/build_llama_tools (about 4 minutes); skipped without it.
"""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.errors import PromptRefused
from crossrt.speculative import loop
from crossrt.backends.llama_spec_cli import TOOL, parse_log
from crossrt.backends.llama_tools import Flags
from crossrt.cli import main
from crossrt.run.prompt_run import run_prompt_native
from crossrt.inputs.prompts import Prompt, load_prompts
from crossrt.run.runtime import DraftRules, RuntimeFailure, RuntimeOptions, RuntimeUnavailable, availability, open_runtime
from crossrt.speculative.schedules import SPEC_SIMPLE
from crossrt.records.record_json import load_record

from conftest import TINY_PAIR

pytestmark = pytest.mark.skipif(availability("llama-spec-cli") is not None,
                                reason=str(availability("llama-spec-cli")))

OPTIONS = RuntimeOptions(n_ctx=512, threads=1)
PROMPTS = [p for p in load_prompts("builtin") if p.id in ("code-fib", "prose-river", "structured-json")]
# n_max/n_min/p_min: fixed drafts, variable drafts, dropped short drafts, and a p_min that
# stops the tiny pair's (very sure) drafter now and then.
RULES = [DraftRules(4, 4, 0.0), DraftRules(4, 0, 0.0), DraftRules(3, 2, 0.0), DraftRules(5, 1, 0.5),
         DraftRules(5, 1, 0.9999)]


@pytest.fixture(scope="module")
def native_runtime():
    return open_runtime("llama-spec-cli", OPTIONS)


@pytest.fixture(scope="module")
def paths(tiny_pair):
    return tiny_pair.path("target", "gguf"), tiny_pair.path("drafter", "gguf")


@pytest.fixture
def open_session(native_runtime, paths, tmp_path):
    sessions = []

    def opener(rules, drafter=None):
        session = native_runtime.open_native(paths[0], drafter or paths[1], rules, tmp_path / "logs")
        sessions.append(session)
        return session
    yield opener
    for session in sessions:
        session.close()


def assert_same_as_driven(result, tiny_sessions, rules, max_new):
    """The native result equals the driven llama-spec-simple schedule, token and count."""
    target, drafter = tiny_sessions
    driven = loop.speculative_generate(target, drafter, list(result.prompt_ids), rules, max_new, SPEC_SIMPLE)
    counters = result.counters
    assert result.output_ids == driven.output_ids
    assert (counters.step_drafted, counters.step_accepted) == (driven.step_drafted, driven.step_accepted)
    assert (counters.emitted, counters.unverified, counters.cut) == (len(driven.output_ids), 0, driven.cut)
    assert result.stop_reason == driven.stop_reason
    assert counters.identity_violations(rules.k) == []


@pytest.mark.parametrize("rules", RULES, ids=lambda r: f"{r.k}-{r.n_min}-{r.p_min}")
def test_native_tool_agrees_with_the_driven_schedule(open_session, tiny_sessions, rules):
    session = open_session(rules)
    for prompt in PROMPTS:
        for max_new in (32, 64):
            result = run_prompt_native(session, prompt, max_new, rules.k)
            assert result.ok and result.lossless, result.error
            assert_same_as_driven(result, tiny_sessions, rules, max_new)
            assert result.counters.cut > 0  # the tool overshot -n: n_predict = emitted + cut


@pytest.mark.parametrize("k", [1, 2, 3])
def test_native_tool_agrees_at_eos(open_session, tiny_sessions, k):
    """"b." is followed by EOS at once and "," or "is c" a few tokens later; with k = 1 or 3 an
    EOS is accepted in the last draft position, and the tool counts the token after it."""
    rules = DraftRules(k, 0)
    session = open_session(rules)
    for text in ("b.", ",", "is c"):
        result = run_prompt_native(session, Prompt(text, "eos", text), 24, k)
        assert result.lossless and result.stop_reason == "eos"
        assert_same_as_driven(result, tiny_sessions, rules, 24)


def test_run_writes_a_native_record(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "category": "code", "prompt": "def add(a, b):\n    return"}) + "\n"
                       + json.dumps({"id": "long", "category": "prose", "prompt": "word " * 600}) + "\n")
    out = tmp_path / "run.json"
    result = CliRunner().invoke(main, [str(a) for a in (
        "run", "--runtime", "llama-spec-cli", "--mode", "native", "--pair", TINY_PAIR, "--k", 3,
        "--draft-n-min", 0, "--max-new-tokens", 16, "--n-ctx", 512, "--prompts", prompts, "--out", out)],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = load_record(out)
    assert (record.runtime.name, record.runtime.build, record.runtime.kv_cache) == ("llama-spec-cli", "0c1e57098", "f16")
    assert (record.params.mode, record.params.schedule, record.params.draft_n_min) == ("native", SPEC_SIMPLE, 0)
    done, too_long = record.results
    assert done.ok and done.lossless and done.counters.step_drafted is not None
    assert done.counters.steps + done.counters.accepted == done.counters.emitted + done.counters.cut
    assert not too_long.ok and "does not fit the context" in too_long.error
    assert any("baseline" in note for note in record.notes)


def test_a_model_that_does_not_load_is_a_runtime_failure(open_session, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))
    session = open_session(DraftRules(3), drafter=broken)
    with pytest.raises(RuntimeFailure, match=f"(?s){TOOL} exited with .*broken.gguf"):
        session.generate(session.tokenize("hello"), 8, speculative=True)


def test_prompt_checks(open_session):
    session = open_session(DraftRules(4))
    with pytest.raises(PromptRefused, match="takes prompt text"):
        session.generate([0, 40, 41], 8, speculative=True)
    ids = session.tokenize("hello there")
    # The tool tokenizes the text it is given: a text that is not what ids came from is caught.
    session._texts[tuple(ids)] = "hello world"
    with pytest.raises(PromptRefused, match="tokenized the prompt into"):
        session.generate(ids, 8, speculative=True)
    long_ids = session.tokenize("word " * 499)  # 502 tokens + 8 fit 512, but not + the k = 4 overshoot
    assert len(session.generate(long_ids, 8, speculative=False).output_ids) == 8
    with pytest.raises(PromptRefused, match=r"\(\+ 4 the schedule may run past them\) does not fit the context"):
        session.generate(long_ids, 8, speculative=True)


def test_a_missing_statistics_tail_is_no_run(open_session):
    session = open_session(DraftRules(4))
    session.generate(session.tokenize("hello"), 8, speculative=True)
    log = session._log.read_bytes()
    assert parse_log(log).n_predict > 8
    assert parse_log(log[:log.index(b"n_predict")]) is None  # retried, never read as zero


def test_flags_follow_the_build(native_runtime):
    new = native_runtime.flags  # read from this build's --help
    assert (new.n_max, new.spec_type, new.flash_attn_takes_value) == ("--spec-draft-n-max", "--spec-type", True)
    # Help lines of a 2025 build, before the renames.
    old = Flags.from_help("--draft-max, --draft, --draft-n N   number of tokens to draft (default: 16)\n"
                          "--draft-min, --draft-n-min N  minimum number of draft tokens (default: 0)\n"
                          "--draft-p-min P   minimum speculative decoding probability (default: 0.8)\n"
                          "-fa,   --flash-attn   enable Flash Attention (default: disabled)\n")
    assert (old.n_max, old.n_min, old.p_min, old.spec_type, old.flash_attn_takes_value) == \
        ("--draft-max", "--draft-min", "--draft-p-min", None, False)


def test_the_binding_and_both_tools_run_one_build(native_runtime):
    """scripts/build_llama_tools compiles llama.cpp once: the binding loads the tools' libllama,
    and all three report the same system info (backends, CPU features), read from each."""
    from crossrt.backends.llama_cpp import BUILD_BIN, llama_cpp

    assert Path(llama_cpp.llama_cpp._lib._name).resolve() == (BUILD_BIN / "libllama.so").resolve()
    in_process = open_runtime("llama-cpp", OPTIONS).info().system_info
    assert in_process.startswith("CPU : ") and not in_process.endswith("|")
    assert native_runtime.info().system_info == in_process
    assert open_runtime("llama-server", OPTIONS).info().system_info == in_process


def test_an_executable_that_is_not_there_is_unavailable(tmp_path):
    with pytest.raises(RuntimeUnavailable, match=f"{TOOL} not found"):
        open_runtime("llama-spec-cli", RuntimeOptions(executable=tmp_path / "nothing"))


def test_preloaded_log_flush_keeps_the_statistics_of_every_run(tmp_path):
    """Without scripts/llama_log_flush.c the tool loses its final statistics in most runs on a
    busy machine (its logger thread is never joined); preloaded, it loses none."""
    import os
    import subprocess

    from crossrt.backends.llama_spec_cli import LOG_FLUSH_SHIM, REPO_TOOL

    models = TINY_PAIR.parent.parent / "tiny"
    command = [str(REPO_TOOL), "-m", str(models / "target.f32.gguf"), "-md", str(models / "drafter.f32.gguf"),
               "--spec-type", "draft-simple", "--spec-draft-n-max", "4", "-n", "16", "-t", "1", "-tb", "1",
               "-td", "1", "--temp", "0", "-lv", "5", "-p", "def add(a, b):"]
    environment = {**os.environ, "LD_PRELOAD": str(LOG_FLUSH_SHIM)}
    for _ in range(10):
        done = subprocess.run(command, capture_output=True, env=environment, stdin=subprocess.DEVNULL)
        assert done.returncode == 0
        assert parse_log(done.stderr) is not None
