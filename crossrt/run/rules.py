"""A run's drafting rules, built in one place with their checks and what a run should be warned
of: `crossrt run`, reproduce's claims, parity's matrix cells and sweep cells build them here
(`run_rules`). Simulations, benches and tests that replay or probe a loop build DraftRules
directly."""

from __future__ import annotations

from typing import Optional

from crossrt.run.runtime import DraftRules, runtime_class
from crossrt.speculative.schedules import LLAMA_SCHEDULES



def run_rules(runtime: str, mode: str, schedule: str, max_new_tokens: int, k: int, n_min: Optional[int] = None,
              p_min: float = 0.0, spec_type: str = "draft") -> tuple[DraftRules, tuple[str, ...]]:
    """The DraftRules of a run of runtime in mode (under schedule where driven), checked
    (SettingsError where they contradict each other), and the warnings the run deserves."""
    rules = DraftRules(k, n_min, p_min, spec_type)
    # llama.cpp's runtimes and schedules drop drafts shorter than n_min, and a draft is at most
    # max_new_tokens - 1 long: with n_min at k (its default), a large k drafts nothing. The runtime
    # is looked up only then: a sweep plans runtimes this machine may not import.
    if rules.n_min >= max_new_tokens and (
            "n_min" in runtime_class(runtime).drafting_rules if mode == "native" else schedule in LLAMA_SCHEDULES):
        return rules, (f"--k {k}: llama.cpp drops drafts shorter than draft-n-min {rules.n_min}, and no draft fits "
                       f"in --max-new-tokens {max_new_tokens}: nothing will be drafted; lower --k or --draft-n-min",)
    return rules, ()
