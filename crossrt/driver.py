"""Runs a pair over prompts on one runtime: baseline, speculative run, a record written
after every prompt (so an interrupted run keeps what finished), and resume.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from crossrt import loop
from crossrt.pairs import ROLES, Pair, pair_info
from crossrt.prompts import Prompt
from crossrt.runtime import (DraftRules, ModelSession, NativeSession, Runtime, RuntimeOptions,
                             RuntimeUnavailable, open_runtime)
from crossrt.schema import (Counters, PromptResult, RecordError, RunParams, RunRecord, Timings,
                            accepted_per_position, load_record, save_record)


@dataclass(frozen=True)
class RunRequest:
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


def _prompt_ids(tokenize: Callable[[str], list[int]], prompt: Prompt,
                shared: Optional[Sequence[int]]) -> tuple[tuple[int, ...], Optional[tuple[int, ...]]]:
    """(ids to run, the runtime's own ids where they differ from the shared ones)."""
    own = tuple(tokenize(prompt.text))
    if shared is None:
        return own, None
    return tuple(shared), (own if own != tuple(shared) else None)


def run_prompt(target: ModelSession, drafter: ModelSession, prompt: Prompt, rules: DraftRules,
               max_new_tokens: int, schedule: str = loop.SCHEDULE,
               shared_ids: Optional[Sequence[int]] = None) -> PromptResult:
    """Baseline then speculative run of one prompt; a prompt that cannot run (too long for
    the context, a decode error) becomes a failed result with the reason."""
    prompt_ids: tuple[int, ...] = ()
    try:
        prompt_ids, own_ids = _prompt_ids(target.tokenize, prompt, shared_ids)
        baseline = loop.greedy_generate(target, prompt_ids, max_new_tokens)
        speculative = loop.speculative_generate(target, drafter, prompt_ids, rules, max_new_tokens, schedule)
    except (ValueError, RuntimeError) as error:
        return PromptResult.failed(prompt.id, prompt.category, str(error), prompt_ids)
    step_accepted = speculative.step_accepted
    counters = Counters(
        steps=len(step_accepted),
        drafted=sum(speculative.step_drafted),
        accepted=sum(step_accepted),
        emitted=len(speculative.output_ids),
        accepted_per_pos=accepted_per_position(step_accepted, rules.k),
        step_drafted=speculative.step_drafted,
        step_accepted=step_accepted,
        unverified=speculative.unverified,
        cut=speculative.cut,
    )
    timings = Timings(speculative.prefill_s, speculative.decode_s, baseline.prefill_s, baseline.decode_s)
    return PromptResult(prompt.id, prompt.category, "ok", None, prompt_ids, speculative.output_ids,
                        baseline.output_ids, speculative.stop_reason, counters, timings, own_ids)


def run_prompt_native(session: NativeSession, prompt: Prompt, max_new_tokens: int,
                      shared_ids: Optional[Sequence[int]] = None) -> PromptResult:
    """The runtime's own plain and speculative generation of one prompt. A prompt that cannot
    run becomes a failed result; a runtime that breaks (RuntimeFailure) ends the run."""
    prompt_ids: tuple[int, ...] = ()
    try:
        prompt_ids, own_ids = _prompt_ids(session.tokenize, prompt, shared_ids)
        baseline = session.generate(prompt_ids, max_new_tokens, speculative=False)
        speculative = session.generate(prompt_ids, max_new_tokens, speculative=True)
    except ValueError as error:
        return PromptResult.failed(prompt.id, prompt.category, str(error), prompt_ids)
    timings = Timings(speculative.prefill_s, speculative.decode_s, baseline.prefill_s, baseline.decode_s)
    return PromptResult(prompt.id, prompt.category, "ok", None, prompt_ids, speculative.output_ids,
                        baseline.output_ids, speculative.stop_reason, speculative.counters, timings, own_ids)


def _starting_record(request: RunRequest, fresh: RunRecord) -> RunRecord:
    """The record to continue: the fresh one, or with --resume the matching one on disk."""
    if not request.out.exists() or request.overwrite:
        return fresh
    if not request.resume:
        raise RecordError(f"{request.out} exists: pass --resume to continue it or --overwrite to replace it")
    previous = load_record(request.out)
    for name, before, now in (("runtime", previous.runtime, fresh.runtime),
                              ("parameters", previous.params, fresh.params),
                              ("target", previous.pair.target.sha256, fresh.pair.target.sha256),
                              ("drafter", previous.pair.drafter.sha256, fresh.pair.drafter.sha256)):
        if before != now:
            raise RecordError(f"cannot resume {request.out}: its {name} differ ({before} vs {now})")
    # Failed prompts are tried again; finished ones are kept.
    return RunRecord(previous.runtime, previous.pair, previous.params,
                     tuple(r for r in previous.results if r.ok), notes=previous.notes)


def _prompt_runner(runtime: Runtime, request: RunRequest, stack: contextlib.ExitStack):
    """A function running one prompt in the requested mode, and the schedule it follows."""
    if request.mode not in runtime.modes:
        raise RuntimeUnavailable(f"runtime {runtime.name!r} has no {request.mode} mode "
                                 f"(it has: {', '.join(runtime.modes)})")
    paths = {role: request.pair.path(role, runtime.model_format) for role in ROLES}

    def shared(prompt: Prompt) -> Optional[tuple[int, ...]]:
        return (request.shared_prompt_ids or {}).get(prompt.id)

    if request.mode == "native":
        work_dir = request.out.with_name(request.out.stem + ".logs")
        session = runtime.open_native(paths["target"], paths["drafter"], request.rules, work_dir)
        stack.callback(session.close)
        return (lambda prompt: run_prompt_native(session, prompt, request.max_new_tokens, shared(prompt))), session
    target, drafter = runtime.load(paths["target"]), runtime.load(paths["drafter"])
    return (lambda prompt: run_prompt(target, drafter, prompt, request.rules, request.max_new_tokens,
                                      request.schedule, shared(prompt))), None


def run_pair(request: RunRequest, prompts: Sequence[Prompt],
             on_prompt: Optional[Callable[[Prompt, Optional[PromptResult]], None]] = None) -> RunRecord:
    """Run every prompt not already finished in the record at request.out.

    on_prompt(prompt, result) is called once per prompt, with None for a prompt skipped
    because the resumed record already holds it. The record is saved after every prompt,
    so what finished survives an error or Ctrl-C in the middle of the run.
    """
    runtime = open_runtime(request.runtime, request.options)
    info = pair_info(request.pair, runtime.model_format)
    with contextlib.ExitStack() as stack:
        run_one, native = _prompt_runner(runtime, request, stack)
        params = RunParams(k=request.rules.k, greedy=True, max_new_tokens=request.max_new_tokens,
                           mode=request.mode, spec_type="draft",
                           schedule=native.schedule if native else request.schedule, n_ctx=request.options.n_ctx,
                           draft_n_min=request.rules.n_min, draft_p_min=request.rules.p_min)
        fresh = RunRecord(runtime.info(), info, params, notes=native.notes if native else ())
        record = _starting_record(request, fresh)
        done = {r.prompt_id for r in record.results}
        save_record(record, request.out)
        for prompt in prompts:
            result = None
            if prompt.id not in done:
                result = run_one(prompt)
                record = record.with_result(result)
                save_record(record, request.out)
            if on_prompt is not None:
                on_prompt(prompt, result)
    return record
