"""Re-scoring a token sequence on the runtime that produced a record, to compare logits.

Greedy tokens can agree while logits do not (a wrong rope permutation still gives ~95% equal
argmax on small models), so parity and diff look at the logits themselves: the target scores
prompt + output in one pass and the rows that predicted each output token are compared.
Native-only runtimes are scored by their in-process sibling at the same commit.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from crossrt.errors import ComparisonError
from crossrt.run.runtime import ModelSession, Rows, RuntimeOptions, RuntimeUnavailable, open_runtime, runtime_class
from crossrt.records.schema import RunRecord, RuntimeInfo


def scoring_runtime(runtime: RuntimeInfo) -> str:
    """The runtime whose forward pass scores sequences for a record made on runtime."""
    cls = runtime_class(runtime.name)
    if "driven" in cls.modes:
        return runtime.name
    scorer = cls.scorer(runtime)
    if scorer is None:
        raise RuntimeUnavailable(f"runtime {runtime.name!r} cannot re-score outputs and names no in-process "
                                 "sibling that can: pass --no-logits")
    return scorer


def scorer_key(record: RunRecord, role: str = "target") -> tuple:
    """What a scorer's computation depends on: its runtime, the file it loads and the numerics
    that runtime reports (n_ctx only sizes the cache). Two scorings with one key compute the same
    rows, so one serves both (DecodedRows)."""
    return (scoring_runtime(record.runtime), getattr(record.pair, role).path, record.runtime.kv_cache,
            record.runtime.flash_attn, record.runtime.dtype)


class DecodedRows:
    """One-token-decode rows (score_stepwise) of the scorers another check will score on again:
    the float control's scoring of a float32 model is the very scoring its runs ran (transformers
    in float32), so the verification-path check's decodes serve it and no model loads twice.
    Only the keys asked for are kept (a real model's row is a vocabulary of float64s)."""

    def __init__(self, wanted=frozenset()):
        self.wanted = frozenset(wanted)
        self._rows: dict[tuple, np.ndarray] = {}

    def decode(self, key: tuple, session: ModelSession, prompt_id: str, prompt_ids: Sequence[int],
               output_ids: Sequence[int], rows: int, least: int = 0,
               beyond: int = 0) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """score_stepwise's first rows rows, and score_stepwise_beyond's first beyond rows with
        their tokens (0: none), from one decode: both are the same decodes along output_ids, so a
        noise control continuing past the output does not decode those rows again. Where key is
        wanted, at least least rows are decoded and kept for get()."""
        kept = max(rows, min(least, len(output_ids))) if key in self.wanted else 0
        decoded, tokens = score_stepwise_beyond(session, prompt_ids, output_ids, max(rows, kept, beyond))
        if kept:
            # a copy where the decodes went on: the rows past kept are not held for get()
            self._rows[key, prompt_id] = decoded[:kept].copy() if len(decoded) > kept else decoded
        return decoded[:rows], decoded[:beyond], tokens[:beyond]

    def get(self, key: tuple, prompt_id: str, rows: int) -> Optional[np.ndarray]:
        """The first rows kept rows of a prompt, or None where fewer were decoded."""
        found = self._rows.get((key, prompt_id))
        return found[:rows] if found is not None and len(found) >= rows else None


def open_scorer(record: RunRecord, role: str = "target", threads: int = 1) -> ModelSession:
    """The record's target (or drafter) loaded on its scoring runtime, with the record's KV
    cache type and flash attention."""
    name = scoring_runtime(record.runtime)
    model = record.pair.target if role == "target" else record.pair.drafter
    if model is None:
        raise ComparisonError(f"{record.runtime.name}'s record names no {role} model file to re-score with")
    options = RuntimeOptions(n_ctx=record.params.n_ctx, threads=threads,
                             f32_kv_cache=record.runtime.kv_cache == "f32",
                             flash_attn=record.runtime.flash_attn is not False, dtype=record.runtime.dtype)
    with _LOADING:
        return open_runtime(name, options).load(Path(model.path))


# Loads take turns: a load sets process-wide state (transformers': torch's threads, the parse of
# tokenizer.json) while the drafters' checks may score beside the targets' (verification.py).
_LOADING = threading.Lock()


def score(session: ModelSession, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> np.ndarray:
    """Logits rows that predict each of output_ids after prompt_ids: shape (len(output_ids), vocab).
    The last output token is not fed: no row needs it."""
    session.truncate(0)
    sequence = list(prompt_ids) + list(output_ids[:-1])
    rows = session.eval(sequence, Rows.ALL)
    return np.array(rows[len(prompt_ids) - 1:], dtype=np.float64)


def score_stepwise(session: ModelSession, prompt_ids: Sequence[int], output_ids: Sequence[int],
                   rows: int) -> np.ndarray:
    """The first rows rows score() gives, computed as a prompt pass and then one-token decodes."""
    session.truncate(0)
    found = [np.asarray(session.eval(list(prompt_ids), Rows.LAST)[0], dtype=np.float64)]
    for token in output_ids[:rows - 1]:
        found.append(np.asarray(session.eval([token], Rows.LAST)[0], dtype=np.float64))
    return np.array(found)


def score_stepwise_beyond(session: ModelSession, prompt_ids: Sequence[int], output_ids: Sequence[int],
                          rows: int) -> tuple[np.ndarray, list[int]]:
    """rows rows of score_stepwise along output_ids and, past its end, along the greedy
    continuation the decodes themselves choose (plain greedy decoding all the way); with the
    rows tokens they predict, for score() to compute the same rows as one pass."""
    session.truncate(0)
    row = np.asarray(session.eval(list(prompt_ids), Rows.LAST)[0], dtype=np.float64)
    found, tokens = [row], []
    while True:
        tokens.append(int(output_ids[len(tokens)]) if len(tokens) < len(output_ids) else int(np.argmax(row)))
        if len(found) == rows:
            return np.array(found), tokens
        row = np.asarray(session.eval([tokens[-1]], Rows.LAST)[0], dtype=np.float64)
        found.append(row)


def row_in_pass(session: ModelSession, prefix: Sequence[int], following: Sequence[int], shape: int) -> np.ndarray:
    """The logits row predicting the token after prefix, computed as the first row of a pass of
    shape tokens (prefix[-1] then following[:shape - 1]) after the rest of prefix is cached:
    shape 1 is a one-token decode, shape 1 + k a verification batch of k drafts; a shape of at
    least len(prefix) is one pass over the whole prefix (a prompt pass), its last row. Rows
    after the first do not change it but for rounding: the batch shape is what is reproduced."""
    session.truncate(0)
    if shape >= len(prefix):
        return np.array(session.eval(list(prefix), Rows.LAST)[0], dtype=np.float64)
    if len(prefix) > 1:
        session.eval(list(prefix[:-1]), Rows.NONE)
    batch = [prefix[-1]] + list(following[:shape - 1])
    return np.array(session.eval(batch, Rows.ALL)[0], dtype=np.float64)


@dataclass(frozen=True)
class LogitAgreement:
    """How closely two runtimes' logits agree over the same positions: the absolute logit
    differences, and the statistics llama.cpp's `llama-perplexity --kl-divergence` prints when
    two builds or quantizations are compared (tools/perplexity/perplexity.cpp): KL divergence
    of B's token distribution from A's (A the reference), and the change of the probability of
    the emitted token (Δp = p_B - p_A)."""

    positions: int
    max_abs_diff: float
    mean_abs_diff: float
    top1_agreement: float  # share of positions with the same argmax ("Same top p")
    top5_overlap: float  # mean share of the top-5 tokens both runtimes rank in their top 5
    kl_mean: float = 0.0
    kl_median: float = 0.0
    kl_p99: float = 0.0
    kl_max: float = 0.0
    rms_delta_p: float = 0.0
    # At each position whose argmaxes differ, the near-tie flip between them (crossrt/speculative/numerics.py:
    # how far A's row put B's choice below its own, plus the same of B's row): a flip within a
    # tolerance's near-tie threshold is a near-tie, which numerics may break either way.
    top1_flips: tuple[float, ...] = ()

    def top1_beyond_near_ties(self, near_tie_flip: float) -> float:
        """The share of positions with the same argmax, counting a differing argmax at a
        near-tie (flip within near_tie_flip) as the same."""
        ties = sum(1 for flip in self.top1_flips if flip <= near_tie_flip)
        return self.top1_agreement + ties / self.positions if self.positions else self.top1_agreement


def top_k(rows: np.ndarray, k: int) -> np.ndarray:
    """The k highest entries' indices of each row, highest first, ties to the lower index: what a
    stable argsort of -rows gives, without sorting a whole row (a 262,144-entry vocabulary made
    the full sort most of `parity`'s logit checks on a real model)."""
    rows = np.asarray(rows)
    flat = rows.reshape(-1, rows.shape[-1])
    k = min(k, flat.shape[-1])
    if len(flat) == 0 or k == 0:
        return np.zeros(rows.shape[:-1] + (k,), dtype=np.intp)
    kth = np.partition(flat, flat.shape[-1] - k, axis=-1)[:, -k]  # each row's k-th highest value
    out = np.empty((len(flat), k), dtype=np.intp)
    for i, (row, threshold) in enumerate(zip(flat, kth)):
        candidates = np.flatnonzero(row >= threshold)  # every tie at the threshold, so the order is exact
        if len(candidates) < k:  # NaNs in the row: sort it whole, as argsort places them
            out[i] = np.argsort(-row, kind="stable")[:k]
            continue
        out[i] = candidates[np.lexsort((candidates, -row[candidates]))[:k]]
    return out.reshape(rows.shape[:-1] + (k,))


def log_softmax(rows: np.ndarray, in_place: bool = False) -> np.ndarray:
    """Each row's log-probabilities; in_place: written over rows (float rows only)."""
    shifted = np.subtract(rows, rows.max(axis=-1, keepdims=True), out=rows if in_place else None)
    shifted -= np.log(np.exp(shifted).sum(axis=-1, keepdims=True))  # in place: a real model's rows are large
    return shifted


class ScoredRows:
    """One run's logits rows with what agreement reads of each row computed once, on first
    use: its top 5 and its log-probabilities (its probabilities are computed per comparison). A parity of n runs compares each run's rows with
    n - 1 others; every statistic is per row, so a prefix of the rows (the positions two runs
    share) reads a prefix of these."""

    def __init__(self, logits: np.ndarray):
        self.logits = np.asarray(logits)

    def __len__(self) -> int:
        return len(self.logits)

    @functools.cached_property
    def top5(self) -> np.ndarray:
        return top_k(self.logits, 5)

    @functools.cached_property
    def log_probs(self) -> np.ndarray:
        return log_softmax(self.logits)

    def prefix(self, rows: int) -> "ScoredRows":
        """The first rows rows, sharing what was computed of them (computing it here if not yet)."""
        part = ScoredRows(self.logits[:rows])
        part.__dict__.update(top5=self.top5[:rows], log_probs=self.log_probs[:rows])
        return part


def logits_of(rows) -> np.ndarray:
    """The logits rows of an array or of ScoredRows."""
    return rows.logits if isinstance(rows, ScoredRows) else np.asarray(rows)


@dataclass(frozen=True)
class RowStatistics:
    """What an agreement reads of each compared row, before it is summarized: rows of many
    prompts are pooled by concatenating these, never the rows themselves (a real model's
    rows are a 262,144-entry vocabulary of float64s each)."""

    max_abs: np.ndarray
    sum_abs: np.ndarray
    same_top1: np.ndarray
    top5_overlap: np.ndarray
    kl: np.ndarray
    delta_p: np.ndarray
    flips: tuple[float, ...]
    width: int  # entries per row

    def summary(self) -> LogitAgreement:
        n = len(self.kl)
        if n == 0:
            return LogitAgreement(0, 0.0, 0.0, 1.0, 1.0)
        return LogitAgreement(n, float(self.max_abs.max()), float(self.sum_abs.sum() / (n * self.width)),
                              float(np.mean(self.same_top1)), float(np.mean(self.top5_overlap)),
                              float(self.kl.mean()), float(np.median(self.kl)), float(np.percentile(self.kl, 99)),
                              float(self.kl.max()), float(np.sqrt(np.mean(self.delta_p ** 2))), self.flips)

    @classmethod
    def joined(cls, parts: Sequence["RowStatistics"]) -> "RowStatistics":
        parts = [part for part in parts if len(part.kl)]
        if not parts:
            return cls(*(np.zeros(0),) * 6, (), 1)
        return cls(*(np.concatenate([getattr(part, name) for part in parts])
                     for name in ("max_abs", "sum_abs", "same_top1", "top5_overlap", "kl", "delta_p")),
                   tuple(flip for part in parts for flip in part.flips), parts[0].width)


def row_statistics(a, b, tokens: Optional[Sequence[int]] = None, length: Optional[int] = None) -> RowStatistics:
    """What agreement() summarizes, row by row (arguments as agreement's)."""
    a, b = (rows if isinstance(rows, ScoredRows) else ScoredRows(rows) for rows in (a, b))
    if a.logits.shape[1:] != b.logits.shape[1:] or (length is None and len(a) != len(b)):
        raise ComparisonError(f"logit shapes differ: {a.logits.shape} vs {b.logits.shape} "
                              "(different vocabulary sizes?)")
    n = len(a) if length is None else length
    width = int(a.logits.shape[-1]) if a.logits.ndim > 1 else 1
    if n == 0:
        return RowStatistics.joined(())
    difference = np.subtract(a.logits[:n], b.logits[:n])
    np.abs(difference, out=difference)  # in place: a real model's rows are 2 MB each
    top_a, top_b = a.top5[:n], b.top5[:n]
    overlap = np.array([len(set(x) & set(y)) / 5 for x, y in zip(top_a, top_b, strict=True)])
    log_a, log_b = a.log_probs[:n], b.log_probs[:n]
    probs_a = np.exp(log_a)  # per comparison: kept per run it would be a third copy of every run's rows
    terms = np.subtract(log_a, log_b)
    terms *= probs_a
    kl = np.maximum(terms.sum(axis=-1), 0.0)  # rounding can dip below 0
    emitted = np.asarray(tokens if tokens is not None else top_a[:, 0])
    rows = np.arange(n)
    delta_p = np.exp(log_b[rows, emitted]) - probs_a[rows, emitted]
    first_a, first_b = top_a[:, 0], top_b[:, 0]
    return RowStatistics(difference.max(axis=-1), difference.sum(axis=-1), first_a == first_b, overlap, kl,
                         delta_p, argmax_flips(a.logits[:n], b.logits[:n], first_a, first_b), width)


def agreement(a, b, tokens: Optional[Sequence[int]] = None, length: Optional[int] = None) -> LogitAgreement:
    """The agreement of rows a and b (arrays, or ScoredRows to reuse what was computed of them),
    over their first length rows (default all). tokens: the token emitted at each position
    (for Δp); default A's top-1."""
    return row_statistics(a, b, tokens, length).summary()


def argmax_flips(a: np.ndarray, b: np.ndarray, top_a: np.ndarray, top_b: np.ndarray) -> tuple[float, ...]:
    """At each row whose argmaxes (top_a, top_b) differ, the near-tie flip between them: how far
    A's row put B's choice below its own, plus the same of B's row (LogitAgreement.top1_flips)."""
    differ = np.flatnonzero(top_a != top_b)
    return tuple(float(a[i, top_a[i]] - a[i, top_b[i]] + b[i, top_b[i]] - b[i, top_a[i]]) for i in differ)
