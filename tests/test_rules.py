"""A run's drafting rules, built in one place (crossrt/run/rules.py): checked, and warned of where
llama.cpp's n_min leaves nothing to draft within the token budget."""

import pytest

from crossrt.compare.parity_run import Matrix, cell_rules, run_matrix
from crossrt.errors import SettingsError
from crossrt.inputs.pairs import load_pair
from crossrt.run.rules import run_rules
from crossrt.run.runtime import K_LIMIT, DraftRules, RuntimeOptions
from crossrt.speculative.strategies import NGRAM_LIMIT, Strategy

from conftest import TINY_PAIR


def test_a_run_whose_n_min_no_draft_reaches_is_warned_where_drafts_shorter_than_n_min_are_dropped():
    # llama-server's native mode and the driven llama.cpp schedules drop short drafts...
    for runtime, mode, schedule in (("llama-server", "native", "crossrt"), ("llama-cpp", "driven", "llama-server"),
                                    ("llama-cpp", "driven", "llama-spec-simple")):
        rules, warnings = run_rules(runtime, mode, schedule, 8, 8)
        assert rules == DraftRules(8)
        assert warnings == ("--k 8: llama.cpp drops drafts shorter than draft-n-min 8, and no draft fits in "
                            "--max-new-tokens 8: nothing will be drafted; lower --k or --draft-n-min",)
        assert run_rules(runtime, mode, schedule, 8, 8, n_min=2) == (DraftRules(8, 2), ())
        assert run_rules(runtime, mode, schedule, 9, 8)[1] == ()
    # ...crossrt's schedule and a native mode without n_min keep them.
    assert run_rules("llama-cpp", "driven", "crossrt", 8, 8)[1] == ()
    assert run_rules("transformers", "native", "crossrt", 8, 8)[1] == ()


def test_rules_that_contradict_each_other_are_refused():
    with pytest.raises(SettingsError, match="n_min must be between 0 and k=4, got 5"):
        run_rules("llama-cpp", "driven", "crossrt", 32, 4, n_min=5)
    with pytest.raises(SettingsError, match="unknown spec type"):
        run_rules("llama-cpp", "driven", "crossrt", 32, 4, spec_type="guess")


def test_a_parity_matrix_builds_each_cells_rules_here_and_warns_before_any_cell_runs(tmp_path):
    """parity's cells take their rules from run_rules too: llama-server's native cell is warned
    (it drops drafts shorter than n_min), llama-cpp's driven cell (crossrt's schedule) is not,
    and the warnings come before the first cell starts."""
    matrix = Matrix(load_pair(TINY_PAIR), ("llama-cpp", "llama-server"), ("driven", "native"),
                    RuntimeOptions(threads=1), 8, 8, tmp_path)
    warned, started = [], []

    def first_cell(label):
        started.append((label, list(warned)))
        raise KeyboardInterrupt  # stops the matrix before anything loads

    with pytest.raises(KeyboardInterrupt):
        run_matrix(matrix, [], on_run=first_cell, on_warning=warned.append)
    assert started == [("llama-cpp/driven", warned)]
    assert warned == ["llama-server/native: " + run_rules("llama-server", "native", "crossrt", 8, 8)[1][0]]
    assert cell_rules(matrix, "llama-cpp", "driven") == (DraftRules(8), ())


def test_absurd_draft_lengths_and_ngram_sizes_are_refused_up_front_with_the_limit_named():
    """A k of 10^8 once ran for minutes building per-position counts before the first prompt."""
    with pytest.raises(SettingsError, match=f"k must be at most {K_LIMIT}"):
        DraftRules(10 ** 8)
    assert DraftRules(K_LIMIT).k == K_LIMIT
    with pytest.raises(SettingsError, match=f"up to {NGRAM_LIMIT}"):
        Strategy(drafting="prompt-lookup", ngram_max=10 ** 5)
    with pytest.raises(SettingsError, match=f"k_max up to {K_LIMIT}"):
        Strategy(k_policy="online", k_max=10 ** 6)
