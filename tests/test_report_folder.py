"""`crossrt report` of a folder of records made for different questions, as a new user's runs/
holds them: a comparable greedy pair (the tiny pair at k = 4 and 2 over the built-in prompts), a
lossy run of the same prompts, and runs of two other prompt sets. The page shows every run, labels
the lossy one, compares the pair, says why each other run was not compared, and names the setting
in its title; not comparable is never failed."""

import dataclasses
import re
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.compare.plain import CAUSES, power_plainly
from crossrt.compare import splits
from crossrt.compare.power import Power
from crossrt.records.record_json import load_record
from crossrt.report.groups import difference

XHTML = "{http://www.w3.org/1999/xhtml}"
RUNS = {"k4": ("--k", "4"), "k2": ("--k", "2"), "lossy": ("--acceptance", "relaxed"),
        "code": ("--prompts", "code"), "prose": ("--prompts", "prose")}


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The records by name, in RUNS' order."""
    where = tmp_path_factory.mktemp("folder")
    for name, options in RUNS.items():
        result = cli("run", "--pair", "tiny", "--max-new-tokens", 8, "--threads", 1, *options, "--out",
                     where / f"{name}.json")
        assert result.exit_code == 0, result.output
    return {name: where / f"{name}.json" for name in RUNS}


def rows(table):
    header = [th.text for th in table.iter(XHTML + "th")]
    return [dict(zip(header, [td.text or "" for td in tr.iter(XHTML + "td")], strict=True))
            for tr in table.find(XHTML + "tbody")]


def tables(section):
    """The section's own tables, by their first heading."""
    return {table.find(f".//{XHTML}th").text: table for table in section.findall(XHTML + "table")}


def test_every_run_is_shown_the_pair_judged_and_the_others_not_compared_with_why(folder, tmp_path):
    out, markdown = tmp_path / "r.html", tmp_path / "r.md"
    result = cli("report", *folder.values(), "-o", out, "--markdown", markdown)
    assert result.exit_code == 0, result.output
    root = ET.parse(out).getroot()
    sections = {s.get("id"): s for s in root.iter(XHTML + "section")}
    label = {row["record"]: row["run"] for row in rows(tables(sections["runs"])["run"])}
    labels = {name: label[str(path)] for name, path in folder.items()}

    # Every run in the summary; the lossy one labelled lossy, in its name and its lossless cell.
    summary = {row["run"]: row for row in rows(tables(sections["summary"])["run"])}
    assert set(summary) == set(labels.values())
    assert labels["lossy"].endswith(" lossy") and summary[labels["lossy"]]["lossless"] == "lossy"
    assert not any(labels[name].endswith("lossy") for name in RUNS if name != "lossy")

    # The banner: the pair's verdict, not failed by the runs that were never comparable.
    banner = sections["summary"].find(f"{XHTML}p")
    verdict, detail = banner.text, banner.find(XHTML + "span").text
    assert banner.get("class") == "banner ok" and verdict.startswith("parity: OK")
    assert detail.startswith("2 runs compared in 1 group of the same vocabulary, prompts and max new tokens; "
                             "3 run(s) not compared with another, 1 of them lossy")

    # Which runs were compared with which, and why not.
    parity = sections["parity"]
    places = {row["run"]: row for row in rows(tables(parity)["run"])}
    assert set(places) == set(labels.values())
    assert places[labels["k4"]]["parity"] == places[labels["k2"]]["parity"] == "group 1"
    assert places[labels["k4"]]["compared with, or why not"] == labels["k2"]
    for name in ("code", "prose"):
        assert places[labels[name]]["parity"] == "not compared"
        assert "other prompts" in places[labels[name]]["compared with, or why not"]
    why = places[labels["lossy"]]["compared with, or why not"]
    assert places[labels["lossy"]]["parity"] == "not compared" and why.startswith("lossy: ran a lossy acceptance")
    assert why.endswith("parity compares greedy runs only")

    # The pair judged against each other; every other comparison a run's own lossless check, the
    # lossy run's none. Each row's counts add up to its prompts.
    verdicts = rows(tables(parity)["run A"]) if "run A" in tables(parity) else []
    said = [li.text for li in parity.find(XHTML + "ul") if li.text.startswith("identical on every prompt: ")]
    pairs = [(row["run A"], row["run B"]) for row in verdicts]
    pairs += [tuple(pair.split(" vs ")) for line in said for pair in line.split(": ", 1)[1].split("; ")]
    assert sorted(map(sorted, pairs)) == sorted(sorted(pair) for pair in [
        (labels["k4"], labels["k2"]), *((labels[name], "its baseline") for name in RUNS if name != "lossy")])
    for row in verdicts:
        parts = [int(row[name].split()[0]) for name in ("identical", "explained (by cause)", "failed",
                                                          "not comparable")]
        assert int(row["prompts"]) == sum(parts)
        by_cause = re.findall(r" (\d+)(?:, |\)$)", row["explained (by cause)"])  # each prompt under one entry
        assert not by_cause or sum(map(int, by_cause)) == parts[1]

    # The title names the setting: pair and files, k, prompts, budget, device.
    records = {name: load_record(path) for name, path in folder.items()}
    sizes = ", ".join(str(len(records[name].results)) for name in ("k4", "code", "prose"))
    device = records["k4"].runtime.device
    expected = (f"crossrt report: tiny (target.f32.gguf / drafter.f32.gguf); k 2, 4; 3 prompt sets ({sizes} prompts); "
                f"8 new tokens; on {device}, 1 thread")
    assert root.find(f"{XHTML}head/{XHTML}title").text == root.find(f".//{XHTML}h1").text == expected

    # The Markdown says the same.
    text = markdown.read_text()
    assert text.startswith(f"# {expected}\n") and text.count("| not compared |") == 3


def test_what_keeps_two_runs_apart_is_named(folder):
    k4, code = load_record(folder["k4"]), load_record(folder["code"])
    assert difference(k4, load_record(folder["k2"])) == ""
    assert re.fullmatch(r"other prompts \(\d+ vs \d+, 0 in common\)", difference(k4, code))
    longer = dataclasses.replace(k4, params=dataclasses.replace(k4.params, max_new_tokens=12))
    assert difference(k4, longer) == "max new tokens 8 vs 12"
    first = dataclasses.replace(k4.results[0], prompt_sha256="another text")
    retold = dataclasses.replace(k4, results=(first, *k4.results[1:]))
    assert difference(k4, retold) == f"other prompt texts under the same ids ({first.prompt_id})"
    target = dataclasses.replace(k4.pair.target, vocab_fingerprint="another vocabulary")
    foreign = dataclasses.replace(k4, pair=dataclasses.replace(k4.pair, target=target))
    assert difference(k4, foreign) == "another vocabulary"


def test_every_cause_and_the_power_are_said_in_plain_words():
    kinds = {value for name, value in vars(splits).items() if name.isupper() and isinstance(value, str)}
    assert kinds <= set(CAUSES) and all(len(sentence.split()) > 8 for sentence in CAUSES.values())
    said = power_plainly(Power(0.01, 1.9e-5))
    assert "random noise of about 0.01" in said and "mean KL divergence of 1.9e-05" in said
