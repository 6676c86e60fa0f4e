"""Sweeps and reproduce attached to running servers (the endpoint runtime): crossrt's own
llama-server runtime starts the tiny pair's servers (the same llama.cpp build) on free loopback
ports, and `crossrt sweep` and `crossrt reproduce` attach to them as to servers a user runs.
What is asserted holds on any CPU: records equal to `crossrt run --runtime endpoint` on the same
server, refusals before any request, never which prompt splits where."""

import json
import os
import socket
import socketserver
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.backends.endpoint import Attached, EndpointSession
from crossrt.backends.llama_server_process import free_port
from crossrt.cli import main
from crossrt.errors import SettingsError
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record
from crossrt.run.runtime import DraftRules, RuntimeOptions, Server, availability, open_runtime
from crossrt.sweep.plan import SweepError, load_sweep
from crossrt.sweep.servers import Attachment, Servers, one_k_per_server
from crossrt.sweep.store import SweepStore

from conftest import TINY_PAIR, assert_clean_error
from test_endpoint import _copy
from test_sweep import write_sweep

needs_server = pytest.mark.skipif(availability("llama-server") is not None,
                                  reason=f"llama-server not usable: {availability('llama-server')}")
HOLD_S = 0.2  # CountingProxy's delay per request
K = 3  # the servers' draft length; the tiny pair's own k is 4, so a cell at 3 took the server's


def sweep_file(folder: Path, axes: str = "") -> Path:
    """One code and one prose prompt, 8 tokens, runtime endpoint, no k: the server's."""
    return write_sweep(folder, f'name = "attached"\n[axes]\npair = "tiny"\nruntime = "endpoint"\nmode = "native"\n'
                               f'prompts = "two.jsonl"\nmax_new_tokens = 8\n{axes}')


def generated(url: str) -> int:
    """Tokens the server has generated since it started (/metrics)."""
    attached = Attached.attach(url)
    return attached.kind.scrape(attached.endpoint).emitted


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The tiny pair's speculative and plain servers at k = K, after one request: llama-server
    prints its draft length in /metrics once it has drafted, as a server in use has."""
    runtime = open_runtime("llama-server", RuntimeOptions(n_ctx=512, threads=1))
    pair = load_pair(TINY_PAIR)
    with runtime.open_native(pair.path("target", "gguf"), pair.path("drafter", "gguf"), DraftRules(K),
                             tmp_path_factory.mktemp("servers")) as session:
        Attached.attach(session.urls[0]).endpoint.call_json("POST", "/completion", {
            "prompt": [1, 2, 3], "n_predict": 8, "temperature": 0.0, "samplers": ["temperature"]})
        assert Attached.attach(session.urls[0]).served.k == K
        yield session


def results(record):
    return [(r.prompt_id, r.status, r.prompt_ids, r.output_ids, r.baseline_ids, r.counters) for r in record.results]


@needs_server
def test_a_sweep_on_an_attached_server_equals_crossrt_run_on_it_and_writes_no_password(servers, tmp_path):
    url, baseline = servers.urls[0].replace("http://", "http://user:sekrit@"), servers.urls[1]
    path = sweep_file(tmp_path)
    runner = CliRunner()
    result = runner.invoke(main, ["sweep", "run", str(path), "--dir", str(tmp_path / "store"), "--url", url,
                                  "--baseline-url", baseline], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (cell,) = SweepStore(tmp_path / "store").stored()
    swept = cell.record()
    assert cell.meta["params"]["k"] == K and cell.meta["params"]["server"] == servers.urls[0]
    assert cell.meta["name"].endswith(f"@{servers.urls[0].split('://')[1]}")
    result = runner.invoke(main, ["run", "--runtime", "endpoint", "--url", url, "--baseline-url", baseline,
                                  "--pair", str(TINY_PAIR), "--k", str(K), "--prompts", str(tmp_path / "two.jsonl"),
                                  "--max-new-tokens", "8", "--out", str(tmp_path / "run.json")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    run = load_record(tmp_path / "run.json")
    assert results(swept) == results(run) and all(r.ok for r in run.results)
    assert sum(r.counters.steps for r in swept.results) > 0  # it drafted
    assert (swept.runtime.version, swept.runtime.device) == (run.runtime.version, f"server {servers.urls[0]}")
    # The server's identity stays put as it serves: planned again after more requests, the same cell.
    (again,) = load_sweep(path, Servers((url,), (baseline,))).runnable()
    assert again.id == cell.meta["id"]
    # sweep query names the server and what it is.
    result = runner.invoke(main, ["sweep", "query", str(tmp_path / "store"),
                                  "SELECT server, runtime, runtime_version, k, n_prompts FROM cells"])
    assert result.exit_code == 0, result.output
    assert servers.urls[0] in result.output and "llama-server b" in result.output
    baselines = Path(os.environ["CROSSRT_CACHE"]) / "baselines"  # their keys name the servers
    written = "".join(p.read_text(errors="replace") for folder in (tmp_path, baselines)
                      for p in folder.rglob("*.json") if p.is_file())
    assert servers.urls[0] in written and "sekrit" not in written


@needs_server
def test_a_k_the_server_does_not_draft_is_one_line_before_any_request(servers, tmp_path):
    before = generated(servers.urls[0])
    for command in ("plan", "run"):
        result = CliRunner().invoke(main, ["sweep", command, str(sweep_file(tmp_path, "k = [3, 5]\n")),
                                           "--dir", str(tmp_path / "store"), "--url", servers.urls[0],
                                           "--baseline-url", servers.urls[1]])
        assert_clean_error(result, rf"k = 5: no server given drafts 5 tokens \({servers.urls[0]} drafts {K}\)")
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert generated(servers.urls[0]) == before and not (tmp_path / "store").exists()


class CountingProxy(socketserver.ThreadingTCPServer):
    """A loopback address in front of a server that counts the requests doing work there (POST:
    tokenize, generate) it forwards at once; crossrt closes each request's connection once it has
    read the answer. Each is held HOLD_S first, so that two cells running at once would overlap
    there whatever the machine's speed (the tiny pair answers in milliseconds). It also counts
    attaches: an attach to llama-server starts with GET /props, which nothing else asks for."""

    daemon_threads = True

    def __init__(self, url: str):
        self.backend = int(url.rsplit(":", 1)[1])
        self.lock = threading.Lock()
        self.now = self.most = self.attaches = 0
        super().__init__(("127.0.0.1", 0), CountingHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def count(self, change: int) -> None:
        with self.lock:
            self.now += change
            self.most = max(self.most, self.now)


class CountingHandler(socketserver.BaseRequestHandler):
    def handle(self):
        first = self.request.recv(65536)
        generation = first.startswith(b"POST")
        if first.startswith(b"GET /props"):
            with self.server.lock:
                self.server.attaches += 1
        if generation:
            self.server.count(+1)
            time.sleep(HOLD_S)
        upstream = socket.create_connection(("127.0.0.1", self.server.backend))
        try:
            upstream.sendall(first)
            pump = threading.Thread(target=_copy, args=(upstream, self.request), daemon=True)
            pump.start()
            _copy(self.request, upstream)
            pump.join()
        finally:
            upstream.close()
            if generation:
                self.server.count(-1)



def swept_through_proxies(path, servers, tmp_path, *extra) -> list[CountingProxy]:
    """`crossrt sweep run path` with the speculative and baseline servers behind counting
    proxies, into tmp_path/store; checks its two cells finished every prompt; the proxies (shut
    down) for their counts."""
    proxies = [CountingProxy(url) for url in servers.urls]
    try:
        result = CliRunner().invoke(main, ["sweep", "run", str(path), "--dir", str(tmp_path / "store"), *extra,
                                           "--url", proxies[0].url, "--baseline-url", proxies[1].url],
                                    catch_exceptions=False)
    finally:
        for proxy in proxies:
            proxy.shutdown()
    assert result.exit_code == 0, result.output
    records = [cell.record() for cell in SweepStore(tmp_path / "store").stored()]
    assert len(records) == 2 and all(r.ok for record in records for r in record.results)
    return proxies

@needs_server
def test_two_cells_on_one_server_never_run_at_once(servers, tmp_path):
    """Two prompt files: two cells on one server, in worker processes with room for both. At
    once, their requests would reach the servers together and their counters mix."""
    path = sweep_file(tmp_path)
    prompt = next(p for p in load_prompts("builtin") if p.category not in ("code", "prose"))
    (tmp_path / "one.jsonl").write_text(json.dumps({"id": prompt.id, "category": prompt.category,
                                                    "prompt": prompt.text}) + "\n")
    path.write_text(path.read_text().replace('prompts = "two.jsonl"', 'prompts = ["two.jsonl", "one.jsonl"]')
                    .replace("max_new_tokens = 8", "max_new_tokens = 24"))
    proxies = swept_through_proxies(path, servers, tmp_path, "--cpus", "2")
    assert [proxy.most for proxy in proxies] == [1, 1]  # both served crossrt, one request at a time
    assert [proxy.attaches for proxy in proxies] == [1, 1]  # to plan; the cells' runs took the plan's


@needs_server
def test_a_sweep_attaches_each_server_once(servers, tmp_path):
    """Two cells on one server, one after the other in this process: the plan attaches each server,
    and the cells' runs take its attachments instead of asking the servers again."""
    path = sweep_file(tmp_path)
    (tmp_path / "one.jsonl").write_text((tmp_path / "two.jsonl").read_text().splitlines()[0] + "\n")
    path.write_text(path.read_text().replace('prompts = "two.jsonl"', 'prompts = ["two.jsonl", "one.jsonl"]'))
    proxies = swept_through_proxies(path, servers, tmp_path)
    assert [proxy.attaches for proxy in proxies] == [1, 1]


@needs_server
def test_reproduce_attaches_to_the_server_and_writes_its_verdict(servers, tmp_path):
    sweep_file(tmp_path)  # two.jsonl
    claims = tmp_path / "claims.toml"
    claim = '''
[[claim]]
id = "{id}"
source = "a test"
runtime = "llama-server"
crossrt_runtime = "llama-cpp"
pair = "{pair}"
k = {k}
max_new_tokens = 8
prompts = "two.jsonl"
sampling = "greedy"
hardware = "anywhere"
[claim.expect.all]
tau = [1.0, {most}]
'''
    claims.write_text(claim.format(id="at-k", pair=TINY_PAIR, k=K, most=K + 1) +
                      claim.format(id="other-k", pair=TINY_PAIR, k=5, most=6))
    result = CliRunner().invoke(main, ["reproduce", str(claims), "--runtime", "endpoint", "--url", servers.urls[0],
                                       "--baseline-url", servers.urls[1], "--out-dir", str(tmp_path / "claims")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert f"ran on endpoint, record: {tmp_path / 'claims' / 'at-k.json'}" in result.output
    assert (f"not run here: the server at {servers.urls[0]} drafts up to {K} tokens (its own setting), the claim's k "
            "is 5") in result.output
    reproduced = load_record(tmp_path / "claims" / "at-k.json")
    assert reproduced.runtime.name == "endpoint" and reproduced.params.k == K
    run = CliRunner().invoke(main, ["run", "--runtime", "endpoint", "--url", servers.urls[0], "--baseline-url",
                                    servers.urls[1], "--pair", str(TINY_PAIR), "--k", str(K), "--prompts",
                                    str(tmp_path / "two.jsonl"), "--max-new-tokens", "8", "--out",
                                    str(tmp_path / "run.json")], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    assert results(reproduced) == results(load_record(tmp_path / "run.json"))


@needs_server
def test_a_run_whose_k_is_not_the_servers_stops_after_its_first_draft(servers):
    """Where the server had not said its draft length on attaching, the run checks it once /metrics
    prints it (here: a session opened without open_native's check)."""
    speculative, baseline = (Attached.attach(url) for url in servers.urls)
    session = EndpointSession(speculative, baseline, DraftRules(K + 1), ())
    with pytest.raises(SettingsError, match=rf"drafts up to {K} tokens \(its own setting\), the run's k is {K + 1}"):
        session.generate(session.tokenize("Hello there"), 8, speculative=True)


def test_endpoint_cells_without_a_server_are_skipped_and_named(tmp_path):
    path = sweep_file(tmp_path)
    result = CliRunner().invoke(main, ["sweep", "plan", str(path)])
    assert result.exit_code == 0, result.output
    assert "skipped: endpoint attaches to a server you run: give `crossrt sweep run --url URL" in result.output
    result = CliRunner().invoke(main, ["sweep", "plan", str(path), "--baseline-url", "http://127.0.0.1:9"])
    assert_clean_error(result, r"--baseline-url without --url")
    port = free_port()
    result = CliRunner().invoke(main, ["sweep", "run", str(path), "--url", f"http://u:sekrit@127.0.0.1:{port}"])
    assert_clean_error(result, rf"--url http://127.0.0.1:{port}: nothing is listening at http://127.0.0.1:{port} "
                               r"\(connection refused\)")
    assert "sekrit" not in result.output and len(result.output.strip().splitlines()) == 1


def test_a_server_that_does_not_say_its_draft_length_takes_one_k():
    """Planning alone: which k a server's cells may have when it reports none yet."""
    attachments = {"http://a": Attachment("http://a", None, Server("http://a", "a", None), ("http://a",))}
    one_k_per_server([{"server": "http://a", "k": 4}, {"server": None, "k": 2}], attachments)
    with pytest.raises(SweepError, match=r"http://a does not report its draft length yet .* k 3, 4"):
        one_k_per_server([{"server": "http://a", "k": 4}, {"server": "http://a", "k": 3}], attachments)
