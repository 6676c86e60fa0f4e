"""HF transformers' own speculative decoding ("assisted generation"), its steps counted.

generate(assistant_model=...) reports no acceptance statistics, so the session wraps the
candidate generator's update_candidate_strategy, called once per verification step, without
changing what it does: drafted = score rows - 1, accepted = num_matches. PromptLookupSession
is the same loop with HF's prompt-lookup generator. HF's schedule, line by line (transformers
5.24): docs/schedules.md, "transformers' assisted generation, step by step".
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
from crossrt.speculative.schedules import check_context_fits
from crossrt.speculative.strategies import Strategy
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
