"""Runs a pair over prompts on one runtime: baseline, speculative run, a record written
after every prompt (so an interrupted run keeps what finished), and resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from crossrt import loop
from crossrt.pairs import ROLES, Pair, pair_info
from crossrt.prompts import Prompt
from crossrt.runtime import ModelSession, RuntimeOptions, open_runtime
from crossrt.schema import (Counters, PromptResult, RecordError, RunParams, RunRecord, Timings,
                            accepted_per_position, load_record, save_record)


@dataclass(frozen=True)
class RunRequest:
    pair: Pair
    runtime: str
    options: RuntimeOptions
    k: int
    max_new_tokens: int
    out: Path
    resume: bool = False
    overwrite: bool = False


def run_prompt(target: ModelSession, drafter: ModelSession, prompt: Prompt, k: int,
               max_new_tokens: int) -> PromptResult:
    """Baseline then speculative run of one prompt; a prompt that cannot run (too long for
    the context, a decode error) becomes a failed result with the reason."""
    prompt_ids: list[int] = []
    try:
        prompt_ids = target.tokenize(prompt.text)
        baseline = loop.greedy_generate(target, prompt_ids, max_new_tokens)
        speculative = loop.speculative_generate(target, drafter, prompt_ids, k, max_new_tokens)
    except (ValueError, RuntimeError) as error:
        return PromptResult.failed(prompt.id, prompt.category, str(error), prompt_ids)
    step_accepted = speculative.step_accepted
    counters = Counters(
        steps=len(step_accepted),
        drafted=sum(speculative.step_drafted),
        accepted=sum(step_accepted),
        emitted=len(speculative.output_ids),
        accepted_per_pos=accepted_per_position(step_accepted, k),
        step_drafted=speculative.step_drafted,
        step_accepted=step_accepted,
    )
    timings = Timings(speculative.prefill_s, speculative.decode_s, baseline.prefill_s, baseline.decode_s)
    return PromptResult(prompt.id, prompt.category, "ok", None, tuple(prompt_ids), speculative.output_ids,
                        baseline.output_ids, speculative.stop_reason, counters, timings)


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


def run_pair(request: RunRequest, prompts: Sequence[Prompt],
             on_prompt: Optional[Callable[[Prompt, Optional[PromptResult]], None]] = None) -> RunRecord:
    """Run every prompt not already finished in the record at request.out.

    on_prompt(prompt, result) is called once per prompt, with None for a prompt skipped
    because the resumed record already holds it.
    """
    runtime = open_runtime(request.runtime, request.options)
    info = pair_info(request.pair, runtime.model_format)
    params = RunParams(k=request.k, greedy=True, max_new_tokens=request.max_new_tokens, mode="driven",
                       spec_type="draft", schedule=loop.SCHEDULE, n_ctx=request.options.n_ctx)
    record = _starting_record(request, RunRecord(runtime.info(), info, params))
    done = {r.prompt_id for r in record.results}
    sessions = {role: runtime.load(request.pair.path(role, runtime.model_format)) for role in ROLES}
    save_record(record, request.out)
    for prompt in prompts:
        if prompt.id in done:
            result = None
        else:
            result = run_prompt(sessions["target"], sessions["drafter"], prompt, request.k, request.max_new_tokens)
            record = record.with_result(result)
            save_record(record, request.out)
        if on_prompt is not None:
            on_prompt(prompt, result)
    return record
