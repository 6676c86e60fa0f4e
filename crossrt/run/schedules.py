"""What every schedule of the driven loop returns, and llama.cpp's two draft-model schedules,
mirrored count for count so a driven run can be compared with llama.cpp's own tools.

Both llama.cpp schedules share the drafting and verification rules of the vendored llama.cpp
(docs/llama-cpp-native.md gives the source lines):
- Drafting (common/speculative.cpp, draft-simple): the drafter decodes the last token, then
  proposes its argmax one token at a time, stopping when the top-10 softmax probability of its
  choice is below p_min, at k tokens, or at the per-call limit (a limit of 0 means none). A draft
  shorter than n_min is thrown away. The drafter does not stop at EOS, and it never decodes its
  own last draft token.
- The drafter's cache mirrors the target's: after drafting it is cut back to the target's
  cache and decodes the same batch the target decodes, as llama.cpp does. Mirroring the batch
  structure keeps the drafter's numerics those of the native tools, not just its tokens.
- Verification (common/sampling.cpp, sample-and-accept-n): the target's argmax at each
  position of [last] + draft; stop at the first mismatch, or at a matched EOS that is not in
  the draft's last position; a fully matched draft adds the target's next token.

"llama-spec-simple" (examples/speculative-simple): prefills prompt[:-1], so the first draft is
made right away and every token comes from a step (plain decodes included: a dropped draft
still verifies [last]). Its per-call limit is max(min(n_ctx - n_past - 2, N - n_predict - 1), 0),
and 0 means unlimited, so it overshoots the budget N: it stops once n_predict > N. The tokens
past N, and the target's token after an accepted EOS, are `cut`: n_predict = emitted + cut.

"llama-server" (tools/server): prefills the whole prompt and takes the first token from the
prompt pass (`unverified`). Its limit is min(n_ctx - n_tokens - 2, n_remaining - 1); at 0 or
below no draft is made, and an empty draft is a plain decode (`unverified`), not a step. It
counts a step's accepted tokens before its stop check, so tokens after an EOS are `cut`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from crossrt.errors import PromptRefused
from crossrt.run.numerics import Choices, choose
from crossrt.run.runtime import DraftRules, ModelSession, Rows
from crossrt.records.schema import Counters, PassView

SPEC_SIMPLE = "llama-spec-simple"
SERVER = "llama-server"
TOP_K = 10  # draft-simple's drafter sampler keeps the 10 best tokens before its softmax


@dataclass(frozen=True)
class Generation:
    output_ids: tuple[int, ...]
    stop_reason: str  # "eos" or "max_new_tokens"
    prefill_s: float
    decode_s: float
    step_drafted: Optional[tuple[int, ...]] = None  # None for the plain baseline
    step_accepted: Optional[tuple[int, ...]] = None
    unverified: int = 0  # tokens emitted outside steps (see schema.Counters)
    cut: int = 0  # tokens counted as accepted but dropped at the budget or after EOS
    view: Optional[PassView] = None  # how the pass that produced each output token saw it

    def counters(self, k: int) -> Counters:
        """This speculative generation's counters (Counters.from_steps: raises if they do not add up)."""
        return Counters.from_steps(self.step_drafted, self.step_accepted, len(self.output_ids), k,
                                   self.unverified, self.cut)


class ViewRecorder:
    """Collects a PassView, one entry per emitted token, from the rows that chose them."""

    def __init__(self):
        self.margins: list[float] = []
        self.runner_up: list[int] = []
        self.pass_tokens: list[int] = []
        self.close_ids: list[tuple[int, ...]] = []
        self.close_gaps: list[tuple[float, ...]] = []

    def add(self, choices: Choices, n_tokens: int, pass_tokens: int) -> None:
        """The first n_tokens rows of one pass of pass_tokens tokens produced the next tokens."""
        self.margins.extend(float(m) for m in choices.margins[:n_tokens])
        self.runner_up.extend(int(t) for t in choices.second[:n_tokens])
        self.pass_tokens.extend([pass_tokens] * n_tokens)
        self.close_ids.extend(choices.close_ids[:n_tokens])
        self.close_gaps.extend(choices.close_gaps[:n_tokens])

    def view(self, n_emitted: int) -> PassView:
        """The view of the first n_emitted tokens (those past the budget or an EOS are cut)."""
        return PassView(tuple(self.margins[:n_emitted]), tuple(self.runner_up[:n_emitted]),
                        tuple(self.pass_tokens[:n_emitted]), tuple(self.close_ids[:n_emitted]),
                        tuple(self.close_gaps[:n_emitted]))


def check_fits(prompt_ids: Sequence[int], max_new_tokens: int, n_ctx: int, overrun: int = 0) -> None:
    """Refuse a prompt whose run could leave a context of n_ctx; overrun: positions a schedule
    may use past prompt + max_new_tokens (a step that overshoots the budget)."""
    if not prompt_ids:
        raise PromptRefused("empty prompt: nothing to condition on")
    if len(prompt_ids) + max_new_tokens + overrun > n_ctx:
        past = f" (+ {overrun} the schedule may run past them)" if overrun else ""
        raise PromptRefused(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens{past} does not fit "
                         f"the context of {n_ctx} tokens")


def check_prompt(prompt_ids: Sequence[int], max_new_tokens: int, sessions: Sequence[ModelSession],
                 overrun: int = 0) -> None:
    """check_fits for every session's context."""
    for session in sessions:
        check_fits(prompt_ids, max_new_tokens, session.n_ctx, overrun)


def prefill_pair(target: ModelSession, drafter: ModelSession, prompt_ids: Sequence[int]) -> list[int]:
    """Empty both caches and run prompt[:-1] through each: the prefill of every driven loop,
    whose first step (or draft) feeds the last prompt token. Returns the context to extend."""
    target.truncate(0)
    drafter.truncate(0)
    context = list(prompt_ids)
    target.eval(context[:-1], Rows.NONE)
    drafter.eval(context[:-1], Rows.NONE)
    return context


def top_probability(logits: np.ndarray) -> np.float32:
    """The drafter's confidence as llama.cpp computes it: softmax over the top-10 logits, in
    float32 terms summed in double in descending order (llama-sampler.cpp, dist sampler)."""
    count = min(TOP_K, logits.size)
    top = np.sort(np.partition(logits, -count)[-count:])[::-1]
    weights = np.exp(top - top[0])
    return np.float32(1.0 / sum(float(w) for w in weights))


def llama_draft(drafter: ModelSession, last: int, rules: DraftRules, limit: int) -> list[int]:
    """One draft-simple draft after last; the drafter's cache holds the context before last."""
    draft: list[int] = []
    pending = last
    while True:
        logits = drafter.eval((pending,), Rows.LAST)[0]
        token = int(logits.argmax())
        if rules.unsure(top_probability(logits)):
            break
        draft.append(token)
        if rules.full(len(draft), limit):
            break
        pending = token
    return draft if rules.kept(len(draft)) else []


def verify(choices: np.ndarray, draft: Sequence[int], eog: frozenset[int]) -> list[int]:
    """The tokens a verification yields: the accepted draft prefix and the target's own token,
    or a matched EOS that ends it early (llama.cpp accepts an EOS only in the last position)."""
    ids: list[int] = []
    for position, token in enumerate(draft):
        chosen = int(choices[position])
        ids.append(chosen)
        if chosen != token or (chosen in eog and position + 1 < len(draft)):
            return ids
    ids.append(int(choices[len(draft)]))
    return ids


class _Tally:
    """What a llama schedule has emitted and counted so far."""

    def __init__(self, max_new_tokens: int, eog: frozenset[int]):
        self.max_new_tokens = max_new_tokens
        self.eog = eog
        self.output: list[int] = []
        self.step_drafted: list[int] = []
        self.step_accepted: list[int] = []
        self.unverified = 0
        self.cut = 0
        self.stopped = False
        self.views = ViewRecorder()

    def emit(self, ids: Sequence[int]) -> None:
        """Emit ids in order until EOS or the budget; the rest of them are cut."""
        for position, token in enumerate(ids):
            self.output.append(token)
            if token in self.eog or len(self.output) >= self.max_new_tokens:
                self.stopped = True
                self.cut += len(ids) - 1 - position
                return

    def generation(self, start: float, prefilled: float) -> Generation:
        stop_reason = "eos" if self.output and self.output[-1] in self.eog else "max_new_tokens"
        return Generation(tuple(self.output), stop_reason, prefilled - start, time.perf_counter() - prefilled,
                          tuple(self.step_drafted), tuple(self.step_accepted), self.unverified, self.cut,
                          self.views.view(len(self.output)))


def _verify_batch(target: ModelSession, drafter: ModelSession, last: int, draft: list[int]) -> Choices:
    """Decode [last] + draft on both models (the drafter mirrors the target's batch) and return
    the target's choices at each position."""
    drafter.truncate(target.n_past)
    batch = [last] + draft
    verified = choose(target.eval(batch, Rows.ALL))
    drafter.eval(batch, Rows.NONE)
    return verified


def spec_simple_generate(target: ModelSession, drafter: ModelSession, prompt_ids: Sequence[int],
                         rules: DraftRules, max_new_tokens: int) -> Generation:
    """llama-speculative-simple's schedule (module docstring)."""
    check_prompt(prompt_ids, max_new_tokens, [target, drafter], overrun=rules.k)
    start = time.perf_counter()
    prefill_pair(target, drafter, prompt_ids)
    prefilled = time.perf_counter()

    tally = _Tally(max_new_tokens, target.eog_ids)
    last = prompt_ids[-1]
    n_predict = 0
    seen_eos = False
    while not seen_eos and n_predict <= max_new_tokens:
        n_past = target.n_past
        limit = max(min(target.n_ctx - n_past - 2, max_new_tokens - n_predict - 1), 0)
        draft = llama_draft(drafter, last, rules, limit)
        choices = _verify_batch(target, drafter, last, draft)
        ids = verify(choices.best, draft, tally.eog)
        target.truncate(n_past + len(ids))
        drafter.truncate(n_past + len(ids))
        tally.step_drafted.append(len(draft))
        tally.step_accepted.append(len(ids) - 1)
        n_predict += len(ids)
        # The tool emits up to its first EOS; crossrt keeps what fits the budget of those.
        produced = ids[:next((i + 1 for i, t in enumerate(ids) if t in tally.eog), len(ids))]
        seen_eos = produced[-1] in tally.eog
        if not tally.stopped:
            tally.views.add(choices, len(produced), len(draft) + 1)
            tally.emit(produced)
        last = ids[-1]
    # n_predict counts every token the steps yielded, those past the budget or after EOS too.
    tally.cut = n_predict - len(tally.output)
    return tally.generation(start, prefilled)


def server_generate(target: ModelSession, drafter: ModelSession, prompt_ids: Sequence[int],
                    rules: DraftRules, max_new_tokens: int) -> Generation:
    """llama-server's schedule (module docstring)."""
    # The server stops when its cache reaches n_ctx - 1: keep a position spare so it never does.
    check_prompt(prompt_ids, max_new_tokens, [target, drafter], overrun=1)
    start = time.perf_counter()
    target.truncate(0)
    drafter.truncate(0)
    first_choices = choose(target.eval(prompt_ids, Rows.LAST))
    first = int(first_choices.best[0])
    drafter.eval(prompt_ids, Rows.NONE)
    prefilled = time.perf_counter()

    tally = _Tally(max_new_tokens, target.eog_ids)
    tally.unverified += 1
    tally.views.add(first_choices, 1, len(prompt_ids))
    tally.emit((first,))
    while not tally.stopped:
        n_tokens = target.n_past
        limit = min(target.n_ctx - n_tokens - 2, max_new_tokens - len(tally.output) - 1)
        draft = llama_draft(drafter, tally.output[-1], rules, limit) if limit > 0 else []
        choices = _verify_batch(target, drafter, tally.output[-1], draft)
        ids = verify(choices.best, draft, tally.eog)
        target.truncate(n_tokens + len(ids))
        drafter.truncate(n_tokens + len(ids))
        if draft:
            tally.step_drafted.append(len(draft))
            tally.step_accepted.append(len(ids) - 1)
        else:
            tally.unverified += 1
        tally.views.add(choices, len(ids), len(draft) + 1)
        tally.emit(ids)
    return tally.generation(start, prefilled)


LLAMA_SCHEDULES = {SPEC_SIMPLE: spec_simple_generate, SERVER: server_generate}
