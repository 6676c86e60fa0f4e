"""Drafting by lookup: the draftings that copy tokens from the context instead of asking a drafter
model, one module per proposer (crossrt's own, transformers', llama.cpp's, vLLM's), and the one table the
rest of crossrt reads them from: the strategy's choices and checks, the loop's drafter, --help.

A proposer reproduced from a runtime is exact only under the schedules of the runtimes that run it
(llama.cpp's n-gram types cut their drafts as llama-server and llama-speculative-simple do, vLLM's
as its scheduler does): `schedules` names them, and the loop refuses any other. Whether a lookup's
state outlives a prompt is the reproduced runtime's: llama-server serves a run's prompts from one
process, llama-speculative-simple starts one per prompt (Lookup.kept_across_prompts).
docs/ngram.md sets the algorithms side by side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from crossrt.speculative.lookup.base import LookupDrafter
from crossrt.speculative.lookup.crossrt_lookup import PromptLookup
from crossrt.speculative.lookup.hf_lookup import HfPromptLookup
from crossrt.speculative.lookup.llama_ngram import LlamaNgramCache, LlamaNgramMap, LlamaNgramMod, LlamaNgramSimple
from crossrt.speculative.lookup.vllm_ngram import VllmNgram
from crossrt.speculative.schedules import LLAMA_SCHEDULES, SERVER, VLLM


@dataclass(frozen=True)
class LookupSettings:
    """What a lookup drafter is built from: the strategy's n-gram lengths, the run's k, the
    target's end-of-generation ids and those after which the schedule ends a draft."""

    ngram_max: int
    ngram_min: int
    k: int
    eog: frozenset[int]
    ends: frozenset[int]


# The schedules whose runtime serves all of a run's prompts from one process, so a lookup's state
# can outlive a prompt there (llama-server); under the others every prompt begins afresh.
ONE_PROCESS_SCHEDULES = (SERVER,)


@dataclass(frozen=True)
class Lookup:
    name: str  # the --drafting value
    about: str  # what it is, for --help
    label: str  # the strategy label, formatted with ngram_min and ngram_max
    build: Callable[[LookupSettings], LookupDrafter]
    has_ngram_min: bool = False  # whether it looks down to a shortest n-gram of its own
    # The schedules it is exact under, at fixed k, greedy; (): any non-llama schedule.
    schedules: tuple[str, ...] = ()
    # Its state outlives a prompt where the runtime keeps it across requests (kept_across_prompts):
    # one drafter then serves a run's prompts in order (crossrt/run/driver.py), begun on each.
    per_run: bool = False

    def kept_across_prompts(self, schedule: str) -> bool:
        """Whether one drafter serves a run's prompts in order under schedule: its state outlives
        a prompt (per_run) and the runtime that schedule reproduces keeps it (one process)."""
        return self.per_run and schedule in ONE_PROCESS_SCHEDULES


LOOKUPS = {lookup.name: lookup for lookup in (
    Lookup("prompt-lookup", "crossrt's own: the token after the most recent match of the longest suffix, from "
           "--ngram-max down to --ngram-min, again for each draft token",
           "prompt-lookup({ngram_min}-{ngram_max})",
           lambda s: PromptLookup(s.ngram_max, s.ngram_min, s.ends), has_ngram_min=True),
    Lookup("hf-prompt-lookup", "transformers' prompt lookup exactly; on the transformers runtime's native mode, "
           "transformers' own", "hf-prompt-lookup(max={ngram_max})",
           lambda s: HfPromptLookup(s.ngram_max, s.eog)),  # its own EOS cut, whatever the schedule
    Lookup("llama-ngram-simple", "llama.cpp's ngram-simple exactly, size_n = --ngram-max, size_m = k; schedules "
           "llama-server, llama-spec-simple", "llama-ngram-simple(n={ngram_max})",
           lambda s: LlamaNgramSimple(s.ngram_max, s.k), schedules=LLAMA_SCHEDULES),
    Lookup("llama-ngram-map-k", "llama.cpp's ngram-map-k exactly, size_n = --ngram-max, size_m = k; schedules "
           "llama-server, llama-spec-simple", "llama-ngram-map-k(n={ngram_max})",
           lambda s: LlamaNgramMap(s.ngram_max, s.k, key_only=True), schedules=LLAMA_SCHEDULES, per_run=True),
    Lookup("llama-ngram-map-k4v", "llama.cpp's ngram-map-k4v exactly, size_n = --ngram-max, size_m = k, "
           "min_hits 1; schedules llama-server, llama-spec-simple", "llama-ngram-map-k4v(n={ngram_max})",
           lambda s: LlamaNgramMap(s.ngram_max, s.k, key_only=False), schedules=LLAMA_SCHEDULES, per_run=True),
    # n_min is crossrt's n_min (a shorter draft is dropped), which these schedules fix at k.
    Lookup("llama-ngram-mod", "llama.cpp's ngram-mod exactly, n_match = --ngram-max, n_max = n_min = k; schedules "
           "llama-server, llama-spec-simple", "llama-ngram-mod(n={ngram_max})",
           lambda s: LlamaNgramMod(s.ngram_max, s.k, s.k), schedules=LLAMA_SCHEDULES, per_run=True),
    Lookup("llama-ngram-cache", "llama.cpp's ngram-cache exactly, without cache files: 1- to 4-grams, 8 tokens "
           "(--ngram-max 4 --k 8 only); schedules llama-server, llama-spec-simple", "llama-ngram-cache(n={ngram_max})",
           lambda s: LlamaNgramCache(s.k, s.ngram_max), schedules=LLAMA_SCHEDULES, per_run=True),
    Lookup("vllm-ngram", "vLLM's ngram method exactly, prompt_lookup_max = --ngram-max, prompt_lookup_min = "
           "--ngram-min, num_speculative_tokens = k; schedule vllm; on the vllm runtime's native mode, vLLM's own",
           "vllm-ngram({ngram_min}-{ngram_max})",
           lambda s: VllmNgram(s.ngram_max, s.ngram_min), has_ngram_min=True, schedules=(VLLM,)),
)}
