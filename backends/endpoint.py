"""A server the user already runs as a native runtime: llama-server, vLLM or SGLang, attached by
URL (`--url`), with a plain server of the same target for the greedy baseline (`--baseline-url`:
these servers speculate on every request, so the baseline cannot come from the same one).

On attaching, crossrt finds out which server it talks to and what it serves
(backends/endpoint_kinds.py) and checks, before any prompt, that the served model is the pair's
target: its vocabulary size where the server reports it, and a probe text tokenized by the
server's own tokenize endpoint against crossrt's tokenization of the pair's target file.
Prompts go as crossrt's token ids, greedy, one at a time; outputs come back as token ids.

Per-prompt counters: from the response where the server reports them (llama-server's timings,
SGLang's meta_info), and from the server's /metrics before and after the request. A prompt during
which the server also served someone else (its counters grew by more than this prompt) is kept
as failed with that reason, never mixed in; a server busy before a prompt, one that restarted
(counters went down, a new process start) or stopped answering ends the run with one line, the
finished prompts kept for --resume. docs/endpoint.md.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from crossrt.backends import endpoint_http
from crossrt.backends.endpoint_http import Endpoint
from crossrt.backends.endpoint_counts import (Scrape, minus, numbers, other_work, sglang_counters, vllm_counters,
                                              went_down)
from crossrt.backends.endpoint_kinds import KINDS, Reply, Served, ServerKind
from crossrt.backends.llama_server_counts import MetricsCounters, speculative_counters
from crossrt.errors import ModelError, PromptRefused, SettingsError
from crossrt.records.schema import Counters, RuntimeInfo, UnfitCounts
from crossrt.run.attach import attachment_for
from crossrt.run.runtime import (DraftRules, NativeGeneration, NativeSession, Runtime, RuntimeFailure,
                                 RuntimeOptions, RuntimeUnavailable, Server)

# A text whose tokenization tells vocabularies apart: words, digits, code, a non-Latin script.
PROBE_TEXT = "Speculative decoding: def f(x):\n    return x ** 2  # 12345 — naïve café, 東京, Привет!"
BUSY_WAIT_S = 30.0  # how long a busy server may take to go idle before a prompt
METRICS_WAIT_S = 5.0  # llama-server adds a request's counts just after answering it
MAX_SAID = 1024  # characters of what a server says about itself (a version, a model path) that crossrt keeps


@dataclass(frozen=True)
class Attached:
    """One attached server: where, what kind, what it said about itself."""

    endpoint: Endpoint
    kind: ServerKind
    served: Served

    @classmethod
    def attach(cls, url: str) -> "Attached":
        endpoint = Endpoint.parse(url)
        asking = endpoint.within(endpoint_http.ATTACH_TIMEOUT_S)  # read at call time: tests shorten it
        seen = []
        for kind in KINDS:
            served = kind.identify(asking)
            if served is not None:
                said = {"version": served.version, "build": served.build or "", "model": served.model,
                        **dict(served.speculative), **dict(served.numerics)}
                long = next(((name, text) for name, text in said.items() if len(text) > MAX_SAID), None)
                if long is not None:  # it would be written into every message and the record
                    raise RuntimeFailure(f"{endpoint.display} answered a {long[0]} of {len(long[1])} characters "
                                         f"({long[1][:40]!r}...): more than the {MAX_SAID} a server's name for itself "
                                         "takes")
                return cls(endpoint, kind, served)
        for path in ("/props", "/version", "/get_server_info", "/v1/models"):
            answer = asking.request("GET", path)
            seen.append(f"{path} HTTP {answer.status}")
        raise RuntimeUnavailable(f"{endpoint.display} is not llama-server, vLLM or SGLang as crossrt knows them "
                                 f"({', '.join(seen)})")

    def describe(self) -> str:
        return f"{self.served.kind} {self.served.version} at {self.endpoint.display} serving {self.served.model}"

    def identity(self) -> str:
        """What the server is while it runs: kind, version, model, URL (without credentials) and
        the speculative and numerics settings it reports that stay put (a sweep cell's id digests it)."""
        fixed = [f"{name} {value}" for name, value in self.served.speculative + self.served.numerics
                 if name not in self.kind.volatile]
        return f"{self.describe()} ({', '.join(fixed)})"


def local_vocabulary(path: Path) -> tuple[int, Callable[[str], list[int]]]:
    """(vocabulary size, tokenize) of the pair's target file as crossrt's own runtimes tokenize it:
    llama.cpp's vocabulary of a GGUF (loaded alone), transformers' tokenizer of a folder."""
    if Path(path).is_file():
        from crossrt.backends.llama_cpp import vocab_model
        model = vocab_model(path)
        add_bos = model.add_bos_token()
        return model.n_vocab(), lambda text: model.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return len(tokenizer), lambda text: list(tokenizer(text)["input_ids"])


def check_target(attached: Attached, target: Path) -> int:
    """The vocabulary's size, once the server serves the pair's target as far as it can tell;
    ModelError (one line) otherwise."""
    n_vocab, tokenize = local_vocabulary(target)
    served = attached.served
    if served.n_vocab is not None and served.n_vocab != n_vocab:
        raise ModelError(f"{attached.describe()}: its vocabulary has {served.n_vocab} tokens, the pair's target "
                         f"{target.name} has {n_vocab}: not the pair's target")
    try:
        theirs = attached.kind.tokenize(attached.endpoint, served, PROBE_TEXT)
    except PromptRefused as error:
        raise ModelError(f"{attached.describe()}: {error} (crossrt's probe text)") from None
    ours = tokenize(PROBE_TEXT)
    if list(theirs) != list(ours):
        at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        raise ModelError(f"{attached.describe()}: it tokenizes the probe text otherwise than the pair's target "
                         f"{target.name} (first difference at token {at}: server {list(theirs[at:at + 3])}, "
                         f"crossrt {list(ours[at:at + 3])}): not the pair's target")
    return n_vocab


class EndpointSession(NativeSession):
    def __init__(self, speculative: Attached, baseline: Attached, rules: DraftRules, notes: tuple[str, ...],
                 n_vocab: Optional[int] = None):
        self.schedule = speculative.kind.name  # the server's own schedule, as crossrt's runtime of it names it
        self.rules = rules
        self.notes = notes
        self.fixed_params = server_params(speculative, rules)
        self._speculative = speculative
        self._baseline = baseline
        self._n_vocab = n_vocab or speculative.served.n_vocab  # the pair's target's, checked against the server's
        self._last = self._idle_scrape(speculative)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, speculative: bool) -> NativeGeneration:
        if not prompt_ids:
            raise PromptRefused("empty prompt: nothing to condition on")
        n_ctx = self._speculative.served.n_ctx
        if n_ctx is not None and len(prompt_ids) + max_new_tokens + 1 > n_ctx:
            raise PromptRefused(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens (+ 1 spare) does "
                                f"not fit the server's context of {n_ctx} tokens")
        server = self._speculative if speculative else self._baseline
        if not speculative:
            reply, wall = self._timed(server, prompt_ids, max_new_tokens)
            return NativeGeneration(reply.output_ids, reply.stop_reason, None, *self._seconds(reply, wall))
        before = self._idle_scrape(server)
        self._check_same_process(before)
        reply, wall = self._timed(server, prompt_ids, max_new_tokens)
        after = self._scrape_after(server, before, len(reply.output_ids))
        self._last = after
        self._check_draft_length(after)
        counters, unfit = self._counters(reply, before, after, len(prompt_ids))
        negative = [f.name for f in dataclasses.fields(counters)
                    if any(n < 0 for n in numbers(getattr(counters, f.name)))]
        if negative:  # a count below 0 is no count: the prompt fails alone, the record stays valid
            raise PromptRefused(f"{server.describe()} gave counts below 0 for this prompt ({', '.join(negative)}): "
                                f"{counters}")
        return NativeGeneration(reply.output_ids, reply.stop_reason, counters, *self._seconds(reply, wall), unfit)

    def tokenize(self, text: str) -> list[int]:
        return self._in_vocabulary(self._speculative, self._speculative.kind.tokenize(
            self._speculative.endpoint, self._speculative.served, text), "its tokenization")

    def _timed(self, server: Attached, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[Reply, float]:
        started = time.perf_counter()
        reply = server.kind.complete(server.endpoint, server.served, prompt_ids, max_new_tokens)
        if len(reply.output_ids) > max_new_tokens:  # never stored: a record holds what was asked for
            raise PromptRefused(f"{server.describe()} answered {len(reply.output_ids)} token ids for a budget of "
                                f"{max_new_tokens}")
        self._in_vocabulary(server, reply.output_ids, "its output")
        return reply, time.perf_counter() - started

    def _in_vocabulary(self, server: Attached, ids: Sequence[int], what: str) -> list[int]:
        """ids, each a token of the pair's vocabulary; PromptRefused naming the first that is not
        (a record never holds an id its readers cannot index)."""
        outside = next(((at, i) for at, i in enumerate(ids) if not 0 <= i < (self._n_vocab or i + 1)), None)
        if outside is not None:
            raise PromptRefused(f"{server.describe()} answered token id {outside[1]} at position {outside[0]} of "
                                f"{what}, outside the vocabulary of {self._n_vocab} tokens")
        return list(ids)

    @staticmethod
    def _seconds(reply: Reply, wall: float) -> tuple[float, float]:
        """(prefill_s, decode_s): the server's own timings (one total: as decode), else the
        request's wall clock as decode."""
        if reply.decode_s is not None:
            return reply.prefill_s or 0.0, reply.decode_s
        return 0.0, wall

    def _idle_scrape(self, server: Attached) -> Optional[Scrape]:
        """The counters once the server runs nothing else (RuntimeFailure after BUSY_WAIT_S)."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            scrape = server.kind.scrape(server.endpoint)
            if scrape is None or scrape.busy == 0:
                return scrape
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"{server.describe()} is busy: {scrape.busy} requests running or waiting for "
                                     f"{BUSY_WAIT_S:g} s; per-prompt counters need it to serve crossrt alone")
            time.sleep(0.2)

    def _check_draft_length(self, now: Optional[Scrape]) -> None:
        """A server that did not say its draft length on attaching (llama-server prints its n_max
        positions in /metrics once it has drafted) is checked once it has."""
        if now is not None and now.per_pos and len(now.per_pos) != self.rules.k:
            raise SettingsError(k_mismatch(self._speculative, len(now.per_pos), self.rules.k))

    def _check_same_process(self, now: Optional[Scrape]) -> None:
        last = self._last
        if now is None or last is None:
            return
        down = went_down(last, now)
        if (now.started and last.started and now.started != last.started) or down:
            why = f"its counters went down ({', '.join(down)})" if down else \
                f"its process start changed ({last.started} -> {now.started})"
            raise RuntimeFailure(f"{self._speculative.describe()} restarted since the last prompt: {why}; the "
                                 "finished prompts are kept, --resume continues")

    def _scrape_after(self, server: Attached, before: Optional[Scrape], emitted: int) -> Optional[Scrape]:
        """Counters once this request's are in (llama-server adds them when it frees the slot,
        just after answering): the first scrape whose emitted count covers the request."""
        if before is None or before.emitted is None:
            return server.kind.scrape(server.endpoint)
        deadline = time.monotonic() + METRICS_WAIT_S
        while True:
            after = server.kind.scrape(server.endpoint)
            if after is None or after.emitted is None or after.emitted - before.emitted >= emitted \
                    or time.monotonic() > deadline:
                return after
            time.sleep(0.01)

    def _counters(self, reply: Reply, before: Optional[Scrape], after: Optional[Scrape],
                  n_prompt: int) -> tuple[Counters, Optional[UnfitCounts]]:
        emitted, kind = len(reply.output_ids), self._speculative.kind.name
        if kind == "sglang":  # per request in meta_info: other requests cannot mix in
            return sglang_counters(reply.per_request, emitted, self.rules.k)
        if before is None or after is None:
            raise RuntimeFailure(f"{self._speculative.describe()} serves no /metrics: crossrt reads per-prompt "
                                 "steps from it (llama-server: start it with --metrics)")
        down = went_down(before, after)
        if down:  # a counter never goes down in one process: this is a restart, not someone else's work
            raise RuntimeFailure(f"{self._speculative.describe()} restarted during this prompt: its counters went "
                                 f"down ({', '.join(down)}); the finished prompts are kept, --resume continues")
        needed = ("steps", "drafted", "accepted") + (("decodes",) if kind == "llama-server" else ())
        missing = [name for name in needed if getattr(after, name) is None or getattr(before, name) is None]
        if missing:
            raise RuntimeFailure(f"{self._speculative.describe()}: its /metrics lacks the {', '.join(missing)} "
                                 "counters crossrt reads per-prompt counts from")
        invalid = other_work(before, after, emitted, n_prompt)
        if invalid:
            raise PromptRefused(f"invalid: {invalid}: the counter deltas cannot be read as this prompt's")
        if kind == "llama-server":
            delta = MetricsCounters(after.steps - before.steps, after.drafted - before.drafted,
                                    after.accepted - before.accepted, minus(after.per_pos, before.per_pos),
                                    after.decodes - before.decodes, emitted)
            return speculative_counters(emitted, reply.stop_reason, reply.per_request, delta, self.rules.k)
        return vllm_counters(before, after, emitted, self.rules.k)

    def close(self) -> None:
        """Nothing to stop: the servers are the user's."""


def server_params(attached: Attached, rules: DraftRules) -> tuple[tuple[str, object], ...]:
    """The run's settings as the server has them, which the record states instead of crossrt's
    options (RunParams' n_ctx, draft_n_min, draft_p_min): its context; its drafting rules where it
    drafts k on every step (n_min k, p_min 0); None, unknown, where it does not report a setting
    (llama-server's n_min and p_min; a vLLM without max_model_len)."""
    fixed = attached.kind.drafts_fixed_k
    return (("n_ctx", attached.served.n_ctx), ("draft_n_min", rules.k if fixed else None),
            ("draft_p_min", 0.0 if fixed else None))


def k_mismatch(attached: Attached, server_k: int, k: int) -> str:
    """The one line for a run whose k is not the server's draft length (a server setting)."""
    return (f"{attached.describe()} drafts up to {server_k} tokens (its own setting), the run's k is {k}: run with "
            f"k {server_k}, or attach a server started with k {k}")


class EndpointRuntime(Runtime):
    name = "endpoint"
    model_format = ("gguf", "hf")  # the target file crossrt tokenizes to check the server's model
    modes = ("native",)
    attaches = True

    def __init__(self, options: RuntimeOptions):
        super().__init__(options)
        if options.url is None:
            raise SettingsError("the endpoint runtime attaches to a running server: give --url URL, and "
                                "--baseline-url URL for a plain server of the same target")
        self.attached = attachment_for(options.url, Attached.attach)
        self.baseline: Optional[Attached] = None  # the plain server, once open_native attached it

    @classmethod
    def check_available(cls) -> None:
        raise RuntimeUnavailable("attaches to a server you run: give --url (and --baseline-url)")

    @classmethod
    def attach_server(cls, url: str) -> Server:
        attachment = Attached.attach(url)
        return Server(attachment.endpoint.display, attachment.identity(), attachment.served.k, attachment)

    @classmethod
    def scorer(cls, info: RuntimeInfo) -> Optional[str]:
        """llama.cpp in-process for an attached llama-server (the same kernels and GGUF); transformers
        for vLLM and SGLang, which run a model's float weights as transformers does."""
        return "llama-cpp" if info.version.startswith("llama-server ") else "transformers"

    def open_native(self, target: Path, drafter: Path, rules: DraftRules, work_dir: Path) -> EndpointSession:
        speculative = self.attached
        if self.options.baseline_url is None:
            raise SettingsError(f"--baseline-url: {speculative.served.kind} speculates on every request, so the "
                                "greedy baseline needs a second server of the same target without a drafter")
        baseline = attachment_for(self.options.baseline_url, Attached.attach)
        if baseline.served.kind != speculative.served.kind:
            raise SettingsError(f"--baseline-url is {baseline.describe()}, --url {speculative.describe()}: give two "
                                "servers of one kind")
        if speculative.served.speculates is False:
            raise SettingsError(f"--url: {speculative.describe()} does not draft (it says so): attach a server "
                                "started with speculative decoding")
        if baseline.served.speculates:
            raise SettingsError(f"--baseline-url: {baseline.describe()} drafts: the baseline needs a plain server")
        served = speculative.served
        if served.k is not None and served.k != rules.k:
            raise SettingsError(k_mismatch(speculative, served.k, rules.k))
        if speculative.kind.drafts_fixed_k and not rules.fixed:
            raise SettingsError(f"{speculative.describe()} drafts k={rules.k} tokens every step: it has no n_min or "
                                f"p_min rules (got n_min={rules.n_min}, p_min={rules.p_min})")
        n_vocab = [check_target(attached, Path(target)) for attached in (speculative, baseline)][0]
        self.baseline = baseline
        return EndpointSession(speculative, baseline, rules, self._notes(speculative, baseline), n_vocab)

    @staticmethod
    def _notes(speculative: Attached, baseline: Attached) -> tuple[str, ...]:
        settings = ", ".join(f"{name} {value}" for name, value in speculative.served.speculative)
        how = {"llama-server": "drafted/accepted from the response's timings.draft_n/draft_n_accepted, steps and "
                               "accepted_per_pos from /metrics deltas, unverified = n_decode_total delta - steps",
               "vllm": "steps, drafted, accepted, accepted_per_pos from /metrics vllm:spec_decode_* deltas; "
                       "unverified 1 (the prefill's first token), cut = 1 + steps + accepted - emitted (drafts "
                       "past the budget); timings: the request's wall clock",
               "sglang": "steps = meta_info.spec_verify_ct, accepted from meta_info, drafted = steps x k; "
                         "unverified = emitted - steps - accepted; timings: meta_info.e2e_latency"}
        served = speculative.served
        numerics = ", ".join(f"{name} {value}" for name, value in served.numerics) or \
            "none reported by the server (flash attention, batch and ubatch sizes, SWA cache, prompt cache are " \
            "unknown: servers of one build started with other flags may give other ids)"
        unknown = [name for name, value in server_params(speculative, DraftRules(served.k or 1)) if value is None]
        models = [] if baseline.served.model == served.model else [
            f"the baseline server serves {baseline.served.model}, the speculative one {served.model}: other paths "
            "(both tokenize crossrt's probe text as the pair's target does)"]
        return (f"attached: {speculative.describe()}; baseline: {baseline.describe()}",
                f"speculative settings as the server reports them: {settings}",
                "the record's n_ctx and drafting rules are the server's"
                + (f"; unknown (null): {', '.join(unknown)}, not reported by {served.kind}" if unknown else ""),
                f"numerics settings as the server reports them: {numerics}", *models,
                f"counters: {how[speculative.served.kind]}; a prompt during which /metrics shows other requests' "
                "tokens is failed as invalid",
                "prompts sent as crossrt's token ids, one at a time, greedy (temperature 0); outputs read as token ids")

    def info(self) -> RuntimeInfo:
        served = self.attached.served
        return RuntimeInfo(name=self.name, version=f"{served.kind} {served.version}", build=served.build,
                           device=f"server {self.attached.endpoint.display}", threads=None, gpu_split=None,
                           kv_cache="server's own", flash_attn=None, system_info=self._what_stays_put())

    def _what_stays_put(self) -> str:
        """The model, and the baseline server's build and model: a resumed run is compared on them,
        and the baseline store's key holds them, so a baseline server swapped for another build or
        model behind the same URL never lends its predecessor's stored baselines."""
        plain = self.baseline.served if self.baseline is not None else None
        return f"model {self.attached.served.model}" + (
            f"; baseline {plain.kind} {plain.version} serving {plain.model}" if plain is not None else "")
