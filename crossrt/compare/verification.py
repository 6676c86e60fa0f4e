"""Parity's verification-path control (docs/parity.md): bugs that break speculative decoding only
where it verifies (a batch of drafts on a cache computed otherwise than one-token decodes) or
drafts (a drafter not rolled back) leave plain greedy decoding exact, so the float control cannot
see them. Each run's scorer, with the run's own numerics, re-scores the reference sequences as
runs verify and draft them, and four checks follow, each against a control the bug cannot widen:

- verification batches: their rows against one-token decodes and one pass, within FACTOR times
  the batch-shape noise (one pass against one-token decodes);
- nondeterminism: the same pass scored twice must agree (never absorbed into a noise control);
- drafter rollback: the drafter's decodes with rejected drafts rolled back against one pass;
- departures: a run leaving its baseline on more prompts than the measured verification-path
  noise makes plausible (a Poisson bound over its baselines' margins: departures.py).

The batch-shape noise also sets the near-tie threshold of the run's batch-shape splits
(diagnosis.Explainer.batch_threshold), tolerance.batch_shape_ceiling its ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from crossrt import progress
from crossrt.compare.beside import Beside
from crossrt.compare.control import CONTROL_ROWS, FACTOR, FLOAT32_EPS, demoted, noise_bounds, reference_sequences
from crossrt.compare.parity import OWN_BASELINE
from crossrt.compare.power import Power, find_power
from crossrt.compare.rescore import (DecodedRows, LogitAgreement, RowStatistics, ScoredRows, open_scorer,
                                     row_statistics, score, score_stepwise_beyond, scorer_key)
from crossrt.compare.splits import first_divergence
from crossrt.compare.tolerance import Tolerance
from crossrt.records.schema import RunRecord
from crossrt.speculative.numerics import gap_shifts
from crossrt.run.runtime import ModelSession, Rows

VERIFICATION, NONDETERMINISM, DEPARTURES = "verification batches", "nondeterminism", "departures"
DRAFTER = "drafter rollback"
DECODED_ROWS = 96  # one-token decodes per scorer, spread over the prompts (each a pass: the check's main cost)
LEAST_ROWS = 4  # decoded rows per prompt at least


@dataclass(frozen=True)
class BatchNoise:
    """A scorer's measured batch-shape noise: one pass against one-token decodes (gap shifts of
    the top two, and max abs logit difference), and the gap shifts of its verification batches
    against one-token decodes (the departure check's sample)."""

    scorer: str
    shift_max: float
    max_abs: float
    logit_scale: float
    verification_shifts: tuple[float, ...]

    def near_tie(self) -> float:
        """The flip a split of this scorer's runs may have and still be numerics: FACTOR times
        the largest gap shift measured, at least float32's rounding of logits of this scale."""
        return FACTOR * max(self.shift_max, FLOAT32_EPS * max(self.logit_scale, 1.0))

    def describe(self) -> str:
        return (f"{FACTOR:g}x the measured batch-shape noise of {self.scorer} (one pass against one-token decodes: "
                f"gap shifts up to {self.shift_max:.3g}, max abs diff {self.max_abs:.3g})")


@dataclass(frozen=True)
class PathCheck:
    """One verification-path check (module docstring) for the runs one scorer serves."""

    kind: str  # VERIFICATION, NONDETERMINISM, DRAFTER, DEPARTURES, or dequantization.DEQUANTIZATION
    scorings: tuple[str, str]
    runs: tuple[tuple[str, ...], tuple[str, ...]]
    prompts: int
    findings: tuple[str, ...]  # what fails, each in words; () when it passes
    summary: str  # what was measured
    measured: Optional[LogitAgreement] = None
    bounds: Optional[Tolerance] = None
    noise: Optional[LogitAgreement] = None
    power: Optional[Power] = None

    @property
    def problems(self) -> list[str]:
        return list(self.findings)

    @property
    def ok(self) -> bool:
        return not self.findings

    def failure(self) -> str:
        return "; ".join(self.findings)

    def describe(self) -> str:
        power = f"; {self.power.describe()}" if self.power else ""
        return f"{self.kind}: {' vs '.join(self.scorings)}: {self.summary}{power}"


def rolled_back_rows(session: ModelSession, prompt_ids: Sequence[int], output_ids: Sequence[int], step: int,
                     batched: bool, rows: Optional[int] = None) -> np.ndarray:
    """Rows predicting the output tokens (the first rows of them) as a speculative run computes
    them: the prompt but its last token cached, then steps of `step` tokens of the sequence (the
    last token so far and the drafts accepted) and one token that is not the next (a draft
    rejected), the cache rolled back past it after each step. batched: each step one pass, as a
    target verifies; else one token at a time, as a drafter drafts."""
    session.truncate(0)
    if len(prompt_ids) > 1:
        session.eval(list(prompt_ids[:-1]), Rows.NONE)
    sequence = [prompt_ids[-1], *output_ids]  # each row predicts the next token of it
    fed = sequence[:-1][:rows]
    found = []
    for start in range(0, len(fed), step):
        kept = fed[start:start + step]
        rejected = (sequence[start + len(kept)] + 1) % session.n_vocab  # not the token the sequence has there
        n_past = session.n_past
        if batched:
            found.extend(np.asarray(session.eval([*kept, rejected], Rows.ALL)[:len(kept)], dtype=np.float64))
        else:
            found.extend(np.asarray(session.eval([token], Rows.LAST)[0], dtype=np.float64) for token in kept)
            if start + step < len(fed):  # a later draft reads the rejected token's cache entry, never its row:
                session.eval([rejected], Rows.NONE)  # no LM head (a real model's is most of a decode)
        session.truncate(n_past + len(kept))
    return np.array(found)


def _batches(records: Sequence[RunRecord]) -> tuple[int, ...]:
    """The verification batch sizes a scorer's runs used: k + 1 each (a lookup's or policy's k
    is its largest)."""
    return tuple(sorted({max(2, (record.params.k_max or record.params.k) + 1) for record in records}))


def scorer_label(key: tuple) -> str:
    runtime, path, kv_cache, flash_attn, dtype = key
    numerics = [f"{kv_cache} KV" if kv_cache else "", "flash attention" if flash_attn else "",
                dtype if dtype else ""]
    return f"{runtime} as run ({', '.join(n for n in numerics if n) or 'its defaults'})"


@dataclass(frozen=True)
class _Measured:
    """What one scorer's re-scoring gave, per prompt summarized at once (a verified row of a real
    model is a vocabulary of float64s: rows are not kept)."""

    noise: RowStatistics  # one pass against one-token decodes
    noise_shifts: np.ndarray
    parts: tuple[tuple[str, RowStatistics], ...]  # (prompt, verification rows against decodes, then one pass)
    decoded_pairs: tuple[tuple[np.ndarray, np.ndarray], ...]  # (decoded, verified) rows: the power's sample
    verification_shifts: np.ndarray
    scale: float
    repeat: tuple[str, float, int]  # (prompt, max abs diff of the same pass scored twice, rows)


def split_rows(records: Sequence[RunRecord]) -> dict[str, int]:
    """prompt id -> the rows up to and including the last position where one of these runs first
    left its own baseline: the batch-shape noise is measured there too, since a split is judged
    against it and the two shapes may agree exactly until some position and differ after it
    (llama.cpp without flash attention, one-token decodes against batches)."""
    found: dict[str, int] = {}
    for record in records:
        for result in record.results:
            index = first_divergence(result.output_ids, result.baseline_ids) if result.ok else None
            if result.lossless is False and index is not None:
                found[result.prompt_id] = max(found.get(result.prompt_id, 0), index + 1)
    return found


def beyond_rows(index: int, measured: int, prompt_ids: Sequence[int], n_ctx: int) -> int:
    """The rows noise_beyond reads, decoded with a check's own (DecodedRows.decode): CONTROL_ROWS
    on the check's first prompt (index 0) where its rows measured fall short and those rows fit
    n_ctx, else 0 (no noise_beyond)."""
    if index or measured >= CONTROL_ROWS or len(prompt_ids) + CONTROL_ROWS >= n_ctx:
        return 0
    return CONTROL_ROWS


def noise_beyond(session: ModelSession, prompt_ids: Sequence[int], decoded: np.ndarray,
                 tokens: Sequence[int]) -> Optional[tuple[RowStatistics, np.ndarray]]:
    """One prompt's batch-shape noise over its first CONTROL_ROWS rows (one-token decodes against
    one pass, with the top-two gap shifts): decoded, score_stepwise_beyond's rows (continued past
    the output by the decodes' own greedy choice where it is shorter) and tokens, the tokens they
    predict; None where there are none (beyond_rows was 0). Each check measures it on its first
    prompt.

    A noise control needs rows beyond the first few: llama.cpp's one-token decodes can equal its
    one pass exactly over a prompt's first rows and differ by a logit from there on (Gemma 3
    270M with flash attention: exact up to the 4th row, then up to 2.5), while its verification
    batches differ from the first row. Measured on the first rows of short outputs alone (the
    README tour's 4 new tokens) the noise was 0 and honest batches failed. Both sides are plain
    greedy decoding, which a verification-path bug cannot reach."""
    if not len(decoded):
        return None
    decoded, full = ScoredRows(decoded), ScoredRows(score(session, prompt_ids, tokens))
    return row_statistics(decoded, full), gap_shifts(decoded.logits, full.logits)[1]


def _smallest_context(records: Sequence[RunRecord]) -> int:
    """The context every scorer's run fits: rows past it are not scored (noise_beyond)."""
    return min(record.params.n_ctx for record in records)


def _measure(session: ModelSession, key: tuple, prompts: dict, rows: dict[str, np.ndarray], batches: Sequence[int],
             per_prompt: int, decodes: DecodedRows, at_splits: dict[str, int], n_ctx: int) -> _Measured:
    noise, shifts, parts, pairs, verification_shifts = [], [], [], [], []
    repeat = None
    for index, (prompt_id, (prompt_ids, output_ids)) in enumerate(
            progress.each(prompts.items(), f"{scorer_label(key)}: verification", total=len(prompts))):
        full = ScoredRows(rows[prompt_id])  # each row's log-probabilities and top 5 computed once
        wanted = min(max(per_prompt, at_splits.get(prompt_id, 0)), len(full))
        # The first prompt's noise over CONTROL_ROWS rows at least, whatever its output's length.
        rows_decoded, continued, tokens = decodes.decode(key, session, prompt_id, prompt_ids, output_ids, wanted,
                                                         least=CONTROL_ROWS,
                                                         beyond=beyond_rows(index, wanted, prompt_ids, n_ctx))
        decoded = ScoredRows(rows_decoded)
        n = len(decoded)
        noise.append(row_statistics(decoded, full, length=n))
        shifts.append(gap_shifts(decoded.logits, full.logits[:n])[1])
        beyond = noise_beyond(session, prompt_ids, continued, tokens)
        if beyond is not None:
            noise.append(beyond[0])
            shifts.append(beyond[1])
        for batch in batches:
            verified = ScoredRows(rolled_back_rows(session, prompt_ids, output_ids, batch - 1, batched=True))
            parts += [(prompt_id, row_statistics(decoded, verified, length=n)),
                      (prompt_id, row_statistics(full, verified))]
            pairs.append((decoded.logits, verified.logits[:n]))
            verification_shifts.append(gap_shifts(decoded.logits, verified.logits[:n])[1])
        if repeat is None:  # the same pass again, after other passes have run
            repeat = (prompt_id, float(np.abs(score(session, prompt_ids, output_ids) - full.logits).max()), len(full))
    return _Measured(RowStatistics.joined(noise), np.concatenate(shifts), tuple(parts), tuple(pairs),
                     np.concatenate(verification_shifts),
                     max(float(np.abs(r).max()) for r in rows.values()), repeat)


def _bounded_check(kind: str, scorings: tuple[str, str], labels: tuple[str, ...],
                   parts: Sequence[tuple[str, RowStatistics]], noise: LogitAgreement, scale: float, what: str,
                   cause: str = "", power_pairs: Sequence = ()) -> PathCheck:
    """A check of rows against their reference (parts: per prompt, their RowStatistics), within
    FACTOR times the noise control (noise_bounds); a failure says what, with the first prompt
    and output token beyond the max-abs bound, and the cause it suggests."""
    measured = RowStatistics.joined([part for _, part in parts]).summary()
    bounds = noise_bounds(noise, scale)
    problems = bounds.problems(measured)
    findings = ()
    if problems:
        first = next(((p, int(np.flatnonzero(part.max_abs > bounds.max_abs_diff)[0])) for p, part in parts
                      if (part.max_abs > bounds.max_abs_diff).any()), None)
        where = f"; first at {first[0]}, output token {first[1]}" if first else ""
        findings = (f"{what}: {'; '.join(problems)} (bounds {bounds.describe()}){where}{cause}",)
    prompts = len(dict.fromkeys(p for p, _ in parts))
    return PathCheck(kind, scorings, (labels, ()), prompts, findings,
                     f"{prompts} prompts, {measured.positions} rows: max abs diff {measured.max_abs_diff:.3g}, "
                     f"mean KL {measured.kl_mean:.3g}, same top-1 {measured.top1_agreement:.3f}; bounds "
                     f"{bounds.describe()}", measured, bounds, noise,
                     find_power(list(power_pairs), bounds) if power_pairs else None)


def _drafts_with_model(record: RunRecord) -> bool:
    """A drafter the scorer can load as a model: not a head (spec types eagle3, dflash), which
    reads the target's hidden states and runs only inside a runtime's speculative decoding."""
    return (record.pair.drafter is not None and record.params.drafting in ("model", "tree")
            and record.params.spec_type == "draft")


def drafter_checks(groups: dict, references: dict, threads: int) -> list[PathCheck]:
    """Per drafter scorer: its decodes with rejected drafts rolled back (rolled_back_rows) against
    one pass, within FACTOR times the noise of plain one-token decodes (no rollback) against it:
    a drafter whose state is not rolled back leaves every output exact, and only this sees it."""
    checks = []
    for key, members in groups.items():
        records = [record for _, record in members]
        k = max(max(1, record.params.k) for record in records)
        labels = tuple(label for label, _ in members)
        name = f"the drafter on {scorer_label(key)}"
        per_prompt = max(2 * k + 2, min(CONTROL_ROWS, DECODED_ROWS // max(1, len(references))))
        n_ctx = _smallest_context(records)
        noise_parts, rolled_parts = [], []
        with open_scorer(records[0], role="drafter", threads=threads) as session:
            for index, (prompt_id, (prompt_ids, output_ids)) in enumerate(
                    progress.each(references.items(), "drafter rollback", total=len(references))):
                full = ScoredRows(score(session, prompt_ids, output_ids))
                rows = rolled_back_rows(session, prompt_ids, output_ids, k, batched=False,
                                        rows=min(per_prompt, len(full)))
                # No rollback, the control: on the first prompt decoded on for noise_beyond too.
                extra = beyond_rows(index, len(rows), prompt_ids, n_ctx)
                continued, tokens = score_stepwise_beyond(session, prompt_ids, output_ids, max(len(rows), extra))
                decoded = continued[:len(rows)]
                noise_parts.append(row_statistics(decoded, full, length=len(decoded)))
                beyond = noise_beyond(session, prompt_ids, continued[:extra], tokens[:extra])
                if beyond is not None:
                    noise_parts.append(beyond[0])
                rolled_parts.append((prompt_id, row_statistics(rows, full, length=len(rows)),
                                     float(np.abs(full.logits).max())))
        scale = max(largest for _, _, largest in rolled_parts)
        checks.append(_bounded_check(DRAFTER, (f"{name} decodes, rejected drafts rolled back every {k}", "one pass"),
                                     labels, [(p, part) for p, part, _ in rolled_parts],
                                     RowStatistics.joined(noise_parts).summary(), scale,
                                     "the drafter's decodes after a rejected draft compute otherwise than one pass",
                                     ": a drafter state not rolled back after a rejection"))
    return checks


def _one_pass_rows(session: ModelSession, members: Sequence[tuple[str, RunRecord]], references: dict,
                   as_run: dict[tuple[str, str], np.ndarray]) -> None:
    """Each member run's rows along its prompts' reference sequences, into as_run by (label,
    prompt id): computed once per prompt and shared by the members (a row is a vocabulary of
    float64s: 2 MB on Gemma's 262k, so ten runs of 10 prompts x 64 tokens each holding their own
    would take 13 GB). A run whose prompt ids are not the reference's gets none (its ids fail)."""
    rows = {}
    for label, record in progress.each(members, "re-scoring", unit="run"):
        for result in record.results:
            reference = references.get(result.prompt_id)
            if result.ok and reference and tuple(result.prompt_ids) == reference[0]:
                if result.prompt_id not in rows:
                    rows[result.prompt_id] = score(session, *reference)
                as_run[label, result.prompt_id] = rows[result.prompt_id]


def _scorer_checks(key: tuple, members: Sequence[tuple[str, RunRecord]], references: dict, threads: int,
                   decodes: DecodedRows, as_run: dict[tuple[str, str], np.ndarray],
                   ) -> tuple[list[PathCheck], dict[str, BatchNoise]]:
    """One scorer's share of scored_with_path_checks: its members' one-pass rows into as_run, its
    verification-batch and nondeterminism checks, and its runs' batch-shape noise by label."""
    first_label = members[0][0]
    labels, name = tuple(label for label, _ in members), scorer_label(key)
    batches = _batches([record for _, record in members])
    with open_scorer(members[0][1], threads=threads) as session:
        _one_pass_rows(session, members, references, as_run)
        prompts = {p: ref for p, ref in references.items() if (first_label, p) in as_run}
        if not prompts:
            return [], {}
        per_prompt = max(LEAST_ROWS, min(CONTROL_ROWS, DECODED_ROWS // len(prompts)))
        measured = _measure(session, key, prompts, {p: as_run[first_label, p] for p in prompts}, batches,
                            per_prompt, decodes, split_rows([record for _, record in members]),
                            _smallest_context([record for _, record in members]))
    noise = measured.noise.summary()
    noises = dict.fromkeys(labels, BatchNoise(name, float(measured.noise_shifts.max()), noise.max_abs_diff,
                                              measured.scale, tuple(map(float, measured.verification_shifts))))
    prompt_id, repeated, rows = measured.repeat
    return [_bounded_check(VERIFICATION, (f"{name} verification batches of {', '.join(map(str, batches))}",
                                          "one-token decodes and one pass"), labels, measured.parts, noise,
                           measured.scale, "verification batches compute otherwise than one-token decodes "
                           "and one pass", power_pairs=measured.decoded_pairs),
            PathCheck(NONDETERMINISM, (name, "itself"), (labels, ()), 1,
                      (f"nondeterministic: {name} scored the same {rows} rows of {prompt_id} twice and they "
                       f"differ by max abs {repeated:.3g}: its noise cannot be measured, every split and "
                       "bound of its runs is in doubt",) if repeated > 0 else (),
                      f"the same pass scored twice: max abs diff {repeated:.3g}")], noises


def scored_with_path_checks(runs: Sequence[tuple[str, RunRecord]], threads: int = 1,
                            decodes: Optional[DecodedRows] = None, beside: bool = False,
                            ) -> tuple[dict[tuple[str, str], np.ndarray], tuple[PathCheck, ...], dict[str, BatchNoise]]:
    """Every run re-scored on its scorer with its numerics, one load per scorer: the one-pass rows
    along the reference sequences (as_run, by run label and prompt id: every logit check reads
    them), then that scorer's verification-batch and nondeterminism checks (module docstring),
    with each run's measured batch-shape noise by label; then each drafter's rollback check.
    decodes: where the one-token decodes of the scorers the float control reads again are kept.
    beside (parity's --jobs 2 or more): the drafters' checks run in a thread beside the targets'
    (crossrt/compare/beside.py), each on its own sessions, so every figure is the one computed one
    after the other. (The scorers beside one another gained nothing more on the real model: 67.2
    against 68.1 s.)"""
    decodes = decodes or DecodedRows()
    references = reference_sequences(runs)
    groups: dict[tuple, list[tuple[str, RunRecord]]] = {}
    drafters: dict[tuple, list[tuple[str, RunRecord]]] = {}
    for label, record in runs:
        if not record.imported:
            groups.setdefault(scorer_key(record), []).append((label, record))
            if _drafts_with_model(record) and record.results:
                drafters.setdefault(scorer_key(record, "drafter"), []).append((label, record))
    drafting = Beside(drafter_checks, drafters, references, threads) if beside and references and drafters else None
    as_run, checks, noises = {}, [], {}
    for key, members in groups.items():
        found, measured_noises = _scorer_checks(key, members, references, threads, decodes, as_run)
        checks += found
        noises.update(measured_noises)
    if drafting is not None:
        checks += drafting.result()
    elif references:
        checks += drafter_checks(drafters, references, threads)
    return as_run, tuple(checks), noises


def judged_by_paths(comparisons: Sequence, checks: Sequence[PathCheck]) -> list:
    """The comparisons with every split of a run from its own baseline taken out of "numerics"
    where a verification-path check of that run fails: a near-tie on a path that computes
    otherwise is no near-tie. Such splits become problems that say why."""
    failed = [check for check in checks if not check.ok]
    judged = []
    for comparison in comparisons:
        why = next((check for check in failed if comparison.run_a in check.runs[0]
                    or (check.kind == DRAFTER and comparison.run_b in check.runs[0])), None)
        lossless = comparison.run_b == OWN_BASELINE
        if why is None or (why.kind != DRAFTER and not lossless) or not comparison.explained:
            judged.append(comparison)
            continue
        judged.append(demoted(comparison, f"the {why.kind} check fails for this run: {why.failure()}"))
    return judged
