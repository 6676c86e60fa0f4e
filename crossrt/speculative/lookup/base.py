"""What every lookup drafter shares: it copies tokens from the context it is given, so it holds
no cache and has nothing to prefill, mirror or cut back (crossrt/speculative/drafters.py's Drafter)."""

from __future__ import annotations

from typing import Sequence

from crossrt.speculative.acceptance import Proposal


class LookupDrafter:
    """A drafter without a model; calls counts its lookups (what a record states as drafter calls)."""

    sessions: tuple = ()
    past_budget = False  # transformers' drafts run past the budget (HfPromptLookup)
    own_n_min = False

    def __init__(self):
        self.calls = 0

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        raise NotImplementedError

    def prefill(self, ids: Sequence[int]) -> None:
        """Nothing to cache: every lookup reads the context it is given."""

    def mirror(self, n_keep: int, batch: Sequence[int]) -> None:
        """Nothing cached to mirror."""

    def keep(self, n_keep: int) -> None:
        """Nothing cached past the context."""
