"""The servers the endpoint runtime attaches to (backends/endpoint.py), each as its source speaks:
how it is recognized, what it reports about its model and speculative settings, how it takes a
prompt as token ids and gives the output back as token ids, and its counters. docs/endpoint.md
lists what is used per server and version, with the source files it was read from.

- llama-server (llama.cpp tools/server at 0c1e57098): /props (build_info, model_path), /v1/models
  (meta.n_vocab), /tokenize, /completion with `prompt` a list of ids and `return_tokens` (the
  response's `tokens`), `timings.draft_n`/`draft_n_accepted` per request, /metrics (`--metrics`).
- vLLM (vllm/entrypoints/openai: completion/protocol.py, serve tokenize): /version, /v1/models
  (owned_by "vllm"), /tokenize, /v1/completions with `prompt` a list of ids and
  `return_token_ids` (choices[0].token_ids), /metrics `vllm:spec_decode_*` (no per-request counts).
- SGLang (python/sglang/srt/entrypoints/http_server.py, managers/tokenizer_manager.py):
  /get_server_info (server_args, version), /v1/tokenize, /generate with `input_ids` (its
  `output_ids`), per-request `meta_info` spec_verify_ct and accepted/proposed draft counts.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from crossrt.backends.endpoint_http import Endpoint, HttpStatusError, generation_budget, tokenize_budget
from crossrt.errors import PromptRefused
from crossrt.records.printable import one_line
from crossrt.inputs.prompts import refuse_non_unicode
from crossrt.backends.endpoint_counts import Scrape, parse_metrics
from crossrt.run.runtime import RuntimeFailure

@dataclass(frozen=True)
class Served:
    """What the server says about itself, as it says it."""

    kind: str  # "llama-server", "vllm" or "sglang"
    version: str
    build: Optional[str]
    model: str
    n_vocab: Optional[int]  # None where the server does not report it
    n_ctx: Optional[int]
    speculative: tuple[tuple[str, str], ...]  # (setting, value) as the server reports them
    k: Optional[int]  # the draft length it reports (or its per-position counters show); None: not said
    speculates: Optional[bool]  # whether it drafts at all, as it says; None: it does not say
    # Settings that change numerics (attention kernels, dtypes, batch sizes, prompt cache) as the
    # server reports them; () where it reports none (llama-server, vLLM's API).
    numerics: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        # What a server says of itself is printed and stored: one printable line each.
        for name in ("version", "build", "model"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, one_line(getattr(self, name)))
        for name in ("speculative", "numerics"):
            object.__setattr__(self, name, tuple((one_line(key), one_line(value)) for key, value in getattr(self, name)))


@dataclass(frozen=True)
class Reply:
    """One greedy generation as the server returned it."""

    output_ids: tuple[int, ...]
    stop_reason: str  # "eos" or "max_new_tokens"
    prefill_s: Optional[float]  # None where the server does not time the prompt apart
    decode_s: Optional[float]
    per_request: dict[str, Any] = field(default_factory=dict)  # counts the response carries


class ServerKind:
    """One kind of server. identify returns None when the server is not of this kind."""

    name: str
    has_per_request_counts: bool = False  # the response itself carries the prompt's counts
    # Reported settings that change while the server runs (set by the last request, or printed
    # only once it drafted): left out of the server's identity, which must stay put.
    volatile: tuple[str, ...] = ()
    # Whether it drafts k tokens on every step (no llama.cpp n_min/p_min rules), so the record
    # can state n_min k and p_min 0 as the server's own rules.
    drafts_fixed_k: bool = True

    def identify(self, endpoint: Endpoint) -> Optional[Served]:
        raise NotImplementedError

    def tokenize(self, endpoint: Endpoint, served: Served, text: str) -> list[int]:
        """text's ids as the server tokenizes it; PromptRefused for a text it cannot take."""
        refuse_non_unicode(text)
        path, body = self._tokenize_request(served, text)
        try:
            answer = endpoint.call_json("POST", path, body, tokenize_budget(text))
        except HttpStatusError as error:
            if 400 <= error.status < 500:
                raise PromptRefused(f"{self.name} refused to tokenize the text: {error}") from None
            raise RuntimeFailure(f"POST {endpoint.display}{path}: {error}") from None
        where = f"POST {endpoint.display}{path}"
        with answer_shape(where, RuntimeFailure):
            return list(token_ids(answer["tokens"], where, RuntimeFailure))

    def _tokenize_request(self, served: Served, text: str) -> tuple[str, dict]:
        raise NotImplementedError

    def complete(self, endpoint: Endpoint, served: Served, ids: Sequence[int], max_new_tokens: int) -> Reply:
        raise NotImplementedError

    def scrape(self, endpoint: Endpoint) -> Optional[Scrape]:
        """The server's counters now; None where it serves no /metrics."""
        raise NotImplementedError

    def _post(self, endpoint: Endpoint, path: str, body: dict, work_tokens: int) -> Any:
        try:
            return endpoint.call_json("POST", path, body, generation_budget(work_tokens))
        except HttpStatusError as error:
            if 400 <= error.status < 500:
                raise PromptRefused(f"{self.name} refused the prompt: {error}") from None
            raise RuntimeFailure(f"POST {endpoint.display}{path}: {error}") from None


@contextlib.contextmanager
def answer_shape(where: str, error: type[Exception]) -> Iterator[None]:
    """Reading a server's JSON field by field: a field missing or of another type than its source
    writes is one line naming it (error: PromptRefused for a generation, which fails that prompt
    alone; RuntimeFailure for identification and tokenization, which end the run)."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RecursionError) as problem:
        raise error(f"{where} answered JSON of another shape than crossrt reads ({type(problem).__name__}: "
                    f"{str(problem)[:200]})") from None


def token_ids(value: Any, where: str, error: type[Exception]) -> tuple[int, ...]:
    """A list of token ids as JSON integers: a string, a float or a bool is not an id, and a
    negative number is none either (the vocabulary's size is checked by the session, which knows it)."""
    if not isinstance(value, list):
        raise error(f"{where} answered token ids as {type(value).__name__}, not a list")
    for at, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise error(f"{where} answered {repr(token)[:40]} as token {at}: not a token id (a whole number from 0)")
    return tuple(value)


# The longest time a server may say one request took: a day. Beyond it, as for NaN, infinity or a
# negative time, what it says is not a time, and a record holding it would make speedups meaningless.
LONGEST_S = 86400.0


def server_seconds(value, per_second: float, name: str, where: str) -> Optional[float]:
    """A duration a server reported (in 1/per_second of a second) as seconds; None where it gave
    none; a value that is not a finite number from 0 to LONGEST_S fails the prompt, naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not 0 <= value / per_second <= LONGEST_S:
        raise PromptRefused(f"{where} answered {name} = {repr(value)[:40]}: not a time from 0 to {LONGEST_S:g} s")
    return value / per_second


def _metrics_text(endpoint: Endpoint) -> Optional[tuple[str, dict[str, str]]]:
    try:
        answer = endpoint.call("GET", "/metrics")
    except HttpStatusError as error:
        if error.status in (404, 501):  # no such endpoint (llama-server without --metrics: 501)
            return None
        raise RuntimeFailure(f"GET {endpoint.display}/metrics: {error}") from None
    return answer.body.decode("utf-8", errors="replace"), answer.headers


def _count(value: Any, name: str) -> Optional[int]:
    """A size the server reports (a vocabulary, a context) as a whole number from 1; None when absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} {repr(value)[:40]} is not a whole number from 1")
    return value


# ---- llama-server -----------------------------------------------------------------------------

LLAMA_METRICS = {"steps": "llamacpp:spec_decode_num_drafts_total", "drafted": "llamacpp:spec_decode_num_draft_tokens_total",
                 "accepted": "llamacpp:spec_decode_num_accepted_tokens_total", "decodes": "llamacpp:n_decode_total",
                 "emitted": "llamacpp:tokens_predicted_total", "prompt": "llamacpp:prompt_tokens_total"}
# Greedy as crossrt's own llama-server runtime asks for it: the temperature sampler alone, at 0.
LLAMA_GREEDY = {"temperature": 0.0, "samplers": ["temperature"]}


class LlamaServer(ServerKind):
    name = "llama-server"
    has_per_request_counts = True  # drafted and accepted; steps come from /metrics
    volatile = ("speculative.types", "draft n_max (/metrics positions)")

    drafts_fixed_k = False  # its drafts follow n_min and p_min, which it does not report

    def identify(self, endpoint: Endpoint) -> Optional[Served]:
        props = endpoint.probe_json("/props")
        if not isinstance(props, dict) or "build_info" not in props or "default_generation_settings" not in props:
            return None
        with answer_shape(f"GET {endpoint.display}/props (or /v1/models, /slots)", RuntimeFailure):
            return self._served(endpoint, props)

    def _served(self, endpoint: Endpoint, props: dict) -> Served:
        models = endpoint.probe_json("/v1/models") or {}
        meta = ((models.get("data") or [{}])[0] or {}).get("meta", {}) if isinstance(models, dict) else {}
        settings = props["default_generation_settings"]
        build = str(props["build_info"])  # llama_build_info(): "b<number>-<commit>"
        # /props' generation settings are the sampling defaults only (no speculative types): the
        # slots say whether they draft, and the last task's params which drafting it used.
        slots = endpoint.probe_json("/slots")
        slot = slots[0] if isinstance(slots, list) and slots else {}
        speculates = slot.get("speculative") if isinstance(slot.get("speculative"), bool) else None
        speculative = [("slots", str(props.get("total_slots"))), ("slot speculative", str(speculates)),
                       ("speculative.types", str(slot.get("params", {}).get("speculative.types", "not reported yet")))]
        scrape = self.scrape(endpoint)
        k = len(scrape.per_pos) if scrape is not None and scrape.per_pos else None
        if k is not None:
            speculative.append(("draft n_max (/metrics positions)", str(k)))
        speculative.append(("draft n_min, p_min", "not reported by llama-server"))
        return Served(self.name, build, build.rsplit("-", 1)[-1] if "-" in build else None,
                      str(props.get("model_path") or props.get("model_alias") or "unknown"),
                      _count(meta.get("n_vocab"), "n_vocab"), _count(settings.get("n_ctx"), "n_ctx"),
                      tuple(speculative), k, speculates)

    def _tokenize_request(self, served: Served, text: str) -> tuple[str, dict]:
        # As crossrt's llama-server runtime: BOS (add_special) and special tokens parsed.
        return "/tokenize", {"content": text, "add_special": True, "parse_special": True}

    def complete(self, endpoint: Endpoint, served: Served, ids: Sequence[int], max_new_tokens: int) -> Reply:
        request = {"prompt": list(ids), "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
                   "stream": False, **LLAMA_GREEDY}
        response = self._post(endpoint, "/completion", request, len(ids) + max_new_tokens)
        where = f"POST {endpoint.display}/completion"
        with answer_shape(where, PromptRefused):
            settings = response.get("generation_settings", {})
            if settings.get("temperature", 0.0) != 0.0:
                raise RuntimeFailure(f"{endpoint.display} did not sample greedily: temperature "
                                     f"{repr(settings['temperature'])[:40]}")
            tokens = token_ids(response["tokens"], where, PromptRefused)
            stop_type = response.get("stop_type")
            timings = response.get("timings") or {}  # absent: the request's wall clock stands in (as for vLLM)
            prefill_s, decode_s = [server_seconds(timings.get(name), 1000, f"timings.{name}", where)
                                   for name in ("prompt_ms", "predicted_ms")]
            per_request = dict(timings)
            bad = [f"{name} {timings[name]!r}" for name in ("draft_n", "draft_n_accepted") if name in timings
                   and (isinstance(timings[name], bool) or not isinstance(timings[name], int) or timings[name] < 0)]
            if bad:
                raise PromptRefused(f"{where} answered timings that are not whole numbers from 0: {', '.join(bad)}")
        if stop_type == "eos":
            stop = "eos"
        elif stop_type == "limit" and len(tokens) == max_new_tokens:
            stop = "max_new_tokens"
        else:
            raise PromptRefused(f"llama-server stopped ({repr(stop_type)[:40]}) after {len(tokens)} of {max_new_tokens} "
                                "tokens")
        return Reply(tokens, stop, prefill_s if decode_s is not None else None, decode_s, per_request)

    def scrape(self, endpoint: Endpoint) -> Optional[Scrape]:
        found = _metrics_text(endpoint)
        if found is None:
            return None
        text, headers = found
        return parse_metrics(text, LLAMA_METRICS, "llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
                             ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
                             headers.get("process-start-time-unix"))


# ---- vLLM -------------------------------------------------------------------------------------

# vllm:cache_config_info's labels that change numerics (the KV cache's dtype and layout, prefix caching).
VLLM_NUMERICS = ("cache_dtype", "block_size", "enable_prefix_caching", "calculate_kv_scales", "sliding_window")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
VLLM_METRICS = {"steps": "vllm:spec_decode_num_drafts_total", "drafted": "vllm:spec_decode_num_draft_tokens_total",
                "accepted": "vllm:spec_decode_num_accepted_tokens_total", "emitted": "vllm:generation_tokens_total",
                "prompt": "vllm:prompt_tokens_total"}


class Vllm(ServerKind):
    name = "vllm"
    volatile = ("num_speculative_tokens (/metrics positions)",)

    def identify(self, endpoint: Endpoint) -> Optional[Served]:
        version = endpoint.probe_json("/version")
        models = endpoint.probe_json("/v1/models")
        if not isinstance(version, dict) or "version" not in version or not isinstance(models, dict):
            return None
        cards = models.get("data") or []
        if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict) \
                or cards[0].get("owned_by") != "vllm":
            return None
        card = cards[0]
        with answer_shape(f"GET {endpoint.display}/v1/models", RuntimeFailure):
            n_ctx = _count(card.get("max_model_len"), "max_model_len")
        scrape = self.scrape(endpoint)
        k = len(scrape.per_pos) if scrape is not None and scrape.per_pos else None
        speculative = (("speculative_config", "not reported by vLLM's API"),
                       ("num_speculative_tokens (/metrics positions)", str(k) if k else "no per-position counters"))
        # vLLM registers its spec_decode counters only when a speculative config is set.
        speculates = None if scrape is None else scrape.steps is not None
        return Served(self.name, str(version["version"]), None, str(card["id"]), None, n_ctx, speculative, k,
                      speculates, self._cache_config(endpoint))

    @staticmethod
    def _cache_config(endpoint: Endpoint) -> tuple[tuple[str, str], ...]:
        """The KV cache settings vLLM prints as the labels of its vllm:cache_config_info gauge (its
        API reports no other engine setting): those that change numerics."""
        found = _metrics_text(endpoint)
        line = next((line for line in (found[0] if found else "").splitlines()
                     if line.startswith("vllm:cache_config_info{")), "")
        labels = dict(LABEL.findall(line))
        return tuple((name, labels[name]) for name in VLLM_NUMERICS if name in labels)

    def _tokenize_request(self, served: Served, text: str) -> tuple[str, dict]:
        return "/tokenize", {"model": served.model, "prompt": text, "add_special_tokens": True}

    def complete(self, endpoint: Endpoint, served: Served, ids: Sequence[int], max_new_tokens: int) -> Reply:
        request = {"model": served.model, "prompt": list(ids), "max_tokens": max_new_tokens,
                   "temperature": 0.0, "return_token_ids": True, "stream": False, "ignore_eos": False}
        response = self._post(endpoint, "/v1/completions", request, len(ids) + max_new_tokens)
        where = f"POST {endpoint.display}/v1/completions"
        with answer_shape(where, PromptRefused):
            choice = response["choices"][0]
            if choice.get("token_ids") is None:
                raise RuntimeFailure(f"vLLM {served.version} at {endpoint.display} returned no token_ids: it "
                                     "predates the completions API's return_token_ids, and crossrt never re-tokenizes "
                                     "text")
            tokens = token_ids(choice["token_ids"], where, PromptRefused)
            reason = choice.get("finish_reason")
        if reason == "length" and len(tokens) == max_new_tokens:
            stop = "max_new_tokens"
        elif reason == "stop":
            stop = "eos"  # stop_reason None: the EOS token; an id: another stop token
        else:
            raise PromptRefused(f"vLLM finished ({repr(reason)[:40]}) after {len(tokens)} of {max_new_tokens} tokens")
        return Reply(tokens, stop, None, None)

    def scrape(self, endpoint: Endpoint) -> Optional[Scrape]:
        found = _metrics_text(endpoint)
        if found is None:
            return None
        return parse_metrics(found[0], VLLM_METRICS, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                             ("vllm:num_requests_running", "vllm:num_requests_waiting"), None)


# ---- SGLang -----------------------------------------------------------------------------------

SGLANG_SETTINGS = ("speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
                   "speculative_eagle_topk", "speculative_num_draft_tokens")
# Server arguments that change numerics (two servers of one build with other values may give other
# ids): recorded as the server reports them.
SGLANG_NUMERICS = ("dtype", "kv_cache_dtype", "quantization", "attention_backend", "sampling_backend",
                   "chunked_prefill_size", "max_prefill_tokens", "disable_radix_cache", "enable_deterministic_inference")
SGLANG_ACCEPTED = ("spec_num_correct_drafts", "spec_accept_token_num", "spec_accepted_tokens")
SGLANG_PROPOSED = ("spec_num_proposed_drafts", "spec_draft_token_num")


class Sglang(ServerKind):
    name = "sglang"
    has_per_request_counts = True

    def identify(self, endpoint: Endpoint) -> Optional[Served]:
        info = endpoint.probe_json("/get_server_info") or endpoint.probe_json("/server_info")
        if not isinstance(info, dict) or "version" not in info or "model_path" not in info:
            return None
        with answer_shape(f"GET {endpoint.display}/get_server_info", RuntimeFailure):
            settings = tuple((name, str(info.get(name))) for name in SGLANG_SETTINGS)
            draft_tokens = _count(info.get("speculative_num_draft_tokens"), "speculative_num_draft_tokens")
            # A chain (topk 1) verifies the last token and num_draft_tokens - 1 drafted ones.
            k = draft_tokens - 1 if draft_tokens and info.get("speculative_eagle_topk") in (1, None) else None
            n_ctx = _count(info.get("context_length") or info.get("max_req_input_len"), "context_length")
            numerics = tuple((name, str(info[name])) for name in SGLANG_NUMERICS if name in info)
        return Served(self.name, str(info["version"]), None, str(info["model_path"]), None, n_ctx, settings,
                      k or None, info.get("speculative_algorithm") is not None, numerics)

    def _tokenize_request(self, served: Served, text: str) -> tuple[str, dict]:
        return "/v1/tokenize", {"model": served.model, "prompt": text, "add_special_tokens": True}

    def complete(self, endpoint: Endpoint, served: Served, ids: Sequence[int], max_new_tokens: int) -> Reply:
        request = {"input_ids": list(ids), "stream": False,
                   "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
        response = self._post(endpoint, "/generate", request, len(ids) + max_new_tokens)
        where = f"POST {endpoint.display}/generate"
        with answer_shape(where, PromptRefused):
            meta = response.get("meta_info") or {}
            tokens = token_ids(response["output_ids"], where, PromptRefused)
            reason = (meta.get("finish_reason") or {}).get("type")
            counts = {"spec_verify_ct": meta.get("spec_verify_ct"), "completion_tokens": meta.get("completion_tokens"),
                      "accepted": next((meta[n] for n in SGLANG_ACCEPTED if n in meta), None),
                      "proposed": next((meta[n] for n in SGLANG_PROPOSED if n in meta), None)}
            bad = [f"{name} {value!r}" for name, value in counts.items()
                   if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0)]
            if bad:
                raise PromptRefused(f"{where} answered counts that are not whole numbers from 0: {', '.join(bad)}")
            latency = meta.get("e2e_latency")
        if reason == "length" and len(tokens) == max_new_tokens:
            stop = "max_new_tokens"
        elif reason == "stop":
            stop = "eos"
        else:
            raise PromptRefused(f"SGLang finished ({repr(reason)[:40]}) after {len(tokens)} of {max_new_tokens} tokens")
        return Reply(tokens, stop, None, server_seconds(latency, 1, "meta_info.e2e_latency", where), counts)

    def scrape(self, endpoint: Endpoint) -> Optional[Scrape]:
        found = _metrics_text(endpoint)
        if found is None:
            return None
        return parse_metrics(found[0], {"emitted": "sglang:generation_tokens_total",
                                        "prompt": "sglang:prompt_tokens_total"}, "",
                             ("sglang:num_running_reqs", "sglang:num_queue_reqs"), None)


KINDS: tuple[ServerKind, ...] = (LlamaServer(), Sglang(), Vllm())
