"""llama.cpp's own speculative decoding, run through its `llama-speculative-simple` tool
("native" mode), its statistics translated into crossrt's counters.

The tool runs once per generation with debug logging; token ids come from the log, never from
text, and the printed text and prompt tokens are checked against them. --drafting llama-ngram-*
runs the tool's own n-gram types, one prompt per process. The tool has no plain mode, so the
baseline runs in-process through llama-cpp-python at the same llama.cpp commit.
Flags, log lines, checks and faults: docs/llama-cpp-native.md, "Running llama-speculative-simple".
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from functools import partial
from pathlib import Path
from typing import Optional, Sequence

from crossrt.speculative import loop
from crossrt.errors import ModelError, PromptRefused, SettingsError
from crossrt.run.memory import check_gguf_fits
from crossrt.run.processes import die_with_parent
from crossrt.run.runtime import (DraftRules, NativeGeneration, NativeSession, Runtime, RuntimeFailure,
                             HEAD_SPEC_TYPES, RuntimeOptions, RuntimeUnavailable)
from crossrt.speculative.schedules import SPEC_SIMPLE, check_prompt
from crossrt.records.schema import Counters, CountsDoNotAddUp, RuntimeInfo
from crossrt.backends.llama_cpp import LlamaCppRuntime
from crossrt.backends.llama_server_ngram import NGRAM_DRAFTINGS, ngram_note, ngram_rules, ngram_settings
from crossrt.backends.llama_spec_cli_log import TOOL, ToolRun, Vocab, parse_log, step_tokens
from crossrt.backends.llama_tools import BUILD_BIN, find_tool, llama_spec_type, log_tail, probe, refuse_unfed_head
from crossrt.speculative.strategies import Strategy
REPO_TOOL = BUILD_BIN / TOOL
# The tool's logger thread is leaked at exit, so the log's tail (the statistics) is lost in a
# quarter to most of the runs on a busy 2-core machine. scripts/build_llama_tools builds a small
# library, preloaded into the tool, that drains the logger at exit (scripts/llama_log_flush.c:
# 0 of 30 runs lost with it, 21 of 30 without); a tool run without it is rerun before a
# missing statistics block counts as a failure.
LOG_FLUSH_SHIM = REPO_TOOL.parent / "libcrossrt_log_flush.so"
ATTEMPTS = 6
LOG_TAIL_LINES = 30
CHECKPOINT_NOTICE = b"speculative decoding will use checkpoints"
# A stopped or deadlocked tool is noticed as llama-server is (llama_server_process.py): a run
# may take TOOL_BASE_S plus TOOL_S_PER_TOKEN per token of its work (prompt and new tokens), and
# a tool found stopped (SIGSTOP, SIGTSTP) at STOPPED_PROBES probes in a row, PROBE_S apart, is
# hung; either is a RuntimeFailure (the run keeps its finished prompts).
TOOL_BASE_S = 60.0
TOOL_S_PER_TOKEN = 2.0
PROBE_S = 5.0
STOPPED_PROBES = 3

def _is_stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP, SIGTSTP), as /proc tells where there is one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


class LlamaSpecCliSession(NativeSession):
    schedule = SPEC_SIMPLE

    def __init__(self, command: list[str], baseline_runtime: LlamaCppRuntime, target: Path,
                 rules: DraftRules, work_dir: Path, notes: tuple[str, ...], batches: bool = False):
        self._command = command
        self._rules = rules
        self._batches = batches  # an n-gram type: drafts read from the target's batches
        work_dir.mkdir(parents=True, exist_ok=True)
        # Only the latest run's files are kept: enough to read a failure, bounded on disk.
        self._prompt = work_dir / f"{TOOL}.prompt"
        self._out = work_dir / f"{TOOL}.out"
        self._log = work_dir / f"{TOOL}.log"
        try:
            self._baseline = baseline_runtime.load(target)
        except ModelError as error:
            raise RuntimeFailure(str(error)) from None
        self._vocab = Vocab(target)
        self._texts: dict[tuple[int, ...], str] = {}
        self.notes = notes

    def tokenize(self, text: str) -> list[int]:
        ids = self._vocab.tokenize(text)
        self._texts[tuple(ids)] = text
        return ids

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, speculative: bool) -> NativeGeneration:
        if not speculative:
            plain = loop.greedy_generate(self._baseline, prompt_ids, max_new_tokens)
            return NativeGeneration(plain.output_ids, plain.stop_reason, None, plain.prefill_s, plain.decode_s)
        text = self._texts.get(tuple(prompt_ids))
        if text is None:
            raise PromptRefused(f"{TOOL} takes prompt text: pass ids that this session's tokenize() made")
        # The tool's last step can run k tokens past the budget: keep that inside the context.
        check_prompt(prompt_ids, max_new_tokens, [self._baseline], overrun=self._rules.k)
        run = self._run(text, max_new_tokens, len(prompt_ids) + max_new_tokens)
        return self._translate(run, prompt_ids, max_new_tokens)

    def _run(self, text: str, max_new_tokens: int, work_tokens: int) -> ToolRun:
        # A file has no argument-length limit; -f drops one trailing newline, so add one.
        self._prompt.write_bytes(text.encode("utf-8") + b"\n")
        command = self._command + ["-n", str(max_new_tokens), "-f", str(self._prompt)]
        environment = dict(os.environ)
        if LOG_FLUSH_SHIM.is_file():
            environment["LD_PRELOAD"] = " ".join(filter(None, [str(LOG_FLUSH_SHIM), os.environ.get("LD_PRELOAD")]))
        if self._batches:  # the n-gram types log no draft ids: llama.cpp's batch listing has them
            environment["LLAMA_BATCH_DEBUG"] = "1"
        for _ in range(ATTEMPTS):
            with open(self._out, "wb") as out_file, open(self._log, "wb") as log_file:
                code = self._watched(command, out_file, log_file, environment, work_tokens)
            if code != 0:
                raise RuntimeFailure(f"{TOOL} exited with {code}; log {self._log}:\n"
                                     f"{log_tail(self._log, LOG_TAIL_LINES)}")
            log = self._log.read_bytes()
            if CHECKPOINT_NOTICE in log:
                raise RuntimeFailure(f"{TOOL}: this target cannot drop part of a sequence, so the tool "
                                     "verifies through checkpoints, re-running partial drafts; crossrt "
                                     "does not read that path's log")
            run = parse_log(log, self._batches)
            if run is not None:
                return run
        raise RuntimeFailure(f"{TOOL} printed no statistics in {ATTEMPTS} runs; log {self._log}:\n"
                             f"{log_tail(self._log, LOG_TAIL_LINES)}")

    def _watched(self, command: list[str], out_file, log_file, environment: dict, work_tokens: int) -> int:
        """Run the tool to its end and return its exit code; a RuntimeFailure when it runs past
        the time its work may take or stays stopped. The kernel kills it if crossrt dies, and
        crossrt kills it on any error here (Ctrl-C too)."""
        timeout = TOOL_BASE_S + TOOL_S_PER_TOKEN * work_tokens
        process = subprocess.Popen(command, stdout=out_file, stderr=log_file, stdin=subprocess.DEVNULL,
                                   env=environment,
                                   preexec_fn=partial(die_with_parent, os.getpid()))
        deadline = time.monotonic() + timeout
        stopped = 0
        try:
            while True:
                try:
                    return process.wait(timeout=max(0.0, min(PROBE_S, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    pass
                stopped = stopped + 1 if _is_stopped(process.pid) else 0
                if stopped >= STOPPED_PROBES:
                    raise RuntimeFailure(f"{TOOL} (pid {process.pid}, stopped by a signal): still stopped at "
                                         f"{stopped} probes in a row ({PROBE_S:g} s apart): the tool is hung; "
                                         f"log {self._log}")
                if time.monotonic() >= deadline:
                    raise RuntimeFailure(f"{TOOL} (pid {process.pid}) did not end within {timeout:g} s "
                                         f"({work_tokens} tokens of work): the tool is hung; log {self._log}")
        finally:
            if process.poll() is None:
                process.kill()  # SIGKILL ends a stopped process too
                process.wait()

    def _translate(self, run: ToolRun, prompt_ids: Sequence[int], max_new_tokens: int) -> NativeGeneration:
        vocab = self._vocab
        echo = b"\n\n" + vocab.printed(prompt_ids)
        printed = self._out.read_bytes()
        if run.n_prompt != len(prompt_ids):
            raise PromptRefused(f"{TOOL} tokenized the prompt into {run.n_prompt} tokens, crossrt into {len(prompt_ids)}")
        if not printed.startswith(echo):
            raise PromptRefused(f"{TOOL} tokenized the prompt into other pieces than crossrt (same count)")
        produced: list[int] = []
        for step in run.steps:
            produced += step_tokens(step, vocab.eog_ids)
        shown = [t for t in produced if t not in vocab.eog_ids]
        step_drafted = tuple(len(step.draft) for step in run.steps)
        step_accepted = tuple(step.accepted for step in run.steps)
        problems = []
        if not printed[len(echo):].startswith(vocab.printed(shown) + b"\n\n"):
            problems.append("its printed text differs from the tokens read from its log")
        if (sum(step_drafted), sum(step_accepted), len(run.steps) + sum(step_accepted)) != \
                (run.n_drafted, run.n_accept, run.n_predict):
            problems.append(f"its steps do not add up to n_drafted {run.n_drafted}, n_accept {run.n_accept}, "
                            f"n_predict {run.n_predict}")
        if problems:
            raise RuntimeFailure(f"{TOOL} run not understood: {'; '.join(problems)}; log {self._log}")
        output = tuple(produced[:max_new_tokens])
        try:  # the steps sum to the tool's n_drafted and n_accept, checked above
            counters = Counters.from_steps(step_drafted, step_accepted, len(output), self._rules.k,
                                           cut=run.n_predict - len(output))
        except CountsDoNotAddUp as error:
            raise RuntimeFailure(f"{TOOL} run not understood: {error}; log {self._log}") from None
        stop_reason = "eos" if output and output[-1] in vocab.eog_ids else "max_new_tokens"
        return NativeGeneration(output, stop_reason, counters, run.prefill_s, run.decode_s)

    def close(self) -> None:
        if self._vocab is not None:
            self._vocab.close()
            self._baseline.close()
            self._vocab = None


class LlamaSpecCliRuntime(Runtime):
    name = "llama-spec-cli"
    model_format = "gguf"
    modes = ("native",)
    scored_by = "llama-cpp"  # the same llama.cpp commit in-process, for logits
    program = TOOL
    drafting_rules = ("n_min", "p_min")  # passed as the build's own flags (Build.flags)
    # --drafting llama-ngram-*: the tool's own n-gram type at the strategy's ngram_max, no drafter loaded.
    native_draftings = tuple(NGRAM_DRAFTINGS)

    def __init__(self, options: RuntimeOptions):
        super().__init__(options)
        executable = find_tool(TOOL, options.executable)
        if executable is None:
            where = options.executable or f"{REPO_TOOL} or on PATH"
            raise RuntimeUnavailable(f"{TOOL} not found at {where}, or not executable")
        self.executable = executable
        self.build = probe(executable)
        self.flags = self.build.flags
        devices = subprocess.run([str(executable), "--list-devices"], capture_output=True, stdin=subprocess.DEVNULL)
        self._devices = (devices.stdout + devices.stderr).decode("utf-8", errors="replace")

    @classmethod
    def check_available(cls) -> None:
        LlamaCppRuntime.check_available()  # tokenization and the baseline run in-process
        if find_tool(TOOL) is None:
            raise RuntimeUnavailable(f"{TOOL} not found: run scripts/build_llama_tools, or pass "
                                     "--llama-spec with the path of one")

    def info(self) -> RuntimeInfo:
        has_gpu = "(none)" not in self._devices
        return RuntimeInfo(
            name=self.name,
            version=self.build.version,
            build=self.build.commit,
            device="gpu" if has_gpu and self.options.n_gpu_layers > 0 else "cpu",
            threads=self.options.threads,
            gpu_split=self.options.gpu_split,
            kv_cache="f32" if self.options.f32_kv_cache else "f16",
            flash_attn=self.options.flash_attn,
            system_info=self.build.system_info,
        )

    def command(self, target: Path, drafter: Optional[Path], rules: DraftRules,
                ngram: tuple[tuple[str, int], ...] = ()) -> list[str]:
        """Everything but -n and the prompt: greedy, the run options, debug logging; drafter None:
        rules.spec_type, an n-gram type, with its settings ngram and no drafter model."""
        options, flags = self.options, self.flags
        threads = str(options.threads)
        model = ["-md", str(drafter), "-td", threads, "-ngld", str(options.n_gpu_layers)] if drafter is not None else []
        command = [str(self.executable), "-m", str(target), *model,
                   flags.n_max, str(rules.k), flags.n_min, str(rules.n_min), flags.p_min, repr(rules.p_min),
                   # The in-process runtime's batch sizes: the prompt is one batch, 512-token ubatches.
                   "-c", str(options.n_ctx), "-b", str(options.n_ctx), "-ub", str(min(options.n_ctx, 512)),
                   "--temp", "0",
                   "-t", threads, "-tb", threads, "-ngl", str(options.n_gpu_layers), "-lv", "5"]
        if flags.spec_type:
            command += [flags.spec_type, llama_spec_type(rules.spec_type) if drafter is not None else rules.spec_type]
        command += [str(part) for setting in ngram for part in setting]
        if flags.swa_full:  # the in-process runtime's cache shape (backends/llama_tools.py, Flags)
            command.append(flags.swa_full)
        if flags.flash_attn_takes_value:
            command += ["-fa", "on" if options.flash_attn else "off"]
        elif options.flash_attn:
            command += ["-fa"]
        if options.f32_kv_cache:
            command += ["-ctk", "f32", "-ctv", "f32"] + (["-ctkd", "f32", "-ctvd", "f32"] if drafter is not None else [])
        if options.gpu_split:
            command += ["-ts", ",".join(str(share) for share in options.gpu_split)]
        return command

    def open_native(self, target: Path, drafter: Path, rules: DraftRules, work_dir: Path,
                    strategy: Optional[Strategy] = None) -> LlamaSpecCliSession:
        """strategy: --drafting llama-ngram-*, run as that n-gram type at its ngram_max, no drafter loaded."""
        refuse_unfed_head(target, rules.spec_type, f"runtime {self.name}")
        ngram: tuple[tuple[str, int], ...] = ()
        if strategy is None:
            # Draft token ids are read from draft-simple's debug lines; an n-gram type needs --drafting.
            if rules.spec_type.startswith("ngram-"):
                raise SettingsError(f"runtime llama-spec-cli runs spec type {rules.spec_type!r} as --drafting "
                                    f"llama-{rules.spec_type} --ngram-max N (its lookup length)")
            if rules.spec_type not in HEAD_SPEC_TYPES:
                rules.require_drafter_model("runtime llama-spec-cli")
        else:
            rules, ngram = self._ngram(rules, strategy)
        models = (target,) if strategy is not None else (target, drafter)
        for path in models:
            if not Path(path).is_file():
                raise FileNotFoundError(f"model file not found: {path}")
        # The tool holds target (and drafter) while the in-process baseline holds the target.
        check_gguf_fits([*models, target], self.options, self.name, gpu="(none)" not in self._devices)
        baseline_runtime = LlamaCppRuntime(dataclasses.replace(self.options, executable=None))
        # Draft ids: the drafter's candidate lines (draft-simple, EAGLE3 and DFlash log them alike);
        # the n-gram types log none, so theirs come from the target's verification batches.
        batches = strategy is not None
        how = (f"its {rules.spec_type} drafts read from the target's input batches (LLAMA_BATCH_DEBUG=1), as "
               "the type logs no draft ids" if batches else "its debug log's steps")
        notes = [
            f"speculative runs: {self.executable.name} (schedule {SPEC_SIMPLE}); counters from its "
            "n_drafted, n_accept, n_predict (= emitted + cut: its last step overshoots -n) and "
            f"{how}; timings from its encoded/decoded lines, with debug logging on",
            "baseline: plain greedy in-process through llama-cpp-python at the same llama.cpp commit "
            "and options, timed with crossrt's Python loop (the tool has no plain mode)",
        ]
        if strategy is not None:
            notes[:0] = [ngram_note(rules.spec_type, ngram, across=False),
                         "one process per prompt: nothing the type learns carries from one prompt to the next"]
        if self.build.commit is None:
            notes.append(f"{self.executable} does not say its commit: the baseline's commit may differ")
        session = LlamaSpecCliSession(self.command(target, None if strategy is not None else drafter, rules, ngram),
                                      baseline_runtime, Path(target), rules, Path(work_dir), tuple(notes),
                                      batches=batches)
        if strategy is not None:  # what it drafts under crossrt's names, as its driven reproduction records them
            session.fixed_params = (("spec_type", rules.spec_type), ("drafting", strategy.drafting),
                                    ("ngram_max", strategy.ngram_max))
        return session

    def _ngram(self, rules: DraftRules, strategy: Strategy) -> tuple[DraftRules, tuple[tuple[str, int], ...]]:
        """The run's rules under the strategy's n-gram type, and the type's own flags for crossrt's
        settings (llama-server's mapping, backends/llama_server_ngram.py)."""
        rules = ngram_rules(rules, strategy.drafting, strategy.ngram_max, TOOL)
        spec_type = rules.spec_type
        ngram = ngram_settings(spec_type, strategy.ngram_max, rules)
        if not self.flags.spec_type or any(flag not in self.flags.spec_ngram for flag, _ in ngram):
            raise SettingsError(f"{TOOL} {self.build.version} cannot set {spec_type}'s sizes "
                                f"(--spec-{spec_type}-*): --drafting {strategy.drafting} needs them")
        return rules, ngram
