"""llama.cpp's own `llama-server` as a native runtime: its draft-model speculative decoding,
its statistics translated into crossrt's counters.

Two servers run per session (backends/llama_server_process.py starts and stops them): one with
the drafter (`--spec-type draft-simple`, n_max = k, n_min, p_min) and a plain one for the
baseline, since this llama.cpp commit compiles out per-request speculative settings. Both
have one slot, greedy sampling, no prompt cache, and the in-process runtime's batch sizes.

Where the counters come from (llama.cpp tools/server/server-context.cpp):
- drafted, accepted: the response's `timings.draft_n` / `draft_n_accepted` (absent when nothing
  was drafted: 0). Acceptance is counted before the stop check, so a bonus token after an
  accepted EOS counts.
- steps, accepted_per_pos: deltas of /metrics `spec_decode_num_drafts_total` and
  `spec_decode_num_accepted_tokens_per_pos_total`; the server adds a request's counts to these
  totals when it releases the slot, just after sending the response, so crossrt waits until
  `tokens_predicted_total` shows the request.
- unverified: target decodes that are not steps (`n_decode_total` delta minus steps): the prompt
  pass that yields the first token, and plain decodes where no draft was made (one token of
  budget left), the draft was empty (p_min stopped it at once) or dropped (shorter than n_min). The prompt is one batch
  (-b n_ctx), and the token that ends generation is sampled without a decode after it.
- cut: what the identity emitted = steps + accepted + unverified - cut leaves; by the server's
  algorithm it is 1 exactly when an EOS was accepted in the last draft position (the bonus
  token after it is dropped) and 0 otherwise, which is checked.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from crossrt.backends.llama_server_process import ServerError, ServerProcess, find_executable
from crossrt.backends.llama_tools import Build, probe
from crossrt.runtime import (DraftRules, NativeGeneration, NativeSession, Runtime, RuntimeOptions,
                             RuntimeUnavailable)
from crossrt.schema import Counters, RuntimeInfo, UnfitCounts

SCHEDULE = "llama-server"
# /metrics prints counters through a C++ stream with 6 significant digits: restart the server
# before any total could lose precision.
PRECISION_LIMIT = 900_000
METRICS_WAIT_S = 5.0
# Greedy: the chain is only the temperature sampler, which at 0 keeps the first highest logit
# (numpy's argmax), then picks it.
GREEDY = {"temperature": 0.0, "samplers": ["temperature"]}
GREEDY_IF_REPORTED = {"dynatemp_range": 0.0, "mirostat": 0, "ignore_eos": False}
METRIC = re.compile(r'^llamacpp:(\w+)(?:\{position="(\d+)"\})? (\S+)$', re.M)


@dataclass(frozen=True)
class Totals:
    """The /metrics counters crossrt reads, as totals since the server started."""

    drafts: int  # verification steps (non-empty drafts)
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]
    decodes: int  # target decode calls: prompt batches, steps and plain decodes
    predicted: int  # tokens generated

    @classmethod
    def parse(cls, text: str) -> "Totals":
        values: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        for name, position, value in METRIC.findall(text):
            if position:
                per_pos[int(position)] = float(value)
            else:
                values[name] = float(value)
        try:
            return cls(drafts=int(values["spec_decode_num_drafts_total"]),
                       draft_tokens=int(values["spec_decode_num_draft_tokens_total"]),
                       accepted=int(values["spec_decode_num_accepted_tokens_total"]),
                       accepted_per_pos=tuple(int(per_pos[i]) for i in sorted(per_pos)),
                       decodes=int(values["n_decode_total"]),
                       predicted=int(values["tokens_predicted_total"]))
        except KeyError as missing:
            raise ValueError(f"/metrics has no {missing.args[0]}") from None

    def minus(self, before: "Totals") -> "Totals":
        # Positions appear in /metrics only once some step has been verified.
        width = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        now, then = _padded(self.accepted_per_pos, width), _padded(before.accepted_per_pos, width)
        return Totals(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                      self.accepted - before.accepted, tuple(a - b for a, b in zip(now, then)),
                      self.decodes - before.decodes, self.predicted - before.predicted)

    @property
    def largest(self) -> int:
        return max(self.drafts, self.draft_tokens, self.accepted, self.decodes, self.predicted,
                   *self.accepted_per_pos)


def _padded(counts: tuple[int, ...], width: int) -> tuple[int, ...]:
    return counts[:width] + (0,) * (width - len(counts))


def speculative_counters(emitted: int, stop_reason: str, timings: dict, delta: Totals,
                         k: int) -> tuple[Counters, Optional[UnfitCounts]]:
    """crossrt's counters for one speculative request (module docstring: where each comes from),
    and, when the server's numbers do not fit its schedule as crossrt reads it, what did not
    fit: the counters then keep the server's steps, drafted and accepted, and take unverified
    from the identity (cut 0, or 1 after an EOS in the last draft position); the prompt is kept."""
    drafted = int(timings.get("draft_n", 0))
    accepted = int(timings.get("draft_n_accepted", 0))
    steps = delta.drafts
    unverified = delta.decodes - steps
    cut = steps + accepted + unverified - emitted
    problems = []
    if (delta.draft_tokens, delta.accepted) != (drafted, accepted):
        problems.append(f"/metrics drafted/accepted {delta.draft_tokens}/{delta.accepted} != "
                        f"timings {drafted}/{accepted}")
    if unverified < 1:
        problems.append(f"{delta.decodes} decodes for {steps} steps leave no prompt pass")
    if not 0 <= cut <= (1 if stop_reason == "eos" else 0):
        problems.append(f"cut {cut} (steps {steps} + accepted {accepted} + unverified {unverified} "
                        f"- emitted {emitted}) with stop {stop_reason}")
    per_pos = delta.accepted_per_pos
    if any(per_pos[k:]):
        problems.append(f"acceptance at draft positions beyond k={k}: {list(per_pos)}")
    unfit = None
    if problems:
        raw = {"emitted": emitted, "timings.draft_n": drafted, "timings.draft_n_accepted": accepted,
               "metrics.drafts": delta.drafts, "metrics.draft_tokens": delta.draft_tokens,
               "metrics.accepted": delta.accepted, "metrics.decodes": delta.decodes,
               "metrics.predicted": delta.predicted,
               **{f"metrics.accepted_per_pos.{i}": n for i, n in enumerate(per_pos)}}
        cut = 1 if stop_reason == "eos" and steps + accepted >= emitted else 0
        unverified = emitted + cut - steps - accepted
        unfit = UnfitCounts(tuple(problems), raw, "steps from /metrics drafts; drafted and accepted from "
                            f"timings; cut {cut} by the stop; unverified = emitted + cut - steps - accepted")
        if sum(per_pos) != accepted or any(per_pos[k:]):
            per_pos = None  # the per-position totals do not match what is kept
    return Counters(steps=steps, drafted=drafted, accepted=accepted, emitted=emitted,
                    accepted_per_pos=_padded(per_pos, k) if per_pos is not None else None,
                    step_drafted=None, step_accepted=None, unverified=unverified, cut=cut), unfit


@dataclass(frozen=True)
class Launcher:
    """How to (re)start one of the session's servers."""

    executable: Path
    args: tuple[str, ...]
    log_path: Path

    def start(self) -> ServerProcess:
        return ServerProcess.start(self.executable, self.args, self.log_path)


class LlamaServerSession(NativeSession):
    schedule = SCHEDULE

    def __init__(self, speculative: Launcher, baseline: Launcher, rules: DraftRules, notes: tuple[str, ...]):
        self.rules = rules
        self.notes = notes
        self._speculative_launcher = speculative
        self._speculative: Optional[ServerProcess] = None
        self._baseline: Optional[ServerProcess] = None
        try:
            self._speculative = speculative.start()
            self._baseline = baseline.start()
            self._check_drafting(self._speculative, True)
            self._check_drafting(self._baseline, False)
            props = self._speculative.call_json("GET", "/props")
            self.n_ctx = int(props["default_generation_settings"]["n_ctx"])
            self._totals = self._read_totals()
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the running servers (speculative, baseline)."""
        return tuple(s.pid for s in (self._speculative, self._baseline) if s is not None)

    @staticmethod
    def _check_drafting(server: ServerProcess, drafting: bool) -> None:
        """The server drafts exactly when it should: `-md` alone loads a drafter that never drafts."""
        slots = server.call_json("GET", "/slots")
        speculates = slots[0].get("speculative") if slots else None
        if speculates is not None and speculates != drafting:
            raise server.failure(f"the slot's speculative flag is {speculates}, expected {drafting}")

    def _read_totals(self) -> Totals:
        server = self._speculative
        try:
            return Totals.parse(server.call("GET", "/metrics").decode("utf-8"))
        except (ServerError, ValueError) as error:
            raise server.failure(f"cannot read /metrics: {error}") from None

    def _totals_after(self, before: Totals, emitted: int) -> Totals:
        """Totals once the request's counts are in. The server adds them when it releases the
        slot, just after queuing the response and before it serves /metrics (a task of the same
        loop), so the first read shows them; the wait guards builds that order this otherwise."""
        deadline = time.monotonic() + METRICS_WAIT_S
        while True:
            after = self._read_totals()
            if after.predicted - before.predicted == emitted:
                return after
            if time.monotonic() > deadline:
                raise self._speculative.failure(
                    f"/metrics shows {after.predicted - before.predicted} new tokens, not {emitted}, "
                    f"{METRICS_WAIT_S:g} s after the response")
            time.sleep(0.01)

    def tokenize(self, text: str) -> list[int]:
        # As the in-process runtime: BOS (add_special) and special tokens parsed.
        request = {"content": text, "add_special": True, "parse_special": True}
        try:
            return list(self._speculative.call_json("POST", "/tokenize", request)["tokens"])
        except ServerError as error:
            raise self._speculative.failure(f"/tokenize: {error}") from None

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, speculative: bool) -> NativeGeneration:
        if not prompt_ids:
            raise ValueError("empty prompt: nothing to condition on")
        # The server stops a step short when its cache reaches n_ctx - 1 (process_token), so one
        # position stays spare, as the driven "llama-server" schedule requires too.
        if len(prompt_ids) + max_new_tokens + 1 > self.n_ctx:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens (+ 1 spare) "
                             f"does not fit the context of {self.n_ctx} tokens")
        if speculative and self._totals.largest >= PRECISION_LIMIT:
            self._speculative.stop()
            self._speculative = self._speculative_launcher.start()
            self._totals = self._read_totals()
        server = self._speculative if speculative else self._baseline
        before = self._totals
        request = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "cache_prompt": False,
                   "return_tokens": True, "stream": False, **GREEDY}
        try:
            response = server.call_json("POST", "/completion", request, work_tokens=len(prompt_ids) + max_new_tokens)
        except ServerError as error:
            if 400 <= error.status < 500:
                if speculative:  # whatever it counted must not land on the next prompt
                    self._totals = self._read_totals()
                raise ValueError(f"llama-server refused the prompt: {error}") from None
            raise server.failure(f"/completion: {error}") from None
        tokens = tuple(int(t) for t in response["tokens"])
        if speculative:  # before anything can fail this prompt, so the next one starts from here
            self._totals = self._totals_after(before, len(tokens))
        self._check_greedy(server, response.get("generation_settings", {}))
        stop_reason = self._stop_reason(server, response.get("stop_type"), len(tokens), max_new_tokens)
        timings = response["timings"]
        counters, unfit = None, None
        if speculative:
            counters, unfit = speculative_counters(len(tokens), stop_reason, timings, self._totals.minus(before),
                                                   self.rules.k)
        # prompt_ms runs to the first token (target and drafter prompt passes); predicted_ms after it.
        return NativeGeneration(tokens, stop_reason, counters, timings["prompt_ms"] / 1000,
                                timings["predicted_ms"] / 1000, unfit)

    @staticmethod
    def _check_greedy(server: ServerProcess, settings: dict) -> None:
        wrong = {name: settings.get(name) for name, value in GREEDY.items() if settings.get(name) != value}
        wrong.update({name: settings[name] for name, value in GREEDY_IF_REPORTED.items()
                      if name in settings and settings[name] != value})
        if wrong:
            raise server.failure(f"the server did not sample greedily: {wrong}")

    @staticmethod
    def _stop_reason(server: ServerProcess, stop_type: Optional[str], n_tokens: int, max_new_tokens: int) -> str:
        if stop_type == "eos":
            return "eos"
        if stop_type == "limit" and n_tokens == max_new_tokens:
            return "max_new_tokens"
        if stop_type == "limit":
            raise ValueError(f"llama-server stopped at its context limit after {n_tokens} of "
                             f"{max_new_tokens} tokens")
        raise server.failure(f"unexpected stop_type {stop_type!r} after {n_tokens} tokens")

    def close(self) -> None:
        for server in (self._speculative, self._baseline):
            if server is not None:
                server.stop()


# crossrt's spec types as llama-server's --spec-type values (common/arg.cpp at 0c1e57098).
LLAMA_SPEC_TYPES = {"draft": "draft-simple", "mtp": "draft-mtp", "eagle3": "draft-eagle3", "dflash": "draft-dflash",
                    "dspark": "draft-dspark", "ngram-simple": "ngram-simple", "ngram-map-k": "ngram-map-k",
                    "ngram-map-k4v": "ngram-map-k4v", "ngram-mod": "ngram-mod", "ngram-cache": "ngram-cache"}


def llama_spec_type(spec_type: str) -> str:
    if spec_type not in LLAMA_SPEC_TYPES:
        raise ValueError(f"llama.cpp has no spec type {spec_type!r}; it has: {', '.join(LLAMA_SPEC_TYPES)}")
    return LLAMA_SPEC_TYPES[spec_type]


class LlamaServerRuntime(Runtime):
    name = "llama-server"
    model_format = "gguf"
    modes = ("native",)
    scored_by = "llama-cpp"  # the same llama.cpp commit in-process, for logits

    def __init__(self, options: RuntimeOptions):
        super().__init__(options)
        executable = find_executable(options.executable)
        if executable is None:
            where = options.executable or "scripts/build_llama_tools' build or PATH"
            raise RuntimeUnavailable(f"no llama-server executable ({where}): run scripts/build_llama_tools, "
                                     "or pass --llama-server PATH")
        self.build: Build = probe(executable)

    @classmethod
    def check_available(cls) -> None:
        if find_executable() is None:
            raise RuntimeUnavailable("llama-server not found (neither built by scripts/build_llama_tools nor "
                                     "on PATH): run scripts/build_llama_tools, or pass --llama-server PATH")

    def _common_args(self) -> list[str]:
        options, flags = self.options, self.build.flags
        threads = str(options.threads)
        # The in-process runtime's batch sizes: the prompt is one batch, one decode call.
        args = ["-np", "1", "-c", str(options.n_ctx), "-b", str(options.n_ctx), "-ub", str(min(options.n_ctx, 512)),
                "-t", threads, "-tb", threads, "-ngl", str(options.n_gpu_layers)]
        if flags.flash_attn_takes_value:
            args += ["-fa", "on" if options.flash_attn else "off"]
        elif options.flash_attn:
            args.append("-fa")
        if options.f32_kv_cache:
            args += ["-ctk", "f32", "-ctv", "f32"]
        if options.gpu_split:
            args += ["-ts", ",".join(f"{share:g}" for share in options.gpu_split)]
        if flags.swa_full:  # the in-process runtime's cache shape; the prompt is then one decode
            args.append(flags.swa_full)
        if flags.no_ui:
            args.append(flags.no_ui)
        if flags.cache_ram:
            args += [flags.cache_ram, "0"]  # no prompt cache kept across requests
        return args

    def _speculative_args(self, drafter: Path, rules: DraftRules) -> list[str]:
        options, flags = self.options, self.build.flags
        threads = str(options.threads)
        args = ["-md", str(drafter), "-td", threads, "-tbd", threads, "-ngld", str(options.n_gpu_layers),
                flags.n_max, str(rules.k), flags.n_min, str(rules.n_min), flags.p_min, str(rules.p_min),
                "--metrics"]
        if flags.spec_type:
            # Without it -md loads a drafter that never drafts.
            args += [flags.spec_type, llama_spec_type(rules.spec_type)]
        elif rules.spec_type != "draft":
            raise ValueError(f"this llama-server build has no --spec-type: it cannot run spec type {rules.spec_type!r}")
        if options.f32_kv_cache:
            args += ["-ctkd", "f32", "-ctvd", "f32"]
        return args

    def open_native(self, target: Path, drafter: Path, rules: DraftRules, work_dir: Path) -> LlamaServerSession:
        for path in (target, drafter):
            if not Path(path).is_file():
                raise FileNotFoundError(f"model file not found: {path}")
        model = ["-m", str(target)]
        speculative = Launcher(self.build.path, tuple(model + self._speculative_args(drafter, rules)
                                                      + self._common_args()),
                               Path(work_dir) / "llama-server-speculative.log")
        baseline = Launcher(self.build.path, tuple(model + self._common_args()),
                            Path(work_dir) / "llama-server-baseline.log")
        return LlamaServerSession(speculative, baseline, rules, self._notes(rules))

    def _notes(self, rules: DraftRules) -> tuple[str, ...]:
        return (
            f"llama-server {self.build.version} (commit {self.build.commit or 'unknown'}): its own draft-model "
            f"speculative decoding (--spec-type {llama_spec_type(rules.spec_type)}, n_max {rules.k}, n_min {rules.n_min}, "
            f"p_min {rules.p_min:g}), one slot, greedy (temperature 0, samplers [temperature]), no prompt cache; "
            "the baseline is a second server without a drafter",
            "drafted/accepted: /completion timings.draft_n/draft_n_accepted (absent when nothing was drafted: 0); "
            "steps and accepted_per_pos: /metrics spec_decode_num_drafts_total and "
            "spec_decode_num_accepted_tokens_per_pos_total deltas (steps are non-empty drafts)",
            "unverified: target decodes outside steps (/metrics n_decode_total delta - steps): the first token "
            "from the prompt pass and plain decodes where no draft fit the budget, p_min left it empty, or a draft "
            "shorter than n_min was dropped; cut: the bonus token after an EOS accepted in the last draft position",
            "step_drafted/step_accepted: null, llama-server does not report per-step lengths",
            "timings: prefill_s = timings.prompt_ms (target and drafter prompt passes, first token), "
            "decode_s = timings.predicted_ms",
        )

    def info(self) -> RuntimeInfo:
        return RuntimeInfo(
            name=self.name,
            version=self.build.version,
            build=self.build.commit,
            device="gpu" if self.options.n_gpu_layers > 0 and self._has_gpu() else "cpu",
            threads=self.options.threads,
            gpu_split=self.options.gpu_split,
            kv_cache="f32" if self.options.f32_kv_cache else "f16",
            flash_attn=self.options.flash_attn,
            system_info=self.build.system_info,
        )

    def _has_gpu(self) -> bool:
        listed = subprocess.run([str(self.build.path), "--list-devices"], capture_output=True, text=True,
                                timeout=60).stdout
        devices = listed.split("Available devices:", 1)[-1].split()
        return bool(devices) and devices != ["(none)"]
