"""Parity's departure check (docs/parity.md, "The verification path"): a run that leaves its own
baseline on more prompts than its scorer's measured verification-path noise makes plausible,
a Poisson bound over the baselines' top-two margins. It catches what re-scoring does not
reproduce: a bug only in a server's own path, or in state only the run had."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from crossrt.compare.control import reference_sequences
from crossrt.compare.splits import first_divergence
from crossrt.compare.verification import DEPARTURES, BatchNoise, PathCheck
from crossrt.records.schema import PassView, RunRecord

SURPRISE = 1e-3  # a departure count this unlikely under the measured noise fails
NOISE_SLACK = 3.0  # the departure bound assumes the verification path up to 3x noisier than measured
LEAST_DEPARTURES = 2  # one departure is judged by its split alone


def departure_chance(margins: Sequence[float], shifts: np.ndarray) -> float:
    """The chance that a verification path with these gap shifts (NOISE_SLACK times noisier)
    breaks at least one of a baseline's margins."""
    if not len(shifts):
        return 0.0
    ordered = np.sort(np.asarray(shifts, dtype=float) * NOISE_SLACK)
    stay = 1.0
    for margin in margins:
        stay *= 1.0 - (len(ordered) - np.searchsorted(ordered, margin, side="left")) / len(ordered)
    return 1.0 - stay


def poisson_tail(observed: int, expected: float) -> float:
    """P(X >= observed) for X ~ Poisson(expected)."""
    if observed <= 0:
        return 1.0
    term = math.exp(-expected)
    below = term
    for n in range(1, observed):
        term *= expected / n
        below += term
    return max(0.0, 1.0 - below)


def baseline_margins(label: str, record: RunRecord, result, view: Optional[PassView],
                     as_run: dict[tuple[str, str], np.ndarray], references: dict) -> Optional[np.ndarray]:
    """The top-two margin of each pass of a prompt's plain baseline: the recorded view's (the
    run's own or a driven twin's), else the scorer's one-pass rows along the reference sequence
    as far as the baseline follows it (a native run records none); None where neither serves."""
    if view is not None:
        return np.asarray(view.margins)
    rows, reference = as_run.get((label, result.prompt_id)), references.get(result.prompt_id)
    if rows is None or reference is None or tuple(result.prompt_ids) != reference[0]:
        return None
    same = first_divergence(result.baseline_ids, reference[1])
    rows = rows[:len(rows) if same is None else same]
    if not len(rows):
        return None
    top2 = np.partition(rows, rows.shape[1] - 2, axis=1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def departure_checks(runs: Sequence[tuple[str, RunRecord]], noises: dict[str, BatchNoise],
                     as_run: dict[tuple[str, str], np.ndarray], baseline_view) -> tuple[PathCheck, ...]:
    """Per run with measured noise and baseline margins (baseline_margins; baseline_view(record,
    result): the run's own or a driven twin's PassView, else None): how many prompts left their
    baseline against how many its noise makes plausible (module docstring)."""
    references = reference_sequences(runs)
    checks = []
    for label, record in runs:
        noise = noises.get(label)
        if noise is None or record.imported:
            continue
        shifts = np.asarray(noise.verification_shifts)
        expected, departed, prompts = 0.0, 0, 0
        for result in record.results:
            if not result.ok:
                continue
            margins = baseline_margins(label, record, result, baseline_view(record, result), as_run, references)
            if margins is None:
                continue
            prompts += 1
            index = first_divergence(result.output_ids, result.baseline_ids)
            if result.lossless is False and index is not None:
                departed += 1
            upto = len(margins) if index is None else index + 1
            expected += departure_chance(margins[:upto], shifts)
        if not prompts:
            continue
        chance = poisson_tail(departed, expected)
        findings = ()
        if departed >= LEAST_DEPARTURES and chance < SURPRISE:
            findings = (f"{label} leaves its own baseline on {departed} of {prompts} prompts where the measured "
                        f"verification-path noise of {noise.scorer} (gap shifts up to {shifts.max(initial=0):.3g}, "
                        f"taken {NOISE_SLACK:g}x) makes {expected:.3g} plausible (chance {chance:.2g} < {SURPRISE:g}): "
                        "not numerics, look for a bug in its verification path",)
        checks.append(PathCheck(DEPARTURES, (label, "its baseline"), ((label,), ()), prompts, findings,
                                f"{departed} of {prompts} prompts leave the baseline, {expected:.3g} expected from "
                                f"the measured noise (chance of as many {chance:.2g})"))
    return tuple(checks)
