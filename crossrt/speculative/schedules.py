"""The schedules of crossrt's one loop (crossrt/speculative/loop.py), what every run of it returns, and the
Tally where its counts accumulate. A schedule says when drafts start and how they are cut near
the budget; the llama.cpp and vLLM ones mirror those runtimes count for count. What each does,
with the source lines it follows: docs/schedules.md. The simulator runs the loop with these on
an oracle (crossrt/simulate/oracle.py): a schedule is written here only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from crossrt.errors import PromptRefused
from crossrt.speculative.numerics import Choices
from crossrt.speculative.session import ModelSession, Rows
from crossrt.records.schema import Counters, PassView

SCHEDULE = "crossrt"
HF_SCHEDULE = "hf-assisted"
SPEC_SIMPLE = "llama-spec-simple"
SERVER = "llama-server"
VLLM = "vllm"
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
    drafter_calls: Optional[int] = None  # drafter passes (prompt lookup: lookups); None for the baseline

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
        self.margins.extend(choices.margins[:n_tokens].tolist())
        self.runner_up.extend(choices.second[:n_tokens].tolist())
        self.pass_tokens.extend([pass_tokens] * n_tokens)
        self.close_ids.extend(choices.close_ids[:n_tokens])
        self.close_gaps.extend(choices.close_gaps[:n_tokens])

    def view(self, n_emitted: int) -> PassView:
        """The view of the first n_emitted tokens (those past the budget or an EOS are cut)."""
        return PassView(tuple(self.margins[:n_emitted]), tuple(self.runner_up[:n_emitted]),
                        tuple(self.pass_tokens[:n_emitted]), tuple(self.close_ids[:n_emitted]),
                        tuple(self.close_gaps[:n_emitted]))


def check_context_fits(prompt_ids: Sequence[int], max_new_tokens: int, n_ctx: int, overrun: int = 0) -> None:
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
    """check_context_fits for every session's context."""
    for session in sessions:
        check_context_fits(prompt_ids, max_new_tokens, session.n_ctx, overrun)


def top_probability(logits: np.ndarray) -> np.float32:
    """The drafter's confidence as llama.cpp computes it: softmax over the top-10 logits, in
    float32 terms summed in double in descending order (llama-sampler.cpp, dist sampler)."""
    count = min(TOP_K, logits.size)
    top = np.sort(np.partition(logits, -count)[-count:])[::-1]
    weights = np.exp(top - top[0])
    return np.float32(1.0 / sum(float(w) for w in weights))




class Tally:
    """The one place a driven run's counts accumulate, step by step: what was emitted, each
    step's drafted and accepted lengths, tokens emitted outside steps (unverified), tokens a
    step yielded past the budget or after an EOS (cut), and the view of every emitted token."""

    def __init__(self, max_new_tokens: int, eog: frozenset[int]):
        self.max_new_tokens = max_new_tokens
        self.eog = eog
        self.output: list[int] = []
        self.step_drafted: list[int] = []
        self.step_accepted: list[int] = []
        self.unverified = 0
        self.yielded = 0  # every token a pass produced, emitted or cut
        self.seen_eos = False
        self.stopped = False
        self.views = ViewRecorder()

    def observe(self, n_drafted: int, ids: Sequence[int], choices: Choices, pass_tokens: int, step: bool) -> None:
        """One target pass of pass_tokens tokens yielded ids, chosen by the first rows of
        choices; step: it verified a draft (a step), else it was a plain decode (unverified)."""
        if step:
            self.step_drafted.append(n_drafted)
            self.step_accepted.append(len(ids) - 1)
        else:
            self.unverified += 1
        self.yielded += len(ids)
        self.seen_eos = self.seen_eos or not self.eog.isdisjoint(ids)
        if not self.stopped:
            self.views.add(choices, len(ids), pass_tokens)
            self._emit(ids)

    def _emit(self, ids: Sequence[int]) -> None:
        """Emit ids in order until EOS or the budget."""
        for token in ids:
            self.output.append(token)
            if token in self.eog or len(self.output) >= self.max_new_tokens:
                self.stopped = True
                return

    def generation(self, start: float, prefilled: float, drafter_calls: int) -> Generation:
        stop_reason = "eos" if self.output and self.output[-1] in self.eog else "max_new_tokens"
        return Generation(tuple(self.output), stop_reason, prefilled - start, time.perf_counter() - prefilled,
                          tuple(self.step_drafted), tuple(self.step_accepted), self.unverified,
                          self.yielded - len(self.output), self.views.view(len(self.output)), drafter_calls)


def draft_cap(k: int, max_new_tokens: int, emitted: int) -> int:
    """crossrt's schedule's longest draft after emitted tokens: k, or what the budget leaves
    beside the token the step adds (also the top-b ceiling's, simulate/trees.py)."""
    return min(k, max_new_tokens - emitted - 1)


class Schedule:
    """When drafts start and how they are cut near the budget: the crossrt schedule (module
    docstring of crossrt/speculative/loop.py); the subclasses change what differs."""

    name = SCHEDULE
    llama = False  # llama.cpp's drafting rules (n_min, p_min), mirrored drafter, its verification
    ends_at_eos = False  # a draft ends at the drafter's first EOS
    empty_is_step = True  # an empty draft still counts as a step (a plain decode verified)
    crops_at_budget = False  # a step's tokens past the budget are dropped before they are counted
    accepts_eos = False  # verification accepts a matched EOS inside a draft (vLLM's rejection sampler)
    first_from_prompt = False  # the first token comes from a pass over the whole prompt, unverified (baseline too)

    def overrun(self, k: int) -> int:
        """Positions past prompt + budget a step may use."""
        return 0

    def start(self, target: ModelSession, drafter, prompt_ids: Sequence[int], tally: Tally) -> list[int]:
        """Prefill both models; the context to extend. Here prompt[:-1]: the last prompt token
        is the first token to verify, so drafting starts at once."""
        target.truncate(0)
        target.eval(prompt_ids[:-1], Rows.NONE)
        drafter.prefill(prompt_ids[:-1])
        return list(prompt_ids)

    def n_max(self, target: ModelSession, tally: Tally, k: int) -> int:
        """The most tokens the next draft may hold: never past the budget."""
        return draft_cap(k, tally.max_new_tokens, len(tally.output))

    def stand_in(self, k: int) -> Optional[tuple[int, ...]]:
        """The draft the runtime schedules instead of the drafter's for the pass n_max was
        just asked of (cut to n_max by the loop); None: the drafter's."""
        return None

    def done(self, tally: Tally) -> bool:
        return tally.stopped


class HfAssisted(Schedule):
    name = HF_SCHEDULE
    ends_at_eos = True
    crops_at_budget = True


class SpecSimple(Schedule):
    """llama-speculative-simple: its limit, 0 meaning none, so it overshoots the budget."""

    name = SPEC_SIMPLE
    llama = True

    def overrun(self, k: int) -> int:
        return k

    def n_max(self, target: ModelSession, tally: Tally, k: int) -> int:
        limit = max(min(target.n_ctx - target.n_past - 2, tally.max_new_tokens - tally.yielded - 1), 0)
        return min(k, limit) if limit else k

    def done(self, tally: Tally) -> bool:
        return tally.seen_eos or tally.yielded > tally.max_new_tokens


class ServerSchedule(Schedule):
    """llama-server: the first token from a pass over the whole prompt, no draft at a limit of
    0 or below, an empty draft a plain decode."""

    name = SERVER
    llama = True
    empty_is_step = False
    first_from_prompt = True

    def overrun(self, k: int) -> int:
        return 1  # the server stops when its cache reaches n_ctx - 1: keep a position spare

    def start(self, target: ModelSession, drafter, prompt_ids: Sequence[int], tally: Tally) -> list[int]:
        target.truncate(0)
        _, choices = target.eval_choices(prompt_ids, Rows.LAST)
        drafter.prefill(prompt_ids)
        tally.observe(0, [int(choices.best[0])], choices, len(prompt_ids), step=False)
        return [*prompt_ids, *tally.output]

    def n_max(self, target: ModelSession, tally: Tally, k: int) -> int:
        limit = min(target.n_ctx - target.n_past - 2, tally.max_new_tokens - len(tally.output) - 1)
        return min(k, limit) if limit > 0 else 0


class VllmSchedule(ServerSchedule):
    """vLLM: the first token from the prefill pass, as llama-server; drafts of k cut only at the
    context (max_model_len), never at the budget, and k zeros instead of a draft once the last
    pass reached too close to it; a matched EOS accepted like any token."""

    name = VLLM
    llama = False
    accepts_eos = True

    def start(self, target: ModelSession, drafter, prompt_ids: Sequence[int], tally: Tally) -> list[int]:
        context = super().start(target, drafter, prompt_ids, tally)
        # The last pass: the positions it started after, and the steps counted before it (the
        # prefill starts after none and is no step, so it reached the prompt's length).
        self._pass = (len(prompt_ids), len(tally.step_drafted))
        self._zeros = False
        return context

    def overrun(self, k: int) -> int:
        return 0  # drafts are cut at the context itself

    def n_max(self, target: ModelSession, tally: Tally, k: int) -> int:
        # Positions the last pass reached, the model runner's max_seq_len: where it started, its
        # last token and the draft tokens it verified, accepted or not.
        began, steps = self._pass
        reached = began + (tally.step_drafted[-1] if len(tally.step_drafted) > steps else 0)
        self._zeros = reached + k > target.n_ctx
        self._pass = (target.n_past + 1, len(tally.step_drafted))
        limit = target.n_ctx - target.n_past - 2
        return min(k, limit) if limit > 0 else 0

    def stand_in(self, k: int) -> Optional[tuple[int, ...]]:
        return (0,) * k if self._zeros else None


SCHEDULE_TYPES = {kind.name: kind for kind in (Schedule, HfAssisted, SpecSimple, ServerSchedule, VllmSchedule)}
SCHEDULES = tuple(SCHEDULE_TYPES)
# llama.cpp's schedules (Schedule.llama): its drafting rules, its n-gram types and its heads run there.
LLAMA_SCHEDULES = tuple(name for name, kind in SCHEDULE_TYPES.items() if kind.llama)
TRACED_SCHEDULES = (SCHEDULE, HF_SCHEDULE)


def first_from_prompt(schedule: str) -> bool:
    """The schedule takes its first token from a pass over the whole prompt (llama-server, vLLM),
    in its baseline too; an imported record's schedule, unknown here, does not."""
    kind = SCHEDULE_TYPES.get(schedule)
    return kind is not None and kind.first_from_prompt  # the schedules that can record a trace (crossrt/records/trace.py)
