"""exllamav3's own speculative decoding (its Generator), its per-round counts translated.

One greedy Job (ArgmaxSampler, the pair's EOS ids as stop tokens, dynamic drafting off) on a
new Generator per generation, with record_draft_stats=True; each round's (new tokens, window,
accepted) becomes a step. Rounds always draft k and never pass the budget, so step_accepted
equals crossrt's schedule's while step_drafted is k; a recurrent target's checkpoint boundary
ends a round (a note says so). The schedule and counts, with file:line in the 1.6.5 wheel:
docs/exllamav3.md, "Native mode".
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from crossrt.backends.exllamav3 import (PINNED_VERSION, Placement, TextModel, build_model, check_options,
                                        chunk_size, load_with_cache, page_round, text_model)
from crossrt.errors import SettingsError
from crossrt.run.runtime import DraftRules, NativeGeneration, NativeSession, RuntimeFailure, RuntimeOptions
from crossrt.speculative.schedules import check_context_fits
from crossrt.records.schema import Counters, CountsDoNotAddUp

SCHEDULE = "exllamav3"
# crossrt spec types (crossrt/run/runtime.py SPEC_TYPES) that exllamav3 drafts with a drafter model
SPEC_TYPES = ("draft", "dflash", "dflash2", "mtp", "dspark")
# Drafters that are a component of the target's own checkpoint: the drafter folder is the target's.
TARGET_COMPONENT_SPEC_TYPES = ("mtp", "dspark")
NOTES = (
    "counts from exllamav3's job.draft_stats, one (new_tokens, window, accepted) per verification round "
    "(generator.py:2001): steps = rounds, drafted = sum of windows, accepted = sum of accepted, checked "
    "against the job's accepted_draft_tokens and rejected_draft_tokens",
    "schedule exllamav3: crossrt's, except that every round verifies a full window of k, also when less "
    "budget is left; positions past the budget or a stop token count as rejected (generator.py:1931)",
    "unverified: tokens from rounds without a draft, from new_tokens between rounds (0 with a drafter "
    "model: every round drafts, generator.py:794)",
    "prefill_s, decode_s: the job's time_prefill (prompt[:-1] through target and drafter) and "
    "time_generate (every round), job.py:923-924",
)
RECURRENT_NOTE = (
    "the target has recurrent layers: exllamav3 stops accepting at a recurrent checkpoint boundary (a page "
    "boundary at least recurrent_checkpoint_interval={interval} tokens past the last checkpoint, job.py:1776-1801) "
    "and counts a draft token that matches there as rejected (generator.py:1955-1961, 1997-1998), so a round "
    "there accepts less than crossrt's schedule would; the output is unaffected"
)
DEFAULT_RECURRENT_CHECKPOINT_INTERVAL = 2048  # generator.py:415, unless the model's caps set one
DSPARK_NOTE = (
    "spec_type dspark: the DSpark drafter's confidence head caps each round's window whatever "
    "dynamic_draft_tokens says (generator.py:1356-1362, architecture/deepseek_v4_mtp.py:204): step_drafted is "
    "each round's window, and rounds where no position clears it draft nothing (their tokens are unverified)"
)


def check_rules(rules: DraftRules) -> None:
    if not rules.fixed:
        raise SettingsError(
            f"exllamav3 drafts a fixed window of num_draft_tokens={rules.k} with dynamic drafting off: it has no "
            f"n_min or p_min drafting rules (got n_min={rules.n_min}, p_min={rules.p_min}); "
            "leave --draft-n-min and --draft-p-min unset")


def drafting_kind(caps: dict, architecture: str, target_component: bool = False) -> str:
    """The spec type a drafter model gives the Generator, which picks its drafting from the
    drafter's caps (generator.py:425-426, 799-804). A DFlash-drafting component of the target's
    own checkpoint is DeepSeek-V4's DSpark block drafter (architecture/deepseek_v4_mtp.py:20-28, 212);
    an MTP drafter may be the target's component or a folder of its own (Gemma4 assistants,
    architecture/gemma4_assistant.py:271)."""
    if caps.get("dflash_draft"):
        if target_component:
            return "dspark"
        return "dflash2" if architecture == "DFlash2DraftModel" else "dflash"
    if caps.get("mtp_draft"):
        return "mtp"
    return "draft"


def counters_from_rounds(rounds: Sequence[tuple[int, int, int]], accepted_total: int, rejected_total: int,
                         emitted: int, k: int) -> Counters:
    """Counters from job.draft_stats and the job's totals; RuntimeFailure when they disagree,
    which means exllamav3 counts differently from the version read here."""
    step_drafted = tuple(int(window) for _, window, _ in rounds)
    step_accepted = tuple(int(accepted) for _, _, accepted in rounds)
    problems = []
    # A round emits its accepted tokens and one of its own; new_tokens growing by more between
    # rounds came from rounds that drafted nothing, which draft_stats does not list.
    unverified, previous = 0, 0
    for new_tokens, _, accepted in rounds:
        extra = new_tokens - previous - (accepted + 1)
        if extra < 0:
            problems.append(f"a round at new_tokens {new_tokens} accepted {accepted} "
                            f"but emitted {new_tokens - previous}")
        unverified += extra
        previous = new_tokens
    unverified += emitted - previous
    if sum(step_accepted) != accepted_total:
        problems.append(f"rounds accept {sum(step_accepted)}, the job counts {accepted_total}")
    if sum(step_drafted) != accepted_total + rejected_total:
        problems.append(f"rounds draft {sum(step_drafted)}, the job counts {accepted_total} accepted "
                        f"+ {rejected_total} rejected")
    try:
        counters = Counters.from_steps(step_drafted, step_accepted, emitted, k, unverified)
    except CountsDoNotAddUp as error:
        problems += error.problems
    if problems:
        raise RuntimeFailure(f"exllamav3 (read at {PINNED_VERSION}): its draft statistics do not add up: "
                             + "; ".join(problems))
    return counters


class GeneratorSession(NativeSession):
    schedule = SCHEDULE

    def __init__(self, target: TextModel, drafter, drafter_cache, rules: DraftRules, options: RuntimeOptions,
                 capacity: int, placements: tuple[Placement, ...]):
        self._target = target
        self._drafter = drafter
        self._drafter_cache = drafter_cache
        self._k = rules.k
        self._n_ctx = options.n_ctx
        self._chunk = chunk_size(capacity)
        self.placements = placements
        notes = NOTES + (f"spec_type {rules.spec_type}; greedy through ArgmaxSampler, dynamic_draft_tokens off",)
        if target.model.caps.get("recurrent_states"):
            interval = target.model.caps.get("default_recurrent_checkpoint_interval",
                                             DEFAULT_RECURRENT_CHECKPOINT_INTERVAL)
            notes += (RECURRENT_NOTE.format(interval=interval),)
        if rules.spec_type == "dspark":
            notes += (DSPARK_NOTE,)
        self.notes = notes

    def tokenize(self, text: str) -> list[int]:
        return self._target.tokenize(text)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, speculative: bool) -> NativeGeneration:
        import exllamav3
        import torch

        check_context_fits(prompt_ids, max_new_tokens, self._n_ctx)
        drafting = {}
        if speculative:
            # Every switch that would change the window is given explicitly, at its off value.
            drafting = dict(draft_model=self._drafter, draft_cache=self._drafter_cache, num_draft_tokens=self._k,
                            record_draft_stats=True, dynamic_draft_tokens=False, ngram_match_min=0,
                            hybrid_draft_tokens=0, draft_max_rows=0, sparse_draft_head=0)
        target = self._target
        generator = exllamav3.Generator(target.model, target.cache, target.tokenizer, max_batch_size=1,
                                        max_chunk_size=self._chunk, **drafting)
        job = exllamav3.Job(input_ids=torch.tensor([list(prompt_ids)], dtype=torch.long),
                            max_new_tokens=max_new_tokens, sampler=exllamav3.ArgmaxSampler(),
                            stop_conditions=sorted(target.eog_ids))
        final = None
        try:
            generator.enqueue(job)
            while generator.num_remaining_jobs():
                for result in generator.iterate():
                    if result["stage"] == "error":
                        raise RuntimeFailure(f"exllamav3's generator failed: {result['error']!r}")
                    if result["eos"]:
                        final = result
        except (AssertionError, RuntimeError) as error:
            raise RuntimeFailure(f"exllamav3's generator failed: {error!r}") from error
        finally:
            generator.close()
        # The job's sequence holds prompt and every sampled token, the stop token included.
        output = tuple(job.sequences[0].sequence_ids.torch()[0, len(prompt_ids):].tolist())
        if final is None or final.get("eos_reason") not in ("stop_token", "max_new_tokens") \
                or final["new_tokens"] != len(output):
            raise RuntimeFailure(f"exllamav3's job ended unexpectedly: {final and final.get('eos_reason')}, "
                                 f"{len(output)} tokens")
        counters = None
        if speculative:
            counters = counters_from_rounds(job.draft_stats, final["accepted_draft_tokens"],
                                            final["rejected_draft_tokens"], len(output), self._k)
        return NativeGeneration(output_ids=output,
                                stop_reason="eos" if final["eos_reason"] == "stop_token" else "max_new_tokens",
                                counters=counters, prefill_s=final["time_prefill"], decode_s=final["time_generate"])

    def close(self) -> None:
        if self._drafter is not None:
            for model in (self._target.model, self._drafter):
                model.unload()
            self._drafter = None


def open_generator_session(target_path: Path, drafter_path: Path, rules: DraftRules,
                           options: RuntimeOptions) -> GeneratorSession:
    """Load drafter then target (the target's load reserves room for the states a DFlash drafter
    taps, model/model.py:585-588) with caches of the same size (generator.py:257-258)."""
    check_rules(rules)
    check_options(options)
    spec_type = rules.spec_type
    if spec_type not in SPEC_TYPES:
        # n-gram drafting (Generator ngram_match_min: a suffix automaton over the job's own
        # context, generator.py:1391, job.py:1899) needs no drafter and a minimum match length
        # crossrt has no setting for; EAGLE3 drafters exllamav3 does not have.
        raise SettingsError(f"exllamav3 runs spec types {', '.join(SPEC_TYPES)} through crossrt, not {spec_type!r}")
    target_config, target_model = build_model(target_path)
    # A drafter named by the target's own folder is the checkpoint's "mtp" component, sharing the
    # target's config, as exllamav3's model_init does (model_init.py:216, 245-246, 284-287).
    target_component = spec_type in TARGET_COMPONENT_SPEC_TYPES and drafter_path.resolve() == target_path.resolve()
    if target_component:
        drafter_config, drafter = build_model(drafter_path, component="mtp", config=target_config)
    elif spec_type == "dspark":
        raise SettingsError(f"spec_type dspark drafts with the DSpark block of the target's own checkpoint: name the "
                         f"target's folder as the drafter too (got {drafter_path})")
    else:
        drafter_config, drafter = build_model(drafter_path)
    kind = drafting_kind(drafter.caps, drafter_config.architecture, target_component)
    if kind != spec_type:
        raise SettingsError(f"spec_type {spec_type} but {drafter_path} is a {drafter_config.architecture} "
                         f"({kind} drafting)")
    if kind in ("dflash", "dflash2") and rules.k > drafter_config.block_size - 1:
        raise SettingsError(f"{drafter_config.architecture} drafts blocks of {drafter_config.block_size}: "
                         f"k is at most {drafter_config.block_size - 1}")
    if target_model.caps.get("recurrent_states") or drafter.caps.get("recurrent_states"):
        # A speculative pass over k tokens must be undoable (generator.py:378-389).
        history = rules.k
    else:
        history = 0
    # Room for the prompt, the budget and one window past it (job.py:1287-1292).
    capacity = page_round(options.n_ctx + rules.k + 1)
    drafter_cache, drafter_placement = load_with_cache(drafter, capacity, options, history)
    target_cache, target_placement = load_with_cache(target_model, capacity, options, history, draft_model=drafter)
    target = text_model(target_config, target_model, target_cache)
    return GeneratorSession(target, drafter, drafter_cache, rules, options, capacity,
                            (target_placement, drafter_placement))
