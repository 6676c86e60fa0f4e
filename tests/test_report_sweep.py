"""`crossrt report` over a sweep: a real sweep of the tiny pair in llama.cpp (two schedules, k = 2,
3 and 4), one cell failed as a failed cell leaves the directory (its reason kept, no record). The
page draws tau, alpha and speedup against k, a line per schedule, the failed cell a cross where
its point would be; every point is a cell record's number, whichever they are on this machine."""

import re
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.records.record_json import load_record
from crossrt.sweep.plan import load_sweep
from crossrt.sweep.store import SweepStore

from conftest import TINY_PAIR

XHTML = "{http://www.w3.org/1999/xhtml}"
SVG = "{http://www.w3.org/2000/svg}"
FAILURE = "crashed: SIGSEGV (made by the test)"
POINT = re.compile(r"(?P<series>.+): \((?P<x>[^,]+), (?P<y>[^)]+)\)$")


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(sweep file, sweep directory, the failed cell)."""
    folder = tmp_path_factory.mktemp("sweep")
    plan = folder / "k.toml"
    plan.write_text(f'name = "report-k"\n[axes]\npair = "{TINY_PAIR}"\nruntime = "llama-cpp"\nmode = "driven"\n'
                    'schedule = ["crossrt", "llama-server"]\nk = [2, 3, 4]\nprompts = "builtin"\n'
                    'max_new_tokens = 16\n[resources.llama-cpp]\nthreads = 1\n')
    ran = cli("sweep", "run", plan, "--dir", folder / "dir")
    assert ran.exit_code == 0, ran.output
    store = SweepStore(folder / "dir")
    failed = next(cell for cell in load_sweep(plan).runnable() if cell.k == 3 and cell.schedule == "llama-server")
    store.record_path(failed.id).unlink()  # as a cell that failed leaves it: no record, its reason kept
    store.record_path(failed.id).with_name(f"{failed.id}.cell.json").unlink()
    store.put(failed, {"error": FAILURE}, "test")
    return plan, folder / "dir", failed


def sections(path):
    return {s.get("id"): s for s in ET.parse(path).getroot().iter(XHTML + "section")}


def points(chart):
    """{(series, x): y} of a chart's points, and [(tooltip)] of its failed cells, as drawn."""
    found = {}
    for circle in chart.iter(SVG + "circle"):
        match = POINT.match(circle.find(SVG + "title").text)
        found[match["series"], float(match["x"])] = match["y"]
    return found, [p.find(SVG + "title").text for p in chart.iter(SVG + "path") if p.get("class") == "failed"]


def expected(sweep_dir, metric):
    """{(schedule, k): the cell record's metric to four significant digits} over the finished cells."""
    store = SweepStore(sweep_dir)
    return {(cell.meta["params"]["schedule"], float(cell.meta["params"]["k"])):
            f"{getattr(load_record(cell.record_path).summary(), metric):.4g}" for cell in store.stored()}


def test_a_sweep_is_drawn_against_k_with_its_failed_cell_marked(sweep, tmp_path):
    plan, sweep_dir, failed = sweep
    out, md = tmp_path / "r.html", tmp_path / "r.md"
    made = cli("report", sweep_dir, "--sweep", plan, "-o", out, "--markdown", md)
    assert made.exit_code == 0, made.output
    page = sections(out)
    assert list(page)[:3] == ["summary", "sweep", "parity"]  # no tau gaps: the sweep's lines say it
    # The summary's chart: tau against k, a line per schedule, each point a cell's tau.
    (chart,) = page["summary"].iter(SVG + "svg")
    drawn, crosses = points(chart)
    assert drawn == expected(sweep_dir, "tau") and len(drawn) == 5
    assert crosses == [f"llama-server, k=3: failed: {FAILURE}"]
    # alpha and speedup against k beside, the failed cell marked in each.
    charts = list(page["sweep"].iter(SVG + "svg"))
    assert [c.get("aria-label") for c in charts] == ["alpha against k", "speedup against k"]
    for chart, metric in zip(charts, ("alpha", "speedup"), strict=True):
        drawn, crosses = points(chart)
        assert drawn == expected(sweep_dir, metric) and len(crosses) == 1
    # A row per cell, the failed one with its reason; the Markdown holds the same.
    rows = [[td.text or "" for td in tr.iter(XHTML + "td")] for tr in page["sweep"].find(XHTML + "table")
            .find(XHTML + "tbody")]
    assert len(rows) == 6 and [row for row in rows if row[2] == f"failed: {FAILURE}"] == [
        ["llama-server", "3", f"failed: {FAILURE}", "", "", "", "", ""]]
    assert "failed: crashed: SIGSEGV (made by the test)" in md.read_text()


def test_without_the_sweep_file_a_failed_cell_is_named_and_paths_read_as_cells(sweep, tmp_path):
    plan, sweep_dir, failed = sweep
    out = tmp_path / "r.html"
    assert cli("report", sweep_dir, "-o", out).exit_code == 0
    notes = [li.text for li in sections(out)["sweep"].iter(XHTML + "li")]
    assert notes == [f"failed cell {failed.id}: {FAILURE} (give --sweep with the sweep file to place it)"]
    # The records `sweep show --paths` prints are read as the same cells (their settings beside them).
    listed = cli("sweep", "show", sweep_dir, "--paths").output.split()
    assert cli("report", *listed, "-o", out).exit_code == 0
    (chart,) = sections(out)["summary"].iter(SVG + "svg")
    assert points(chart) == (expected(sweep_dir, "tau"), [])
