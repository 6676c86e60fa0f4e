"""llama.cpp's n-gram types run natively by llama-speculative-simple (the llama-spec-cli runtime,
--drafting llama-ngram-*, no drafter model loaded) and reproduced by the driven loop under the
llama-spec-simple schedule: id for id and count for count on the tiny pair. The tool runs one
prompt per process, so the reproduction begins every prompt afresh (docs/ngram.md).

Needs the tool built by scripts/build_llama_tools; skipped without it."""

import json

import pytest
from click.testing import CliRunner

from crossrt.backends.llama_spec_cli_log import parse_log
from crossrt.cli import main
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record
from crossrt.speculative import loop
from crossrt.run.repeating import repeating, write_jsonl
from crossrt.run.runtime import DraftRules, RuntimeFailure, availability
from crossrt.speculative.schedules import SPEC_SIMPLE
from crossrt.speculative.strategies import Strategy

from conftest import TINY_PAIR, assert_clean_error, assert_reproduced

pytestmark = pytest.mark.skipif(availability("llama-spec-cli") is not None,
                                reason=str(availability("llama-spec-cli")))

MAX_NEW = 32
# drafting, k, ngram_max, the type's own flags in the record's note
TYPES = [("llama-ngram-simple", 4, 3, "--spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4"),
         ("llama-ngram-map-k", 4, 2, "--spec-ngram-map-k-size-n 2 --spec-ngram-map-k-size-m 4"),
         ("llama-ngram-map-k4v", 4, 2, "--spec-ngram-map-k4v-size-n 2 --spec-ngram-map-k4v-size-m 4 "
          "--spec-ngram-map-k4v-min-hits 1"),
         ("llama-ngram-mod", 4, 2, "--spec-ngram-mod-n-match 2 --spec-ngram-mod-n-max 4 --spec-ngram-mod-n-min 4"),
         ("llama-ngram-cache", 8, 4, "its fixed sizes")]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def repeating_prompts(tiny_sessions, tmp_path_factory):
    """Three built-in prompts, each followed by the target's greedy continuation and itself again,
    so the output repeats earlier text (as scripts/repeating_prompts.py builds them)."""
    target, _ = tiny_sessions
    return write_jsonl(repeating(target, load_prompts("builtin")[::4], 24),
                       tmp_path_factory.mktemp("spec-cli-ngram") / "prompts.jsonl")


def _runs(tmp_path, prompts, drafting, k, ngram_max):
    same = ["--pair", TINY_PAIR, "--k", k, "--max-new-tokens", MAX_NEW, "--prompts", prompts, "--threads", 1,
            "--drafting", drafting, "--ngram-max", ngram_max]
    native = invoke("run", "--runtime", "llama-spec-cli", "--mode", "native", "--out", tmp_path / "native.json", *same)
    assert native.exit_code == 0, native.output
    driven = invoke("run", "--runtime", "llama-cpp", "--schedule", SPEC_SIMPLE, "--out", tmp_path / "driven.json",
                    *same)
    assert driven.exit_code == 0, driven.output
    return load_record(tmp_path / "native.json"), load_record(tmp_path / "driven.json")


@pytest.mark.parametrize("drafting, k, ngram_max, flags", TYPES)
def test_each_ngram_type_runs_natively_and_its_reproduction_equals_it(drafting, k, ngram_max, flags,
                                                                      repeating_prompts, tmp_path):
    native, driven = _runs(tmp_path, repeating_prompts, drafting, k, ngram_max)
    spec_type = drafting.removeprefix("llama-")
    assert (native.params.schedule, native.params.spec_type, native.params.drafting, native.params.ngram_max,
            native.pair.drafter.loaded) == (SPEC_SIMPLE, spec_type, drafting, ngram_max, ())
    assert any(note.startswith(f"{spec_type}: {flags} ") for note in native.notes)
    assert (driven.params.schedule, driven.params.drafting, driven.params.ngram_max) == (SPEC_SIMPLE, drafting, ngram_max)
    assert_reproduced(driven, native)
    assert sum(r.counters.accepted for r in native.results) > 0


def test_the_tool_begins_each_prompt_afresh_and_parity_compares_counters(repeating_prompts, tiny_sessions,
                                                                         tmp_path):
    """One prompt twice: ngram-mod's pool would outlive the first in one process (as in
    llama-server) and hold its output when the second begins; the tool's process ends with its
    prompt, and a drafter kept across the prompts drafts otherwise."""
    first = json.loads(repeating_prompts.read_text().splitlines()[0])
    twice = tmp_path / "twice.jsonl"
    twice.write_text("".join(json.dumps({**first, "id": name}) + "\n" for name in ("first", "again")))
    native, driven = _runs(tmp_path, twice, "llama-ngram-mod", 4, 2)
    assert native.results[0].counters == native.results[1].counters
    strategy, rules = Strategy(drafting="llama-ngram-mod", ngram_max=2), DraftRules(4)
    target, _ = tiny_sessions
    assert loop.run_lookup(strategy, rules, SPEC_SIMPLE, target.eog_ids) is None
    kept = loop.run_lookup(strategy, rules, "llama-server", target.eog_ids)
    counts = [loop.speculative_generate(target, None, r.prompt_ids, rules, MAX_NEW, SPEC_SIMPLE, strategy=strategy,
                                        drafts=kept).counters(4) for r in native.results]
    assert [(c.drafted, c.accepted) for c in counts] != \
        [(r.counters.drafted, r.counters.accepted) for r in native.results]
    parity = invoke("parity", tmp_path / "native.json", tmp_path / "driven.json")
    assert parity.exit_code == 0, parity.output
    assert "identical, 0 explained, 0 failed, 0 not comparable; counters compared" in parity.output


@pytest.mark.parametrize("args, message", [
    (["--spec-type", "ngram-simple"], "runs spec type 'ngram-simple' as --drafting llama-ngram-simple"),
    (["--drafting", "llama-ngram-cache", "--ngram-max", 4, "--k", 4], "ngram-cache drafts up to 8 tokens"),
    (["--drafting", "llama-ngram-mod", "--ngram-max", 2, "--spec-type", "ngram-simple"],
     "llama-ngram-mod is llama-speculative-simple's ngram-mod, not spec type 'ngram-simple'"),
])
def test_what_the_tool_cannot_run_is_refused_in_one_line(args, message, tmp_path):
    result = invoke("run", "--runtime", "llama-spec-cli", "--mode", "native", "--pair", TINY_PAIR,
                    "--max-new-tokens", 4, "--out", tmp_path / "r.json", *args)
    assert_clean_error(result, message)


def test_a_batch_that_does_not_start_at_the_last_token_is_not_read():
    """The n-gram path reads each draft from the batch the target verified, [last token] + draft;
    a batch whose first id is not the previous step's last token is not that batch."""
    def batch(ids):
        rows = "".join(f"D ubatch_print:     {i}: id = {t} (x), pos = {i}\n" for i, t in enumerate(ids))
        return f"D init: input batch info:\n{rows}D ubatch_print:   ]\n"
    tail = ("I encoded 3 tokens in 0.1 seconds, speed: 30.0 t/s\nI decoded 4 tokens in 0.1 seconds, speed: 40.0 t/s\n"
            "I n_predict = 4\nI n_drafted = 2\nI n_accept  = 2\n")
    good = batch([5, 6, 7]) + "D accepted 2/2 draft tokens, the last target token is: (8)\n" + \
        batch([8]) + "D accepted 0/0 draft tokens, the last target token is: (9)\n" + tail
    run = parse_log(good.encode(), batches=True)
    assert [(s.draft, s.accepted, s.last) for s in run.steps] == [((6, 7), 2, 8), ((), 0, 9)]
    with pytest.raises(RuntimeFailure, match="its batch held"):
        parse_log(good.replace(batch([8]), batch([3])).encode(), batches=True)
