"""What an attached run's record states (issue 47): the server's own settings, never crossrt's
options, with what the server does not report recorded as unknown; no id a reader cannot index;
no secret from the URL. Real llama-servers of the tiny pair (crossrt's llama-server runtime starts
them with settings crossrt's run does not use), with a proxy where a server must misbehave."""

import json

import pytest
from click.testing import CliRunner

from crossrt.backends.endpoint import Attached, server_params
from crossrt.cli import main
from crossrt.inputs.pairs import load_pair
from crossrt.records.record_json import load_record
from crossrt.run.runtime import DraftRules, RuntimeOptions, availability, open_runtime

from conftest import TINY_PAIR
from test_endpoint import FormatServer, LoopbackServer, QuietHandler, vllm_routes

needs_server = pytest.mark.skipif(availability("llama-server") is not None,
                                  reason=f"llama-server not usable: {availability('llama-server')}")


@pytest.fixture(scope="module")
def own_servers(tmp_path_factory):
    """The tiny pair's servers started as `llama-server -c 512 --spec-draft-n-min 1
    --spec-draft-p-min 0.6` at k 3: none of it is what `crossrt run` defaults to (n_ctx 2048,
    n_min k, p_min 0)."""
    pair = load_pair(TINY_PAIR)
    runtime = open_runtime("llama-server", RuntimeOptions(n_ctx=512, threads=1))
    with runtime.open_native(pair.path("target", "gguf"), pair.path("drafter", "gguf"), DraftRules(3, 1, 0.6),
                             tmp_path_factory.mktemp("own-servers")) as session:
        yield session


class RewritingProxy(LoopbackServer):
    """An HTTP proxy in front of a real llama-server that rewrites its /completion answers with
    rewrite(response) -> response: a server that answers what no model made."""

    def __init__(self, upstream: str, rewrite):
        self.upstream, self.rewrite, self.paths = upstream, rewrite, []
        super().__init__(_RewritingHandler)


class _RewritingHandler(QuietHandler):
    def forward(self):
        self.server.paths.append(self.path)
        status, data, kind = self.ask_upstream()
        if self.path.split("?")[0] == "/completion" and status == 200:
            data = json.dumps(self.server.rewrite(json.loads(data))).encode()
        self.reply(status, data, kind)

    do_GET = do_POST = forward


def run(url, baseline_url, out, *extra):
    return CliRunner().invoke(main, ["run", "--runtime", "endpoint", "--pair", str(TINY_PAIR), "--k", "3",
                                     "--max-new-tokens", "8", "--prompts", "builtin", "--url", url,
                                     "--baseline-url", baseline_url, "--out", str(out), *extra])


@needs_server
def test_the_record_states_the_servers_settings_and_unknown_where_it_does_not_say_them(own_servers, tmp_path):
    out = tmp_path / "r.json"
    result = run(own_servers.urls[0] + "/?api_key=sekrit", own_servers.urls[1], out)
    assert result.exit_code == 0, result.output
    record = load_record(out)
    params = record.params
    # The server's context (its /props), not --n-ctx's default 2048; llama-server reports no
    # n_min or p_min: unknown, not crossrt's n_min 3 and p_min 0.
    assert (params.n_ctx, params.draft_n_min, params.draft_p_min) == (512, None, None)
    assert any("unknown (null): draft_n_min, draft_p_min, not reported by llama-server" in note
               for note in record.notes), record.notes
    assert any(note.startswith("numerics settings as the server reports them: none reported") for note in record.notes)
    assert "sekrit" not in out.read_text() and record.runtime.device == f"server {own_servers.urls[0]}/"
    # Parity does not compare counts it cannot know were made alike: unknown is "not compared", and why.
    driven = tmp_path / "driven.json"
    assert CliRunner().invoke(main, ["run", "--pair", str(TINY_PAIR), "--k", "3", "--schedule", "llama-server",
                                     "--max-new-tokens", "8", "--out", str(driven)]).exit_code == 0
    parity = CliRunner().invoke(main, ["parity", "--no-logits", str(out), str(driven)])
    assert "counters not compared (the endpoint record states no draft_n_min, draft_p_min)" in parity.output, \
        parity.output
    assert "counters unexplained" not in parity.output


@needs_server
def test_an_id_outside_the_vocabulary_fails_that_prompt_and_the_run_goes_on(own_servers, tmp_path):
    answered = []

    def first_answer_out_of_vocabulary(response):
        answered.append(len(response["tokens"]))
        if len(answered) == 1:
            response["tokens"][2] = 999999
        return response

    proxy = RewritingProxy(own_servers.urls[0], first_answer_out_of_vocabulary)
    out = tmp_path / "r.json"
    try:
        result = run(proxy.url, own_servers.urls[1], out)
    finally:
        proxy.shutdown()
    assert result.exit_code == 0, result.output
    record = load_record(out)
    assert [r.status for r in record.results[:2]] == ["failed", "ok"], [r.error for r in record.results]
    assert "answered token id 999999 at position 2 of its output, outside the vocabulary of 512 tokens" in \
        record.results[0].error
    assert all(r.ok for r in record.results[1:])
    # No id of the record is outside the vocabulary: a reader can index every one.
    assert all(0 <= i < 512 for r in record.results for i in (*r.output_ids, *r.baseline_ids))


def test_vllms_reported_settings_are_the_records():
    """vLLM's API reports its context (max_model_len) and, as labels of its vllm:cache_config_info
    gauge, its KV cache settings; it drafts k every step. Served in vLLM's formats
    (test_endpoint.vllm_routes), not by vLLM."""
    routes = vllm_routes(True)
    counting = routes["/metrics"]
    routes["/metrics"] = lambda body: (200, counting(body)[1] + 'vllm:cache_config_info{block_size="16",'
                                       'cache_dtype="fp8_e5m2",enable_prefix_caching="True",engine="0",'
                                       'gpu_memory_utilization="0.9"} 1.0\n')
    server = FormatServer(routes)
    try:
        attached = Attached.attach(server.url)
    finally:
        server.shutdown()
    assert attached.served.numerics == (("cache_dtype", "fp8_e5m2"), ("block_size", "16"),
                                        ("enable_prefix_caching", "True"))
    assert "cache_dtype fp8_e5m2" in attached.identity()  # a sweep cell of another cache is another cell
    assert server_params(attached, DraftRules(3)) == (("n_ctx", 512), ("draft_n_min", 3), ("draft_p_min", 0.0))
