"""Runs a pair over prompts on one runtime: baseline, speculative run, every finished prompt
kept on disk at once (crossrt/run/run_writer.py: so an interrupted run keeps what finished), and
resume. With RunRequest.trace, driven runs also keep per-token traces beside the record
(crossrt/records/trace.py), kept with it after every prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from crossrt.speculative import loop
from crossrt.run.baselines import BaselineStore, RunBaselines, run_key
from crossrt.speculative.head_drafter import load_head
from crossrt.speculative.lookup import LOOKUPS
from crossrt.inputs.chat_template import ChatRendering, with_template_ids
from crossrt.errors import PromptRefused, SettingsError
from crossrt.records.journal import storage_error
from crossrt.inputs.pairs import ROLES, Pair, pair_info
from crossrt.inputs.prompts import Prompt
from crossrt.run.memory import loading
from crossrt.run.prompt_run import NativeBaseline, native_baseline, prompt_ids_of, run_prompt, run_prompt_native
from crossrt.run.resume import check_prompts, check_writable, prompt_sha256, starting_record
from crossrt.run.run_writer import RunWriter, record_lock
from crossrt.run.runtime import (HEAD_SPEC_TYPES, DraftRules, ModelSession, Runtime, RuntimeOptions,
                             RuntimeUnavailable, open_runtime)
from crossrt.speculative.strategies import STRATEGY_PARTS, Strategy, format_content_k, tree_spec
from crossrt.records.schema import ModelInfo, PairInfo, PromptFormat, PromptResult, RunParams, RunRecord
from crossrt.records.trace import PromptTrace, TraceRecorder, read_traces, trace_path


@dataclass(frozen=True)
class RunRequest:
    """One run of a pair, as run_pair takes it: the pair on a runtime with its options, the draft
    rules and (driven) the strategy and schedule, the token budget per prompt, the record it
    writes (`out`, resumed or overwritten), and what it shares with other runs (a comparison's
    prompt ids, the chat rendering, the baseline store, the loading lock). Build it with
    keywords: most fields have defaults, and positions past the first few are easy to shift."""

    pair: Pair
    runtime: str
    options: RuntimeOptions
    rules: DraftRules
    max_new_tokens: int
    out: Path
    mode: str = "driven"
    schedule: str = loop.SCHEDULE  # driven mode only: native runs follow the runtime's own
    resume: bool = False
    overwrite: bool = False
    # Prompt id -> token ids shared by every runtime of a comparison; each runtime's own
    # tokenization is still made and recorded where it differs.
    shared_prompt_ids: Optional[Mapping[str, tuple[int, ...]]] = None
    # The chat template the prompts were rendered with (crossrt/inputs/chat_template.py): a runtime that
    # renders templates itself renders each templated prompt too, for template parity.
    chat: Optional[ChatRendering] = None
    prompt_format: Optional[PromptFormat] = None  # kept in the record
    # Record per-token traces (driven mode, crossrt and hf-assisted schedules) in
    # <out stem>.trace.npz beside the record.
    trace: bool = False
    # The baseline store (crossrt/run/baselines.py): None decodes every baseline and keeps none; the
    # record names each baseline's source either way.
    baselines: Optional[BaselineStore] = None
    # driven mode only: drafting, k policy, acceptance (crossrt/speculative/strategies.py)
    strategy: Strategy = Strategy()
    # Runs started at once (parity --jobs) share this lock file, held from each one's memory check
    # until its models are loaded (crossrt.run.memory.loading); None: no lock.
    loading_lock: Optional[Path] = None
    # Times each prompt runs, baseline then speculative, interleaved; the first run is the one
    # recorded, the others add their timings (PromptResult.repeats) and must emit the same ids.
    repeat: int = 1


def strategy_params(strategy: Strategy) -> dict:
    """The strategy's RunParams fields, each parameter only where its part applies."""
    return dict(
        drafting=strategy.drafting, tree=strategy.tree,
        ngram_max=strategy.ngram_max if strategy.looks_up else None,
        ngram_min=strategy.ngram_min if strategy.drafting in STRATEGY_PARTS["ngram_min"][1] else None,
        k_policy=strategy.k_policy,
        content_k=format_content_k(strategy.content_k) if strategy.content_k else None,
        k_max=strategy.k_max if strategy.k_policy == "online" else None,
        min_p1=strategy.min_p1 if strategy.k_policy == "confidence" else None,
        acceptance=strategy.acceptance,
        top_m=strategy.top_m if strategy.acceptance == "relaxed" else None,
        delta=strategy.delta if strategy.acceptance == "relaxed" else None,
        lossy=strategy.lossy)


def _runs_natively(runtime: Runtime, strategy: Strategy) -> bool:
    """The runtime's native mode runs strategy's drafting as its own, at fixed k, greedy."""
    return (strategy.drafting in runtime.native_draftings and strategy.k_policy == "fixed"
            and strategy.acceptance == "greedy")


def _tree_session(runtime: Runtime, request: RunRequest, path: Path, stack: contextlib.ExitStack) -> ModelSession:
    """The target's tree session, for tree drafting (Runtime.load_tree: runtimes without one refuse)."""
    leaves = len(tree_spec(request.strategy.tree).leaves())
    return stack.enter_context(runtime.load_tree(path, leaves))


def _starting_traces(request: RunRequest, record: RunRecord) -> dict[str, PromptTrace]:
    """The traces a traced run continues: those of the record's finished prompts, if any."""
    path = request.out.parent / record.trace if record.trace else None
    if not request.trace or path is None or not path.is_file():
        return {}
    kept = {r.prompt_id for r in record.results}
    return {i: trace for i, trace in read_traces(path).items() if i in kept}


class LoadedModels:
    """Driven-mode sessions kept loaded from one run to the next (a sweep actor's cells of one
    runtime and pair): keyed by runtime, options and model path, and closed by close(), not by
    the run. Sessions start every prompt from an empty cache, so a kept one runs as a fresh one."""

    def __init__(self):
        self._sessions: dict[tuple, ModelSession] = {}

    def load(self, runtime: Runtime, path: Path) -> ModelSession:
        key = (runtime.name, runtime.options, Path(path).resolve())
        if key not in self._sessions:
            self._sessions[key] = runtime.load(path)
        return self._sessions[key]

    def __len__(self) -> int:
        return len(self._sessions)

    def close(self) -> None:
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()


def _prompt_runner(runtime: Runtime, request: RunRequest, stack: contextlib.ExitStack,
                   models: Optional[LoadedModels] = None):
    """A function running one prompt (and filling a trace recorder) in the requested mode,
    the native session when the mode is native, the session that tokenizes prompts (and
    renders chat templates, where the runtime does), and what runs before the prompts (native
    mode: every baseline first, where the session runs one process at a time) or None."""
    if request.mode not in runtime.modes:
        raise RuntimeUnavailable(f"runtime {runtime.name!r} has no {request.mode} mode "
                                 f"(it has: {', '.join(runtime.modes)})")
    if request.trace and (request.mode != "driven" or request.schedule not in loop.TRACED_SCHEDULES):
        raise SettingsError(f"traces are recorded in driven mode with the {' or '.join(loop.TRACED_SCHEDULES)} "
                         "schedule")
    native_strategy = request.mode == "native" and not request.strategy.is_default
    if native_strategy and not _runs_natively(runtime, request.strategy):
        raise SettingsError(f"a native run follows the runtime's own drafting, not {request.strategy.label()}: "
                            "strategies run in driven mode"
                            + (f" (runtime {runtime.name} runs --drafting {' or '.join(runtime.native_draftings)} "
                               "natively, at fixed k, greedy)" if runtime.native_draftings else ""))
    paths = {role: request.pair.path(role, runtime.model_format) for role in ROLES}

    def shared(prompt: Prompt) -> Optional[tuple[int, ...]]:
        return (request.shared_prompt_ids or {}).get(prompt.id)

    if request.mode == "native":
        work_dir = request.out.with_name(request.out.stem + ".logs")
        try:  # here, so a runtime's own logs meet a read-only or full disk as the record does
            work_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise storage_error(work_dir, error) from None
        with loading(request.loading_lock):
            # Only a runtime with native_draftings takes a strategy; the others' signature stays.
            # Where baselines may be stored, one that can starts its baseline's process only once
            # one is missing (baselines_first), not beside the speculative one.
            on_demand = runtime.baseline_on_demand and request.baselines is not None and request.repeat == 1
            given = {**({"strategy": request.strategy} if native_strategy else {}),
                     **({"baseline_on_demand": True} if on_demand else {})}
            session = stack.enter_context(runtime.open_native(paths["target"], paths["drafter"], request.rules,
                                                              work_dir, **given))
        firsts: dict[str, NativeBaseline] = {}

        def run_native(prompt: Prompt, _, baselines: Optional[RunBaselines]) -> PromptResult:
            return run_prompt_native(session, prompt, request.max_new_tokens, request.rules.k, shared(prompt),
                                     baselines, firsts.pop(prompt.id, None))

        def baselines_first(todo: Sequence[Prompt], baselines: RunBaselines) -> None:
            """Where the session runs one process at a time, every baseline before the first
            speculative run, so its processes start once each (NativeSession.one_at_a_time);
            where it starts its baseline's on demand, that process if a baseline is missing,
            holding the loading lock as its first models were loaded."""
            if session.one_at_a_time:
                firsts.update((p.id, native_baseline(session, p, request.max_new_tokens, shared(p), baselines))
                              for p in todo)
            elif on_demand and any(not stored(p, baselines) for p in todo):
                with loading(request.loading_lock):
                    session.start_baseline()

        def stored(prompt: Prompt, baselines: RunBaselines) -> bool:
            try:
                ids, _ = prompt_ids_of(session.tokenize, prompt, shared(prompt))
            except PromptRefused:  # refused again, and recorded, when it runs
                return True
            return baselines.stored(ids, request.max_new_tokens, False)

        _refuse_repeats(request, session.one_at_a_time)
        return run_native, session, session, baselines_first
    strategy = request.strategy
    loop.check_strategy(strategy, request.schedule, request.rules, request.trace)  # before any loading
    lookup = strategy.looks_up
    with loading(request.loading_lock):
        if models is not None:
            target = models.load(runtime, paths["target"])
        else:
            target = stack.enter_context(runtime.load(paths["target"]))
        if request.rules.spec_type in HEAD_SPEC_TYPES:  # a head drafting from the target's hidden states
            # Its torch weights are the speculators folder's, whatever format the runtime loads the target in.
            drafter = load_head(request.rules.spec_type, request.pair.path("drafter", "hf"), target,
                                request.options.f32_kv_cache)
        elif lookup:
            drafter = None
        else:
            drafter = models.load(runtime, paths["drafter"]) if models is not None \
                else stack.enter_context(runtime.load(paths["drafter"]))
        tree_target = _tree_session(runtime, request, paths["target"], stack) if strategy.drafting == "tree" else None
    kept = loop.run_lookup(strategy, request.rules, request.schedule, target.eog_ids)  # as one server's, in order
    _refuse_repeats(request, kept is None)
    return (lambda prompt, trace, baselines: run_prompt(target, drafter, prompt, request.rules,
                                                        request.max_new_tokens, request.schedule, shared(prompt),
                                                        trace, baselines, strategy, tree_target, kept)), None, target, None


def _refuse_repeats(request: RunRequest, fresh_per_prompt: bool) -> None:
    """A repeated prompt drafts as its first run did only where no drafter state outlives a prompt."""
    lookup = LOOKUPS.get(request.strategy.drafting)
    if request.repeat > 1 and lookup is not None and lookup.per_run and not fresh_per_prompt:
        raise SettingsError(f"--repeat {request.repeat} runs each prompt again, and {lookup.name}'s state lasts "
                            f"across prompts on {request.runtime}: a repetition would draft from what the first "
                            "left; time it without --repeat")


def repeated(result: PromptResult, again: Sequence[PromptResult]) -> PromptResult:
    """result with every repetition's timings (PromptResult.repeats), or failed where a repetition
    emitted other tokens or failed: its timings are not of the same work."""
    if not again or not result.ok:
        return result
    for number, other in enumerate(again, start=2):
        if not other.ok or other.output_ids != result.output_ids or other.counters != result.counters:
            why = other.error if not other.ok else "other tokens or counts than the first (a nondeterministic runtime)"
            return dataclasses.replace(result, status="failed", error=f"--repeat: run {number} of this prompt: {why}")
    return dataclasses.replace(result, repeats=(result.timings, *(other.timings for other in again)))


def _with_loaded(info: PairInfo, runtime: Runtime, drafter_read: bool) -> PairInfo:
    """info naming what the runtime read for each model (ModelInfo.loaded), once they are in;
    a prompt-lookup run reads no drafter."""
    def loaded(model: ModelInfo, read: bool) -> ModelInfo:
        return dataclasses.replace(model, loaded=runtime.loaded_files(Path(model.path)) if read else ())

    return dataclasses.replace(info, target=loaded(info.target, True), drafter=loaded(info.drafter, drafter_read))


def run_pair(request: RunRequest, prompts: Sequence[Prompt],
             on_prompt: Optional[Callable[[Prompt, Optional[PromptResult]], None]] = None,
             models: Optional[LoadedModels] = None) -> RunRecord:
    """Run every prompt not already finished in the record at request.out.

    on_prompt(prompt, result) is called once per prompt, with None for a prompt skipped
    because the resumed record already holds it. Every finished prompt is kept on disk at
    once (appended to the record's journal), so what finished survives an error, Ctrl-C or a
    kill in the middle of the run; with request.trace, its trace is kept just before it (a
    resumed run without request.trace keeps the traces it has and traces no new prompt).
    models, when given, holds the driven sessions beyond this run (LoadedModels).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(record_lock(request.out))  # first: a second writer is refused before any loading
        check_writable(request.out, request.resume, request.overwrite)
        runtime = open_runtime(request.runtime, request.options)
        # A driven head run reads the head's speculators folder, whatever the target's format.
        head_driven = request.mode == "driven" and request.rules.spec_type in HEAD_SPEC_TYPES
        info = pair_info(request.pair, runtime.model_format, "hf" if head_driven else None)
        run_one, native, prompt_session, before_prompts = _prompt_runner(runtime, request, stack, models)
        info = _with_loaded(info, runtime, drafter_read=not request.strategy.looks_up)
        driven = native is None
        # k: the most a step drafts (a k policy's largest, a tree's nodes), which the counters are checked against.
        params = RunParams(k=loop.draft_bound(request.strategy, request.rules.k) if driven else request.rules.k,
                           greedy=True, max_new_tokens=request.max_new_tokens,
                           mode=request.mode, spec_type=request.rules.spec_type,
                           schedule=request.schedule if driven else native.schedule, n_ctx=request.options.n_ctx,
                           draft_n_min=request.rules.n_min, draft_p_min=request.rules.p_min, repeat=request.repeat,
                           **(strategy_params(request.strategy) if driven or not request.strategy.is_default
                              else {}))
        if native is not None:  # what the runtime fixes itself (an attached server's settings)
            params = dataclasses.replace(params, **dict(native.fixed_params))
        runtime_info = runtime.info()
        fresh = RunRecord(runtime_info, info, params, notes=native.notes if native else ())
        # Repeated prompts time their baselines beside them, never from the store (timed at another moment).
        store = request.baselines if request.repeat == 1 else None
        baselines = RunBaselines(store, run_key(runtime_info, request.options, info.target.sha256, request.mode))
        record = check_prompts(request.out, starting_record(request.out, fresh, request.resume, request.overwrite),
                               prompts, prompt_session.tokenize)
        # How this run feeds its prompts; a resumed one whose rendering changed was refused by digest.
        record = dataclasses.replace(record, prompt_format=request.prompt_format)
        traces = _starting_traces(request, record)
        if request.trace:
            record = dataclasses.replace(record, trace=trace_path(request.out).name)
        done = {r.prompt_id for r in record.results}
        resumed = request.out.exists() and not request.overwrite  # starting_record refused anything else
        writer = RunWriter(record, request.out, traces if request.trace else None, continues=resumed)
        try:
            if before_prompts is not None:
                before_prompts([prompt for prompt in prompts if prompt.id not in done], baselines)
            for prompt in prompts:
                result = None
                if prompt.id not in done:
                    recorder = TraceRecorder() if request.trace else None
                    first = run_one(prompt, recorder, baselines)
                    again = [run_one(prompt, None, baselines) for _ in range(request.repeat - 1)] if first.ok else []
                    result = dataclasses.replace(repeated(first, again), prompt_sha256=prompt_sha256(prompt))
                    result = with_template_ids(result, prompt_session, prompt, request.chat)
                    writer.add(result, recorder.finish() if recorder is not None and result.ok else None)
                if on_prompt is not None:
                    on_prompt(prompt, result)
        finally:  # fold the journals in, after an error or Ctrl-C too: the record is whole on disk
            record = writer.close()
    return record
