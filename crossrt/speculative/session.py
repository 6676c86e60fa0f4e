"""What a runtime opens: a session. A ModelSession owns one loaded model's KV cache and exposes
what crossrt's shared loop needs, nothing more: evaluate tokens after the cached ones and return
logits for the rows asked for (Rows), cut the cache back, tokenize and detokenize. A
NativeSession is a runtime's own speculative decoding of one pair (NativeGeneration per prompt).
Runtime.load and Runtime.open_native (crossrt/run/runtime.py) open them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Optional, Sequence

import numpy as np

from crossrt.errors import PromptRefused, SettingsError
from crossrt.records.schema import Counters, UnfitCounts
from crossrt.speculative.numerics import Choices, choose


class Rows(Enum):
    """Which logits rows an evaluation returns: asking for fewer keeps the runtime from
    computing and copying output rows nobody reads."""

    NONE = "none"
    LAST = "last"
    ALL = "all"


class ModelSession(abc.ABC):
    """One loaded model with its cache. Positions are implicit: eval appends after n_past.

    A session holds memory (on a GPU, device memory) until closed: use it as a context manager
    or hold it in the command's ExitStack, never leave it to the garbage collector."""

    n_vocab: int
    n_ctx: int
    eog_ids: frozenset[int]
    # The CPU threads the session computes with, where the runtime takes a count: a head drafting
    # beside it in torch takes as many (speculative/head_drafter.py).
    threads: Optional[int] = None
    _n_past: int = 0  # tokens in the cache: only eval and truncate change it
    _closed: bool = False

    def __enter__(self) -> "ModelSession":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Free the model and its cache; safe to call twice."""
        if not self._closed:
            self._closed = True
            self._release()

    @abc.abstractmethod
    def _release(self) -> None:
        """Free what the backend holds (weights, cache, buffers). Called once, by close."""

    @property
    def n_past(self) -> int:
        """Tokens currently held in the cache."""
        return self._n_past

    def eval(self, tokens: Sequence[int], rows: Rows) -> np.ndarray:
        """Append tokens to the cache and return logits, shape (rows, n_vocab).

        The array may be a view into the runtime's buffer, valid until the next call.
        """
        if len(tokens) == 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        if self._n_past + len(tokens) > self.n_ctx:
            raise PromptRefused(f"context full: {self._n_past} cached + {len(tokens)} new > n_ctx {self.n_ctx}")
        logits = self._forward(tokens, rows)
        self._n_past += len(tokens)
        return logits

    def eval_choices(self, tokens: Sequence[int], rows: Rows) -> tuple[np.ndarray, Choices]:
        """eval, and what each returned row chooses (numerics.choose): the loop's verification and
        prompt passes. A session that knows its choices without logits (an oracle,
        crossrt/simulate/oracle_sessions.py) returns them with no rows."""
        logits = self.eval(tokens, rows)
        return logits, choose(logits)

    @abc.abstractmethod
    def _forward(self, tokens: Sequence[int], rows: Rows) -> np.ndarray:
        """Run tokens at positions n_past, n_past + 1, ... with the cache; return the rows
        asked for. Called by eval, which checks the context and advances n_past."""

    def truncate(self, n_keep: int) -> None:
        """Drop every cached position from n_keep on (n_keep at or past n_past: nothing)."""
        n_keep = max(0, n_keep)
        if n_keep < self._n_past:
            self._drop(n_keep)
            self._n_past = n_keep

    @abc.abstractmethod
    def _drop(self, n_keep: int) -> None:
        """Remove cached positions n_keep..n_past-1 from the backend's cache (n_keep < n_past).
        Called by truncate, which then lowers n_past."""

    def tap_layers(self, layer_ids: Sequence[int], observer: Optional[Callable]) -> None:
        """From now on, after every eval of tokens at positions p0, p0 + 1, ..., call
        observer(p0, tokens, features): features a float32 array [len(tokens), len(layer_ids) x hidden], the model's
        inputs to those layers (a drafter head's reading of the target); observer None: stop.
        Runtimes whose hidden states crossrt cannot read refuse."""
        raise SettingsError(f"{type(self).__name__} cannot read its model's hidden states, which an EAGLE3 head "
                            "drafts from: run the head's driven reproduction on the transformers runtime")

    def input_embeddings(self):
        """The model's token embedding table (a torch tensor), which a head borrows."""
        raise SettingsError(f"{type(self).__name__} cannot share its token embeddings with a drafter head")

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of text, with the model's BOS when the model asks for one."""

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ids; invalid UTF-8 (a split multi-byte character) is replaced, not raised."""


@dataclass(frozen=True)
class NativeGeneration:
    """What a runtime's own speculative decoding produced for one prompt, its statistics
    already translated into crossrt's counters (None where the runtime does not report)."""

    output_ids: tuple[int, ...]
    stop_reason: str  # "eos" or "max_new_tokens"
    counters: Optional[Counters]  # None for a plain (baseline) generation
    prefill_s: float
    decode_s: float
    unfit_counts: Optional[UnfitCounts] = None  # the runtime's numbers, where they did not fit


class NativeSession(abc.ABC):
    """A runtime's own speculative decoding of one pair at one k (a server, a CLI tool).

    notes: what the runtime does not report or how a counter was derived, for the record.
    """

    schedule: str
    notes: tuple[str, ...] = ()
    # Settings the runtime fixes itself, which the record states instead of crossrt's options (an
    # attached server's context and drafting rules): (RunParams field, value), the value None
    # where the runtime does not report it.
    fixed_params: tuple[tuple[str, object], ...] = ()
    # True where its baseline and speculative processes do not fit in memory together
    # (crossrt.run.memory.plan_processes): one runs at a time, so the driver decodes every
    # baseline before the first speculative generation.
    one_at_a_time: bool = False

    @abc.abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of text as the runtime tokenizes it, BOS included."""

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, speculative: bool) -> NativeGeneration:
        """Greedy generation from prompt_ids: speculative, or plain for the baseline."""

    def close(self) -> None:
        """Release processes and files; safe to call twice."""

    def __enter__(self) -> "NativeSession":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
