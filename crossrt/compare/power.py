"""The power of a logit check: the smallest Gaussian per-logit perturbation its bounds flag,
found by bisection on the check's own rows (docs/parity.md, "The float control")."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from crossrt.compare.rescore import LogitAgreement, argmax_flips, log_softmax, logits_of
from crossrt.compare.tolerance import Tolerance

POWER_ROWS = 32  # rows a power search perturbs (its statistics are per row: a sample serves)


@dataclass(frozen=True)
class Power:
    """The smallest Gaussian per-logit perturbation (standard deviation sigma) a check's bounds
    flag, found on its own rows, and the mean KL divergence it makes there."""

    sigma: float
    kl_mean: float

    def describe(self) -> str:
        return f"would catch logit noise of sigma {self.sigma:.2g} (mean KL {self.kl_mean:.2g})"



def find_power(pairs: Sequence[tuple[np.ndarray, np.ndarray]], bounds: Tolerance, seed: int = 0) -> Optional[Power]:
    """The smallest sigma (to 10%) at which B's rows plus Gaussian noise of that sigma fail the
    bounds against A's, on up to POWER_ROWS rows spread over the prompts; None if no row, or
    if the rows fail unperturbed. Only what the bounds read is computed per trial (A's
    probabilities once): a full agreement per trial made this most of the control's cost."""
    if not pairs:
        return None
    starts = np.cumsum([0] + [len(x) for x, _ in pairs])
    if starts[-1] == 0:
        return None
    pick = np.linspace(0, starts[-1] - 1, min(starts[-1], POWER_ROWS)).round().astype(int)
    which = np.searchsorted(starts, pick, side="right") - 1  # the pair each picked row is in
    a, b = (np.stack([logits_of(pairs[i][side])[row - starts[i]] for i, row in zip(which, pick)]) for side in (0, 1))
    trial = _Trial(a, b, _gaussian(b.shape, seed))
    if trial.fails(0.0, bounds):
        return None
    low, high = _bracket(trial, bounds)
    if high is None:
        return None
    while high - low > 0.1 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if trial.fails(middle, bounds) else (middle, high)
    return Power(high, trial.at(high).kl_mean)


@functools.lru_cache(maxsize=1)
def _gaussian(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A power search's fixed noise: the same draw for every check of a verdict, so drawn once."""
    noise = np.random.default_rng(seed).standard_normal(shape)
    noise.flags.writeable = False  # shared by every trial of every check
    return noise


def _bracket(trial: "_Trial", bounds: Tolerance) -> tuple[float, Optional[float]]:
    """(low, high) sigmas, low passing (or 0) and high failing, at most 2x apart where a guess
    allows: the largest of n Gaussians is ~sqrt(2 ln n) sigma (the max-abs bound), and small
    noise of sigma moves KL by ~sigma^2 / 2 (the KL bounds). (0, None) if none fails below 1e3."""
    guesses = [(bounds.max_abs_diff or 1e-3) / np.sqrt(2 * np.log(trial.noise.size))]
    guesses += [np.sqrt(2 * bound) for bound in (bounds.kl_mean, bounds.kl_p99) if bound]
    high = min(guesses)
    if trial.fails(high, bounds):
        low = high / 2
        while low > 1e-12 and trial.fails(low, bounds):
            low, high = low / 2, low
        return (low if low > 1e-12 else 0.0), high
    low, high = high, high * 2
    while not trial.fails(high, bounds):
        low, high = high, high * 2
        if high > 1e3:
            return 0.0, None
    return low, high


class _Trial:
    """B's rows perturbed by sigma times fixed noise, summarized as the bounds read them."""

    def __init__(self, a: np.ndarray, b: np.ndarray, noise: np.ndarray):
        self.a, self.b, self.noise = a, b, noise
        self.log_a = log_softmax(a)
        self.p_a = np.exp(self.log_a)
        self.top_a = a.argmax(axis=1)

    def fails(self, sigma: float, bounds: Tolerance) -> bool:
        """Whether the rows perturbed by sigma fail the bounds: the max-abs bound first, which needs
        no probabilities (the same trials fail either way)."""
        b, difference = self._perturbed(sigma)
        if bounds.max_abs_diff is not None and difference.max() > bounds.max_abs_diff:
            return True
        return bool(bounds.problems(self._agreement(b, difference)))

    def at(self, sigma: float) -> LogitAgreement:
        return self._agreement(*self._perturbed(sigma))

    def _perturbed(self, sigma: float) -> tuple[np.ndarray, np.ndarray]:
        """B's rows plus sigma times the noise, and |A - them|: in place (67 MB an array on Gemma)."""
        b = self.noise * sigma
        b += self.b
        difference = np.subtract(self.a, b)
        return b, np.abs(difference, out=difference)

    def _agreement(self, b: np.ndarray, difference: np.ndarray) -> LogitAgreement:
        """The trial's agreement; b becomes its log-probabilities."""
        top_b = b.argmax(axis=1)
        flips = argmax_flips(self.a, b, self.top_a, top_b)
        terms = np.subtract(self.log_a, log_softmax(b, in_place=True), out=b)
        terms *= self.p_a
        kl = np.maximum(terms.sum(axis=1), 0.0)
        return LogitAgreement(len(b), float(difference.max()), float(difference.mean()),
                              float(np.mean(top_b == self.top_a)), 1.0, float(kl.mean()), float(np.median(kl)),
                              float(np.percentile(kl, 99)), float(kl.max()), 0.0, flips)
