"""crossrt's shared greedy speculative loop ("driven" mode) and the plain greedy baseline.

Pure logic over the ModelSession contract, identical whatever the runtime. The schedule
("crossrt"):
- Both models prefill prompt[:-1]; the last prompt token is the first token to verify, so
  drafting starts at once and every emitted token comes out of a verification step. Hence
  emitted = steps + accepted exactly.
- Each step drafts min(k, budget_left - 1) tokens greedily (the drafter's argmax), so a step
  never produces tokens past max_new_tokens; with one token of budget left the step verifies
  an empty draft (a plain decode, still counted as a step with 0 drafted).
- The target scores [last] + draft in one batch; the longest prefix where its argmax equals
  the draft is accepted, and its own next token is added (the bonus). An accepted EOS ends
  acceptance: the EOS is then the step's own token, and generation stops.
- Both caches roll back to what was kept. The drafter never decodes its own last draft
  token, which it would only need if every draft token were accepted.
Given a TraceRecorder, the crossrt and hf-assisted schedules also record the run's per-token
trace from the rows they compute anyway (crossrt/records/trace.py).
The baseline prefills the same prompt[:-1] and decodes one token at a time, so both runs do
the same prefill and their decode timings compare like for like; under the "llama-server"
schedule it takes its first token from a pass over the whole prompt, as llama-server does.

The other schedules mirror llama.cpp's own tools ("llama-spec-simple", "llama-server"), with
its drafting rules (n_min, p_min): crossrt/run/schedules.py.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from crossrt.errors import SettingsError
from crossrt.run.runtime import DraftRules, ModelSession, Rows
from crossrt.run.numerics import choose
from crossrt.run.schedules import LLAMA_SCHEDULES, Generation, ViewRecorder, check_prompt, prefill_pair
from crossrt.records.trace import TraceRecorder

SCHEDULE = "crossrt"
# transformers' assisted generation: crossrt's schedule, except that the drafter, running its
# own generate() with the target's EOS ids, ends a draft at its first EOS (EOS kept).
HF_SCHEDULE = "hf-assisted"
SCHEDULES = (SCHEDULE, HF_SCHEDULE, *LLAMA_SCHEDULES)
TRACED_SCHEDULES = (SCHEDULE, HF_SCHEDULE)  # the schedules that can record a trace (crossrt/records/trace.py)


def greedy_generate(target: ModelSession, prompt_ids: Sequence[int], max_new_tokens: int,
                    whole_prompt: bool = False) -> Generation:
    """Plain greedy decoding, one token per target pass: the reference output. whole_prompt:
    the first token comes from a pass over the whole prompt, as llama-server decodes (its
    "llama-server" schedule's baseline), instead of prompt[:-1] then a one-token decode."""
    check_prompt(prompt_ids, max_new_tokens, [target])
    start = time.perf_counter()
    target.truncate(0)
    views = ViewRecorder()
    output: list[int] = []
    if whole_prompt:
        choices = choose(target.eval(prompt_ids, Rows.LAST))
        views.add(choices, 1, len(prompt_ids))
        output.append(int(choices.best[0]))
    else:
        target.eval(prompt_ids[:-1], Rows.NONE)
    prefilled = time.perf_counter()
    last = output[-1] if output else prompt_ids[-1]
    stop_reason = "eos" if output and last in target.eog_ids else "max_new_tokens"
    while len(output) < max_new_tokens and stop_reason != "eos":
        choices = choose(target.eval((last,), Rows.LAST))
        views.add(choices, 1, 1)
        last = int(choices.best[0])
        output.append(last)
        if last in target.eog_ids:
            stop_reason = "eos"
    return Generation(tuple(output), stop_reason, prefilled - start, time.perf_counter() - prefilled,
                      view=views.view(len(output)))


def speculative_generate(target: ModelSession, drafter: ModelSession, prompt_ids: Sequence[int],
                         rules: DraftRules, max_new_tokens: int, schedule: str = SCHEDULE,
                         trace: Optional[TraceRecorder] = None) -> Generation:
    """Greedy speculative decoding with the named schedule (module docstring); trace, when
    given, records the run's per-token trace."""
    if schedule not in SCHEDULES:
        raise SettingsError(f"unknown schedule {schedule!r}; schedules: {', '.join(SCHEDULES)}")
    rules.require_drafter_model("crossrt's driven loop")
    if trace is not None and schedule not in TRACED_SCHEDULES:
        raise SettingsError(f"traces are recorded by the {' and '.join(TRACED_SCHEDULES)} schedules, not {schedule}")
    if schedule in LLAMA_SCHEDULES:
        return LLAMA_SCHEDULES[schedule](target, drafter, prompt_ids, rules, max_new_tokens)
    if not rules.fixed:
        raise SettingsError(f"the {schedule} schedule drafts exactly k tokens: n_min and p_min are "
                         "llama.cpp drafting rules, for the llama-* schedules")
    draft_stops_at_eos = schedule == HF_SCHEDULE
    k = rules.k
    check_prompt(prompt_ids, max_new_tokens, [target, drafter])
    start = time.perf_counter()
    context = prefill_pair(target, drafter, prompt_ids)
    prefilled = time.perf_counter()

    eog = target.eog_ids
    views = ViewRecorder()
    step_drafted: list[int] = []
    step_accepted: list[int] = []
    n_emitted = 0
    stop_reason = "max_new_tokens"
    while n_emitted < max_new_tokens:
        n_draft = min(k, max_new_tokens - n_emitted - 1)
        draft: list[int] = []
        if n_draft:
            pending = context[drafter.n_past:]
            while True:
                row = drafter.eval(pending, Rows.LAST)[0]
                token = int(row.argmax())
                if trace is not None:
                    trace.drafted(row)
                draft.append(token)
                if len(draft) == n_draft or (draft_stops_at_eos and token in eog):
                    break
                pending = (token,)
            n_draft = len(draft)

        rows = target.eval([context[-1]] + draft, Rows.ALL)
        choices = choose(rows)
        n_accepted = 0
        while n_accepted < n_draft and draft[n_accepted] == choices.best[n_accepted] \
                and draft[n_accepted] not in eog:
            n_accepted += 1
        kept = draft[:n_accepted] + [int(choices.best[n_accepted])]
        views.add(choices, len(kept), n_draft + 1)
        if trace is not None:
            trace.verified(rows[:n_accepted + 1], n_draft, n_accepted)

        # The target now caches context + draft; keep context + accepted draft tokens (the
        # bonus token is the new last token, evaluated at the next step).
        target.truncate(len(context) + n_accepted)
        drafter.truncate(min(drafter.n_past, len(context) + n_accepted))
        context += kept
        n_emitted += len(kept)
        step_drafted.append(n_draft)
        step_accepted.append(n_accepted)
        if kept[-1] in eog:
            stop_reason = "eos"
            break

    return Generation(
        output_ids=tuple(context[len(prompt_ids):]),
        stop_reason=stop_reason,
        prefill_s=prefilled - start,
        decode_s=time.perf_counter() - prefilled,
        step_drafted=tuple(step_drafted),
        step_accepted=tuple(step_accepted),
        view=views.view(n_emitted),
    )
