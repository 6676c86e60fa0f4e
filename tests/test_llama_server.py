"""The llama-server runtime against the real server (built by scripts/build_llama_tools from the
same llama.cpp commit as the in-process binding), on the tiny pair, one thread per server."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.errors import PromptRefused
from crossrt.speculative import loop
from crossrt.cli import main
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import (DraftRules, NativeGeneration, RuntimeFailure, RuntimeOptions, RuntimeUnavailable,
                             availability, open_runtime)
from crossrt.records.schema import accepted_per_position
from crossrt.records.record_json import load_record

from conftest import TINY_PAIR

pytestmark = pytest.mark.skipif(availability("llama-server") is not None,
                                reason=f"llama-server not usable: {availability('llama-server')}")

OPTIONS = RuntimeOptions(n_ctx=512, threads=1)
PROMPTS = load_prompts("builtin")
# With k=4 the tiny pair accepts an EOS in the last draft position here: the bonus token is cut.
EOS_IN_LAST_DRAFT_POSITION = "river"


@pytest.fixture(scope="module")
def runtime():
    return open_runtime("llama-server", OPTIONS)


@pytest.fixture(scope="module")
def sessions(runtime, tiny_pair, tmp_path_factory):
    """Native sessions by DraftRules, started once each and closed after the module."""
    opened = {}

    def session(rules: DraftRules):
        if rules not in opened:
            opened[rules] = runtime.open_native(tiny_pair.path("target", "gguf"), tiny_pair.path("drafter", "gguf"),
                                                rules, tmp_path_factory.mktemp("server-logs"))
        return opened[rules]

    yield session
    for opened_session in opened.values():
        opened_session.close()


def server_children() -> set[int]:
    """Live llama-server processes started by this test process."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            name = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and name.endswith(b"llama-server"):
            found.add(int(entry))
    return found


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_tokenize_matches_the_in_process_runtime(sessions, tiny_sessions):
    session, (target, _) = sessions(DraftRules(4)), tiny_sessions
    texts = [p.text for p in PROMPTS] + ["<|bos|>b.<|eos|> x", "naïve café ✓"]
    assert [session.tokenize(t) for t in texts] == [target.tokenize(t) for t in texts]
    assert session.tokenize("b.")[0] == 0  # BOS added


def test_outputs_match_in_process_greedy_and_counters_add_up(sessions, tiny_sessions):
    session, (target, _) = sessions(DraftRules(4)), tiny_sessions
    for prompt in PROMPTS[:3]:
        ids = session.tokenize(prompt.text)
        baseline = session.generate(ids, 32, speculative=False)
        speculative = session.generate(ids, 32, speculative=True)
        assert baseline.output_ids == loop.greedy_generate(target, ids, 32).output_ids
        assert speculative.output_ids == baseline.output_ids
        assert baseline.counters is None and speculative.stop_reason == "max_new_tokens"
        counters = speculative.counters
        assert counters.identity_violations(4) == []
        assert counters.steps > 0 and counters.unverified >= 1 and counters.step_drafted is None
        assert speculative.prefill_s > 0 and speculative.decode_s > 0


def test_first_token_eos_comes_from_the_prompt_pass(sessions):
    session = sessions(DraftRules(4))
    generation = session.generate(session.tokenize("b."), 32, speculative=True)
    assert generation.output_ids == (1,) and generation.stop_reason == "eos"
    counters = generation.counters
    assert (counters.steps, counters.drafted, counters.unverified, counters.cut) == (0, 0, 1, 0)


def test_bonus_token_after_an_accepted_eos_is_cut(sessions):
    session = sessions(DraftRules(4))
    generation = session.generate(session.tokenize(EOS_IN_LAST_DRAFT_POSITION), 32, speculative=True)
    assert generation.stop_reason == "eos" and generation.output_ids[-1] == 1
    assert generation.counters.cut == 1 and generation.counters.identity_violations(4) == []


def test_prompt_that_does_not_fit_fails_alone(sessions):
    session = sessions(DraftRules(4))
    with pytest.raises(PromptRefused, match="does not fit the context of 512"):
        session.generate([0] * 500, 12, speculative=True)
    assert session.generate(session.tokenize("b."), 4, speculative=True).output_ids == (1,)


@pytest.mark.parametrize("rules", [DraftRules(4, 4, 0.0), DraftRules(4, 0, 0.0), DraftRules(3, 2, 0.0),
                                   DraftRules(5, 1, 0.5)], ids=str)
def test_counts_agree_with_the_driven_llama_server_schedule(sessions, tiny_sessions, rules):
    if "llama-server" not in loop.SCHEDULES:
        pytest.skip("the driven loop has no llama-server schedule yet")
    session, (target, drafter) = sessions(rules), tiny_sessions
    texts = [p.text for p in PROMPTS[::3]] + [EOS_IN_LAST_DRAFT_POSITION]
    for text in texts:
        ids = session.tokenize(text)
        for budget in (32, 64):
            native = session.generate(ids, budget, speculative=True)
            driven = loop.speculative_generate(target, drafter, ids, rules, budget, "llama-server")
            counters = native.counters
            assert native.output_ids == driven.output_ids, (text, budget)
            assert (counters.steps, counters.drafted, counters.accepted, counters.emitted, counters.unverified,
                    counters.cut, counters.accepted_per_pos) == (
                len(driven.step_accepted), sum(driven.step_drafted), sum(driven.step_accepted),
                len(driven.output_ids), driven.unverified, driven.cut,
                accepted_per_position(driven.step_accepted, rules.k)), (text, budget)


def test_close_stops_both_servers_and_can_be_repeated(runtime, tiny_pair, tmp_path):
    session = runtime.open_native(tiny_pair.path("target", "gguf"), tiny_pair.path("drafter", "gguf"),
                                  DraftRules(2), tmp_path)
    pids = session.pids
    assert len(pids) == 2 and not any(gone(pid) for pid in pids)
    assert (tmp_path / "llama-server-speculative.log").read_text().count("listening on") == 1
    session.close()
    session.close()
    assert all(gone(pid) for pid in pids)


def test_server_is_restarted_before_its_metrics_lose_precision(runtime, tiny_pair, tmp_path, monkeypatch):
    from crossrt.backends import llama_server

    monkeypatch.setattr(llama_server, "PRECISION_LIMIT", 1)  # restart before every speculative request
    session = runtime.open_native(tiny_pair.path("target", "gguf"), tiny_pair.path("drafter", "gguf"),
                                  DraftRules(4), tmp_path)
    try:
        ids = session.tokenize(PROMPTS[0].text)
        first, first_pids = session.generate(ids, 32, speculative=True), session.pids
        second = session.generate(ids, 32, speculative=True)
        assert first_pids[0] != session.pids[0] and gone(first_pids[0]) and first_pids[1] == session.pids[1]
        assert second == NativeGeneration(first.output_ids, first.stop_reason, first.counters,
                                          second.prefill_s, second.decode_s)
    finally:
        session.close()


def test_missing_executable_says_how_to_get_one(tmp_path):
    with pytest.raises(RuntimeUnavailable, match="scripts/build_llama_tools"):
        open_runtime("llama-server", RuntimeOptions(executable=tmp_path / "llama-server"))


def test_model_that_fails_to_load_raises_with_the_log_and_leaves_no_process(runtime, tiny_pair, tmp_path):
    before = server_children()
    broken = tmp_path / "broken.gguf"
    broken.write_text("not a model")
    with pytest.raises(RuntimeFailure, match="(?s)exited with 1 while starting.*failed to load model"):
        runtime.open_native(broken, tiny_pair.path("drafter", "gguf"), DraftRules(4), tmp_path)
    assert server_children() == before


def test_port_in_use_is_reported_and_leaves_no_process(runtime, tiny_pair, tmp_path):
    from crossrt.backends.llama_server_process import PortInUse, ServerProcess

    before = server_children()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUse, match=f"could not bind 127.0.0.1:{port} \\(port in use\\)"):
            ServerProcess.start(runtime.build.path, ["-m", str(tiny_pair.path("target", "gguf")), "-t", "1"],
                                tmp_path / "server.log", port=port)
    assert server_children() == before


def test_server_that_is_not_healthy_in_time_is_stopped(runtime, tiny_pair, tmp_path):
    from crossrt.backends.llama_server_process import ServerProcess

    before = server_children()
    with pytest.raises(RuntimeFailure, match="was not healthy within 0 s"):
        ServerProcess.start(runtime.build.path, ["-m", str(tiny_pair.path("target", "gguf")), "-t", "1"],
                            tmp_path / "server.log", health_timeout_s=0)
    assert server_children() == before


def run_request(tmp_path):
    return RunRequest(pair=load_pair(TINY_PAIR), runtime="llama-server",
                      options=OPTIONS, rules=DraftRules(3), max_new_tokens=16, out=tmp_path / "run.json",
                      mode="native")


def test_server_killed_mid_run_keeps_finished_prompts(tmp_path):
    before = server_children()

    def kill_servers(prompt, result):
        for pid in server_children() - before:
            os.kill(pid, signal.SIGKILL)

    with pytest.raises(RuntimeFailure, match="(?s)killed by SIGKILL.*last lines"):
        run_pair(run_request(tmp_path), PROMPTS[:3], on_prompt=kill_servers)
    record = load_record(tmp_path / "run.json")
    assert [r.prompt_id for r in record.results] == [PROMPTS[0].id] and record.results[0].lossless
    assert server_children() == before


def test_ctrl_c_stops_the_servers(tmp_path):
    before = server_children()

    def interrupt(prompt, result):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_pair(run_request(tmp_path), PROMPTS[:2], on_prompt=interrupt)
    assert len(load_record(tmp_path / "run.json").results) == 1
    assert server_children() == before


def test_server_dies_with_a_killed_parent(runtime, tiny_pair, tmp_path):
    args = ["-m", str(tiny_pair.path("target", "gguf")), "-t", "1"]
    code = ("import time; from pathlib import Path; "
            "from crossrt.backends.llama_server_process import ServerProcess; "
            f"s = ServerProcess.start(Path({str(runtime.build.path)!r}), {args!r}, Path({str(tmp_path / 'log')!r})); "
            "print(s.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(parent.stdout.readline())
        assert not gone(server_pid)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while not gone(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(server_pid)


def test_cli_native_run_writes_a_lossless_record(tmp_path):
    out = tmp_path / "run.json"
    command = ["run", "--runtime", "llama-server", "--mode", "native", "--pair", str(TINY_PAIR), "--k", "4",
               "--max-new-tokens", "32"]
    result = CliRunner().invoke(main, command + ["--out", str(out), "--fresh-baseline"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (out.parent / "run.logs" / "llama-server-baseline.log").is_file()
    # Every baseline now stored: a second run reads them all, and its plain server never starts.
    again = tmp_path / "again.json"
    result = CliRunner().invoke(main, command + ["--out", str(again)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "again.logs" / "llama-server-baseline.log").exists()
    record, stored = load_record(out), load_record(again)  # schema, derived numbers and identities checked on load
    assert [r.baseline_source.origin for r in stored.results] == ["store"] * len(PROMPTS)
    assert [r.baseline_ids for r in stored.results] == [r.baseline_ids for r in record.results]
    assert record.runtime.name == "llama-server" and record.runtime.build == "0c1e57098" and record.runtime.flash_attn
    assert (record.params.mode, record.params.schedule, record.params.k) == ("native", "llama-server", 4)
    assert len(record.results) == len(PROMPTS) and all(r.ok and r.lossless for r in record.results)
    assert all(r.counters.unverified >= 1 and r.counters.step_accepted is None for r in record.results)
    assert any("step_drafted/step_accepted: null" in note for note in record.notes)


def test_flag_names_follow_the_build():
    from crossrt.backends.llama_server_process import BUILT_EXECUTABLE
    from crossrt.backends.llama_tools import Flags, probe

    if BUILT_EXECUTABLE.is_file():
        new = probe(BUILT_EXECUTABLE).flags
        assert (new.n_max, new.spec_type, new.flash_attn_takes_value) == ("--spec-draft-n-max", "--spec-type", True)
    old = Flags.from_help("--draft-max, --draft-n-max N\n--draft-min N\n--draft-p-min P\n"
                          "-fa,   --flash-attn    enable Flash Attention\n")
    assert (old.n_max, old.n_min, old.p_min, old.spec_type, old.flash_attn_takes_value) == (
        "--draft-max", "--draft-min", "--draft-p-min", None, False)
    with pytest.raises(RuntimeUnavailable, match="no draft-model flags"):
        Flags.from_help("-m, --model FNAME\n")


def test_counts_that_do_not_fit_the_schedule_are_kept_with_the_raw_numbers():
    from crossrt.backends.llama_server_counts import MetricsCounters, speculative_counters

    delta = MetricsCounters(drafts=3, draft_tokens=12, accepted=6, accepted_per_pos=(3, 2, 1, 0), decodes=5,
                            predicted=12)
    timings = {"draft_n": 12, "draft_n_accepted": 6}
    counters, unfit = speculative_counters(11, "max_new_tokens", timings, delta, 4)
    assert (counters.unverified, counters.cut, unfit) == (2, 0, None)
    # One decode more than the schedule explains (as a prompt split into two batches gives).
    counters, unfit = speculative_counters(10, "max_new_tokens", timings, delta, 4)
    assert "cut 1" in unfit.problems[0] and unfit.raw["metrics.decodes"] == 5
    assert (counters.steps, counters.accepted, counters.unverified, counters.cut) == (3, 6, 1, 0)
    assert counters.identity_violations(4) == []
    counters, unfit = speculative_counters(11, "max_new_tokens", {**timings, "draft_n_accepted": 5}, delta, 4)
    assert "timings 12/5" in unfit.problems[0] and counters.accepted == 5
    assert counters.accepted_per_pos is None and counters.identity_violations(4) == []


def test_native_spec_types_pass_through_and_driven_mode_refuses_them(tmp_path):
    def run(*args):
        return CliRunner().invoke(main, ["run", "--pair", str(TINY_PAIR), "--spec-type", "ngram-simple",
                                         "--max-new-tokens", "24", *map(str, args)], catch_exceptions=False)

    native = run("--runtime", "llama-server", "--mode", "native", "--out", tmp_path / "ngram.json")
    assert native.exit_code == 0, native.output
    record = load_record(tmp_path / "ngram.json")
    assert record.params.spec_type == "ngram-simple"
    assert any("--spec-type ngram-simple" in note for note in record.notes)
    assert all(r.ok and r.lossless for r in record.results)
    driven = run("--out", tmp_path / "driven.json")
    assert driven.exit_code == 1 and "drafts with a drafter model only" in driven.output
    assert not (tmp_path / "driven.json").exists()  # refused before anything ran
