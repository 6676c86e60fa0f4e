"""llama.cpp's own `llama-server` as a native runtime: its draft-model speculative decoding,
its statistics translated into crossrt's counters.

Two servers run per session (backends/llama_server_process.py starts and stops them): one with
the drafter (`--spec-type draft-simple`, n_max = k, n_min, p_min) and a plain one for the
baseline, since this llama.cpp commit compiles out per-request speculative settings. Both
have one slot, greedy sampling, no prompt cache, and the in-process runtime's batch sizes.

The counters: backends/llama_server_counts.py.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from crossrt.backends.llama_server_counts import MetricsCounters, speculative_counters
from crossrt.backends.llama_server_ngram import (NGRAM_DRAFTINGS, ngram_note, ngram_rules, ngram_settings,
                                                 ngram_simple_size_n)
from crossrt.backends.llama_server_process import HOST, ServerError, ServerProcess, find_executable
from crossrt.backends.llama_tools import Build, llama_spec_type, probe, refuse_unfed_head
from crossrt.errors import PromptRefused, SettingsError
from crossrt.run.memory import check_gguf_fits, plan_processes
from crossrt.run.runtime import (DraftRules, NativeGeneration, NativeSession, Runtime, RuntimeOptions,
                             RuntimeUnavailable)
from crossrt.records.schema import RuntimeInfo

SCHEDULE = "llama-server"
# /metrics prints counters through a C++ stream with 6 significant digits: restart the server
# before any total could lose precision.
PRECISION_LIMIT = 900_000
METRICS_WAIT_S = 5.0
# Greedy: the chain is only the temperature sampler, which at 0 keeps the first highest logit
# (numpy's argmax), then picks it.
GREEDY = {"temperature": 0.0, "samplers": ["temperature"]}
GREEDY_IF_REPORTED = {"dynatemp_range": 0.0, "mirostat": 0, "ignore_eos": False}
ONE_AT_A_TIME = ("the baseline and speculative servers did not fit in memory together: every baseline was "
                 "decoded first, then the baseline server stopped and the speculative server started")


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

    def __init__(self, speculative: Launcher, baseline: Launcher, rules: DraftRules, notes: tuple[str, ...],
                 one_at_a_time: bool = False, baseline_on_demand: bool = False):
        """baseline_on_demand: the baseline server starts at start_baseline or the first baseline
        decoded (Runtime.baseline_on_demand), not beside the speculative one."""
        self.rules = rules
        self.notes = notes
        # Where both servers do not fit in memory together: only the one generating runs (the
        # driver decodes every baseline first), and the other is stopped before it starts.
        self.one_at_a_time = one_at_a_time
        self._speculative_launcher = speculative
        self._baseline_launcher = baseline
        self._speculative: Optional[ServerProcess] = None
        self._baseline: Optional[ServerProcess] = None
        self._template: Optional[tuple[str, ServerProcess]] = None  # (template text, its server)
        self._totals: Optional[MetricsCounters] = None  # the speculative server's, read when it starts
        try:
            # One at a time, the baseline server first (the driver decodes every baseline first); on
            # demand, the speculative one; else both.
            first = self._server(speculative=baseline_on_demand and not one_at_a_time)
            if not one_at_a_time and not baseline_on_demand:
                self._server(speculative=True)
            props = first.call_json("GET", "/props")
            self.n_ctx = int(props["default_generation_settings"]["n_ctx"])
        except BaseException:
            self.close()
            raise

    def _server(self, speculative: bool) -> ServerProcess:
        """The running server of this kind, started (after stopping the other, one at a time) if it is not."""
        running = self._speculative if speculative else self._baseline
        if running is not None:
            return running
        other = self._baseline if speculative else self._speculative
        if self.one_at_a_time and other is not None:
            other.stop()
            self._baseline, self._speculative = (None, self._speculative) if speculative else (self._baseline, None)
        if speculative:
            self._speculative = self._speculative_launcher.start()
            self._check_drafting(self._speculative, drafting=True)
            self._totals = self._read_totals()
            return self._speculative
        self._baseline = self._baseline_launcher.start()
        self._check_drafting(self._baseline, drafting=False)
        return self._baseline

    def start_baseline(self) -> None:
        self._server(speculative=False)

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the running servers (speculative, baseline)."""
        return tuple(s.pid for s in (self._speculative, self._baseline) if s is not None)

    @property
    def urls(self) -> tuple[Optional[str], Optional[str]]:
        """The servers' addresses (speculative, baseline), to attach to them (backends/endpoint.py);
        None for one not running (one at a time, where both do not fit in memory)."""
        return tuple(f"http://{HOST}:{s.port}" if s is not None else None for s in (self._speculative, self._baseline))

    @staticmethod
    def _check_drafting(server: ServerProcess, *, drafting: bool) -> None:
        """The server drafts exactly when it should: `-md` alone loads a drafter that never drafts."""
        slots = server.call_json("GET", "/slots")
        speculates = slots[0].get("speculative") if slots else None
        if speculates is not None and speculates != drafting:
            raise server.failure(f"the slot's speculative flag is {speculates}, expected {drafting}")

    def _read_totals(self) -> MetricsCounters:
        server = self._speculative
        try:
            return MetricsCounters.parse(server.call("GET", "/metrics").decode("utf-8"))
        except (ServerError, ValueError) as error:
            raise server.failure(f"cannot read /metrics: {error}") from None

    def _totals_after(self, before: MetricsCounters, emitted: int) -> MetricsCounters:
        """The counters once the request's counts are in. The server adds them when it releases the
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
        server = self._speculative or self._baseline  # the same target, tokenized alike
        try:
            return list(server.call_json("POST", "/tokenize", request)["tokens"])
        except ServerError as error:
            raise server.failure(f"/tokenize: {error}") from None

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, speculative: bool) -> NativeGeneration:
        if not prompt_ids:
            raise PromptRefused("empty prompt: nothing to condition on")
        # The server stops a step short when its cache reaches n_ctx - 1 (process_token), so one
        # position stays spare, as the driven "llama-server" schedule requires too.
        if len(prompt_ids) + max_new_tokens + 1 > self.n_ctx:
            raise PromptRefused(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens (+ 1 spare) "
                             f"does not fit the context of {self.n_ctx} tokens")
        server = self._server(speculative)
        if speculative and self._totals.largest >= PRECISION_LIMIT:
            self._speculative.stop()
            self._speculative = None
            server = self._server(speculative)
        before = self._totals
        request = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "cache_prompt": False,
                   "return_tokens": True, "stream": False, **GREEDY}
        try:
            response = server.call_json("POST", "/completion", request, work_tokens=len(prompt_ids) + max_new_tokens)
        except ServerError as error:
            if 400 <= error.status < 500:
                if speculative:  # whatever it counted must not land on the next prompt
                    self._totals = self._read_totals()
                raise PromptRefused(f"llama-server refused the prompt: {error}") from None
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
            raise PromptRefused(f"llama-server stopped at its context limit after {n_tokens} of "
                             f"{max_new_tokens} tokens")
        raise server.failure(f"unexpected stop_type {stop_type!r} after {n_tokens} tokens")

    def chat_template_ids(self, messages: list[dict], template: str, variables: dict) -> list[int]:
        """llama-server's own rendering of a chat turn (/apply-template, its jinja engine, which
        drops a leading BOS text when the model adds one) tokenized as /completion tokenizes a
        prompt (add_special, parse_special): what its chat endpoint would feed. The template
        comes from crossrt as a file, so a server of its own (no drafter) is started once."""
        if self._template is None or self._template[0] != template:
            if self._template is not None:
                self._template[1].stop()
            launcher = self._speculative_launcher
            template_file = launcher.log_path.with_name("chat_template.jinja")
            template_file.write_text(template, encoding="utf-8")
            args = (*launcher.args[:2], "-c", "512", "-np", "1", "-t", "1", "--chat-template-file", str(template_file))
            self._template = (template, ServerProcess.start(launcher.executable, args,
                                                            launcher.log_path.with_name("llama-server-template.log")))
        server = self._template[1]
        request = {"messages": messages, "add_generation_prompt": True, "chat_template_kwargs": variables}
        try:
            prompt = server.call_json("POST", "/apply-template", request)["prompt"]
            return list(server.call_json("POST", "/tokenize", {"content": prompt, "add_special": True,
                                                              "parse_special": True})["tokens"])
        except ServerError as error:
            raise server.failure(f"/apply-template: {error}") from None

    def close(self) -> None:
        for server in (self._speculative, self._baseline, self._template[1] if self._template else None):
            if server is not None:
                server.stop()


class LlamaServerRuntime(Runtime):
    name = "llama-server"
    model_format = "gguf"
    modes = ("native",)
    scored_by = "llama-cpp"  # the same llama.cpp commit in-process, for logits
    program = "llama-server"
    drafting_rules = ("n_min", "p_min")  # passed as the build's own flags (Build.flags)
    # --drafting llama-ngram-*: its own n-gram type at the strategy's ngram_max, no drafter loaded.
    native_draftings = tuple(NGRAM_DRAFTINGS)
    baseline_on_demand = True  # a run whose baselines are all stored never starts the plain server

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

    def _speculative_args(self, drafter: Optional[Path], rules: DraftRules,
                          ngram: tuple[tuple[str, int], ...]) -> list[str]:
        """drafter None: n-gram drafting without a drafter model loaded; ngram: its type's settings."""
        options, flags = self.options, self.build.flags
        threads = str(options.threads)
        args = ["-md", str(drafter), "-td", threads, "-tbd", threads, "-ngld", str(options.n_gpu_layers)] \
            if drafter is not None else []
        args += [flags.n_max, str(rules.k), flags.n_min, str(rules.n_min), flags.p_min, str(rules.p_min), "--metrics"]
        if flags.spec_type:
            # Without it -md loads a drafter that never drafts.
            args += [flags.spec_type, llama_spec_type(rules.spec_type)]
        elif rules.spec_type != "draft":
            raise SettingsError(f"this llama-server build has no --spec-type: it cannot run spec type {rules.spec_type!r}")
        args += [str(part) for setting in ngram for part in setting]
        if options.f32_kv_cache and drafter is not None:
            args += ["-ctkd", "f32", "-ctvd", "f32"]
        return args

    def _ngram_settings(self, rules: DraftRules, size_n: int, chosen: bool) -> tuple[tuple[str, int], ...]:
        """What crossrt sets of the run's n-gram type: ngram-simple's always (its defaults draft
        nothing shorter than 12 tokens), the others' where --drafting chose the type (chosen; else
        llama.cpp's defaults); nothing where the build lacks the flags."""
        if rules.spec_type not in NGRAM_DRAFTINGS.values() or (rules.spec_type != "ngram-simple" and not chosen):
            return ()
        settings = ngram_settings(rules.spec_type, size_n, rules)
        return settings if all(flag in self.build.flags.spec_ngram for flag, _ in settings) else ()

    def open_native(self, target: Path, drafter: Path, rules: DraftRules, work_dir: Path,
                    strategy=None, baseline_on_demand: bool = False) -> LlamaServerSession:
        """strategy: --drafting llama-ngram-*, run as that n-gram type at its ngram_max, no drafter
        loaded. baseline_on_demand: LlamaServerSession's."""
        refuse_unfed_head(target, rules.spec_type, f"runtime {self.name}")
        size_n = ngram_simple_size_n(rules.k)
        if strategy is not None:
            rules = ngram_rules(rules, strategy.drafting, strategy.ngram_max, "llama-server")
            spec_type, size_n, drafter = rules.spec_type, strategy.ngram_max, None
            if not self.build.flags.spec_type or \
                    (spec_type != "ngram-cache" and not self._ngram_settings(rules, size_n, chosen=True)):
                raise SettingsError(f"llama-server {self.build.version} cannot set {spec_type}'s sizes "
                                    f"(--spec-{spec_type}-*): --drafting {strategy.drafting} needs them")
        ngram = self._ngram_settings(rules, size_n, chosen=strategy is not None)
        for path in (target, drafter) if drafter is not None else (target,):
            if not Path(path).is_file():
                raise FileNotFoundError(f"model file not found: {path}")
        # The baseline server holds the target, the speculative server target and drafter again.
        gpu = self.options.n_gpu_layers > 0 and self._has_gpu()
        held = ([target], [target] + ([drafter] if drafter is not None else []))
        together = plan_processes(self.name, ("baseline server", "speculative server"), lambda which: check_gguf_fits(
            [path for i in which for path in held[i]], self.options, self.name, gpu=gpu))
        model = ["-m", str(target)]
        speculative = Launcher(self.build.path, tuple(model + self._speculative_args(drafter, rules, ngram)
                                                      + self._common_args()),
                               Path(work_dir) / "llama-server-speculative.log")
        baseline = Launcher(self.build.path, tuple(model + self._common_args()),
                            Path(work_dir) / "llama-server-baseline.log")
        chosen = bool(ngram) or strategy is not None  # the type under crossrt's settings
        notes = ((ngram_note(rules.spec_type, ngram),) if chosen else ()) + self._notes(rules) \
            + (() if together else (ONE_AT_A_TIME,))
        session = LlamaServerSession(speculative, baseline, rules, notes, one_at_a_time=not together,
                                     baseline_on_demand=baseline_on_demand)
        if chosen:
            # What it drafts under crossrt's names, as its driven reproduction records them (docs/ngram.md).
            drafting = next(name for name, kind in NGRAM_DRAFTINGS.items() if kind == rules.spec_type)
            session.fixed_params = (("spec_type", rules.spec_type), ("drafting", drafting), ("ngram_max", size_n))
        return session

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
