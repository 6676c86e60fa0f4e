"""Passes a run did not record, reproduced in-process: how crossrt explains native runs itself.

A native runtime (llama-server, llama-speculative-simple, transformers' assisted generation)
reports tokens and counts, not the logits of the passes that chose them. When such a run leaves
its baseline or parts from another run, crossrt re-scores the context where it split on the
runtime's scoring sibling (the same llama.cpp commit in-process, or transformers itself), in
the pass shapes the native schedule used there: a verification batch of 1 + k tokens for the
speculative side, a one-token decode (or, for llama-server's first token, the prompt pass) for
the plain side; with the record's KV cache type, flash attention and threads. The two emitted
tokens' logits in those passes are then judged like recorded ones (crossrt/speculative/numerics.py).
A native output whose re-scored passes put its token far below the other is not reproduced:
that is reported as a finding about the runtime, never excused.

Models load once per (runtime, file, numerics) and stay loaded until the Replayer closes.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import numpy as np

from crossrt.speculative.numerics import Gap, rescored_gap
from crossrt.compare.rescore import open_scorer, row_in_pass, score, score_stepwise, scoring_runtime
from crossrt.run.runtime import ModelSession
from crossrt.records.schema import RunRecord


class Replayer:
    """Re-scored passes for crossrt/compare/diagnosis.py's Explainer; a context manager."""

    def __init__(self):
        self._stack = contextlib.ExitStack()
        self._sessions: dict[tuple, ModelSession] = {}
        self._gaps: dict[tuple, Gap] = {}  # a split is asked for by its lossless check and its cross-run links
        self.passes = 0  # re-scored passes run, for the report of what explaining cost
        self._heads: dict[tuple, tuple] = {}  # (head, its KV dtype and LM-head arithmetic as loaded)
        # The drafter rows of the split explained last: a counts split of two runs that draft on one
        # scorer asks for the same rows for each run (a native run and its driven twin, say).
        self._drafter: dict[tuple, np.ndarray] = {}
        self._drafter_split: Optional[tuple] = None  # (prompt ids, output ids) whose rows _drafter holds

    def __enter__(self) -> "Replayer":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @staticmethod
    def _key(record: RunRecord, role: str) -> tuple:
        model = record.pair.target if role == "target" else record.pair.drafter
        return (scoring_runtime(record.runtime), getattr(model, "path", None), record.runtime.kv_cache,
                record.runtime.flash_attn, record.runtime.threads or 1, record.params.n_ctx)

    def session(self, record: RunRecord, role: str) -> ModelSession:
        key = self._key(record, role)
        threads = record.runtime.threads or 1
        if key not in self._sessions:
            self._sessions[key] = self._stack.enter_context(open_scorer(record, role, threads))
        return self._sessions[key]

    def scorer_name(self, record: RunRecord) -> str:
        return scoring_runtime(record.runtime)

    def gap(self, record: RunRecord, prefix: Sequence[int], following: Sequence[int], shape: int,
            emitted: int, other: int) -> Gap:
        """How far a pass of shape tokens (crossrt.compare.rescore.row_in_pass) on the record's target
        puts other below emitted after prefix."""
        key = (self._key(record, "target"), tuple(prefix), tuple(following[:shape - 1]), shape, emitted, other)
        if key not in self._gaps:
            self.passes += 1
            row = row_in_pass(self.session(record, "target"), prefix, following, shape)
            self._gaps[key] = rescored_gap(row, emitted, other, f"re-scored {_shape(shape, len(prefix))}")
        return self._gaps[key]

    def drafter_rows(self, record: RunRecord, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> np.ndarray:
        """The record's drafter's logits rows predicting each output token, in one pass."""
        return self._drafter_rows(record, prompt_ids, output_ids, None)

    def drafter_rows_decoded(self, record: RunRecord, prompt_ids: Sequence[int], output_ids: Sequence[int],
                             rows: int) -> np.ndarray:
        """The first rows of drafter_rows, computed as one-token decodes (as a drafter drafts):
        how far the drafter's own batch shapes move its logits."""
        return self._drafter_rows(record, prompt_ids, output_ids, rows)

    def _drafter_rows(self, record: RunRecord, prompt_ids: Sequence[int], output_ids: Sequence[int],
                      decoded: Optional[int]) -> np.ndarray:
        """drafter_rows (decoded None) or drafter_rows_decoded, kept while the same prompt and
        output are explained: a real model's rows are 2 MB each, so another split's are let go."""
        split = (tuple(prompt_ids), tuple(output_ids))
        if split != self._drafter_split:
            self._drafter_split, self._drafter = split, {}
        key = (self._key(record, "drafter"), decoded)
        if key not in self._drafter:
            session = self.session(record, "drafter")
            self.passes += 1 if decoded is None else decoded
            self._drafter[key] = (score(session, prompt_ids, output_ids) if decoded is None
                                  else score_stepwise(session, prompt_ids, output_ids, decoded))
        return self._drafter[key]

    def head_counts(self, record: RunRecord, prompt_ids: Sequence[int], max_new_tokens: int,
                    variant: str) -> Optional[tuple[int, int, int]]:
        """(steps, drafted, accepted) of the record's head drafting one prompt, replayed by
        crossrt's loop on its target's scorer under the record's schedule and rules, in one of
        HEAD_VARIANTS' arithmetics; None where the record names no head folder."""
        from crossrt.speculative import loop
        from crossrt.speculative.head_drafter import head_folder, load_head
        from crossrt.run.runtime import DraftRules

        folder = head_folder(record.pair.drafter.path) if record.pair.drafter else None
        if folder is None:
            return None
        target = self.session(record, "target")
        key = (self._key(record, "target"), str(folder))
        if key not in self._heads:  # with the arithmetic it was loaded in: the run's KV type, its target's head
            head = load_head(record.params.spec_type, folder, target, record.runtime.kv_cache == "f32")
            self._heads[key] = (head, head.kv_dtype, getattr(head, "quantized_head", False))
        head, kv_dtype, quantized = self._heads[key]
        head.kv_dtype = None if variant == F32_KV else kv_dtype
        if hasattr(head, "quantized_head"):
            head.quantized_head = quantized and variant != FLOAT_HEAD
        params = record.params
        rules = DraftRules(params.k, params.draft_n_min, params.draft_p_min or 0.0, params.spec_type)
        generation = loop.speculative_generate(target, head, prompt_ids, rules, max_new_tokens, params.schedule)
        self.passes += len(generation.step_drafted) + 1
        return (len(generation.step_drafted), sum(generation.step_drafted), sum(generation.step_accepted))


# A head's drafting replayed in arithmetics runtimes use (crossrt/compare/diagnosis.py): as the
# run computes it (llama.cpp's: float16 keys and values unless the run asked for float32, 8-bit
# activations into a quantized borrowed LM head), with float32 keys and values, and with the LM
# head in float arithmetic.
AS_LOADED, F32_KV, FLOAT_HEAD = "as the run computes it", "float32 keys and values", "a float LM head"
HEAD_VARIANTS = (AS_LOADED, F32_KV, FLOAT_HEAD)


def _shape(shape: int, prefix: int) -> str:
    if shape >= prefix:
        return "prompt pass"
    return "one-token decode" if shape == 1 else f"{shape}-token batch"
