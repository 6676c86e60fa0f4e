"""`--format table|csv|json|md` of show, analyze, cache ls and sweep show (crossrt/records/tables.py):
every row names its run (file, pair, runtime, mode, schedule, drafting, k or the k policy,
acceptance, lossy), read back from each format and checked against the records, which real
tiny-pair runs wrote; and a content policy's k stated as the policy, per row as used."""

import csv
import io
import json
import re

import pytest
from click.testing import CliRunner

from crossrt.analyze import analysis
from crossrt.cli import main
from crossrt.records.record_json import load_record
from crossrt.speculative.strategies import Strategy
from crossrt.sweep.store import SweepStore

from conftest import REPO, TINY_PAIR

TRAINED_PAIR = REPO / "models" / "pairs" / "trained.toml"
FORMATS = ("csv", "json", "md")
IDENTITY = ("file", "pair", "runtime", "mode", "schedule", "drafting", "k", "acceptance", "lossy")
CONTENT = "content code=7,prose=3"
# Each run: its options, then the identity its rows state besides file, pair, runtime, mode and schedule.
RUNS = {"fixed": (["--k", "3"], {"drafting": "model", "k": 3, "acceptance": "greedy", "lossy": False}),
        "lossy": (["--k", "3", "--drafting", "prompt-lookup", "--acceptance", "relaxed", "--top-m", "2",
                   "--delta", "1"],
                  {"drafting": "prompt-lookup ngram=1..3", "k": 3, "acceptance": "relaxed top_m=2,delta=1",
                   "lossy": True})}
SWEEP = f"""name = "tables"
[axes]
pair = "{TINY_PAIR}"
runtime = "llama-cpp"
k = [1, 2]
prompts = "code"
max_new_tokens = 4
[resources.llama-cpp]
threads = 1
"""


def cli(*args, **env):
    result = CliRunner(env=env).invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Records of three real runs (fixed k; lossy lookup; the trained pair's content policy under its
    default name) and a two-cell sweep, their baselines in a store of their own; the runs by name."""
    folder = tmp_path_factory.mktemp("tables")
    env = {"CROSSRT_CACHE": str(folder / "cache")}
    paths = {}
    for name, (options, _) in RUNS.items():
        paths[name] = folder / f"{name}.json"
        cli("run", "--pair", TINY_PAIR, "--max-new-tokens", 8, "--threads", 1, *options, "--out", paths[name], **env)
    with pytest.MonkeyPatch.context() as patch:  # the default record name is under ./runs
        patch.chdir(folder)
        printed = cli("run", "--pair", TRAINED_PAIR, "--k-policy", "content", "--content-k", "code=7,prose=3",
                      "--max-new-tokens", 16, "--threads", 1, **env).stdout
    (paths["content"],) = (folder / "runs").glob("*.json")
    (folder / "sweep.toml").write_text(SWEEP)
    cli("sweep", "run", folder / "sweep.toml", "--dir", folder / "sweep", **env)
    return paths, printed, folder, env


def rows_of(output_format: str, text: str) -> list[dict]:
    """The printed table's rows by column: CSV's and JSON's keys, Markdown's headings."""
    if output_format == "json":
        return json.loads(text)
    if output_format == "csv":
        return list(csv.DictReader(io.StringIO(text)))
    header, rule, *lines = text.splitlines()
    assert re.fullmatch(r"\|(---\|)+", rule), rule

    def cells(line):
        assert line.startswith("| ") and line.endswith(" |"), line
        return [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line[2:-2])]
    return [dict(zip(cells(header), cells(line), strict=True)) for line in lines]


def written(output_format: str, value):
    """value as a format writes it: JSON as itself, CSV as text, Markdown as the table shows it."""
    if output_format == "json":
        return value
    if isinstance(value, bool):
        return {"csv": "true" if value else "false", "md": "yes" if value else "no"}[output_format]
    return ("" if output_format == "csv" else "-") if value is None else str(value)


def rate(output_format: str, value, digits: int = 2):
    """A rate as a format writes it: whole in JSON and CSV, to digits in Markdown."""
    if value is None:
        return written(output_format, None)
    return {"json": value, "csv": repr(value), "md": f"{value:.{digits}f}"}[output_format]


def identity(path, record, stated: dict) -> dict:
    return {"file": str(path), "pair": record.pair.name, "runtime": "llama-cpp", "mode": "driven",
            "schedule": "crossrt", **stated}


def stated(name: str) -> dict:
    return RUNS[name][1] if name in RUNS else {"drafting": "model", "k": CONTENT, "acceptance": "greedy",
                                               "lossy": False}


@pytest.mark.parametrize("output_format", FORMATS)
def test_show_names_every_row_run_and_its_numbers(made, output_format):
    paths, _, _, _ = made
    records = {name: load_record(path) for name, path in paths.items()}
    result = cli("show", *paths.values(), "--format", output_format)
    rows = rows_of(output_format, result.stdout)
    tau, alpha, k_used = ("tau", "alpha", "k_used") if output_format != "md" else ("tau", "alpha", "k used")
    expected = []
    for name, record in records.items():
        for category in (*record.categories(), None):
            summary = record.summary(category)
            done = summary.prompts - summary.failed
            lossless = summary.lossless if output_format != "md" else f"{summary.lossless}/{done}"
            numbers = {"category": category or "ALL", tau: rate(output_format, summary.tau),
                       alpha: rate(output_format, summary.alpha, 3),
                       k_used: rate(output_format, summary.drafted / summary.steps, 1),
                       # a lossy run makes no lossless claim
                       "lossless": ("lossy" if output_format == "md" else written(output_format, None))
                       if record.params.lossy else written(output_format, lossless)}
            expected.append({**{key: written(output_format, value) for key, value in
                                identity(paths[name], record, stated(name)).items()}, **numbers})
    assert [{key: row[key] for key in expected[0]} for row in rows] == expected


def test_a_content_policy_states_the_policy_and_the_k_each_row_used(made):
    """The record's k (7, the most a step drafts) is no row's k: the policy is, and each row's k
    used is what its steps drafted; the default record name carries the policy, not an unread k."""
    paths, printed, _, _ = made
    record = load_record(paths["content"])
    assert record.params.k == 7 and record.params.content_k == "code=7,prose=3"
    assert re.fullmatch(r"trained-llama-cpp-model-content-code-7-prose-3-greedy-[0-9a-f]{6}\.json",
                        paths["content"].name)
    assert Strategy(k_policy="content", content_k=(("code", 7), ("prose", 3))).k_setting(4) == CONTENT
    rows = {row["category"]: row for row in rows_of("json", cli("show", paths["content"], "--format", "json").stdout)}
    assert {row["k"] for row in rows.values()} == {CONTENT}
    for category, row in rows.items():
        summary = record.summary(None if category == "ALL" else category)
        assert row["k_used"] == summary.drafted / summary.steps
    assert rows["prose"]["k_used"] < 4 < 6 < rows["code"]["k_used"] <= 7  # code=7, prose=3 as the policy says
    # `crossrt run` prints the same: the policy once above, each row's k used in its column.
    header = next(line for line in printed.splitlines() if line.startswith("category"))
    assert f"k: {CONTENT}" in printed and "k used" in header
    prose = next(line for line in printed.splitlines() if line.startswith("prose "))
    assert f"{rows['prose']['k_used']:.1f}" in prose.split()


def test_the_aligned_table_states_shared_identity_once_and_fits_the_terminal(made):
    paths, _, _, _ = made
    ordered = list(paths)
    wide = cli("show", *paths.values(), COLUMNS="250").stdout.splitlines()
    narrow = cli("show", *paths.values(), COLUMNS="120").stdout.splitlines()
    for lines in (wide, narrow):
        assert lines[0] == "runtime: llama-cpp; mode: driven; schedule: crossrt"  # every row's
        for number, name in enumerate(ordered, 1):
            assert any(line.startswith(f"file #{number}: {paths[name]}") for line in lines)
    # Wide: the identity that differs is a column, each row's file a number.
    header = next(line for line in wide if line.startswith("file  "))
    assert re.split(r"\s{2,}", header)[:7] == ["file", "pair", "drafting", "k", "acceptance", "lossy", "category"]
    assert any(line.startswith("#3 ") and CONTENT in line for line in wide)
    # Narrow: the widest of it goes beside each file's number, and the table fits.
    table = narrow[narrow.index(next(line for line in narrow if line.startswith("file  "))):]
    assert max(map(len, table)) <= 120 and "drafting" not in table[0]
    text = "\n".join(narrow)
    for name in ordered:
        for key in ("drafting", "k", "acceptance"):
            assert f"{key}: {written('md', stated(name)[key])}" in text


@pytest.mark.parametrize("output_format", FORMATS)
def test_analyze_names_every_row_run(made, output_format):
    paths, _, _, _ = made
    result = cli("analyze", *paths.values(), "--format", output_format)
    rows = rows_of(output_format, result.stdout)
    keys = ("category", "tau", "accept_rate", "pos_1") if output_format != "md" else (
        "category", "tau", "P(acc|reached)", "pos 1")
    expected = []
    for name, path in paths.items():
        record = load_record(path)
        for stats in analysis.category_stats(record):
            first = analysis.position_acceptance(record, stats.category)[0].rate
            values = (stats.category or "ALL", rate(output_format, stats.tau),
                      rate(output_format, stats.accept_rate, 3), rate(output_format, first))
            expected.append({**{key: written(output_format, value) for key, value in
                                identity(path, record, stated(name)).items()}, **dict(zip(keys, values))})
    assert [{key: row[key] for key in expected[0]} for row in rows] == expected
    # Draft positions up to the largest k among them (the content run's 7); none past a run's own.
    last = "pos_7_reached" if output_format != "md" else "pos 7 reached"
    assert [row[last] for row in rows if row["file"] == str(paths["fixed"])] == \
        [written(output_format, None)] * len(load_record(paths["fixed"]).categories() + [None])


def test_analyze_states_each_record_above_its_tables(made):
    paths, _, _, _ = made
    text = cli("analyze", paths["content"]).stdout
    identity_lines = "; ".join(line.strip() for line in text.split("\ncategory ")[0].splitlines())
    assert identity_lines == (f"file: {paths['content']}; pair: trained; runtime: llama-cpp; mode: driven; "
                              f"schedule: crossrt; drafting: model; k: {CONTENT}; acceptance: greedy; lossy: no")
    assert "16 new tokens; no trace (run with --trace)" in text


@pytest.mark.parametrize("output_format", FORMATS)
def test_cache_ls_names_each_baseline(made, output_format):
    paths, _, folder, env = made
    result = cli("cache", "ls", "--format", output_format, **env)
    assert "baseline(s) in" in result.stderr and "baseline(s)" not in result.stdout  # the table alone on stdout
    rows = rows_of(output_format, result.stdout)
    records = [load_record(path) for path in paths.values()]
    targets = {record.pair.target.sha256 for record in records}
    if output_format == "md":  # shown by their first 12 digits
        targets = {target[:12] for target in targets}
    entries = sorted((folder / "cache" / "baselines").glob("*.json"))
    assert len(rows) == len(entries) >= len({r.prompt_id for r in records[0].results})
    for row, entry in zip(rows, entries):
        assert row["file"] == (str(entry) if output_format != "md" else entry.stem[:16])
        assert row["target"] in targets
        assert [row[key] for key in ("runtime", "mode", "drafting", "k", "acceptance", "lossy")] == \
            [written(output_format, value) for value in ("llama-cpp", "driven", "none", None, "greedy", False)]
        assert row["schedule"] == "crossrt,hf-assisted,llama-spec-simple"


@pytest.mark.parametrize("output_format", FORMATS)
def test_sweep_show_names_each_cell(made, output_format):
    _, _, folder, env = made
    stored = SweepStore(folder / "sweep").stored()
    result = cli("sweep", "show", folder / "sweep", "--format", output_format, **env)
    rows = rows_of(output_format, result.stdout)
    expected = [{"file": written(output_format, str(cell.record_path)), "k": written(output_format, record.params.k),
                 "category": category or "ALL", "tau": rate(output_format, record.summary(category).tau)}
                for cell in stored for record in [cell.record()] for category in (*record.categories(), None)]
    assert sorted(record.params.k for record in (cell.record() for cell in stored)) == [1, 2]
    assert [{key: row[key] for key in expected[0]} for row in rows] == expected
    assert {tuple(row[key] for key in ("pair", "drafting", "acceptance", "lossy")) for row in rows} == \
        {tuple(written(output_format, value) for value in ("tiny", "model", "greedy", False))}


@pytest.mark.parametrize("command", [["show", "{record}"], ["analyze", "{record}"], ["cache", "ls"],
                                     ["sweep", "show", "{sweep}"]])
def test_a_bad_format_is_refused(made, command):
    paths, _, folder, _ = made
    args = [part.format(record=paths["fixed"], sweep=folder / "sweep") for part in command]
    result = CliRunner().invoke(main, [*args, "--format", "xml"])
    assert result.exit_code == 2 and "Invalid value for '--format': 'xml' is not one of" in result.output


def test_analyze_keeps_its_ceiling_to_the_aligned_table(made):
    paths, _, _, _ = made
    result = CliRunner().invoke(main, ["analyze", str(paths["fixed"]), "--ceiling", str(paths["fixed"]),
                                       "--format", "csv"])
    assert result.exit_code == 2 and "--ceiling prints its own table" in result.output
