"""No verdict passes on zero comparisons (issue 40): `crossrt parity` (records, `--against`),
`crossrt reproduce` and the split census count what they really compared, and fail when a pair
of runs, a claims file or a census batch compared nothing. Records are real: tiny-pair runs of
llama.cpp made here, and imports of the recorded logs under tests/fixtures/import."""

import re
import shutil
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.compare.census import Variant, take_census
from crossrt.records.record_json import load_record

from conftest import TINY_PAIR

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "import"
# Every counting setting stated, so two imports of one log count alike (their counters compare).
STATED = ("--k", "4", "--draft-n-min", "4", "--draft-p-min", "0", "--max-new-tokens", "32")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def last_line(result) -> str:
    return result.output.strip().splitlines()[-1]


def run_tiny(out: Path, *extra) -> Path:
    invoke("run", "--pair", TINY_PAIR, "--prompts", "builtin", "--max-new-tokens", 12, "--threads", 1,
           "--n-ctx", 256, "--out", out, *extra)
    assert out.is_file(), out
    return out


def imported(folder: Path, log: str, source: str, *options, name: str = "") -> Path:
    """The record of one recorded log imported (copied first under name, as a second server's log)."""
    path = FIXTURES / log
    if name:
        path = Path(shutil.copy(path, folder / name))
    out = folder / f"{name or log}.json"
    result = invoke("import", path, "--from", source, "--out", out, *options)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("verdicts")
    return {"k4": run_tiny(folder / "k4.json", "--k", 4), "k2": run_tiny(folder / "k2.json", "--k", 2),
            "server": imported(folder, "llama-server-log-tiny.log", "llama-server-log", "--k", "4"),
            "sglang": imported(folder, "sglang-log-11948.log", "sglang-log"),
            "stated": imported(folder, "llama-server-log-tiny.log", "llama-server-log", *STATED, name="a.log"),
            "stated-again": imported(folder, "llama-server-log-tiny.log", "llama-server-log", *STATED, name="b.log")}


def test_two_imports_compare_nothing_and_fail(runs, tmp_path):
    """A llama-server log and an SGLang log: no token ids, counted differently. It used to print
    `1 identical` and `parity: OK`, exit 0."""
    result = invoke("parity", runs["server"], runs["sglang"], "--no-logits", "--junit", tmp_path / "p.xml",
                    "--html", tmp_path / "p.html")
    assert result.exit_code == 1, result.output
    assert ("llama-server/native vs sglang/native: 1 prompts: 0 identical, 0 explained, 0 failed, 1 not comparable "
            "(no token ids: imported from llama-server-log, sglang-log); counters not compared (k differs: 4 vs 3; "
            "schedule differs: llama-server vs sglang;") in result.output
    assert last_line(result).startswith("parity: FAILED: nothing compared between llama-server/native and "
                                        "sglang/native (and 2 more pair(s) of runs): no token ids")
    assert "parity: OK" not in result.output and " 1 identical" not in result.output
    suite = ElementTree.parse(tmp_path / "p.xml").getroot()
    assert suite.get("failures") == "3"  # the pair and each import's lossless check: nothing compared
    page = ElementTree.parse(tmp_path / "p.html").getroot()
    xhtml = "{http://www.w3.org/1999/xhtml}"
    overview = next(s for s in page.iter(xhtml + "section") if s.get("id") == "parity")
    assert [th.text for th in next(overview.iter(xhtml + "thead")).iter(xhtml + "th")][-1] == "not comparable"
    rows = [[td.text for td in tr.iter(xhtml + "td")] for tr in next(overview.iter(xhtml + "tbody"))]
    assert ["1 (no token ids: imported from llama-server-log, sglang-log)", "0"] == [rows[1][-1], rows[1][4]]
    # Counters alone would be accepted with --counters-only, but these were not compared either.
    only = invoke("parity", runs["server"], runs["sglang"], "--no-logits", "--counters-only")
    assert only.exit_code == 1 and "--counters-only" not in last_line(only), only.output
    assert last_line(only).startswith("parity: FAILED: nothing compared between llama-server/native and sglang/native: ")


def test_counters_alone_pass_only_when_asked_and_the_verdict_says_so(runs, tmp_path):
    pair = (runs["stated"], runs["stated-again"], "--no-logits")
    result = invoke("parity", *pair)
    assert result.exit_code == 1, result.output
    assert last_line(result).endswith("pass --counters-only to accept their counters alone")
    only = invoke("parity", *pair, "--counters-only", "--markdown", tmp_path / "p.md")
    assert only.exit_code == 0, only.output
    assert last_line(only) == "parity: OK, counters only; compared counters in 1 comparison"
    assert "a.log.json) vs llama-server/native (b.log.json): 1 prompts: 1 identical, 0 explained, 0 failed, " \
           "0 not comparable; counters compared" in only.output
    markdown = (tmp_path / "p.md").read_text()
    assert markdown.startswith("## crossrt parity: passed (counters only)\n\nparity: OK, counters only; compared")


def test_against_a_saved_import_compares_nothing_and_fails(runs):
    result = invoke("parity", runs["stated"], "--against", runs["stated-again"], "--no-logits")
    assert result.exit_code == 1, result.output
    assert last_line(result).startswith("parity: FAILED: nothing compared between llama-server/native (saved) and "
                                        "llama-server/native")


def test_against_a_saved_run_of_another_k_names_it_and_counts_no_prompt(runs):
    """With no saved run of the same runtime, mode and k, the headline used to say `1 prompts`."""
    result = invoke("parity", runs["k4"], "--against", runs["k2"], "--no-logits")
    assert result.exit_code == 1, result.output
    assert ("llama-cpp/driven vs saved baseline: no prompt compared: no saved run of the same runtime, mode and k "
            "(k4; saved: llama-cpp/driven k2)") in result.output
    assert "llama-cpp/driven (saved) vs new runs: no prompt compared: not run this time" in result.output
    assert "1 prompts" not in result.output


def test_a_run_whose_every_prompt_failed_is_not_lossless_by_default(tmp_path):
    """Each prompt's lossless check used to count a failed prompt `identical`: a run of nothing passed."""
    record = run_tiny(tmp_path / "short.json", "--n-ctx", 16)
    assert all(not r.ok for r in load_record(record).results)
    result = invoke("parity", record, "--no-logits")
    assert result.exit_code == 1, result.output
    count = len(load_record(record).results)
    assert re.search(rf"vs its baseline: {count} prompts: 0 identical, 0 explained, 0 failed, {count} not comparable "
                     r"\(the prompt failed \(", result.output), result.output
    assert last_line(result).startswith("parity: FAILED: nothing compared between llama-cpp/driven and its baseline: "
                                        "the prompt failed (")


def test_runs_that_differ_in_k_alone_say_so(runs):
    """Both on the crossrt schedule: the note used to blame the schedules."""
    result = invoke("parity", runs["k4"], runs["k2"], "--no-logits")
    assert result.exit_code == 0, result.output
    # draft_n_min defaults to k, so it differs with it
    assert "; counters not compared (k differs: 4 vs 2; draft_n_min differs: 4 vs 2)" in result.output
    assert "schedules differ" not in result.output
    assert re.fullmatch(r"parity: OK; compared token ids in \d+ comparisons", last_line(result)), result.output


def test_reproduce_fails_when_no_claimed_number_was_compared(runs, tmp_path):
    claims = tmp_path / "claims.toml"
    head = ('[[claim]]\nid = "server"\nsource = "tests/fixtures/import/llama-server-log-tiny.log"\n'
            'runtime = "llama-server"\nk = 4\nsampling = "greedy"\nhardware = "this box"\n')
    claims.write_text(head + "[claim.expect.all]\ntokens_per_s = 100\n")  # an import gives no timings
    result = invoke("reproduce", claims, "--measured", f"server={runs['server']}")
    assert result.exit_code == 1, result.output
    assert "nothing compared: none of the 1 claimed number(s) was measured and checked here" in result.output
    tau = load_record(runs["server"]).summary().tau
    claims.write_text(head + f"[claim.expect.all]\ntau = {tau:.3f}\ntokens_per_s = 100\n")
    result = invoke("reproduce", claims, "--measured", f"server={runs['server']}")
    assert result.exit_code == 0, result.output
    assert "compared 1 of 2 claimed number(s)" in result.output


def test_a_census_batch_that_compared_nothing_fails(tmp_path):
    """The census counted a batch of failed prompts as a batch without splits."""
    def run_one(variant, prompts, out):
        invoke("run", "--pair", TINY_PAIR, "--prompts", prompts, "--max-new-tokens", 16, "--out", out, *variant.options)
        return load_record(out)

    census = take_census(run_one, tmp_path, (Variant("short", "llama-cpp", "driven", ("--n-ctx", "16", "--threads", "1")),),
                         batch=2, max_batches=1)
    assert census.compared == 0
    assert any(re.match(r"batch 0 \(prompts-0.jsonl\): nothing compared \(the prompt failed", line)
               for line in census.failures), census.failures
    assert "2 prompts, 0 comparisons of token ids" in census.render()


def test_simulate_against_a_record_sharing_no_prompt_fails(runs, tmp_path):
    """`against R: 0 prompts compared, 0 match step for step` used to exit 0."""
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "not-in-the-record", "category": "prose", "prompt": "river value code"}\n')
    simulate = ("simulate", "--pair", TINY_PAIR, "--max-new-tokens", 12, "--threads", 1, "--max-k", 4)
    result = invoke(*simulate, "--prompts", other, "--against", runs["k4"])
    assert result.exit_code == 1, result.output
    assert last_line(result) == (f"against {runs['k4']}: nothing compared: none of its finished prompts is among "
                                 "the 1 simulated (--prompts)")
    same = invoke(*simulate, "--prompts", "builtin", "--against", runs["k4"])
    assert same.exit_code == 0 and last_line(same) == f"against {runs['k4']}: 10 prompts compared, 10 match step for " \
                                                      "step", same.output
