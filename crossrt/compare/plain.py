"""The verdict's terms in plain words: what each cause of a split means and what the float
control's power means, for a reader who has not read docs/parity.md. `crossrt parity`'s text
and the report's page both say them from here (ParityReport.plainly)."""

from __future__ import annotations

from typing import Optional

from crossrt.compare.power import Power
from crossrt.compare.splits import (BATCH_SHAPE, COUNTERS_UNEXPLAINED, COUNTS_UNFIT, CROSS_NUMERICS, DISAGREEMENT,
                                    DRAFT_RULE, DRAFTER_NUMERICS, INSIDE_DISAGREEMENT, NOT_REPRODUCED,
                                    OWN_TOKENIZATION, STOP, TEMPLATE, TOKENIZATION, UNEXPLAINED)

_ROUNDING = "expected floating-point behaviour, not a bug"
CAUSES = {
    TOKENIZATION: "the two runs gave the model different token ids for the same prompt, before generating "
                  "anything: a tokenizer or chat-template difference, not a decoding one",
    TEMPLATE: "the runtime renders the chat template itself, and its rendering is not the text crossrt fed the "
              "other runs: the model saw another prompt",
    OWN_TOKENIZATION: "the runtime splits the prompt text into other tokens than the ids every run was given",
    BATCH_SHAPE: "inside one runtime, speculative decoding left the runtime's own plain output where two candidate "
                 f"tokens were almost tied: checking a draft in one batch rounds a little differently from "
                 f"decoding one token at a time, enough to swap a near-tie; {_ROUNDING}",
    INSIDE_DISAGREEMENT: "inside one runtime, speculative decoding left the runtime's own plain output at a token "
                         "that was not a near-tie: more than rounding explains, so a cache, batching or rollback bug",
    NOT_REPRODUCED: "the runtime's own speculative decoding emitted a token that the same computation, redone by "
                    "crossrt, puts clearly below another: the runtime's own path computed something else",
    CROSS_NUMERICS: "two runtimes' plain greedy outputs part where two candidate tokens were almost tied: their "
                    f"arithmetic differs a little (kernels, precision), enough to swap a near-tie; {_ROUNDING}",
    DISAGREEMENT: "two runs' plain greedy outputs part at a token that was not a near-tie: they do not compute the "
                  "same function (another model or weights, or a bug)",
    DRAFTER_NUMERICS: "the same output, other acceptance counts: the two drafters find two draft candidates almost "
                      f"tied, and rounding ranked them differently; {_ROUNDING}",
    DRAFT_RULE: "the same output, other counts: the drafter's confidence sat right at the draft rule's cut-off "
                f"(p_min), so rounding decided whether a draft was made; {_ROUNDING}",
    COUNTERS_UNEXPLAINED: "the same output, other acceptance counts, and no near-tie explains them: the runs "
                          "drafted or verified differently",
    STOP: "one output ends where the other goes on (an end-of-text token, or the token budget)",
    UNEXPLAINED: "the runs part, and neither recorded passes nor passes re-scored say why",
    COUNTS_UNFIT: "the runtime's own statistics did not add up under its schedule as crossrt reads it: its counts "
                  "are kept as it reported them",
}


def cause_plainly(cause: str) -> Optional[str]:
    """What a cause of a split means, in a sentence; None for a cause this table lacks."""
    return CAUSES.get(cause)


def power_plainly(power: Power) -> str:
    """What a check's power means: the smallest difference it would notice."""
    return (f"the logit checks would notice a run whose every logit was off by random noise of about "
            f"{power.sigma:.2g} (noise that moves the next-token probabilities by a mean KL divergence of "
            f"{power.kl_mean:.2g}); runs that differ by less than that pass, so a smaller bug could go unseen")
