"""The parity sections of `crossrt report` and `crossrt parity --html`, on real llama.cpp runs of
the tiny pair and of a run whose target is the tiny drafter (a different model: its baselines
part from the tiny pair's, a disagreement, whatever the machine). Which prompts split, where and
how is up to this CPU: every assertion holds for each split the page shows, whichever they are."""

import dataclasses
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.compare.parity_report import Headline, ParityReport
from crossrt.compare.plain import cause_plainly
from crossrt.compare.splits import BATCH_SHAPE, CROSS_NUMERICS, DISAGREEMENT, DRAFTER_NUMERICS, NUMERICS
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.pairs import pair_from_paths
from crossrt.compare.parity import IDS, PromptParity, compare_all
from crossrt.inputs.prompts import load_prompts
from crossrt.compare.replay import Replayer
from crossrt.report.groups import group_runs, grouped_comparisons
from crossrt.report.parity import parity_section, report_parity, shown_splits, visible
from crossrt.report.runs import load_runs
from crossrt.report.steps import load_vocab, token_texts
from crossrt.run.runtime import DraftRules, RuntimeOptions

from conftest import REPO

XHTML = "{http://www.w3.org/1999/xhtml}"
PROMPTS = load_prompts("builtin")[:5]


def make(pair, path):
    run_pair(RunRequest(pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(4), 24, path), PROMPTS)
    return path


@pytest.fixture(scope="module")
def paths(tiny_pair, tmp_path_factory):
    """The tiny pair, and the tiny drafter standing in as target (same vocabulary)."""
    folder = tmp_path_factory.mktemp("parity-page")
    drafter = REPO / "models" / "tiny" / "drafter.f32.gguf"
    return make(tiny_pair, folder / "tiny.json"), make(pair_from_paths(drafter, drafter), folder / "swapped.json")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def fail_lines(output):
    return [line for line in output.splitlines() if line.startswith("FAIL ")]


def verdict_rows(parity):
    """The parity section's verdict table, as text: the table of the section itself, not of a split."""
    table = parity.find(XHTML + "table")
    return [] if table is None else [[td.text for td in tr.iter(XHTML + "td")] for tr in table.iter(XHTML + "tr")][1:]


def identical_pairs(parity):
    """The pairs of runs the parity section names identical on every prompt, in one line."""
    said = [li.text for li in parity.find(XHTML + "ul") if li.text.startswith("identical on every prompt: ")]
    return [pair.split(" vs ") for line in said for pair in line.split(": ", 1)[1].split("; ")]


def test_sections_show_every_split_once_with_its_verdict_and_tokens(paths):
    runs = load_runs(paths)
    labelled = [(run.label, run.record) for run in runs]
    grouping = group_runs(labelled)
    with Replayer() as replay:
        report = ParityReport(tuple(grouped_comparisons(labelled, grouping, replay)))
        direct = compare_all(labelled, replay=replay)
    assert grouping.whole and report.comparisons == tuple(direct)  # one group of comparable runs: compare_all
    overview = parity_section(labelled, report, rescored=True, grouping=grouping)
    assert overview.id == "parity" and len(overview.tables) == 1  # no table of groups: every run compared

    # The verdict table: one row per pair of runs not identical on every prompt, its failed count as
    # parity counts it; the identical pairs in one line.
    verdicts = overview.tables[0]
    failed = {(row[0], row[1]): int(row[6]) for row in verdicts.rows}
    for (run_a, run_b), count in failed.items():
        assert count == sum(not c.ok for c in direct if (c.run_a, c.run_b) == (run_a, run_b))
    assert failed[(runs[0].label, runs[1].label)] > 0  # another model: its outputs part on some prompt
    identical = {(c.run_a, c.run_b) for c in direct} - set(failed)
    assert all(c.identical for c in direct if (c.run_a, c.run_b) in identical)
    said = [note for note in overview.notes if note.startswith("identical on every prompt: ")]
    assert said == ([f"identical on every prompt: {'; '.join(f'{a} vs {b}' for a, b in sorted(identical))}"]
                    if identical else [])
    # Each cause found said in plain words, once.
    found = dict.fromkeys(cause for c in direct for cause in c.causes)
    assert DISAGREEMENT in found  # another model
    assert [note for note in overview.notes if note.startswith("in plain words: ")] == [
        f"in plain words: {cause}: {cause_plainly(cause)}" for cause in found]

    # Every split of every comparison shown once, under its cause, naming each comparison that holds it.
    shown_all = shown_splits(report, labelled)
    assert sum(len(s.comparisons) for s in shown_all) == sum(len(c.splits) for c in direct)
    assert 0 < len({split for c in direct for split in c.splits}) <= len(shown_all)
    causes = overview.parts
    splits = {split.id: split for cause in causes for split in cause.parts}
    assert sorted(splits) == sorted(f"split-{n}" for n in range(1, len(shown_all) + 1))
    assert [cause.mark for cause in causes] == sorted((cause.mark for cause in causes), key=lambda m: m != "fail")
    for cause in causes:  # one line: status, kind, how many, which prompts; the evidence folded under it
        members = [shown_all[int(split.id.split("-")[1]) - 1] for split in cause.parts]
        status, kinds = ("FAIL" if members[0].failed else "NOTE"), {m.split.kind for m in members}
        assert cause.fold and len(kinds) == 1 and {m.failed for m in members} == {status == "FAIL"}
        prompts = ", ".join(dict.fromkeys(m.split.prompt_id for m in members))
        kind = kinds.pop()
        assert cause.title == f"{status} {kind}: {len(members)} split{'s' * (len(members) > 1)} ({prompts})"
        assert cause.intro == f"In plain words: {cause_plainly(kind)}."

    vocab, _ = load_vocab(runs[0].record)
    with_candidates = 0
    for number, shown in enumerate(shown_all, start=1):
        section = splits[f"split-{number}"]
        status = "FAIL" if shown.failed else "NOTE"
        assert shown.failed == (shown.split.kind not in NUMERICS)
        assert section.title.startswith(f"{status} {section.id.replace('-', ' ')}: {shown.split.prompt_id}")
        assert section.mark == status.lower() and f"in: {', '.join(shown.comparisons)}" in section.notes
        verdict = section.tables[0]
        assert verdict.header[0] == "verdict" and verdict.rows[0][0].startswith(f"{status}: {shown.split.kind}")
        if shown.split.verdict is not None:  # a near-tie reads flip <= threshold, a finding flip > threshold
            assert verdict.rows[0][3] == ("<=" if shown.split.verdict.near else ">")
            assert verdict.rows[0][4] == f"{shown.split.verdict.threshold:g}"
        tables = {table.header[0]: table for table in section.tables}
        for side in shown.split.sides:  # the emitted tokens decoded as llama.cpp's vocabulary reads them
            cells = next(r for r in tables["side"].rows if r[0] == side.label)
            assert cells[1] == f'{side.token} "{visible(token_texts(vocab, [side.token])[0])}"'
            assert cells[4] == side.gap.describe()
        if shown.sequences is not None and shown.sequences.sides:
            # Side by side from the split on: the first tokens differ (or one side has ended).
            first = tables["from the split"].rows[0][1:]
            assert first[0] != first[1]
            context = tables["text before the split"].rows[0]
            assert context[1] == " ".join(map(str, shown.sequences.prefix[-12:]))
            assert context[0] == visible("".join(token_texts(vocab, shown.sequences.prefix)[-12:]))
        if "side" in tables and any(shown.sequences.views if shown.sequences else ()):
            # Driven runs record their passes: each side's candidates start with its emitted token.
            candidates = tables["pass of"].rows
            for side in shown.split.sides:
                mine = [r for r in candidates if r[0] == side.label]
                assert mine[0][1:] == (f'{side.token} "{visible(token_texts(vocab, [side.token])[0])}"', "emitted",
                                       "1", "0")
            with_candidates += 1
    assert with_candidates > 0  # the other model's splits at least: driven runs, recorded passes


def test_report_and_parity_html_show_the_same_splits_and_failures(paths, tmp_path):
    assert cli("report", *paths, "-o", tmp_path / "r.html", "--markdown", tmp_path / "r.md").exit_code == 0
    parity = cli("parity", *paths, "--no-logits", "--html", tmp_path / "p.html")
    assert parity.exit_code == 1
    assert f"in plain words: {DISAGREEMENT}: {cause_plainly(DISAGREEMENT)}" in parity.output.splitlines()
    titles = {}
    for name in ("r", "p"):
        root = ET.parse(tmp_path / f"{name}.html").getroot()
        sections = list(root.iter(XHTML + "section"))
        assert [s.get("id") for s in sections][:2] == ["summary", "parity"]
        titles[name] = [s.find(XHTML + "h4").text for s in sections if s.get("id").startswith("split-")]
        rows = verdict_rows(sections[1])
        assert sum(int(row[6]) for row in rows) == len(fail_lines(parity.output))
        assert all(s.get("class") in ("fail", "note") for s in sections if s.get("id").startswith("split-"))
    assert titles["r"] == titles["p"] and titles["r"]
    markdown = (tmp_path / "r.md").read_text()
    assert [line[5:] for line in markdown.splitlines() if line.startswith(("#### FAIL ", "#### NOTE "))] \
        == titles["r"]


def test_without_rescoring_the_page_says_so_and_one_record_has_no_parity(paths, tmp_path):
    runs = load_runs(paths)
    _, section = report_parity(runs, rescore=False)
    assert "Re-scoring was off (--no-rescore)" in section.intro
    assert report_parity(runs[:1]) is None
    assert cli("report", paths[0], "-o", tmp_path / "one.html").exit_code == 0
    assert 'id="parity"' not in (tmp_path / "one.html").read_text()


def test_runs_of_another_vocabulary_are_left_out_and_named(paths):
    runs = load_runs(paths)
    record = runs[1].record
    target = dataclasses.replace(record.pair.target, vocab_fingerprint="another vocabulary")
    foreign = dataclasses.replace(record, pair=dataclasses.replace(record.pair, target=target))
    labelled = [(runs[0].label, runs[0].record), (runs[1].label, foreign)]
    grouping = group_runs(labelled)
    assert grouping.groups == () and [label for label, _ in grouping.alone] == [run.label for run in runs]
    assert all(why.endswith(f"{other}: another vocabulary") for (_, why), other in
               zip(grouping.alone, reversed([run.label for run in runs])))
    comparisons = grouped_comparisons(labelled, grouping)
    assert {c.run_b for c in comparisons} == {"its baseline"}  # each run's own lossless check only


def test_explained_prompts_count_once_so_their_causes_add_up():
    """A prompt explained by two causes counts once, under both joined: the parts sum to the whole."""
    two = PromptParity("p1", "a", "b", (), 3, (), False, ("near-ties",), (CROSS_NUMERICS, BATCH_SHAPE),
                       compared=(IDS,))
    one = PromptParity("p2", "a", "b", (), 5, (), False, ("a near-tie",), (DRAFTER_NUMERICS,), compared=(IDS,))
    headline = Headline.of([two, one])
    assert headline.explained_prompts == 2 == sum(n for _, n in headline.explained)
    assert headline.by_cause() == f"{CROSS_NUMERICS} + {BATCH_SHAPE} 1, {DRAFTER_NUMERICS} 1"
    assert headline.describe().startswith(f"2 prompts: 0 identical, 2 explained ({headline.by_cause()}), 0 failed")


def test_a_parity_matrix_writes_its_page_without_record_paths(tmp_path):
    result = cli("parity", "--pair", REPO / "models" / "pairs" / "tiny.toml", "--max-new-tokens", 8, "--no-logits",
                 "--out-dir", tmp_path / "runs", "--html", tmp_path / "m.html")
    assert result.exit_code in (0, 1), result.output
    root = ET.parse(tmp_path / "m.html").getroot()
    sections = {s.get("id"): s for s in root.iter(XHTML + "section")}
    runs = [[td.text for td in tr.iter(XHTML + "td")] for tr in next(sections["runs"].iter(XHTML + "tbody"))]
    assert [row[5] for row in runs] == ["(run by this command)"]  # the matrix's one run, held in memory
    verdicts = verdict_rows(sections["parity"])
    assert [row[:2] for row in verdicts] + identical_pairs(sections["parity"]) == [["llama-cpp/driven", "its baseline"]]
    assert sum(int(row[6]) for row in verdicts) == len(fail_lines(result.output))
