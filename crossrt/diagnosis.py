"""The cause of a split, from what the runs themselves saw.

A driven run records, for every emitted token, the top-2 margin, the runner-up and the size of
the target pass that chose it (schema.PassView), for its speculative output and for its plain
greedy baseline. A split is then explained with those numbers, not with a later re-score that
runs yet another batch shape:
- tokenization or template: the prompt ids differ before anything is generated;
- template: a runtime that renders chat templates itself renders a templated prompt to other ids
  than crossrt's rendering (which every runtime ran);
- batch-shape numerics: inside one runtime, the speculative output leaves its own baseline at a
  two-way near-tie (each pass's choice is the other's runner-up): the verification batch and the
  one-token decode round the same model differently;
- inside-runtime disagreement: the passes rank other candidates (a cache or batching bug);
- across runtimes (crossrt/diff.py): numerics against the measured noise, or a real disagreement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from crossrt.schema import PassView, PromptResult

TOKENIZATION = "tokenization or template"
TEMPLATE = "template"  # a runtime's own chat-template rendering differs from crossrt's (chat_template.py)
BATCH_SHAPE = "batch-shape numerics"
INSIDE_DISAGREEMENT = "disagreement inside the runtime"
CROSS_NUMERICS = "cross-runtime numerics"
DISAGREEMENT = "disagreement"
STOP = "stop"
UNEXPLAINED = "unexplained"

Detokenize = Callable[[Sequence[int]], str]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first position where a and b differ, the shorter length when one is a
    strict prefix of the other, None when they are equal."""
    for index in range(min(len(a), len(b))):
        if a[index] != b[index]:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def no_text(ids: Sequence[int]) -> Optional[str]:
    """A Detokenize for readers without a tokenizer at hand (parity): ids only."""
    return None


@dataclass(frozen=True)
class Side:
    """One run's emitted token at a split, as the pass that produced it saw it."""

    label: str
    token: int
    text: Optional[str]
    margin: Optional[float]  # over the runner-up; None where the run recorded no view
    runner_up: Optional[int]
    runner_up_text: Optional[str]
    pass_tokens: Optional[int]

    def describe(self) -> str:
        chosen = f"{self.label} emitted {_token(self.token, self.text)}"
        if self.margin is None:
            return chosen + " (no pass view recorded: a native run)"
        return (f"{chosen}, {self.margin:.3g} over {_token(self.runner_up, self.runner_up_text)}, "
                f"in {pass_shape(self.pass_tokens)}")


def _token(token: int, text: Optional[str]) -> str:
    return str(token) if text is None else f"{token} {text!r}"


def pass_shape(tokens: Optional[int]) -> str:
    if tokens == 1:
        return "a one-token decode"
    return f"a pass of {tokens} tokens"


def side(label: str, ids: Sequence[int], view: Optional[PassView], index: int, detokenize: Detokenize) -> Side:
    token = ids[index]
    if view is None or index >= len(view.margins):
        return Side(label, token, detokenize([token]), None, None, None, None)
    runner_up = view.runner_up[index]
    return Side(label, token, detokenize([token]), view.margins[index], runner_up, detokenize([runner_up]),
                view.pass_tokens[index])


def swapped(a: Side, b: Side) -> bool:
    """Each side's choice is the other's runner-up: a two-way near-tie."""
    return a.runner_up == b.token and b.runner_up == a.token


def flip(a: Side, b: Side) -> Optional[float]:
    """How far the gap between the two candidates moved from one pass to the other (both
    margins, when each is over the other's token); None when the views do not give it."""
    if a.margin is None or b.margin is None or not swapped(a, b):
        return None
    return a.margin + b.margin


@dataclass(frozen=True)
class Split:
    prompt_id: str
    kind: str
    index: Optional[int]  # output token where the sequences part (prompt position for tokenization)
    sides: tuple[Side, ...]
    detail: str

    def render(self) -> list[str]:
        where = f" at token {self.index}" if self.index is not None else ""
        return [f"{self.prompt_id}: {self.kind}{where}"] + [f"  {s.describe()}" for s in self.sides] + \
               [f"  verdict: {self.kind}: {self.detail}"]


def tokenization_split(prompt_id: str, labels: tuple[str, str], ids: tuple[Sequence[int], Sequence[int]],
                       detokenize: Detokenize) -> Optional[Split]:
    """The prompt ids of two runs, or a run's own tokenization against the shared ids."""
    at = first_divergence(*ids)
    if at is None:
        return None
    shown = [f"{label}: {list(seq[at:at + 4])}" + ("" if text is None else f" {text!r}")
             for label, seq in zip(labels, ids) for text in [detokenize(seq[at:at + 4])]]
    return Split(prompt_id, TOKENIZATION, at, (), f"prompt ids differ from position {at} before generation ("
                 + "; ".join(shown) + ")")


def own_tokenization(label: str, result: PromptResult, detokenize: Detokenize) -> Optional[Split]:
    if result.own_prompt_ids is None:
        return None
    return tokenization_split(result.prompt_id, (f"{label} own", "shared"),
                              (result.own_prompt_ids, result.prompt_ids), detokenize)


def template_split(label: str, result: PromptResult, detokenize: Detokenize) -> Optional[Split]:
    """The runtime's own rendering of a templated prompt against crossrt's, which ran."""
    if result.template_ids is None:
        return None
    at = first_divergence(result.template_ids, result.prompt_ids)
    shown = [f"{who}: {list(seq[at:at + 4])}" + ("" if text is None else f" {text!r}")
             for who, seq in ((f"{label}'s own rendering", result.template_ids), ("crossrt's", result.prompt_ids))
             for text in [detokenize(seq[at:at + 4])]]
    return Split(result.prompt_id, TEMPLATE, at, (), f"{label} renders the chat template itself to other ids, "
                 f"from prompt position {at} (" + "; ".join(shown) + ")")


def lossless_split(label: str, result: PromptResult, detokenize: Detokenize) -> Optional[Split]:
    """Why one run's speculative output left its own greedy baseline; None when it did not."""
    if not result.ok or result.lossless:
        return None
    index = first_divergence(result.output_ids, result.baseline_ids)
    if index >= min(len(result.output_ids), len(result.baseline_ids)):
        return Split(result.prompt_id, STOP, index, (), "one output ends here (an EOS emitted by one run only)")
    speculative = side(f"{label} speculative", result.output_ids, result.output_view, index, detokenize)
    baseline = side(f"{label} baseline", result.baseline_ids, result.baseline_view, index, detokenize)
    sides = (speculative, baseline)
    if speculative.margin is None or baseline.margin is None:
        return Split(result.prompt_id, UNEXPLAINED, index, sides,
                     "the run recorded no pass views (native mode): re-run it driven with the runtime's "
                     "schedule (e.g. --schedule llama-spec-simple) to see the margins")
    if swapped(speculative, baseline):
        return Split(result.prompt_id, BATCH_SHAPE, index, sides,
                     f"the same weights after the same {index} tokens; {pass_shape(speculative.pass_tokens)} "
                     f"and {pass_shape(baseline.pass_tokens)} swap two candidates {flip(speculative, baseline):.3g} "
                     "logits apart in all")
    return Split(result.prompt_id, INSIDE_DISAGREEMENT, index, sides,
                 "the passes rank different runner-ups: more than rounding; look for a cache or batching bug")


Twins = dict[tuple, tuple[str, PromptResult]]


def twins_of(runs: Sequence[tuple[str, Sequence[PromptResult]]]) -> Twins:
    """Results that recorded pass views, by everything a run of the same schedule would share
    with them (prompt, prompt ids, output and baseline ids): a native run that produced exactly
    these tokens is explained by its driven twin's views."""
    found: Twins = {}
    for label, results in runs:
        for result in results:
            if result.ok and result.output_view is not None:
                found.setdefault(_twin_key(result), (label, result))
    return found


def _twin_key(result: PromptResult) -> tuple:
    return result.prompt_id, result.prompt_ids, result.output_ids, result.baseline_ids


def with_twin_views(results: Sequence[PromptResult], twins: Twins) -> tuple[PromptResult, ...]:
    """results, each without pass views given its driven twin's (same prompt and ids)."""
    return tuple(dataclasses.replace(r, output_view=twins[_twin_key(r)][1].output_view,
                                     baseline_view=twins[_twin_key(r)][1].baseline_view)
                 if r.ok and r.output_view is None and _twin_key(r) in twins else r for r in results)


def explained_split(label: str, result: PromptResult, detokenize: Detokenize, twins: Twins) -> Optional[Split]:
    """lossless_split, through a driven twin (twins_of) where the run recorded no views."""
    split = lossless_split(label, result, detokenize)
    if split is None or split.kind != UNEXPLAINED or _twin_key(result) not in twins:
        return split
    twin_label, twin = twins[_twin_key(result)]
    shown = lossless_split(twin_label, twin, detokenize)
    return Split(shown.prompt_id, shown.kind, shown.index, shown.sides,
                 f"{shown.detail} (seen in {twin_label}, which emitted the same tokens with pass views)")


def explain_record(label: str, results: Sequence[PromptResult], detokenize: Detokenize) -> list[Split]:
    """Every tokenization split and lossless failure of one record, each with its cause."""
    splits = []
    for result in results:
        for split in (own_tokenization(label, result, detokenize), template_split(label, result, detokenize),
                      lossless_split(label, result, detokenize)):
            if split is not None:
                splits.append(split)
    return splits
