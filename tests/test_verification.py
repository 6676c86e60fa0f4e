"""crossrt.compare.verification: where the batch-shape noise is measured.

A split of a run from its own baseline is judged against the noise its scorer measures between
one pass and one-token decodes. On llama.cpp without flash attention the two agree exactly up to
some position and differ after it (docs/parity.md), so noise measured on each prompt's first rows
alone can miss the difference at the split's own row. The measurement must cover every row where
a run left its baseline, whichever prompts split on this machine: here a split is made on purpose
by editing one baseline of a real run.
"""

import dataclasses

from crossrt.compare.control import CONTROL_ROWS
from crossrt.compare.verification import (DECODED_ROWS, DRAFTER, LEAST_ROWS, NONDETERMINISM, VERIFICATION,
                                         scored_with_path_checks, split_rows)
from crossrt.run.driver import RunRequest, run_pair
from crossrt.run.runtime import DraftRules, RuntimeOptions
from crossrt.inputs.prompts import load_prompts

TOKENS = 24
SPLIT_AT = 19  # past the rows each prompt measures anyway (verification.DECODED_ROWS spread over 8 prompts)


def test_the_noise_is_measured_at_every_row_where_a_run_left_its_baseline(tiny_pair, tmp_path):
    prompts = load_prompts("builtin")[:8]
    options = RuntimeOptions(n_ctx=512, threads=1, f32_kv_cache=True, flash_attn=False)
    record = run_pair(RunRequest(tiny_pair, "llama-cpp", options, DraftRules(4), TOKENS, tmp_path / "run.json"),
                      prompts)
    index = next(i for i, r in enumerate(record.results) if r.ok and len(r.output_ids) == TOKENS and r.lossless)
    result = record.results[index]
    baseline = list(result.baseline_ids)
    baseline[SPLIT_AT] ^= 1  # another token there: the run leaves it at SPLIT_AT (no row reads the baseline's ids)
    results = list(record.results)
    results[index] = dataclasses.replace(result, baseline_ids=tuple(baseline))
    split = dataclasses.replace(record, results=tuple(results))
    assert split_rows([split]) == {**split_rows([record]), result.prompt_id: SPLIT_AT + 1}

    def measured_rows(run):
        _, checks, _ = scored_with_path_checks([("llama-cpp/driven", run)])
        check = next(c for c in checks if c.kind == VERIFICATION)
        assert check.ok, check.describe()
        return check.measured.positions

    # Each verification batch size compares its rows against the decoded ones: the split prompt
    # decodes SPLIT_AT + 1 rows where it decoded fewer.
    per_prompt = max(LEAST_ROWS, min(CONTROL_ROWS, DECODED_ROWS // len(prompts)))
    assert per_prompt < SPLIT_AT + 1
    assert measured_rows(split) - measured_rows(record) == SPLIT_AT + 1 - per_prompt


def test_a_short_output_still_measures_the_noise_over_control_rows(real_pair, tmp_path):
    """The noise control reaches CONTROL_ROWS rows on its first prompt, past the output where it
    is shorter (by the decodes' own greedy choice). Gemma 3 270M on llama.cpp's defaults (F16 KV,
    flash attention): its one-token decodes equal one pass exactly over a prompt's first rows
    and differ by about a logit after them, while its verification batches differ from the first
    row; 4 new tokens measured a noise of 0 and the honest batches failed (the README tour's
    sizes, one prompt). The real model because the tiny pair's float32 rows never agree exactly."""
    prompts = [load_prompts("builtin")[0]]
    record = run_pair(RunRequest(real_pair, "llama-cpp", RuntimeOptions(threads=1), DraftRules(7), 4,
                                 tmp_path / "run.json"), prompts)
    assert record.results[0].ok and len(record.results[0].output_ids) <= 4
    _, checks, _ = scored_with_path_checks([("llama-cpp/driven", record)])
    verification = next(c for c in checks if c.kind == VERIFICATION)
    assert verification.noise.positions >= CONTROL_ROWS > verification.measured.positions
    assert all(check.ok for check in checks), [check.describe() for check in checks if not check.ok]


def test_drafter_checks_beside_the_scorers_give_every_figure_they_give_one_after_them(tiny_pair, tmp_path,
                                                                                     monkeypatch):
    """parity --jobs 2: the drafters' rollback checks run in a thread of their own beside the
    scorers' checks (each on its own session, loads in turn); every row, noise and check is what it
    is one after the other."""
    import threading
    from crossrt.compare import verification

    options = RuntimeOptions(n_ctx=512, threads=1, f32_kv_cache=True, flash_attn=False)
    runs = [(f"{runtime}/driven", run_pair(RunRequest(tiny_pair, runtime, options, DraftRules(4), 12,
                                                      tmp_path / f"{runtime}.json"), load_prompts("builtin")[:2]))
            for runtime in ("llama-cpp", "transformers")]
    threads = []

    def in_thread(function):
        def recorded(*args):
            threads.append((function.__name__, threading.current_thread() is threading.main_thread()))
            return function(*args)
        return recorded
    for name in ("drafter_checks", "_scorer_checks"):
        monkeypatch.setattr(verification, name, in_thread(getattr(verification, name)))

    def said(beside):
        as_run, checks, noises = scored_with_path_checks(runs, beside=beside)
        return ({key: rows.tobytes() for key, rows in as_run.items()}, noises,
                [(c.kind, c.scorings, c.runs, c.prompts, c.findings, c.summary, c.measured, c.bounds, c.noise)
                 for c in checks])
    after = said(False)
    assert threads == [("_scorer_checks", True), ("_scorer_checks", True), ("drafter_checks", True)]
    threads.clear()
    beside = said(True)
    assert sorted(threads) == [("_scorer_checks", True), ("_scorer_checks", True), ("drafter_checks", False)]
    assert [kind for kind, *_ in after[2]] == [VERIFICATION, NONDETERMINISM] * 2 + [DRAFTER] * 2, after[2]
    assert beside == after
