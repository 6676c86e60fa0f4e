"""A split: where two runs' token ids part (or their prompt ids do), each side's emitted token
with the gap its pass put to the other side's, and the kind of split it is. The kinds are the
causes crossrt/compare/diagnosis.py's Explainer names (its docstring says when each applies);
NUMERICS are the kinds explained by numerics, which parity notes and does not fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from crossrt.records.schema import PassView, PromptResult
from crossrt.speculative.numerics import Gap, NearTie, recorded_gap

TOKENIZATION = "tokenization or template"
TEMPLATE = "template"  # a runtime's own chat-template rendering differs from crossrt's (chat_template.py)
BATCH_SHAPE = "batch-shape numerics"
INSIDE_DISAGREEMENT = "disagreement inside the runtime"
NOT_REPRODUCED = "native output not reproduced"
CROSS_NUMERICS = "cross-runtime numerics"
DISAGREEMENT = "disagreement"
DRAFTER_NUMERICS = "drafter numerics"
DRAFT_RULE = "draft rule at its threshold"
COUNTERS_UNEXPLAINED = "counters unexplained"
STOP = "stop"
UNEXPLAINED = "unexplained"
# Causes of a run's own check that are no split of token ids (crossrt/compare/parity.py: lossless_checks).
COUNTS_UNFIT = "counts did not fit"  # a native runtime's own statistics did not fit its schedule: noted
OWN_TOKENIZATION = "tokenization"  # the runtime's own tokenization of the prompt text differs from the shared ids
NUMERICS = frozenset({BATCH_SHAPE, CROSS_NUMERICS, DRAFTER_NUMERICS, DRAFT_RULE})  # explained, not failed

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
    """One run's emitted token at a split, and how far its pass put the other side's token."""

    label: str
    token: int
    text: Optional[str]
    other: int
    other_text: Optional[str]
    gap: Optional[Gap]  # None where nothing was recorded or reproduced
    pass_tokens: Optional[int]

    def describe(self) -> str:
        chosen = f"{self.label} emitted {token_text(self.token, self.text)}"
        if self.gap is None:
            return chosen + " (no pass recorded: a native run)"
        shape = f" in {pass_shape(self.pass_tokens)}" if self.pass_tokens else ""
        return f"{chosen}{shape}; {token_text(self.other, self.other_text)} {self.gap.describe()}"


def token_text(token: int, text: Optional[str]) -> str:
    """A token as splits print it: its id, and its text where a tokenizer gave one."""
    return str(token) if text is None else f"{token} {text!r}"


def pass_shape(tokens: Optional[int]) -> str:
    if tokens == 1:
        return "a one-token decode"
    return f"a pass of {tokens} tokens"


def recorded_side(label: str, ids: Sequence[int], view: Optional[PassView], index: int, other: int,
                  detokenize: Detokenize) -> Side:
    token = ids[index]
    if view is None or index >= len(view.margins):
        return Side(label, token, detokenize([token]), other, detokenize([other]), None, None)
    close_ids = view.close_ids[index] if view.close_ids is not None else None
    close_gaps = view.close_gaps[index] if view.close_gaps is not None else None
    gap = recorded_gap(view.margins[index], view.runner_up[index], close_ids, close_gaps, token, other)
    return Side(label, token, detokenize([token]), other, detokenize([other]), gap, view.pass_tokens[index])


@dataclass(frozen=True)
class Split:
    prompt_id: str
    kind: str
    index: Optional[int]  # output token where the sequences part (prompt position for tokenization)
    sides: tuple[Side, ...]
    detail: str
    verdict: Optional[NearTie] = None

    @property
    def numerics(self) -> bool:
        return self.kind in NUMERICS

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
