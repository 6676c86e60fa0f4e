"""The endpoint runtime attached to real servers: crossrt's own llama-server runtime starts its
servers (the same llama.cpp build) on free loopback ports, and the endpoint runtime attaches to
them as to a server a user already runs. Faults are real too: a server killed, a server swapped
for a fresh one behind the same address, a socket that accepts and never answers, a port nobody
listens on, a web server that is not an inference server.

vLLM and SGLang do not run in this suite: their tests (at the end) answer with responses in the
formats their sources write (vllm/entrypoints/openai/completion/protocol.py and serve tokenize;
SGLang's http_server.py and tokenizer_manager.py), served over a real local socket, and say so.
"""

import dataclasses
import functools
import http.client
import json
import os
import re
import signal
import socket
import socketserver
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.backends import endpoint_http
from crossrt.backends import endpoint as endpoint_module
from crossrt.backends.endpoint import Attached, EndpointRuntime, EndpointSession
from crossrt.backends.endpoint_counts import Scrape, other_work
from crossrt.backends.endpoint_http import API_KEY_VARIABLE, Endpoint
from crossrt.backends.llama_server_process import free_port
from crossrt.cli import main
from crossrt.errors import ModelError, PromptRefused, SettingsError
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record
from crossrt.run.baselines import BaselineStore
from crossrt.run.driver import RunRequest, run_pair
from crossrt.run.runtime import DraftRules, RuntimeFailure, RuntimeOptions, RuntimeUnavailable, availability, open_runtime

from conftest import TINY_PAIR, assert_clean_error, vllm_metrics_text

OPTIONS = RuntimeOptions(n_ctx=512, threads=1)
PROMPTS = load_prompts("builtin")
needs_server = pytest.mark.skipif(availability("llama-server") is not None,
                                  reason=f"llama-server not usable: {availability('llama-server')}")


def serve(pair, k, tmp_path):
    """crossrt's own llama-server runtime's two servers (speculative, plain) for pair at k."""
    runtime = open_runtime("llama-server", OPTIONS)
    return runtime.open_native(pair.path("target", "gguf"), pair.path("drafter", "gguf"), DraftRules(k), tmp_path)


def attaching(urls, options=OPTIONS):
    return dataclasses.replace(options, url=urls[0], baseline_url=urls[1])


def request(pair, runtime, options, k, out, max_new_tokens=16, resume=False):
    return RunRequest(pair, runtime, options, DraftRules(k), max_new_tokens, out, mode="native", resume=resume)


@pytest.fixture(scope="module")
def real_servers(real_pair, tmp_path_factory):
    with serve(real_pair, 7, tmp_path_factory.mktemp("real-servers")) as session:
        yield session


@pytest.fixture(scope="module")
def tiny_servers(tmp_path_factory):
    with serve(load_pair(TINY_PAIR), 3, tmp_path_factory.mktemp("tiny-servers")) as session:
        yield session


# ---- the real model: equal to crossrt's own native run ------------------------------------------

@needs_server
def test_attached_llama_server_equals_the_native_run_id_for_id_and_count_for_count(real_pair, real_servers, tmp_path):
    prompts = PROMPTS[:2]
    native = run_pair(request(real_pair, "llama-server", OPTIONS, 7, tmp_path / "native.json"), prompts)
    attached = run_pair(request(real_pair, "endpoint", attaching(real_servers.urls), 7, tmp_path / "endpoint.json"),
                        prompts)
    assert [r.ok for r in attached.results] == [True, True]
    for ours, theirs in zip(native.results, attached.results):
        assert (ours.output_ids, ours.baseline_ids, ours.counters) == \
            (theirs.output_ids, theirs.baseline_ids, theirs.counters)
    assert sum(r.counters.steps for r in attached.results) > 0  # it really drafted
    assert attached.runtime.version == f"llama-server {attached.runtime.version.split()[1]}"
    assert attached.params.schedule == native.params.schedule == "llama-server"
    assert any(note.startswith("attached: llama-server") for note in attached.notes)
    result = CliRunner().invoke(main, ["parity", str(tmp_path / "native.json"), str(tmp_path / "endpoint.json"),
                                       "--no-logits"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "2 prompts: 2 identical, 0 explained, 0 failed" in result.output


def stream_until(url: str, body: dict, stop: threading.Event) -> None:
    """A streamed /completion read until stop is set, then its connection closed: llama-server
    cancels a request whose client has gone (tools/server/server-context.cpp stops the stream at
    should_stop, server_response_reader::stop posts the cancel task), so it never runs to the end."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        connection.request("POST", "/completion", json.dumps({**body, "stream": True}),
                           {"Content-Type": "application/json"})
        answer = connection.getresponse()
        while not stop.is_set() and answer.readline():
            pass
    finally:
        connection.close()


@needs_server
def test_a_busy_server_is_one_line(real_servers, monkeypatch):
    monkeypatch.setattr(endpoint_module, "BUSY_WAIT_S", 0.5)
    speculative, baseline = (Attached.attach(url) for url in real_servers.urls)
    session = EndpointSession(speculative, baseline, DraftRules(7), ())
    # Someone else's request, long enough to outlast the 0.5 s wait on any machine, cancelled
    # once the failure is seen rather than decoded to its end.
    stop = threading.Event()
    someone_else = threading.Thread(target=stream_until, args=(real_servers.urls[0], {
        "prompt": "Once upon a time", "n_predict": 400, "temperature": 0.0}, stop))
    someone_else.start()
    try:
        while speculative.kind.scrape(speculative.endpoint).busy == 0:
            assert someone_else.is_alive(), "the other request ended before the server showed it"
            time.sleep(0.01)  # a scrape without a pause starves the server of the CPU it needs
        with pytest.raises(RuntimeFailure, match=r"is busy: 1 requests running or waiting for 0.5 s"):
            session.generate(session.tokenize("Hello"), 4, speculative=True)
    finally:
        stop.set()
        someone_else.join()
    deadline = time.monotonic() + 60
    while speculative.kind.scrape(speculative.endpoint).busy:  # the cancelled request leaves the server idle
        assert time.monotonic() < deadline, "the other request was not cancelled"
        time.sleep(0.05)


# ---- faults on the tiny pair's servers -------------------------------------------------------------

class Proxy(socketserver.ThreadingTCPServer):
    """One loopback address in front of a server that can be swapped: a restarted server as the
    attached runtime sees it (the same URL, a fresh process behind it)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int):
        self.backend = port
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class ProxyHandler(socketserver.BaseRequestHandler):
    def handle(self):
        upstream = socket.create_connection(("127.0.0.1", self.server.backend))
        pump = threading.Thread(target=_copy, args=(upstream, self.request), daemon=True)
        pump.start()
        _copy(self.request, upstream)
        pump.join()
        upstream.close()


def _copy(source, sink):
    while data := source.recv(65536):
        sink.sendall(data)
    sink.shutdown(socket.SHUT_WR)


@needs_server
def test_a_restarted_server_ends_the_run_and_resume_continues_with_the_key_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_VARIABLE, "sekrit-key")
    pair = load_pair(TINY_PAIR)
    with serve(pair, 3, tmp_path / "first") as first, serve(pair, 3, tmp_path / "second") as second:
        proxy = Proxy(int(first.urls[0].rsplit(":", 1)[1]))
        url = proxy.url.replace("http://", "http://user:sekrit-pass@")
        options = dataclasses.replace(OPTIONS, url=url, baseline_url=first.urls[1])
        out = tmp_path / "run.json"

        def restart(prompt, result):
            proxy.backend = int(second.urls[0].rsplit(":", 1)[1])

        with pytest.raises(RuntimeFailure, match=r"restarted since the last prompt: .*--resume continues"):
            run_pair(request(pair, "endpoint", options, 3, out), PROMPTS[:3], on_prompt=restart)
        assert [r.prompt_id for r in load_record(out).results] == [PROMPTS[0].id]
        record = run_pair(request(pair, "endpoint", options, 3, out, resume=True), PROMPTS[:3])
        proxy.shutdown()
    assert [r.prompt_id for r in record.results] == [p.id for p in PROMPTS[:3]]
    assert all(r.ok and r.lossless and not r.counters.identity_violations(3) for r in record.results)
    written = "".join(path.read_text(errors="replace") for path in tmp_path.rglob("*") if path.is_file())
    assert proxy.url in written and "sekrit" not in written


class LoopbackServer(ThreadingHTTPServer):
    """An HTTP server on a free loopback port, serving from a thread of its own until shutdown()."""

    def __init__(self, handler):
        super().__init__(("127.0.0.1", 0), handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def serve_forever(self, poll_interval=0.02):
        # shutdown() waits for the loop's next look at its flag: at socketserver's 0.5 s each
        # server took half a second to stop.
        super().serve_forever(poll_interval)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class QuietHandler(BaseHTTPRequestHandler):
    """A handler without the request log, answering with reply()."""

    def reply(self, status: int, data: bytes, content_type: str = "") -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

    def ask_upstream(self) -> tuple[int, bytes, str]:
        """This request passed on to the server's upstream URL: its status, body and type (a
        proxy in front of a real llama-server)."""
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        ahead = urllib.request.Request(self.server.upstream + self.path, data=body if body else None,
                                       method=self.command, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(ahead, timeout=120) as answer:
                return answer.status, answer.read(), answer.headers.get("Content-Type", "")
        except urllib.error.HTTPError as error:
            return error.code, error.read(), error.headers.get("Content-Type", "")


class RebuildingProxy(LoopbackServer):
    """An HTTP proxy in front of a real llama-server whose /props can name another build: the
    same server, as if upgraded behind the same URL (the only way to have two builds here)."""

    def __init__(self, upstream: str):
        self.upstream, self.build = upstream, None
        super().__init__(RebuildingHandler)


class RebuildingHandler(QuietHandler):
    def forward(self):
        status, data, kind = self.ask_upstream()
        if self.path == "/props" and self.server.build is not None:
            data = json.dumps({**json.loads(data), "build_info": self.server.build}).encode()
        self.reply(status, data, kind)

    do_GET = do_POST = forward


@needs_server
def test_a_baseline_server_of_another_build_behind_the_same_url_never_lends_its_stored_baselines(tiny_servers, tmp_path):
    pair, store = load_pair(TINY_PAIR), BaselineStore(tmp_path / "store")
    proxy = RebuildingProxy(tiny_servers.urls[1])
    options = dataclasses.replace(OPTIONS, url=tiny_servers.urls[0], baseline_url=proxy.url)

    def origins(name):
        record = run_pair(dataclasses.replace(request(pair, "endpoint", options, 3, tmp_path / name, 8),
                                              baselines=store), PROMPTS[:2])
        assert all(r.ok for r in record.results)
        return record, [r.baseline_source.origin for r in record.results]
    try:
        first, decoded = origins("first.json")
        again, stored = origins("again.json")
        proxy.build = "b9999-0123abc"
        upgraded, after_upgrade = origins("upgraded.json")
    finally:
        proxy.shutdown()
    assert (decoded, stored, after_upgrade) == (["decoded"] * 2, ["store"] * 2, ["decoded"] * 2)
    named = re.fullmatch(r"model (\S+); baseline llama-server (\S+) serving (\S+)", first.runtime.system_info)
    assert named and named[1] == named[3] and named[2] != "b9999-0123abc", first.runtime.system_info
    assert upgraded.runtime.system_info == first.runtime.system_info.replace(named[2], "b9999-0123abc")
    assert [r.baseline_ids for r in upgraded.results] == [r.baseline_ids for r in first.results]


def dead(pid: int) -> bool:
    """pid has exited with all its threads (a zombie until its parent reaps it, or gone): its
    sockets are closed only once the last thread is."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X") and len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


@needs_server
def test_a_killed_server_ends_the_run_keeping_finished_prompts(tmp_path):
    pair = load_pair(TINY_PAIR)
    with serve(pair, 3, tmp_path) as servers:
        def kill(prompt, result):
            os.kill(servers.pids[0], signal.SIGKILL)
            while not dead(servers.pids[0]):  # the kill lands asynchronously; its socket closes at exit
                time.sleep(0.01)

        out = tmp_path / "run.json"
        with pytest.raises(RuntimeFailure, match=r"nothing is listening at http://127.0.0.1:\d+ \(connection refused\)"):
            run_pair(request(pair, "endpoint", attaching(servers.urls), 3, out), PROMPTS[:3], on_prompt=kill)
    assert [r.prompt_id for r in load_record(out).results] == [PROMPTS[0].id]


@needs_server
def test_a_server_error_fails_the_prompt_alone(tiny_servers, tmp_path):
    pair = load_pair(TINY_PAIR)
    session = EndpointRuntime(attaching(tiny_servers.urls)).open_native(
        pair.path("target", "gguf"), pair.path("drafter", "gguf"), DraftRules(3), tmp_path)
    with pytest.raises(PromptRefused, match=r"llama-server refused the prompt: HTTP 400: .*"):
        session.generate([1, 100000], 4, speculative=True)
    ids = session.tokenize("Hello")
    assert session.generate(ids, 8, speculative=True).counters.emitted == 8  # the session goes on


@needs_server
def test_the_pairs_target_is_checked_before_any_prompt(tiny_servers, real_pair, tmp_path):
    runtime = EndpointRuntime(attaching(tiny_servers.urls))
    with pytest.raises(ModelError, match=r"its vocabulary has 512 tokens, the pair's target .* has 262144"):
        runtime.open_native(real_pair.path("target", "gguf"), real_pair.path("drafter", "gguf"), DraftRules(3),
                            tmp_path)
    pair = load_pair(TINY_PAIR)
    with pytest.raises(SettingsError, match=r"the baseline needs a plain server"):
        EndpointRuntime(dataclasses.replace(OPTIONS, url=tiny_servers.urls[0], baseline_url=tiny_servers.urls[0])) \
            .open_native(pair.path("target", "gguf"), pair.path("drafter", "gguf"), DraftRules(3), tmp_path)
    with pytest.raises(SettingsError, match=r"does not draft"):
        EndpointRuntime(dataclasses.replace(OPTIONS, url=tiny_servers.urls[1], baseline_url=tiny_servers.urls[1])) \
            .open_native(pair.path("target", "gguf"), pair.path("drafter", "gguf"), DraftRules(3), tmp_path)


@needs_server
def test_a_wrong_url_is_refused_naming_what_answered(tiny_servers, tmp_path):
    with pytest.raises(RuntimeUnavailable, match=r"/nope is not llama-server, vLLM or SGLang .*\(/props HTTP 404"):
        Attached.attach(tiny_servers.urls[0] + "/nope")
    (tmp_path / "index.html").write_text("a web page")
    web = LoopbackServer(functools.partial(QuietFiles, directory=str(tmp_path)))
    try:
        with pytest.raises(RuntimeUnavailable, match=r"not llama-server, vLLM or SGLang .*/props HTTP 404"):
            Attached.attach(web.url)
    finally:
        web.shutdown()


def test_nothing_listening_is_one_line_at_the_command_line(tmp_path):
    port = free_port()
    result = CliRunner().invoke(main, ["run", "--runtime", "endpoint", "--pair", str(TINY_PAIR),  # native: its only mode
                                       "--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "r.json")])
    assert_clean_error(result, rf"nothing is listening at http://127.0.0.1:{port} \(connection refused\)")


def test_a_server_that_never_answers_times_out(monkeypatch):
    monkeypatch.setattr(endpoint_http, "PROBE_TIMEOUT_S", 0.5)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections (the backlog), never answers
        with pytest.raises(RuntimeFailure, match=r"GET http://127.0.0.1:\d+/props: no whole answer within 0.5 s"):
            Attached.attach(f"http://127.0.0.1:{silent.getsockname()[1]}")


def test_credentials_stay_out_of_what_is_shown():
    endpoint = Endpoint.parse("http://alice:pw@example.test:8080/base")
    assert endpoint.display == "http://example.test:8080/base" and "pw" not in repr(endpoint)
    with pytest.raises(SettingsError, match="give a server's address as http://HOST:PORT"):
        Endpoint.parse("127.0.0.1:8080")


def test_other_requests_during_a_prompt_make_it_invalid():
    def scrape(emitted, prompt, exact=True):
        return Scrape(None, 0, emitted, prompt, 0, 0, 0, (), 0, exact)

    assert other_work(scrape(100, 50), scrape(116, 58), 16, 8) is None
    assert other_work(scrape(100, 50), scrape(140, 58), 16, 8) == \
        "the server served other requests during this prompt (/metrics shows 40 tokens generated, this prompt 16)"
    assert other_work(scrape(100, 50), scrape(116, 90), 16, 8) == \
        "the server served other requests during this prompt (/metrics shows 40 prompt tokens read, this prompt has 8)"
    assert other_work(scrape(100, 50, exact=False), scrape(116, 58), 16, 8) is not None


# ---- vLLM and SGLang: responses in the formats their sources write -----------------------------------

class QuietFiles(SimpleHTTPRequestHandler):
    """A plain web server's handler (files from a folder), without its request log."""

    def log_message(self, *args):
        pass


class FormatServer(LoopbackServer):
    """A loopback server answering each route with a response in a server's own format (not
    that server: vLLM and SGLang do not run in this suite). routes: path -> function(body) ->
    (status, JSON value or text)."""

    def __init__(self, routes):
        self.routes = routes
        super().__init__(_FormatHandler)


class _FormatHandler(QuietHandler):
    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        route = self.server.routes.get(self.path)
        status, value = route(body) if route else (404, {"detail": "Not Found"})
        self.reply(status, value.encode() if isinstance(value, str) else json.dumps(value).encode())

    do_GET = do_POST = _answer


def vllm_routes(speculative: bool):
    """vLLM's answers: /version {"version"}; /v1/models ModelList (owned_by "vllm", max_model_len);
    /tokenize TokenizeResponse {count, max_model_len, tokens}; /v1/completions CompletionResponse
    with choices[0].token_ids (return_token_ids) and finish_reason; /metrics vllm:spec_decode_*
    counters (one series per engine, prometheus_client's _total suffix), registered only with a
    speculative config, each completion adding 2 drafts of 3 tokens, 4 accepted."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "generation": 0, "pos": [0, 0, 0]}

    def complete(body):
        totals.update(drafts=totals["drafts"] + 2, draft_tokens=totals["draft_tokens"] + 6,
                      accepted=totals["accepted"] + 4, generation=totals["generation"] + 7)
        totals["pos"] = [totals["pos"][0] + 2, totals["pos"][1] + 1, totals["pos"][2] + 1]
        return 200, {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
                     "choices": [{"index": 0, "text": "…", "logprobs": None, "finish_reason": "length",
                                  "stop_reason": None, "token_ids": [5, 6, 7, 8, 9, 10, 11], "prompt_token_ids": None}],
                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 7, "total_tokens": 0}}

    def metrics(_):
        return 200, vllm_metrics_text(totals, speculative)

    return {"/version": lambda _: (200, {"version": "0.32.0"}),
            "/v1/models": lambda _: (200, {"object": "list", "data": [{"id": "tiny", "object": "model",
                                                                     "owned_by": "vllm", "root": "/models/tiny",
                                                                     "max_model_len": 512}]}),
            "/tokenize": lambda body: (200, {"count": 3, "max_model_len": 512, "tokens": [1, 2, 3]}),
            "/v1/completions": complete, "/metrics": metrics}


def test_vllm_in_its_source_formats_gives_ids_and_metrics_deltas():
    spec, plain = FormatServer(vllm_routes(True)), FormatServer(vllm_routes(False))
    try:
        speculative, baseline = Attached.attach(spec.url), Attached.attach(plain.url)
        assert (speculative.served.kind, speculative.served.version, speculative.served.model) == ("vllm", "0.32.0", "tiny")
        assert (speculative.served.k, speculative.served.speculates, baseline.served.speculates) == (3, True, False)
        session = EndpointSession(speculative, baseline, DraftRules(3), ())
        assert session.tokenize("abc") == [1, 2, 3]
        result = session.generate([1, 2, 3], 7, speculative=True)
    finally:
        spec.shutdown(), plain.shutdown()
    assert result.output_ids == (5, 6, 7, 8, 9, 10, 11) and result.stop_reason == "max_new_tokens"
    counters = result.counters
    assert (counters.steps, counters.drafted, counters.accepted, counters.unverified, counters.cut) == (2, 6, 4, 1, 0)
    assert counters.accepted_per_pos == (2, 1, 1) and not counters.identity_violations(3)


def sglang_routes():
    """SGLang's answers: /get_server_info {**server_args, **scheduler_info, "version"};
    /v1/tokenize {"tokens", "count", "max_model_len"}; /generate {"text", "output_ids", "meta_info":
    finish_reason {"type"}, prompt_tokens, completion_tokens, spec_verify_ct and, since PR 33518,
    spec_num_correct_drafts / spec_num_proposed_drafts}."""
    info = {"version": "0.5.9", "model_path": "tiny", "tokenizer_path": "tiny", "context_length": 512,
            "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "tiny-drafter",
            "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    meta = {"id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "completion_tokens": 6,
            "cached_tokens": 0, "spec_verify_ct": 2, "spec_num_correct_drafts": 3, "spec_num_proposed_drafts": 6,
            "spec_accept_length": 3.0, "e2e_latency": 0.25}
    return {"/get_server_info": lambda _: (200, info), "/v1/tokenize": lambda _: (200, {"tokens": [1, 2, 3], "count": 3,
                                                                                        "max_model_len": 512}),
            "/generate": lambda _: (200, {"text": "…", "output_ids": [5, 6, 7, 8, 9, 2], "meta_info": meta})}


def test_sglang_in_its_source_formats_gives_ids_and_per_request_counts():
    spec = FormatServer(sglang_routes())
    try:
        speculative = Attached.attach(spec.url)
        assert (speculative.served.kind, speculative.served.k, speculative.served.speculates) == ("sglang", 3, True)
        assert ("speculative_algorithm", "STANDALONE") in speculative.served.speculative
        session = EndpointSession(speculative, speculative, DraftRules(3), ())
        result = session.generate([1, 2, 3], 16, speculative=True)
    finally:
        spec.shutdown()
    assert result.output_ids == (5, 6, 7, 8, 9, 2) and result.stop_reason == "eos"
    counters = result.counters
    assert (counters.steps, counters.drafted, counters.accepted, counters.unverified) == (2, 6, 3, 1)
    assert result.decode_s == 0.25 and not counters.identity_violations(3)


@pytest.mark.skipif(availability("exllamav3") is None, reason="exllamav3 runs here: no unusable runtime to check")
def test_a_url_skips_the_availability_check_of_the_runtime_that_attaches_only():
    """In a parity matrix with --url, the other runtimes are still checked before they run."""
    options = RuntimeOptions(threads=1, url="http://127.0.0.1:9")
    with pytest.raises(RuntimeUnavailable):
        open_runtime("exllamav3", options)
