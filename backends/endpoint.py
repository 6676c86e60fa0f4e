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

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from crossrt.backends.endpoint_http import Endpoint
from crossrt.backends.endpoint_kinds import KINDS, Reply, Scrape, Served, ServerKind
from crossrt.backends.llama_server_counts import Totals, speculative_counters
from crossrt.errors import ModelError, PromptRefused, SettingsError
from crossrt.records.schema import Counters, RuntimeInfo, UnfitCounts
from crossrt.run.runtime import (DraftRules, NativeGeneration, NativeSession, Runtime, RuntimeFailure,
                                 RuntimeOptions, RuntimeUnavailable, Server)

# A text whose tokenization tells vocabularies apart: words, digits, code, a non-Latin script.
PROBE_TEXT = "Speculative decoding: def f(x):\n    return x ** 2  # 12345 — naïve café, 東京, Привет!"
BUSY_WAIT_S = 30.0  # how long a busy server may take to go idle before a prompt
METRICS_WAIT_S = 5.0  # llama-server adds a request's counts just after answering it


@dataclass(frozen=True)
class Attached:
    """One attached server: where, what kind, what it said about itself."""

    endpoint: Endpoint
    kind: ServerKind
    served: Served

    @classmethod
    def attach(cls, url: str) -> "Attached":
        endpoint = Endpoint.parse(url)
        seen = []
        for kind in KINDS:
            served = kind.identify(endpoint)
            if served is not None:
                return cls(endpoint, kind, served)
        for path in ("/props", "/version", "/get_server_info", "/v1/models"):
            answer = endpoint.request("GET", path)
            seen.append(f"{path} HTTP {answer.status}")
        raise RuntimeUnavailable(f"{endpoint.display} is not llama-server, vLLM or SGLang as crossrt knows them "
                                 f"({', '.join(seen)})")

    def describe(self) -> str:
        return f"{self.served.kind} {self.served.version} at {self.endpoint.display} serving {self.served.model}"

    def identity(self) -> str:
        """What the server is while it runs: kind, version, model, URL (without credentials) and
        the speculative settings it reports that stay put (a sweep cell's id digests it)."""
        fixed = [f"{name} {value}" for name, value in self.served.speculative if name not in self.kind.volatile]
        return f"{self.describe()} ({', '.join(fixed)})"


def local_vocabulary(path: Path) -> tuple[int, Callable[[str], list[int]]]:
    """(vocabulary size, tokenize) of the pair's target file as crossrt's own runtimes tokenize it:
    llama.cpp's vocabulary of a GGUF (loaded alone), transformers' tokenizer of a folder."""
    if Path(path).is_file():
        from crossrt.backends.llama_cpp import _UNAVAILABLE, _internals, llama_cpp
        if llama_cpp is None:
            raise RuntimeUnavailable(_UNAVAILABLE)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
        add_bos = model.add_bos_token()
        return model.n_vocab(), lambda text: model.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return len(tokenizer), lambda text: list(tokenizer(text)["input_ids"])


def check_target(attached: Attached, target: Path) -> None:
    """ModelError (one line) unless the server serves the pair's target, as far as it can tell."""
    n_vocab, tokenize = local_vocabulary(target)
    served = attached.served
    if served.n_vocab is not None and served.n_vocab != n_vocab:
        raise ModelError(f"{attached.describe()}: its vocabulary has {served.n_vocab} tokens, the pair's target "
                         f"{target.name} has {n_vocab}: not the pair's target")
    theirs, ours = attached.kind.tokenize(attached.endpoint, served, PROBE_TEXT), tokenize(PROBE_TEXT)
    if list(theirs) != list(ours):
        at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        raise ModelError(f"{attached.describe()}: it tokenizes the probe text otherwise than the pair's target "
                         f"{target.name} (first difference at token {at}: server {list(theirs[at:at + 3])}, "
                         f"crossrt {list(ours[at:at + 3])}): not the pair's target")


class EndpointSession(NativeSession):
    def __init__(self, speculative: Attached, baseline: Attached, rules: DraftRules, notes: tuple[str, ...]):
        self.schedule = speculative.kind.name  # the server's own schedule, as crossrt's runtime of it names it
        self.rules = rules
        self.notes = notes
        self._speculative = speculative
        self._baseline = baseline
        self._last = self._idle_scrape(speculative)

    def tokenize(self, text: str) -> list[int]:
        return self._speculative.kind.tokenize(self._speculative.endpoint, self._speculative.served, text)

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
        return NativeGeneration(reply.output_ids, reply.stop_reason, counters, *self._seconds(reply, wall), unfit)

    @staticmethod
    def _timed(server: Attached, prompt_ids: Sequence[int], max_new_tokens: int) -> tuple[Reply, float]:
        started = time.perf_counter()
        reply = server.kind.complete(server.endpoint, server.served, prompt_ids, max_new_tokens)
        return reply, time.perf_counter() - started

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
        went_down = [name for name in ("emitted", "steps", "drafted", "accepted", "decodes")
                     if getattr(now, name) is not None and getattr(last, name) is not None
                     and getattr(now, name) < getattr(last, name)]
        if (now.started and last.started and now.started != last.started) or went_down:
            why = f"its counters went down ({', '.join(went_down)})" if went_down else \
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
            return sglang_counters(reply, emitted, self.rules.k)
        if before is None or after is None:
            raise RuntimeFailure(f"{self._speculative.describe()} serves no /metrics: crossrt reads per-prompt "
                                 "steps from it (llama-server: start it with --metrics)")
        invalid = other_work(before, after, emitted, n_prompt)
        if invalid:
            raise PromptRefused(f"invalid: the server served other requests during this prompt ({invalid}); its "
                                "counters would mix theirs in")
        if kind == "llama-server":
            delta = Totals(after.steps - before.steps, after.drafted - before.drafted, after.accepted - before.accepted,
                           _minus(after.per_pos, before.per_pos), after.decodes - before.decodes, emitted)
            return speculative_counters(emitted, reply.stop_reason, reply.per_request, delta, self.rules.k)
        return vllm_counters(before, after, emitted, self.rules.k)

    def close(self) -> None:
        """Nothing to stop: the servers are the user's."""


def k_mismatch(attached: Attached, server_k: int, k: int) -> str:
    """The one line for a run whose k is not the server's draft length (a server setting)."""
    return (f"{attached.describe()} drafts up to {server_k} tokens (its own setting), the run's k is {k}: run with "
            f"k {server_k}, or attach a server started with k {k}")


def other_work(before: Scrape, after: Scrape, emitted: int, n_prompt: int) -> Optional[str]:
    """Why a prompt's counter deltas cannot be its own, or None: the server generated or read
    more tokens than this prompt's, or printed a counter too large to difference exactly."""
    if not (before.exact and after.exact):
        return "a counter is past /metrics' printed precision"
    if after.emitted is not None and before.emitted is not None and after.emitted - before.emitted != emitted:
        return f"/metrics shows {after.emitted - before.emitted} tokens generated, this prompt {emitted}"
    if after.prompt is not None and before.prompt is not None and after.prompt - before.prompt > n_prompt:
        return f"/metrics shows {after.prompt - before.prompt} prompt tokens read, this prompt has {n_prompt}"
    return None


def _minus(now: tuple[int, ...], then: tuple[int, ...]) -> tuple[int, ...]:
    width = max(len(now), len(then))
    pad = lambda counts: counts + (0,) * (width - len(counts))  # positions print once a step reached them
    return tuple(a - b for a, b in zip(pad(now), pad(then)))


def vllm_counters(before: Scrape, after: Scrape, emitted: int, k: int) -> tuple[Counters, Optional[UnfitCounts]]:
    """vLLM's /metrics deltas: steps (num_drafts), drafted, accepted and per position; read as
    crossrt's vllm runtime reads the same counters (backends/vllm.py, translate): the first token
    comes from the prefill (unverified 1), and vLLM drafts k even where the budget ends, so the
    accepted tokens past it are cut (cut = 1 + steps + accepted - emitted, at most k)."""
    steps, drafted = after.steps - before.steps, after.drafted - before.drafted
    accepted, per_pos = after.accepted - before.accepted, _minus(after.per_pos, before.per_pos)
    unverified = 1 if emitted else 0
    cut = unverified + steps + accepted - emitted
    problems = ([f"{cut} tokens cut (1 + steps {steps} + accepted {accepted} - emitted {emitted}): only the last "
                 f"step's accepted tokens can be"] if not 0 <= cut <= k else []) + \
        ([f"acceptance beyond k={k}: {list(per_pos)}"] if any(per_pos[k:]) else [])
    unfit = None
    if problems:
        unfit = UnfitCounts(tuple(problems), {"emitted": emitted, "metrics.drafts": steps,
                                              "metrics.draft_tokens": drafted, "metrics.accepted": accepted},
                            "unverified = emitted + cut - steps - accepted, cut clamped to 0..k")
        cut = min(max(cut, 0), k)
        unverified = emitted + cut - steps - accepted
    per_pos = (per_pos + (0,) * k)[:k] if sum(per_pos) == accepted and not any(per_pos[k:]) else None
    return Counters(steps=steps, drafted=drafted, accepted=accepted, emitted=emitted, accepted_per_pos=per_pos,
                    step_drafted=None, step_accepted=None, unverified=unverified, cut=cut), unfit


def sglang_counters(reply: Reply, emitted: int, k: int) -> tuple[Counters, Optional[UnfitCounts]]:
    """SGLang's meta_info: steps = spec_verify_ct; accepted = its accepted draft count (where it
    gives none, completion_tokens - spec_verify_ct, SGLang's own accept length); drafted = steps x k
    (a chain drafts k every pass); unverified = what the identity leaves."""
    counts = reply.per_request
    steps = counts.get("spec_verify_ct")
    if steps is None:
        raise RuntimeFailure("SGLang's response has no meta_info.spec_verify_ct: the server does not speculate")
    accepted = counts.get("accepted")
    if accepted is None:
        accepted = (counts.get("completion_tokens") or emitted) - steps
    rest = emitted - steps - accepted
    unfit = None
    if rest < 0:
        unfit = UnfitCounts((f"emitted {emitted} < steps {steps} + accepted {accepted}",),
                            {"emitted": emitted, **{n: v for n, v in counts.items() if isinstance(v, int)}},
                            "cut = steps + accepted - emitted, unverified 0")
    return Counters(steps=steps, drafted=steps * k, accepted=accepted, emitted=emitted, accepted_per_pos=None,
                    step_drafted=None, step_accepted=None, unverified=max(rest, 0), cut=max(-rest, 0)), unfit


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
        self.attached = Attached.attach(options.url)
        self.baseline: Optional[Attached] = None  # the plain server, once open_native attached it

    @classmethod
    def check_available(cls) -> None:
        raise RuntimeUnavailable("attaches to a server you run: give --url (and --baseline-url)")

    @classmethod
    def attach_server(cls, url: str) -> Server:
        attached = Attached.attach(url)
        return Server(attached.endpoint.display, attached.identity(), attached.served.k)

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
        baseline = Attached.attach(self.options.baseline_url)
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
        for attached in (speculative, baseline):
            check_target(attached, Path(target))
        self.baseline = baseline
        return EndpointSession(speculative, baseline, rules, self._notes(speculative, baseline))

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
        return (f"attached: {speculative.describe()}; baseline: {baseline.describe()}",
                f"speculative settings as the server reports them: {settings}",
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
