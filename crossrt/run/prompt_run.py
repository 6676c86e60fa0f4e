"""One prompt's run on a loaded runtime: its ids, its plain greedy baseline (decoded, or from the
run's store) and its speculative run, driven (crossrt's loop over the runtime's sessions) or
native (the runtime's own generation); a prompt that cannot run becomes a failed result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from crossrt.errors import PromptRefused
from crossrt.inputs.prompts import Prompt, refuse_non_unicode
from crossrt.records.schema import PromptResult, Timings
from crossrt.records.trace import TraceRecorder
from crossrt.run.baselines import RunBaselines
from crossrt.run.runtime import DraftRules, ModelSession, NativeSession
from crossrt.speculative import loop
from crossrt.speculative.drafters import Drafter
from crossrt.speculative.schedules import first_from_prompt
from crossrt.speculative.strategies import Strategy


def baseline_for(baselines: Optional[RunBaselines], prompt_ids: tuple[int, ...], max_new_tokens: int,
                 whole_prompt: bool, decode: Callable[[], object]):
    """(the prompt's baseline, its BaselineSource): decoded, or from the run's store."""
    if baselines is None:  # a caller outside run_pair: decoded, and no source to name
        return decode(), None
    return baselines.get(prompt_ids, max_new_tokens, whole_prompt, decode)


def prompt_ids_of(tokenize: Callable[[str], list[int]], prompt: Prompt,
                  shared: Optional[Sequence[int]]) -> tuple[tuple[int, ...], Optional[tuple[int, ...]]]:
    """(ids to run, the runtime's own ids where they differ from the shared ones)."""
    refuse_non_unicode(prompt.text)
    own = tuple(tokenize(prompt.text))
    if shared is None:
        return own, None
    return tuple(shared), (own if own != tuple(shared) else None)


def run_prompt(target: ModelSession, drafter: Optional[ModelSession], prompt: Prompt, rules: DraftRules,
               max_new_tokens: int, schedule: str = loop.SCHEDULE,
               shared_ids: Optional[Sequence[int]] = None, trace: Optional[TraceRecorder] = None,
               baselines: Optional[RunBaselines] = None, strategy: Strategy = Strategy(),
               tree_target: Optional[ModelSession] = None, lookup: Optional[Drafter] = None) -> PromptResult:
    """Baseline then speculative run of one prompt; a prompt that cannot run (too long for
    the context, a decode error) becomes a failed result with the reason. trace, when given,
    records the speculative run; baselines, when given, holds the baseline decoded once;
    strategy: how the run drafts, sizes and accepts drafts (tree drafting verifies on
    tree_target, the target's tree session; prompt lookup needs no drafter; lookup: the run's
    lookup drafter where its state outlives a prompt, loop.run_lookup)."""
    prompt_ids: tuple[int, ...] = ()
    try:
        prompt_ids, own_ids = prompt_ids_of(target.tokenize, prompt, shared_ids)
        whole_prompt = first_from_prompt(schedule)  # their runtimes' baselines sample the first token so too
        baseline, source = baseline_for(baselines, prompt_ids, max_new_tokens, whole_prompt, lambda: loop.greedy_generate(
            target, prompt_ids, max_new_tokens, whole_prompt=whole_prompt))
        speculative = loop.speculative_generate(tree_target or target, drafter, prompt_ids, rules, max_new_tokens,
                                                schedule, trace, strategy, drafts=lookup)
    except PromptRefused as error:
        return PromptResult.failed(prompt.id, prompt.category, str(error), prompt_ids)
    # crossrt's own loop: counts that did not add up would be a bug, so they are not caught here.
    counters = speculative.counters(loop.draft_bound(strategy, rules.k))
    timings = Timings(speculative.prefill_s, speculative.decode_s, baseline.prefill_s, baseline.decode_s)
    return PromptResult(prompt.id, prompt.category, "ok", None, prompt_ids, speculative.output_ids,
                        baseline.output_ids, speculative.stop_reason, counters, timings, own_ids,
                        output_view=speculative.view, baseline_view=baseline.view, baseline_source=source,
                        lossy=strategy.lossy)



@dataclass(frozen=True)
class NativeBaseline:
    """One prompt's ids and plain greedy baseline on a native session, or why it was refused."""

    prompt_ids: tuple[int, ...]
    own_ids: Optional[tuple[int, ...]] = None
    baseline: Any = None  # (Baseline or NativeGeneration, its BaselineSource)
    refused: Optional[str] = None


def native_baseline(session: NativeSession, prompt: Prompt, max_new_tokens: int,
                    shared_ids: Optional[Sequence[int]] = None,
                    baselines: Optional[RunBaselines] = None) -> NativeBaseline:
    prompt_ids: tuple[int, ...] = ()
    try:
        prompt_ids, own_ids = prompt_ids_of(session.tokenize, prompt, shared_ids)
        return NativeBaseline(prompt_ids, own_ids, baseline_for(
            baselines, prompt_ids, max_new_tokens, False,
            lambda: session.generate(prompt_ids, max_new_tokens, speculative=False)))
    except PromptRefused as error:
        return NativeBaseline(prompt_ids, refused=str(error))


def run_prompt_native(session: NativeSession, prompt: Prompt, max_new_tokens: int, k: int,
                      shared_ids: Optional[Sequence[int]] = None,
                      baselines: Optional[RunBaselines] = None, first: Optional[NativeBaseline] = None) -> PromptResult:
    """The runtime's own plain and speculative generation of one prompt (first: its baseline,
    decoded before, where the session runs one process at a time). A prompt that cannot run
    becomes a failed result; a runtime that breaks (RuntimeFailure) ends the run."""
    first = first or native_baseline(session, prompt, max_new_tokens, shared_ids, baselines)
    prompt_ids, own_ids = first.prompt_ids, first.own_ids
    try:
        if first.refused is not None:
            raise PromptRefused(first.refused)
        baseline, source = first.baseline
        speculative = session.generate(prompt_ids, max_new_tokens, speculative=True)
    except PromptRefused as error:
        return PromptResult.failed(prompt.id, prompt.category, str(error), prompt_ids)
    problems = speculative.counters.identity_violations(k)
    if problems:  # kept as a failed prompt with the runtime's own numbers; the run goes on
        raw = speculative.unfit_counts.raw if speculative.unfit_counts else {}
        return PromptResult.failed(prompt.id, prompt.category, "the runtime's counts break crossrt's identities: "
                                   + "; ".join(problems) + (f" (raw: {raw})" if raw else ""), prompt_ids)
    timings = Timings(speculative.prefill_s, speculative.decode_s, baseline.prefill_s, baseline.decode_s)
    return PromptResult(prompt.id, prompt.category, "ok", None, prompt_ids, speculative.output_ids,
                        baseline.output_ids, speculative.stop_reason, speculative.counters, timings, own_ids,
                        unfit_counts=speculative.unfit_counts, baseline_source=source)
