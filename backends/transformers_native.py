"""HF transformers' own speculative decoding ("assisted generation"), its steps counted.

model.generate(assistant_model=drafter, do_sample=False) reports no acceptance statistics.
Each verification step ends in one call of the candidate generator's
update_candidate_strategy(input_ids, scores, num_matches) (transformers 5.24
generation/utils.py:4185, in _assisted_decoding): scores holds the target's logits over the
candidates plus one (candidate_length + 1 rows) and num_matches the draft tokens kept, after
HF has cropped the step's tokens at the token budget and after an EOS (utils.py:4153-4165).
The session wraps that method on the generator its own target builds for the call
(utils.py:3989), without changing what it does, and reads drafted = rows - 1 and
accepted = num_matches per step.

HF's schedule, read from the same source (line numbers of transformers 5.24):
- The first draft is made from the whole prompt (utils.py:4051), and the target's prefill of
  prompt + draft is the first verification step (utils.py:4091): no token comes from a prefill.
- Drafts are min(k, max_new_tokens - generated - 1) tokens (candidate_generator.py:288);
  at 0 the drafter is not run and the step verifies an empty draft (a plain decode, still a
  step: candidate_generator.py:214-215).
- The drafter runs its own generate() under a copy of the target's generation config, EOS ids
  included (candidate_generator.py:167, 325), so a draft ends at the drafter's first EOS,
  that EOS included.
- A step keeps the matching prefix plus the target's own next token (utils.py:4146-4148);
  tokens past the budget or after an EOS are cropped before num_matches is recomputed
  (utils.py:4153-4165). The budget crop never bites for drafts capped as above; the EOS
  crop turns an accepted EOS into the step's own token. So each step emits num_matches + 1
  tokens: emitted = steps + accepted, with unverified = cut = 0.
This equals crossrt's driven schedule except for the drafter stopping at EOS.

Prompt lookup (PromptLookupSession) is the same loop with HF's PromptLookupCandidateGenerator
(candidate_generator.py, utils.py:1318-1330) instead of a drafter model: generate(
prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram_max). Its drafts are not capped at
the budget (only with one token left is there none), so there the budget crop does bite: a step
counts only the tokens up to the budget. crossrt/run/lookup/hf_lookup.py HfPromptLookup reproduces it
under the hf-assisted schedule.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch
import transformers

from crossrt.backends.transformers import LoadedModel, synchronize, tokenize
from crossrt.errors import SettingsError
from crossrt.run.runtime import DraftRules, NativeGeneration, NativeSession, RuntimeFailure, RuntimeOptions
from crossrt.run.schedules import check_context_fits
from crossrt.run.strategies import Strategy
from crossrt.records.schema import Counters, CountsDoNotAddUp

SCHEDULE = "hf-assisted"
NOTES = (
    "counts from HF's AssistedCandidateGenerator.update_candidate_strategy per step: drafted = "
    "candidates verified, accepted = num_matches after HF's budget/EOS crop; the drafter stops a draft at EOS",
    "prefill_s is a separate forward pass of the prompt (target, and drafter when speculative) timed "
    "before generate(), which does not expose its own prefill; decode_s is generate()'s wall time minus it",
)
LOOKUP_NOTES = (
    "counts from HF's PromptLookupCandidateGenerator.update_candidate_strategy per step: drafted = candidates "
    "verified, accepted = num_matches after HF's budget crop (drafts run up to k past the budget; the tokens "
    "past it are not counted)",
    NOTES[1],
)


def check_rules(rules: DraftRules) -> None:
    rules.require_drafter_model("HF assisted generation")
    if not rules.fixed:
        raise SettingsError(
            f"HF assisted generation drafts a fixed num_assistant_tokens={rules.k}: it has no "
            f"n_min or p_min drafting rules (got n_min={rules.n_min}, p_min={rules.p_min}); "
            "leave --draft-n-min and --draft-p-min unset")


def check_lookup_rules(rules: DraftRules, strategy: Strategy) -> None:
    if strategy.drafting != "hf-prompt-lookup":
        raise SettingsError(f"transformers' native mode drafts with a drafter model or its own prompt lookup "
                            f"(--drafting hf-prompt-lookup), not {strategy.drafting}")
    if rules.spec_type != "draft" or not rules.fixed:
        raise SettingsError("transformers' prompt lookup copies up to prompt_lookup_num_tokens = k tokens: it has "
                            "no spec type, n_min or p_min; leave --spec-type, --draft-n-min and --draft-p-min unset")


def unfiltered(generator) -> None:
    """Refuse a prompt-lookup generator whose logits processors could forbid candidate tokens:
    HfPromptLookup assumes none (a generation config with bad words, say, would add some)."""
    processors = getattr(generator, "logits_processor", None)
    if processors:
        names = ", ".join(type(processor).__name__ for processor in processors)
        raise SettingsError(f"transformers' prompt lookup here drops candidates its logits processors forbid "
                            f"({names}): crossrt's reproduction of it has none; clear them from the target's "
                            "generation config")


@contextlib.contextmanager
def recording_steps(model, steps: list[tuple[int, int]], check=None):
    """While open, every assisted generate() of model appends (drafted, accepted) per step;
    check(generator), when given, sees each candidate generator first.

    _get_candidate_generator is looked up on the model at each generate() call
    (utils.py:3989), so an instance attribute wraps the generator of this model's calls only.
    """
    build = model._get_candidate_generator

    def get_candidate_generator(*args, **kwargs):
        generator = build(*args, **kwargs)
        if check is not None:
            check(generator)
        update = generator.update_candidate_strategy

        def update_candidate_strategy(input_ids, scores, num_matches):
            steps.append((int(scores.shape[1]) - 1, int(num_matches)))
            return update(input_ids, scores, num_matches)

        generator.update_candidate_strategy = update_candidate_strategy
        return generator

    model._get_candidate_generator = get_candidate_generator
    try:
        yield
    finally:
        del model._get_candidate_generator


class AssistedSession(NativeSession):
    schedule = SCHEDULE
    notes = NOTES

    def __init__(self, target: LoadedModel, drafter: LoadedModel, rules: DraftRules, options: RuntimeOptions):
        """rules must pass check_rules (open_native checks them before loading the models)."""
        self._target = target
        self._drafter = drafter
        self._k = rules.k
        self._n_ctx = options.n_ctx
        # Read by HF from the assistant's generation_config: k tokens every step, and no
        # confidence threshold, which would end drafts early and re-tune itself.
        drafter.model.generation_config.num_assistant_tokens = rules.k
        drafter.model.generation_config.num_assistant_tokens_schedule = "constant"
        drafter.model.generation_config.assistant_confidence_threshold = 0.0

    def tokenize(self, text: str) -> list[int]:
        return tokenize(self._target.tokenizer, text)

    _check = None  # what every candidate generator is checked by, before its first step

    def _drafting(self) -> dict:
        """generate()'s arguments for a speculative run."""
        return {"assistant_model": self._drafter.model}

    def _prefill_s(self, input_ids, speculative: bool) -> float:
        models = [self._target.model] + ([self._drafter.model] if speculative and self._drafter else [])
        start = time.perf_counter()
        with torch.inference_mode():
            for model in models:
                model(input_ids=input_ids, logits_to_keep=1)
        synchronize(input_ids.device)
        return time.perf_counter() - start

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, speculative: bool) -> NativeGeneration:
        check_context_fits(prompt_ids, max_new_tokens, self._n_ctx)
        target = self._target.model
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
        prefill_s = self._prefill_s(input_ids, speculative)
        steps: list[tuple[int, int]] = []
        drafting = self._drafting() if speculative else {}
        recording = recording_steps(target, steps, self._check) if speculative else contextlib.nullcontext()
        start = time.perf_counter()
        with recording:
            sequences = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                        max_new_tokens=max_new_tokens, **drafting)
        generate_s = time.perf_counter() - start
        output = tuple(int(t) for t in sequences[0, len(prompt_ids):].tolist())
        stop_reason = "eos" if output and output[-1] in self._target.eog_ids else "max_new_tokens"
        return NativeGeneration(
            output_ids=output, stop_reason=stop_reason,
            counters=self._counters(steps, len(output)) if speculative else None,
            prefill_s=prefill_s,
            # The separate prefill is the same work generate() starts with; timer noise on a
            # tiny model must not make the rest negative.
            decode_s=max(generate_s - prefill_s, 0.0))

    def _counters(self, steps: list[tuple[int, int]], emitted: int) -> Counters:
        try:
            return Counters.from_steps([d for d, _ in steps], [a for _, a in steps], emitted, self._k)
        except CountsDoNotAddUp as error:
            # The hook reads transformers internals; a version that moved them must stop the
            # run rather than write counts that mean something else.
            raise RuntimeFailure(f"transformers {transformers.__version__}: assisted generation's step counts "
                                 f"do not add up: {error}") from None


class PromptLookupSession(AssistedSession):
    """HF's prompt lookup (module docstring): no drafter model; transformers' own settings are
    prompt_lookup_num_tokens = k and max_matching_ngram_size = the strategy's ngram_max."""

    notes = LOOKUP_NOTES
    _check = staticmethod(unfiltered)

    def __init__(self, target: LoadedModel, rules: DraftRules, strategy: Strategy, options: RuntimeOptions):
        """rules and strategy must pass check_lookup_rules (before loading the target)."""
        self._target, self._drafter = target, None
        self._k, self._ngram_max = rules.k, strategy.ngram_max
        self._n_ctx = options.n_ctx

    def _drafting(self) -> dict:
        return {"prompt_lookup_num_tokens": self._k, "max_matching_ngram_size": self._ngram_max}

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, speculative: bool) -> NativeGeneration:
        # Its last step may verify k drafted tokens past the budget: the same check as the driven loop's.
        check_context_fits(prompt_ids, max_new_tokens, self._n_ctx, self._k if speculative else 0)
        return super().generate(prompt_ids, max_new_tokens, speculative)
