"""Servers that cannot hurt crossrt (issue 47): small HTTP servers in the test that answer the way a
broken server or gateway does (an endless body, a trickle of bytes, ids outside the vocabulary,
JSON of another shape), over a real loopback socket, against the real command or the real
endpoint session. What each may cost crossrt is bounded and said in one line."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from crossrt.backends import endpoint_http
from crossrt.backends.endpoint import Attached, EndpointSession
from crossrt.backends.endpoint_http import Endpoint
from crossrt.cli import main
from crossrt.errors import PromptRefused, SettingsError
from crossrt.run.runtime import DraftRules, RuntimeFailure

from conftest import TINY_PAIR, assert_clean_error, with_sigint
from test_endpoint import LoopbackServer, QuietHandler, vllm_routes

CROSSRT = os.path.join(os.path.dirname(sys.executable), "crossrt")
ENOUGH = 64 << 20  # what a hostile server sends at most here, so that code without a cap ends too


class Scripted(LoopbackServer):
    """A loopback server answering each route (the path without its query) with route(body): a
    (status, JSON value or text) answer, or a function of the handler that answers as it likes;
    it counts the bytes such a function sent and keeps every request's path with its query."""

    def __init__(self, routes):
        self.routes, self.sent, self.paths = routes, 0, []
        super().__init__(_ScriptedHandler)


class _ScriptedHandler(QuietHandler):
    def _answer(self):
        self.server.paths.append(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        route = self.server.routes.get(self.path.split("?")[0])
        answer = route(body) if route else (404, {"detail": "Not Found"})
        try:
            if callable(answer):
                answer(self)
            else:
                status, value = answer
                self.reply(status, value.encode() if isinstance(value, str) else json.dumps(value).encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # crossrt hung up: what a hostile server must expect

    do_GET = do_POST = _answer


def behaving(function):
    """A route that answers by function(handler)."""
    return lambda body: function


def endless(handler):
    """A 200 whose body never ends (no Content-Length: the body runs until the connection closes)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.end_headers()
    handler.wfile.write(b'{"build_info": "b1-abc", "default_generation_settings": {}, "x": "')
    block = b"a" * 65536
    while handler.server.sent < ENOUGH:
        handler.wfile.write(block)
        handler.server.sent += len(block)



def timed_attach(server: "Scripted", tmp_path) -> tuple:
    """`crossrt run --runtime endpoint` against server as both servers, and its seconds; the
    server is shut down after."""
    try:
        started = time.monotonic()
        result = CliRunner().invoke(main, ["run", "--runtime", "endpoint", "--pair", str(TINY_PAIR), "--url",
                                           server.url, "--baseline-url", server.url, "--out", str(tmp_path / "r.json")])
        return result, time.monotonic() - started
    finally:
        server.shutdown()

def test_an_endless_body_is_cut_at_its_cap_in_one_line(tmp_path):
    server = Scripted({"/props": behaving(endless)})
    result, took = timed_attach(server, tmp_path)
    assert_clean_error(result, r"GET http://127.0.0.1:\d+/props: the answer goes on past 8 MiB, more than the 8 MiB "
                               r"crossrt reads of such an answer \(its cap")
    # What crossrt read is the cap; what the server sent besides sat in the sockets' buffers.
    assert server.sent < ENOUGH // 2 and took < 10, (server.sent, took)


def test_an_announced_body_past_the_cap_is_not_read_at_all():
    def announces(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", str(1 << 40))
        handler.end_headers()
        handler.wfile.write(b"{")

    server = Scripted({"/props": behaving(announces)})
    try:
        with pytest.raises(RuntimeFailure, match=r"/props: the answer announces 1.04858e\+06 MiB, more than the 8 MiB"):
            Attached.attach(server.url)
    finally:
        server.shutdown()


def test_an_endless_generation_behind_a_valid_attach_is_cut_at_a_cap_sized_to_the_request():
    spec, plain = Scripted(vllm_routes(True)), Scripted(vllm_routes(False))
    try:
        speculative, baseline = Attached.attach(spec.url), Attached.attach(plain.url)
        session = EndpointSession(speculative, baseline, DraftRules(3), ())
        spec.routes["/v1/completions"] = behaving(endless)
        with pytest.raises(RuntimeFailure, match=r"POST http://127.0.0.1:\d+/v1/completions: the answer goes on past "
                                                 r"1.03906 MiB, more than the 1.03906 MiB crossrt reads"):
            session.generate([1, 2, 3], 7, speculative=True)
    finally:
        spec.shutdown(), plain.shutdown()
    assert spec.sent < ENOUGH // 2, spec.sent


def trickle(handler):
    """Headers announcing 1000 bytes, then a byte every 0.2 s: no single read waits long, the
    whole answer takes 200 s (the server gives up after 8 s, so that code without a deadline ends)."""
    handler.send_response(200)
    handler.send_header("Content-Length", "1000")
    handler.end_headers()
    for _ in range(40):
        handler.wfile.write(b" ")
        handler.wfile.flush()
        time.sleep(0.2)


def test_a_trickling_server_fails_at_the_requests_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(endpoint_http, "PROBE_TIMEOUT_S", 1.0)
    server = Scripted({"/props": behaving(trickle)})
    result, took = timed_attach(server, tmp_path)
    assert_clean_error(result, r"GET http://127.0.0.1:\d+/props: no whole answer within 1 s, the request's deadline "
                               r"\(waited 1.\d s, \d bytes of the body read\)")
    assert took < 4, took


def test_a_body_shorter_than_announced_is_a_closed_connection_not_an_answer():
    def short(handler):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        handler.wfile.write(b'{"build_info": "b1"}')

    server = Scripted({"/props": behaving(short)})
    try:
        with pytest.raises(RuntimeFailure, match=r"GET http://127.0.0.1:\d+/props: the server closed the connection "
                                                 r"after 20 of the 1000 bytes it announced"):
            Attached.attach(server.url)
    finally:
        server.shutdown()


def test_a_generation_has_a_deadline_for_the_whole_answer(monkeypatch):
    spec, plain = Scripted(vllm_routes(True)), Scripted(vllm_routes(False))
    try:
        speculative, baseline = Attached.attach(spec.url), Attached.attach(plain.url)
        session = EndpointSession(speculative, baseline, DraftRules(3), ())
        spec.routes["/v1/completions"] = behaving(trickle)
        monkeypatch.setattr(endpoint_http, "REQUEST_BASE_S", 1.0)
        monkeypatch.setattr(endpoint_http, "REQUEST_S_PER_TOKEN", 0.0)
        started = time.monotonic()
        with pytest.raises(RuntimeFailure, match=r"/v1/completions: no whole answer within 1 s, the request's deadline"):
            session.generate([1, 2, 3], 7, speculative=True)
        assert time.monotonic() - started < 3
    finally:
        spec.shutdown(), plain.shutdown()


# ---- what the server answers, read as a server's answer ------------------------------------------

def answering(path, value):
    """vLLM's routes (test_endpoint.vllm_routes) with path answering value instead."""
    routes = vllm_routes(True)
    routes[path] = lambda body: (200, value)
    return routes


def session_of(routes, n_vocab=None):
    spec, plain = Scripted(routes), Scripted(vllm_routes(False))
    speculative, baseline = Attached.attach(spec.url), Attached.attach(plain.url)
    return spec, plain, EndpointSession(speculative, baseline, DraftRules(3), (), n_vocab)


COMPLETION = {"choices": [{"index": 0, "finish_reason": "length", "token_ids": [5, 6, 7, 8, 9, 10, 11]}]}


@pytest.mark.parametrize("ids, message", [
    ([5, 6, 999999, 8, 9, 10, 11], r"answered token id 999999 at position 2 of its output, outside the vocabulary of "
                                   r"512 tokens"),
    ([5, 6, -1, 8, 9, 10, 11], r"answered -1 as token 2: not a token id \(a whole number from 0\)"),
    ([5, "6", 7, 8, 9, 10, 11], r"answered '6' as token 1: not a token id"),
    ([5, 6.5, 7, 8, 9, 10, 11], r"answered 6.5 as token 1: not a token id"),
    ("5 6 7", r"answered token ids as str, not a list"),
], ids=["outside", "negative", "string", "float", "not-a-list"])
def test_ids_a_server_cannot_have_made_fail_that_prompt(ids, message):
    choice = {**COMPLETION["choices"][0], "token_ids": ids}
    spec, plain, session = session_of(answering("/v1/completions", {"choices": [choice]}), n_vocab=512)
    try:
        with pytest.raises(PromptRefused, match=message):
            session.generate([1, 2, 3], 7, speculative=True)
    finally:
        spec.shutdown(), plain.shutdown()


@pytest.mark.parametrize("path, value, error, message", [
    ("/v1/completions", {"choices": []}, PromptRefused, r"/v1/completions answered JSON of another shape than crossrt "
                                                        r"reads \(IndexError"),
    ("/v1/completions", [1, 2], PromptRefused, r"/v1/completions answered JSON of another shape"),
    ("/tokenize", {"count": 3}, RuntimeFailure, r"/tokenize answered JSON of another shape than crossrt reads "
                                                r"\(KeyError: 'tokens'\)"),
    ("/tokenize", {"tokens": [1, "2"]}, RuntimeFailure, r"/tokenize answered '2' as token 1: not a token id"),
], ids=["no-choice", "a-list", "no-tokens", "string-token"])
def test_json_of_another_shape_is_one_line(path, value, error, message):
    spec, plain, session = session_of(answering(path, value))
    try:
        with pytest.raises(error, match=message):
            session.tokenize("abc") if path == "/tokenize" else session.generate([1, 2, 3], 7, speculative=True)
    finally:
        spec.shutdown(), plain.shutdown()


def test_an_http_error_from_tokenize_and_a_lone_surrogate_are_one_line():
    routes = vllm_routes(True)
    spec, plain, session = session_of(routes)
    try:
        with pytest.raises(PromptRefused, match=r"the text is not valid Unicode: a lone surrogate '\\ud800' at "
                                                r"character 2"):
            session.tokenize("ab\ud800")
        routes["/tokenize"] = lambda body: (500, {"error": {"message": "tokenizer exploded"}})
        with pytest.raises(RuntimeFailure, match=r"POST http://127.0.0.1:\d+/tokenize: HTTP 500: tokenizer exploded"):
            session.tokenize("abc")
        routes["/tokenize"] = lambda body: (400, {"error": {"message": "bad text"}})
        with pytest.raises(PromptRefused, match=r"vllm refused to tokenize the text: HTTP 400: bad text"):
            session.tokenize("abc")
    finally:
        spec.shutdown(), plain.shutdown()


def test_malformed_identification_is_one_line(tmp_path):
    props = {"build_info": "b1-abc", "default_generation_settings": [], "model_path": "m.gguf"}
    server = Scripted({"/props": lambda body: (200, props)})
    try:
        result = CliRunner().invoke(main, ["run", "--runtime", "endpoint", "--pair", str(TINY_PAIR), "--url",
                                           server.url, "--baseline-url", server.url, "--out", str(tmp_path / "r.json")])
        assert_clean_error(result, r"/props \(or /v1/models, /slots\) answered JSON of another shape than crossrt reads "
                                   r"\(AttributeError")
        props["default_generation_settings"] = {"n_ctx": "512"}
        with pytest.raises(RuntimeFailure, match=r"\(ValueError: n_ctx '512' is not a whole number from 1\)"):
            Attached.attach(server.url)
    finally:
        server.shutdown()


def test_a_huge_name_or_id_is_not_carried_into_messages_or_the_record():
    routes = vllm_routes(True)
    routes["/version"] = lambda body: (200, {"version": "0.32." + "9" * 100000})
    server = Scripted(routes)
    try:
        with pytest.raises(RuntimeFailure, match=r"answered a version of 100005 characters \('0.32.9999.*'\.\.\.\): more "
                                                 r"than the 1024 a server's name for itself takes") as raised:
            Attached.attach(server.url)
        assert len(str(raised.value)) < 300
    finally:
        server.shutdown()
    choice = {**COMPLETION["choices"][0], "token_ids": [5, "x" * 100000]}
    spec, plain, session = session_of(answering("/v1/completions", {"choices": [choice]}))
    try:
        with pytest.raises(PromptRefused, match=r"answered 'xxx.* as token 1: not a token id") as raised:
            session.generate([1, 2, 3], 7, speculative=True)
        assert len(str(raised.value)) < 300
    finally:
        spec.shutdown(), plain.shutdown()


def attaching_fails(path, answer, message):
    """Attaching to vLLM's routes with path answering answer (status, body) fails with message."""
    routes = vllm_routes(True)
    routes[path] = lambda body: answer
    server = Scripted(routes)
    try:
        with pytest.raises(RuntimeFailure, match=message):
            Attached.attach(server.url)
    finally:
        server.shutdown()


def test_a_metrics_error_is_said_as_it_is_not_as_a_missing_endpoint():
    attaching_fails("/metrics", (500, "internal error"), r"GET http://127.0.0.1:\d+/metrics: HTTP 500: internal error")


# ---- the URL: what is sent, what is shown ------------------------------------------------------

def test_a_query_in_the_url_is_sent_and_never_shown_and_port_0_is_refused():
    server = Scripted(vllm_routes(True))
    try:
        attached = Attached.attach(server.url + "/?api_key=sekrit")
    finally:
        server.shutdown()
    assert server.paths and all(path.endswith("?api_key=sekrit") for path in server.paths), server.paths
    assert attached.endpoint.display == server.url + "/"
    assert "sekrit" not in attached.describe() + attached.identity() + repr(attached)
    with pytest.raises(SettingsError, match=r"--url 'http://127.0.0.1:0': the port is not a number from 1 to 65535"):
        Endpoint.parse("http://127.0.0.1:0")


def test_ctrl_c_before_any_prompt_shows_no_password_and_claims_no_record(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the backlog), never answers
        port = silent.getsockname()[1]
        out = tmp_path / "r.json"
        process = subprocess.Popen([CROSSRT, "run", "--runtime", "endpoint", "--pair", str(TINY_PAIR), "--url",
                                    f"http://alice:hunter2@127.0.0.1:{port}/?api_key=sekrit", "--out", str(out)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=with_sigint)
        silent.settimeout(60)
        connection, _ = silent.accept()  # crossrt is attaching: asking /props
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
        connection.close()
    assert process.returncode == 130, stderr
    assert "hunter2" not in stdout + stderr and "alice" not in stdout + stderr and "sekrit" not in stdout + stderr
    assert f"interrupted before any prompt finished: nothing is kept in {out} yet; continue with:" in stderr, stderr
    assert f"--url http://127.0.0.1:{port}/ --out {out} --resume  (a URL's user info and query are left out here" \
        in stderr, stderr
    assert "Traceback" not in stderr


# ---- /metrics read as counts ------------------------------------------------------------------------

def test_counters_that_go_down_during_a_prompt_are_a_restart_and_negative_ones_fail_the_prompt():
    routes = vllm_routes(True)
    spec, plain, session = session_of(routes)
    counting = routes["/metrics"]
    try:
        routes["/metrics"] = lambda body: (200, counting(body)[1].replace("vllm:spec_decode_num_drafts_total{", "x{")
                                           + 'vllm:spec_decode_num_drafts_total{engine="0"} -3.0\n')
        with pytest.raises(PromptRefused, match=r"invalid: /metrics shows counters below 0 \(steps\), which no count "
                                                r"can be: the counter deltas cannot be read as this prompt's"):
            session.generate([1, 2, 3], 7, speculative=True)
        restarted = {"generation": 1000}

        def shrinking(body):  # each scrape shows fewer generated tokens: a server restarting under crossrt
            restarted["generation"] -= 100
            return 200, counting(body)[1].replace("vllm:generation_tokens_total", "x") + \
                f'vllm:generation_tokens_total{{engine="0"}} {restarted["generation"]}.0\n'
        routes["/metrics"] = shrinking
        session = EndpointSession(*(Attached.attach(server.url) for server in (spec, plain)), DraftRules(3), ())
        with pytest.raises(RuntimeFailure, match=r"restarted (since the last|during this) prompt: its counters went "
                                                 r"down \(emitted\)"):
            session.generate([1, 2, 3], 7, speculative=True)
    finally:
        spec.shutdown(), plain.shutdown()


def test_attaching_has_one_deadline_over_all_its_requests(monkeypatch):
    """Each answer comes just inside its own request's deadline, but identification asks endpoint
    after endpoint: attaching as a whole still ends at its own deadline, in one line."""
    monkeypatch.setattr(endpoint_http, "PROBE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(endpoint_http, "ATTACH_TIMEOUT_S", 1.5)

    def slow_not_found(handler):
        time.sleep(0.6)
        handler.reply(404, b'{"detail": "Not Found"}')

    paths = ("/props", "/version", "/get_server_info", "/v1/models", "/server_info", "/model_info", "/slots")
    server = Scripted({path: behaving(slow_not_found) for path in paths})
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeFailure) as caught:
            Attached.attach(server.url)
        waited = time.monotonic() - started
    finally:
        server.shutdown()
    message = str(caught.value)
    assert "\n" not in message and "deadline over all of attaching's requests" in message, message
    assert waited < 1.5 + 1.0, waited  # not one PROBE_TIMEOUT_S per endpoint asked
    assert len(server.paths) >= 2  # the answers themselves each came within their own deadline


@pytest.mark.parametrize("latency", [float("nan"), -1.0, 1e308, "fast"], ids=["nan", "negative", "huge", "string"])
def test_a_time_that_is_not_a_time_fails_the_prompt_naming_it(latency):
    """NaN seconds once went into a record that no command could read again (issue 58)."""
    from test_endpoint import sglang_routes

    routes = sglang_routes()
    answer = routes["/generate"](None)[1]
    routes["/generate"] = lambda _: (200, {**answer, "meta_info": {**answer["meta_info"], "e2e_latency": latency}})
    spec = Scripted(routes)  # SGLang's routes, answered as test_endpoint's FormatServer does
    try:
        speculative = Attached.attach(spec.url)
        session = EndpointSession(speculative, speculative, DraftRules(3), ())
        with pytest.raises(PromptRefused, match=r"answered meta_info.e2e_latency = .*: not a time from 0 to 86400 s"):
            session.generate([1, 2, 3], 16, speculative=True)
    finally:
        spec.shutdown()


def test_a_metrics_position_beyond_any_draft_allocates_nothing():
    """One line `..._per_pos_total{position="9999999999"} 1` once built a list that long (issue 58)."""
    from crossrt.backends.endpoint_counts import parse_metrics
    from crossrt.run.runtime import K_LIMIT

    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    text = f'{name}{{position="0"}} 3\n{name}{{position="9999999999"}} 1\n'
    started = time.perf_counter()
    scrape = parse_metrics(text, {}, name, (), None)
    assert time.perf_counter() - started < 1.0
    assert scrape.per_pos == (3,) and not scrape.exact and len(scrape.per_pos) <= K_LIMIT


def test_a_server_echoing_the_request_gets_no_secret_into_the_message(monkeypatch):
    """A gateway's error that quotes the request's key, query or Authorization header (issue 58)."""
    from crossrt.backends.endpoint_http import API_KEY_VARIABLE, HttpStatusError

    key, query_key = "sk-env-0123456789", "qk-9876543210"
    echo = f"bad request GET /v1/completions?api_key={query_key}; Authorization: Bearer {key}; password=hunter22"
    server = Scripted({"/v1/completions": lambda body: (400, {"error": {"message": echo}})})
    monkeypatch.setenv(API_KEY_VARIABLE, key)
    try:
        endpoint = Endpoint.parse(f"{server.url}/?api_key={query_key}")
        with pytest.raises(HttpStatusError) as raised:
            endpoint.call("POST", "/v1/completions", {})
    finally:
        server.shutdown()
    message = str(raised.value)
    assert key not in message and query_key not in message and "hunter22" not in message, message
    assert "[redacted]" in message


def test_a_servers_name_cannot_clear_the_screen_or_forge_a_line(tmp_path):
    """A model id holding ESC [2J and a newline then `Error: ...` is printed as one line with its
    control characters written out (issue 58)."""
    routes = vllm_routes(True)
    hostile = "tiny\x1b[2J\nError: forged"
    models = routes["/v1/models"](None)[1]
    routes["/v1/models"] = lambda _: (200, {**models, "data": [{**models["data"][0], "id": hostile}]})
    result, _ = timed_attach(Scripted(routes), tmp_path)
    # Refused (one server cannot be its own plain baseline), in a message that names it as it is.
    assert "\x1b" not in result.output and "\nError: forged" not in result.output, result.output
    assert "serving tiny\\x1b[2J\\x0aError: forged" in result.output, result.output
    assert sum(line.startswith("Error:") for line in result.output.splitlines()) == 1


def test_everything_printed_goes_through_one_filter():
    """Whatever a command prints (a record's strings included), ESC and other controls are written out."""
    import io

    from crossrt.records.printable import SafeStream

    stream = io.StringIO()
    SafeStream(stream).write("ok\x1b[2J\x9b31m\x07\tend\n")
    assert stream.getvalue() == "ok\\x1b[2J\\x9b31m\\x07\tend\n"


def test_more_ids_than_the_budget_fail_the_prompt():
    """A server answering 20,000 ids for a budget of 7 once had them all stored (issue 58)."""
    choice = {**COMPLETION["choices"][0], "token_ids": [5] * 19999 + [2], "finish_reason": "stop"}  # "ended at EOS"
    spec, plain, session = session_of(answering("/v1/completions", {"choices": [choice]}), n_vocab=512)
    try:
        with pytest.raises(PromptRefused, match=r"answered 20000 token ids for a budget of 7"):
            session.generate([1, 2, 3], 7, speculative=True)
    finally:
        spec.shutdown(), plain.shutdown()


DEEP = "[" * 100000 + "]" * 100000  # deeper than Python's JSON parser goes


def test_json_nested_too_deep_is_one_line_when_attaching():
    """[[[[...]]]] 100,000 deep once ended crossrt with a RecursionError traceback (issue 58)."""
    attaching_fails("/v1/models", (200, DEEP), r"GET .*/v1/models answered JSON nested too deep to read")


def test_json_nested_too_deep_is_one_line_in_a_generation():
    spec, plain, session = session_of(answering("/v1/completions", DEEP))
    try:
        with pytest.raises(RuntimeFailure, match=r"/v1/completions answered JSON nested too deep to read"):
            session.generate([1, 2, 3], 7, speculative=True)
    finally:
        spec.shutdown(), plain.shutdown()


def test_a_metrics_body_with_every_line_repeated_reads_as_once():
    """Prometheus allows one sample per name and label set; a body repeating each line once made
    every prompt's deltas double and failed them as "served other requests" (issue 58)."""
    from crossrt.backends.endpoint_counts import parse_metrics

    metrics = vllm_routes(True)["/metrics"](None)[1]
    names = {"steps": "vllm:spec_decode_num_drafts_total", "accepted": "vllm:spec_decode_num_accepted_tokens_total"}
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    once = parse_metrics(metrics, names, per_pos, ("vllm:num_requests_running",), None)
    assert parse_metrics(metrics + metrics, names, per_pos, ("vllm:num_requests_running",), None) == once


class RawServer:
    """A loopback socket answering every connection with the same raw bytes, then closing."""

    def __init__(self, answer: bytes):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with connection:
                connection.recv(65536)
                try:
                    connection.sendall(self.answer)
                except OSError:
                    pass

    def shutdown(self):
        self.listener.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n{}",
    b"HTTP/1.1 200 OK\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n{}",
    b"SPDY/9 twelve\r\n\r\n",
], ids=["200-headers", "70kb-header-line", "bad-status-line"])
def test_an_answer_that_is_not_http_is_named_so_not_a_restart(answer):
    """200 headers, a 70 KB header line or a bad status line were reported as "the server stopped
    or restarted" (issue 58)."""
    server = RawServer(answer)
    try:
        with pytest.raises(RuntimeFailure, match=r"the answer is not HTTP crossrt can read .*not a restart") as raised:
            Endpoint.parse(server.url).request("GET", "/props")
        assert len(str(raised.value)) < 400
    finally:
        server.shutdown()
