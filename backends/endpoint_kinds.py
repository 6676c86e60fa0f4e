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

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from crossrt.backends.endpoint_http import Endpoint, HttpStatusError, generation_timeout
from crossrt.errors import PromptRefused
from crossrt.run.runtime import RuntimeFailure

SAMPLE = re.compile(r'^(?P<name>[A-Za-z_:][\w:]*)(?P<labels>\{[^\n]*\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$', re.M)
POSITION = re.compile(r'position="(\d+)"')


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


@dataclass(frozen=True)
class Reply:
    """One greedy generation as the server returned it."""

    output_ids: tuple[int, ...]
    stop_reason: str  # "eos" or "max_new_tokens"
    prefill_s: Optional[float]  # None where the server does not time the prompt apart
    decode_s: Optional[float]
    per_request: dict[str, Any] = field(default_factory=dict)  # counts the response carries


@dataclass(frozen=True)
class Scrape:
    """A server's counters at one moment (/metrics), by crossrt's name; None where absent."""

    started: Optional[str]  # the process start the server reports (llama-server's header)
    busy: int  # requests running or waiting right now
    emitted: Optional[int]
    prompt: Optional[int]
    steps: Optional[int]
    drafted: Optional[int]
    accepted: Optional[int]
    per_pos: tuple[int, ...]
    decodes: Optional[int]
    exact: bool  # every counter printed as a whole number (llama-server prints 6 significant digits)


def parse_metrics(text: str, names: dict[str, str], per_pos_name: str, busy_names: Sequence[str],
                  started: Optional[str]) -> Scrape:
    """Prometheus text: each named counter summed over its label sets (vLLM: one per engine)."""
    values: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    exact = True
    for match in SAMPLE.finditer(text):
        name, labels, raw = match["name"], match["labels"] or "", match["value"]
        try:
            value = float(raw)
        except ValueError:
            continue
        if "e" in raw.lower() or value != int(value):
            exact = exact and not (name in names.values() or name == per_pos_name)
        position = POSITION.search(labels) if name == per_pos_name else None
        if position:
            per_pos[int(position.group(1))] = per_pos.get(int(position.group(1)), 0) + value
        else:
            values[name] = values.get(name, 0) + value
    counts = {role: int(values[name]) if name in values else None for role, name in names.items()}
    width = max(per_pos) + 1 if per_pos else 0
    return Scrape(started, int(sum(values.get(name, 0) for name in busy_names)), counts.get("emitted"),
                  counts.get("prompt"), counts.get("steps"), counts.get("drafted"), counts.get("accepted"),
                  tuple(int(per_pos.get(i, 0)) for i in range(width)), counts.get("decodes"), exact)


class ServerKind:
    """One kind of server. identify returns None when the server is not of this kind."""

    name: str
    has_per_request_counts: bool = False  # the response itself carries the prompt's counts
    # Reported settings that change while the server runs (set by the last request, or printed
    # only once it drafted): left out of the server's identity, which must stay put.
    volatile: tuple[str, ...] = ()

    def identify(self, endpoint: Endpoint) -> Optional[Served]:
        raise NotImplementedError

    def tokenize(self, endpoint: Endpoint, served: Served, text: str) -> list[int]:
        raise NotImplementedError

    def complete(self, endpoint: Endpoint, served: Served, ids: Sequence[int], max_new_tokens: int) -> Reply:
        raise NotImplementedError

    def scrape(self, endpoint: Endpoint) -> Optional[Scrape]:
        """The server's counters now; None where it serves no /metrics."""
        raise NotImplementedError

    def _post(self, endpoint: Endpoint, path: str, body: dict, work_tokens: int) -> Any:
        try:
            return endpoint.call_json("POST", path, body, timeout=generation_timeout(work_tokens))
        except HttpStatusError as error:
            if 400 <= error.status < 500:
                raise PromptRefused(f"{self.name} refused the prompt: {error}") from None
            raise RuntimeFailure(f"POST {endpoint.display}{path}: {error}") from None


def _metrics_text(endpoint: Endpoint) -> Optional[tuple[str, dict[str, str]]]:
    answer = endpoint.request("GET", "/metrics")
    if answer.status != 200:
        return None
    return answer.body.decode("utf-8", errors="replace"), answer.headers


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

    def identify(self, endpoint: Endpoint) -> Optional[Served]:
        props = endpoint.probe_json("/props")
        if not isinstance(props, dict) or "build_info" not in props or "default_generation_settings" not in props:
            return None
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
                      int(meta["n_vocab"]) if "n_vocab" in meta else None,
                      int(settings["n_ctx"]) if "n_ctx" in settings else None, tuple(speculative), k, speculates)

    def tokenize(self, endpoint: Endpoint, served: Served, text: str) -> list[int]:
        # As crossrt's llama-server runtime: BOS (add_special) and special tokens parsed.
        return list(endpoint.call_json("POST", "/tokenize", {"content": text, "add_special": True,
                                                             "parse_special": True})["tokens"])

    def complete(self, endpoint: Endpoint, served: Served, ids: Sequence[int], max_new_tokens: int) -> Reply:
        request = {"prompt": list(ids), "n_predict": max_new_tokens, "cache_prompt": False, "return_tokens": True,
                   "stream": False, **LLAMA_GREEDY}
        response = self._post(endpoint, "/completion", request, len(ids) + max_new_tokens)
        settings = response.get("generation_settings", {})
        if settings.get("temperature", 0.0) != 0.0:
            raise RuntimeFailure(f"{endpoint.display} did not sample greedily: temperature {settings['temperature']}")
        tokens = tuple(int(t) for t in response["tokens"])
        stop_type = response.get("stop_type")
        if stop_type == "eos":
            stop = "eos"
        elif stop_type == "limit" and len(tokens) == max_new_tokens:
            stop = "max_new_tokens"
        else:
            raise PromptRefused(f"llama-server stopped ({stop_type!r}) after {len(tokens)} of {max_new_tokens} tokens")
        timings = response.get("timings", {})
        return Reply(tokens, stop, timings["prompt_ms"] / 1000, timings["predicted_ms"] / 1000, dict(timings))

    def scrape(self, endpoint: Endpoint) -> Optional[Scrape]:
        found = _metrics_text(endpoint)
        if found is None:
            return None
        text, headers = found
        return parse_metrics(text, LLAMA_METRICS, "llamacpp:spec_decode_num_accepted_tokens_per_pos_total",
                             ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
                             headers.get("process-start-time-unix"))


# ---- vLLM -------------------------------------------------------------------------------------

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
        if not cards or cards[0].get("owned_by") != "vllm":
            return None
        card = cards[0]
        scrape = self.scrape(endpoint)
        k = len(scrape.per_pos) if scrape is not None and scrape.per_pos else None
        speculative = (("speculative_config", "not reported by vLLM's API"),
                       ("num_speculative_tokens (/metrics positions)", str(k) if k else "no per-position counters"))
        # vLLM registers its spec_decode counters only when a speculative config is set.
        speculates = None if scrape is None else scrape.steps is not None
        return Served(self.name, str(version["version"]), None, str(card["id"]), None,
                      int(card["max_model_len"]) if card.get("max_model_len") else None, speculative, k, speculates)

    def tokenize(self, endpoint: Endpoint, served: Served, text: str) -> list[int]:
        return list(endpoint.call_json("POST", "/tokenize", {"model": served.model, "prompt": text,
                                                             "add_special_tokens": True})["tokens"])

    def complete(self, endpoint: Endpoint, served: Served, ids: Sequence[int], max_new_tokens: int) -> Reply:
        request = {"model": served.model, "prompt": list(ids), "max_tokens": max_new_tokens,
                   "temperature": 0.0, "return_token_ids": True, "stream": False, "ignore_eos": False}
        response = self._post(endpoint, "/v1/completions", request, len(ids) + max_new_tokens)
        choice = response["choices"][0]
        if choice.get("token_ids") is None:
            raise RuntimeFailure(f"vLLM {served.version} at {endpoint.display} returned no token_ids: it predates "
                                 "the completions API's return_token_ids, and crossrt never re-tokenizes text")
        tokens = tuple(int(t) for t in choice["token_ids"])
        if choice.get("finish_reason") == "length" and len(tokens) == max_new_tokens:
            stop = "max_new_tokens"
        elif choice.get("finish_reason") == "stop":
            stop = "eos"  # stop_reason None: the EOS token; an id: another stop token
        else:
            raise PromptRefused(f"vLLM finished ({choice.get('finish_reason')!r}) after {len(tokens)} of "
                                f"{max_new_tokens} tokens")
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
SGLANG_ACCEPTED = ("spec_num_correct_drafts", "spec_accept_token_num", "spec_accepted_tokens")
SGLANG_PROPOSED = ("spec_num_proposed_drafts", "spec_draft_token_num")


class Sglang(ServerKind):
    name = "sglang"
    has_per_request_counts = True

    def identify(self, endpoint: Endpoint) -> Optional[Served]:
        info = endpoint.probe_json("/get_server_info") or endpoint.probe_json("/server_info")
        if not isinstance(info, dict) or "version" not in info or "model_path" not in info:
            return None
        settings = tuple((name, str(info.get(name))) for name in SGLANG_SETTINGS)
        draft_tokens = info.get("speculative_num_draft_tokens")
        # A chain (topk 1) verifies the last token and num_draft_tokens - 1 drafted ones.
        k = int(draft_tokens) - 1 if draft_tokens and info.get("speculative_eagle_topk") in (1, None) else None
        n_ctx = info.get("context_length") or info.get("max_req_input_len")
        return Served(self.name, str(info["version"]), None, str(info["model_path"]), None,
                      int(n_ctx) if n_ctx else None, settings, k, info.get("speculative_algorithm") is not None)

    def tokenize(self, endpoint: Endpoint, served: Served, text: str) -> list[int]:
        return list(endpoint.call_json("POST", "/v1/tokenize", {"model": served.model, "prompt": text,
                                                                "add_special_tokens": True})["tokens"])

    def complete(self, endpoint: Endpoint, served: Served, ids: Sequence[int], max_new_tokens: int) -> Reply:
        request = {"input_ids": list(ids), "stream": False,
                   "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens}}
        response = self._post(endpoint, "/generate", request, len(ids) + max_new_tokens)
        meta = response.get("meta_info", {})
        tokens = tuple(int(t) for t in response["output_ids"])
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason == "length" and len(tokens) == max_new_tokens:
            stop = "max_new_tokens"
        elif reason == "stop":
            stop = "eos"
        else:
            raise PromptRefused(f"SGLang finished ({reason!r}) after {len(tokens)} of {max_new_tokens} tokens")
        counts = {"spec_verify_ct": meta.get("spec_verify_ct"), "completion_tokens": meta.get("completion_tokens"),
                  "accepted": next((meta[n] for n in SGLANG_ACCEPTED if n in meta), None),
                  "proposed": next((meta[n] for n in SGLANG_PROPOSED if n in meta), None)}
        return Reply(tokens, stop, None, meta.get("e2e_latency"), counts)

    def scrape(self, endpoint: Endpoint) -> Optional[Scrape]:
        found = _metrics_text(endpoint)
        if found is None:
            return None
        return parse_metrics(found[0], {"emitted": "sglang:generation_tokens_total",
                                        "prompt": "sglang:prompt_tokens_total"}, "",
                             ("sglang:num_running_reqs", "sglang:num_queue_reqs"), None)


KINDS: tuple[ServerKind, ...] = (LlamaServer(), Sglang(), Vllm())
