"""The one near-tie verdict (crossrt/speculative/numerics.py): gaps between the two emitted tokens, whatever
lies between them, and the close candidates a pass records, against a full sort of the row."""

import numpy as np
import pytest

from crossrt.speculative.numerics import CLOSE_MAX, CLOSE_WINDOW, Gap, choose, judge, recorded_gap, rescored_gap
from crossrt.compare.rescore import top_k
from crossrt.compare.tolerance import F16_CACHE, F32_EXACT, HALF_WEIGHTS, QUANTIZED, QUANTIZED_ONE_RUNTIME


def test_close_candidates_are_the_sorted_rows_nearest_entries():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(16, 5000)).astype(np.float32) * 0.6
    rows[3, :] = 1.0  # a flat row: capped at CLOSE_MAX, ties to the lower id
    choices = choose(rows)
    order = top_k(rows, CLOSE_MAX + 1)
    for i, row in enumerate(rows):
        assert choices.best[i] == order[i, 0] and choices.second[i] == order[i, 1]
        expected = [int(t) for t in order[i, 1:] if row[order[i, 0]] - row[t] <= CLOSE_WINDOW]
        assert list(choices.close_ids[i]) == expected
        assert choices.close_gaps[i] == pytest.approx([float(row[order[i, 0]] - row[t]) for t in expected])
    assert len(choices.close_ids[3]) == CLOSE_MAX and choices.close_ids[3] == tuple(range(1, CLOSE_MAX + 1))


def test_a_three_way_near_tie_is_a_near_tie():
    """The case an unseen real pair showed: the speculative pass emits ' oxygen' 0.0409 over
    ' air' (its runner-up), the one-token decode emits ' air' 0.0559 over ' dust', with ' oxygen'
    third at 0.09: the two emitted tokens lie within 0.13 logits in both passes."""
    oxygen, air, dust = 7, 8, 9
    speculative = recorded_gap(0.0409, air, (air, dust), (0.0409, 0.07), oxygen, air)
    baseline = recorded_gap(0.0559, dust, (dust, oxygen), (0.0559, 0.09), air, oxygen)
    verdict = judge([speculative, baseline], QUANTIZED.near_tie_flip, QUANTIZED.reason)
    assert verdict.near and verdict.flip == pytest.approx(0.1309)
    assert judge([speculative, baseline], F32_EXACT.near_tie_flip, F32_EXACT.reason).near is False
    assert judge([speculative, baseline], QUANTIZED_ONE_RUNTIME.near_tie_flip, "llama.cpp").near


def test_a_token_outside_the_recorded_candidates_is_never_a_near_tie():
    gap = recorded_gap(0.2, 5, (5,), (0.2,), 1, 99)
    assert gap.at_least and gap.value == CLOSE_WINDOW
    assert not judge([gap, Gap(0.0, False, "recorded")], 100.0, "any").near
    # Records from before close candidates: only the runner-up's gap is known exactly.
    assert recorded_gap(0.3, 5, None, None, 1, 5) == Gap(0.3, False, "recorded")
    assert recorded_gap(0.3, 5, None, None, 1, 6).at_least


def test_rescored_gaps_ranked_the_other_way_still_bound_the_flip():
    row = np.array([0.0, 1.0, 1.02])
    gap = rescored_gap(row, 1, 2, "re-scored one-token decode")
    assert gap.value == pytest.approx(-0.02)
    verdict = judge([gap, rescored_gap(row, 2, 1, "re-scored 8-token batch")], F16_CACHE.near_tie_flip, "f16")
    assert verdict.near and verdict.flip == pytest.approx(0.04)
    assert "ranked the other way" in gap.describe()


def test_every_threshold_lies_inside_the_recorded_window():
    for tolerance in (F32_EXACT, F16_CACHE, HALF_WEIGHTS, QUANTIZED, QUANTIZED_ONE_RUNTIME):
        assert tolerance.near_tie_flip < CLOSE_WINDOW
