"""crossrt.compare.rescore's statistics: top_k is the order a stable argsort of -rows gives (highest
first, ties to the lower index, NaN last), without sorting whole rows."""

import numpy as np
import pytest

from crossrt.errors import ComparisonError
from crossrt.compare.rescore import ScoredRows, agreement, top_k
from crossrt.compare.tolerance import Tolerance


@pytest.mark.parametrize("seed", range(5))
def test_top_k_is_a_stable_descending_sort(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        n = int(rng.integers(1, 40))
        rows = rng.integers(0, 5, size=(int(rng.integers(1, 4)), n)).astype(np.float32)  # many ties
        if rng.random() < 0.3:
            rows[0, int(rng.integers(n))] = np.nan
        for k in (1, 2, 5):
            assert (top_k(rows, k) == np.argsort(-rows, axis=-1, kind="stable")[..., :k]).all()


def test_top_k_on_a_real_sized_vocabulary():
    rows = np.random.default_rng(0).standard_normal((3, 262144)).astype(np.float32)
    rows[1, [7, 9, 200000]] = rows[1].max() + 1  # a three-way tie at the top
    assert top_k(rows, 5).shape == (3, 5)
    assert (top_k(rows, 5) == np.argsort(-rows, axis=-1, kind="stable")[:, :5]).all()
    assert list(top_k(rows[1], 3)) == [7, 9, 200000]


def test_agreement_of_identical_and_of_swapped_rows():
    a = np.array([[3.0, 1.0, 2.0, 0.0, -1.0, -2.0]])
    same = agreement(a, a.copy())
    assert (same.top1_agreement, same.top5_overlap, same.max_abs_diff) == (1.0, 1.0, 0.0)
    swapped = agreement(a, a[:, [2, 1, 0, 3, 4, 5]])
    assert swapped.top1_agreement == 0.0 and swapped.kl_mean > 0


def test_scored_rows_reused_over_prefixes_give_the_sliced_arrays_agreement():
    """parity's logit checks analyse each run's rows once (ScoredRows) and compare prefixes:
    the statistics must be exactly those of the sliced arrays."""
    rng = np.random.default_rng(7)
    a, b = rng.normal(size=(6, 1000)), rng.normal(size=(6, 1000))
    b[:3] = a[:3] + rng.normal(scale=1e-3, size=(3, 1000))
    rows_a, rows_b = ScoredRows(a), ScoredRows(b)
    for length in (0, 3, 6):
        assert agreement(rows_a, rows_b, length=length) == agreement(a[:length], b[:length])
    assert agreement(rows_a, rows_b, length=3).top1_agreement == 1.0
    with pytest.raises(ComparisonError, match="logit shapes differ"):
        agreement(a, b[:, :999])


def test_a_differing_argmax_at_a_near_tie_counts_as_the_same_top1_and_a_far_one_does_not():
    """The top-1 bound of a tolerance forgives what numerics may flip: at position 0 the two rows
    put their choices 0.3 apart in all (a near-tie under a 1.0 flip), at position 1 apart by 8."""
    a = np.array([[1.0, 0.9, 0.0], [5.0, 1.0, 0.0], [0.0, 0.0, 2.0]], dtype=np.float32)
    b = np.array([[0.9, 1.1, 0.0], [1.0, 5.0, 0.0], [0.0, 0.0, 2.0]], dtype=np.float32)
    measured = agreement(a, b)
    assert measured.top1_agreement == pytest.approx(1 / 3)
    assert measured.top1_flips == pytest.approx((0.3, 8.0))
    assert measured.top1_beyond_near_ties(1.0) == pytest.approx(2 / 3)
    loose = Tolerance("test", top1=0.6, near_tie_flip=1.0)
    strict = Tolerance("test", top1=0.6, near_tie_flip=0.1)
    assert loose.problems(measured) == []
    assert strict.problems(measured) and "same top-1 0.333 < 0.6" in strict.problems(measured)[0]
