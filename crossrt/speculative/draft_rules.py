"""How drafts are made, as the loop and a runtime's own speculative decoding are both given it:
`DraftRules` (k, and llama.cpp's n_min and p_min) with the spec types a run may draft by. The
runtime contract (crossrt/run/runtime.py) gives these names too, so a backend imports the whole
contract from one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from crossrt.errors import SettingsError

# How drafts are made. "draft": a drafter model (every runtime); the others are native
# drafting methods some runtimes have (llama.cpp's n-gram and MTP/EAGLE3/DFlash drafting,
# exllamav3's block drafters), selected by a pair manifest's [defaults] spec_type.
SPEC_TYPES = ("draft", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache",
              "mtp", "eagle3", "dflash", "dflash2", "dspark")
# Spec types drafted by a head the runtime loads as its drafter file (llama.cpp's -md, vLLM's
# speculative model) reading the target's hidden states: `crossrt drafter eagle3` makes them.
HEAD_SPEC_TYPES = ("eagle3", "dflash")


# The longest draft crossrt runs: block drafters draft 16, llama.cpp's --draft-max is 16 by
# default; a k of 10^8 would allocate per-position counts of that length before the first prompt.
K_LIMIT = 256


@dataclass(frozen=True)
class DraftRules:
    """How drafts are made: up to k tokens; llama.cpp's drafting rules add n_min (shorter
    drafts are thrown away) and p_min (drafting stops when the drafter's top-10 softmax
    probability of its choice falls below it). n_min defaults to k: fixed-length drafts."""

    k: int
    n_min: Optional[int] = None
    p_min: float = 0.0
    spec_type: str = "draft"

    def __post_init__(self):
        if self.k < 1:
            raise SettingsError(f"k must be at least 1, got {self.k}")
        if self.k > K_LIMIT:
            raise SettingsError(f"k must be at most {K_LIMIT} (drafts longer than that are refused: every "
                                f"verification batch and per-position count grows with k), got {self.k}")
        if self.n_min is None:
            object.__setattr__(self, "n_min", self.k)
        if not 0 <= self.n_min <= self.k:
            raise SettingsError(f"n_min must be between 0 and k={self.k}, got {self.n_min}")
        if not 0.0 <= self.p_min <= 1.0:
            raise SettingsError(f"p_min must be between 0 and 1, got {self.p_min}")
        if self.spec_type not in SPEC_TYPES:
            raise SettingsError(f"unknown spec type {self.spec_type!r}; spec types: {', '.join(SPEC_TYPES)}")

    def require_drafter_model(self, where: str) -> None:
        """Refuse spec types other than a drafter model, for runtimes that have no other."""
        if self.spec_type != "draft":
            driven = (f" (or reproduce it: --drafting llama-{self.spec_type} --schedule llama-server)"
                      if self.spec_type.startswith("ngram-") else "")
            raise SettingsError(f"{where} drafts with a drafter model only (spec type 'draft'), not "
                             f"{self.spec_type!r}: run it natively on a runtime that has it (e.g. llama-server){driven}")

    @property
    def fixed(self) -> bool:
        """Every draft is k tokens unless the token budget cuts it."""
        return self.n_min == self.k and self.p_min == 0.0

    def kept(self, n_drafted: int) -> bool:
        """A draft shorter than n_min is thrown away."""
        return n_drafted >= self.n_min
