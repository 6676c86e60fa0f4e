"""`crossrt report`'s page as a person sees it: Debian's headless Chromium loads the HTML of real
tiny-pair runs and the test reads the rendered page through the DevTools protocol (over
--remote-debugging-pipe, Python's standard library only): section titles, table text, charts and
step-coloured texts that take up space on the screen, their colours, and the console.

scripts/setup installs Chromium where apt-get can; elsewhere these tests are skipped, saying so.
"""

import dataclasses
import json
import os
import re
import select
import shutil
import subprocess
import time

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.cli.report import report
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.pairs import pair_from_paths
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record, save_record
from crossrt.report.steps import load_vocab, token_texts
from crossrt.run.runtime import DraftRules, RuntimeOptions

from conftest import REPO
import test_report_folder
import test_report_sweep

CHROMIUM = shutil.which("chromium")
# A fresh profile and nothing a headless run does not need: no sandbox (tests run as root), no
# GPU, no network services, no first-run or sync machinery.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1366,768", "--remote-debugging-pipe")
SCREEN = (1366, 768)  # the first screen the page must answer in: a common laptop's
NARROW = 400  # a phone, or a window beside another: the page must not scroll sideways
TIMEOUT_S = 60
NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")  # shown as \xNN on the page

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed, and scripts/setup "
                                "could not install it here (no apt-get, or not root)")

# What a person sees: the sections' titles, their tables' text, and the charts, chart marks and
# step-coloured texts that are laid out with a size and not hidden; where they lie on the page
# (top and bottom, scrolled to the top); the folds (<details>) with their one-line summaries.
READ_PAGE = """(() => {
  // checkVisibility: not hidden, not displayed none, and not folded in a closed <details>
  // (content-visibility: hidden), which still lays its content out with a size.
  const shown = e => { const r = e.getBoundingClientRect();
                       return r.width > 0 && r.height > 0 && e.checkVisibility({visibilityProperty: true}); };
  const count = (root, selector) => [...root.querySelectorAll(selector)].filter(shown).length;
  const place = e => e ? [e.getBoundingClientRect().top, e.getBoundingClientRect().bottom] : null;
  window.scrollTo(0, 0);
  return {
    title: document.title,
    screen: [window.innerWidth, window.innerHeight],
    width: document.documentElement.scrollWidth,
    folds: [...document.querySelectorAll("details")].map(d => ({
      id: d.id, summary: d.querySelector("summary").innerText, shown: shown(d), mark: d.className,
      background: getComputedStyle(d).backgroundColor, place: place(d)})),
    sections: [...document.querySelectorAll("section")].map(s => ({
      id: s.id,
      title: s.querySelector(":scope > h2, :scope > h3, :scope > h4").innerText,
      mark: s.className,
      shown: shown(s),
      place: place(s),
      banner: [...s.querySelectorAll(":scope > p.banner")].filter(shown).map(
        b => ({text: b.firstChild.textContent, status: b.className, place: place(b)})),
      firstTable: place(s.querySelector(":scope > table")),
      firstChart: place(s.querySelector(":scope > figure > svg.chart")),
      notes: [...s.querySelectorAll(":scope > ul > li")].map(li => li.innerText),
      bars: [...s.querySelectorAll("svg.chart rect.bar")].filter(shown).map(r => r.querySelector("title").textContent),
      background: getComputedStyle(s).backgroundColor,
      charts: count(s, "svg.chart"),
      marks: count(s, "svg.chart rect.bar, svg.chart circle.point, svg.chart polyline.line"),
      figures: [...s.querySelectorAll("figure.steps")].filter(shown).map(f => ({
        caption: f.querySelector("figcaption").innerText,
        text: f.querySelector("p").innerText,
        steps: [...f.querySelectorAll("span.step")].map(x => [Number(x.dataset.accepted),
                                                               getComputedStyle(x).backgroundColor])})),
      tables: [...s.querySelectorAll("table")].filter(shown).map(t => [...t.rows].map(r => [...r.cells].map(
        c => c.innerText)))}))};
})()"""


class Browser:
    """Headless Chromium driven over the DevTools protocol's pipe: JSON messages, each ended by
    a NUL byte, written to the browser's fd 3 and read from its fd 4."""

    def __init__(self, profile):
        commands_in, self._commands = os.pipe()
        self._replies, replies_out = os.pipe()

        def give_pipes():  # runs in the child: the protocol's fds are 3 and 4
            os.dup2(commands_in, 3)
            os.dup2(replies_out, 4)

        self._log = open(profile.parent / "chromium.log", "wb")
        self.process = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                        preexec_fn=give_pipes, close_fds=False, stdin=subprocess.DEVNULL,
                                        stdout=self._log, stderr=self._log)
        os.close(commands_in)
        os.close(replies_out)
        self._buffer, self._id, self.events = b"", 0, []

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._replies], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self._replies, 1 << 16) if ready else b""
            if not chunk:
                self._log.flush()
                log = open(self._log.name, "rb").read()[-2000:].decode(errors="replace")
                raise AssertionError(f"Chromium sent nothing in time, or exited; the end of its log:\n{log}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params=None, session=None) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            reply = self._message(deadline)
            if reply.get("id") != self._id:
                self.events.append(reply)
            elif "error" in reply:
                raise AssertionError(f"{method}: {reply['error']}")
            else:
                return reply["result"]

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        while not any(event.get("method") == method for event in self.events):
            self.events.append(self._message(deadline))
        return next(event for event in self.events if event.get("method") == method)

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and logged errors (a resource that failed to load)."""
        errors = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append(" ".join(str(arg.get("value")) for arg in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                errors.append(f"{details.get('text', '')} {details.get('exception', {}).get('description', '')}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                errors.append(params["entry"].get("text", ""))
        return errors

    def close(self):
        try:
            self.send("Browser.close")
            self.process.wait(timeout=TIMEOUT_S)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            os.close(self._commands)
            os.close(self._replies)
            self._log.close()


OPEN_FOLDS = '(() => { const folds = [...document.querySelectorAll("details")]; folds.forEach(d => { d.open = true; }); ' \
    'return folds.length; })()'


def read_page(path, tmp_path):
    """(what READ_PAGE returns, console errors) for the page at path, once loaded, on a screen of
    SCREEN. What it returns also holds the page read again: as printed (`printed`), in a narrow
    window (`narrow`), and with every fold opened (`opened`)."""
    browser = Browser(tmp_path / "profile")
    try:
        target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            browser.send(f"{domain}.enable", session=session)
        screen = {"width": SCREEN[0], "height": SCREEN[1], "deviceScaleFactor": 1, "mobile": False}
        browser.send("Emulation.setDeviceMetricsOverride", screen, session=session)
        browser.send("Page.navigate", {"url": path.resolve().as_uri()}, session=session)
        browser.wait_for("Page.loadEventFired")

        def read(expression=READ_PAGE):
            return browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                                session=session)["result"]["value"]
        seen = read()
        browser.send("Emulation.setEmulatedMedia", {"media": "print"}, session=session)
        seen["printed"] = read()
        browser.send("Emulation.setEmulatedMedia", {"media": "screen"}, session=session)
        browser.send("Emulation.setDeviceMetricsOverride", {"width": NARROW, "height": SCREEN[1],
                                                            "deviceScaleFactor": 1, "mobile": False}, session=session)
        seen["narrow"] = read()
        browser.send("Emulation.setDeviceMetricsOverride", screen, session=session)
        read(OPEN_FOLDS)
        seen["opened"] = read()
        return seen, browser.console_errors()
    finally:
        browser.close()


@pytest.fixture(scope="module")
def runs(tiny_pair, tmp_path_factory):
    """Real tiny-pair runs in llama.cpp: k = 4 traced and k = 2 untraced, the built-in prompts."""
    folder = tmp_path_factory.mktemp("browser")
    prompts = load_prompts("builtin")
    made = []
    for k, trace in ((4, True), (2, False)):
        path = folder / f"k{k}.json"
        request = RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(k), 24, path,
                             trace=trace)
        made.append((path, run_pair(request, prompts), f"llama-cpp/driven crossrt k={k}"))
    return made


def test_the_rendered_page_shows_every_section_table_chart_and_step_text(runs, tmp_path):
    out = tmp_path / "report.html"
    result = CliRunner().invoke(report, [str(runs[0][0]), str(runs[1][0]), "-o", str(out), "--title", "seen"])
    assert result.exit_code == 0, result.output
    seen, errors = read_page(out, tmp_path)
    assert errors == []
    assert seen["title"] == "seen"
    # Two runs: the answer first (the summary, parity: its splits vary by machine, the test below),
    # the details after, the runs last.
    ids = [s["id"] for s in seen["sections"]]
    assert ids[:2] == ["summary", "parity"] and ids[-1] == "runs"
    records = [s for s in seen["sections"] if s["id"] not in ("summary", "parity") and not s["id"].startswith("split-")]
    sections = {s["id"]: s for s in records}
    assert [s["title"] for s in records] == [
        "Tau per category", "Acceptance per draft position", "Accepted length per step, in the output text",
        "Acceptance by target entropy", "Acceptance by target entropy, per content type", "Speedup",
        "i.i.d. fit per category", "Runs"]
    # A chart on screen in each charted section, with its marks drawn.
    assert {name: s["charts"] for name, s in sections.items()} == {
        "runs": 0, "tau": 1, "positions": 1, "steps": 0, "entropy": 1, "entropy-types": 1, "speedup": 1, "iid": 1}
    assert sections["tau"]["marks"] == 2 * 4  # two runs, three categories and ALL
    assert sections["positions"]["marks"] == 2 + 4 + 2  # a line per run, a point per position
    assert all(s["marks"] > 0 for s in sections.values() if s["charts"])

    # The summary table as it reads on the page.
    (k4_path, k4, k4_label), (_, k2, k2_label) = runs
    header, *rows = sections["tau"]["tables"][0]
    shown = {(row[0], row[1]): dict(zip(header, row, strict=True)) for row in rows}
    for record, label in ((k4, k4_label), (k2, k2_label)):
        for category in [*record.categories(), None]:
            summary = record.summary(category)
            row = shown[(label, category or "ALL")]
            assert (row["tau"], row["alpha"], row["lossless"]) == (
                f"{summary.tau:.2f}", f"{summary.alpha:.3f}", f"{summary.lossless}/{summary.prompts - summary.failed}")

    # Every finished prompt's output on screen, as llama.cpp reads it, one coloured span per step,
    # one colour per accepted length.
    figures = {f["caption"]: f for f in sections["steps"]["figures"]}
    assert len(figures) == sum(1 for _, record, _ in runs for r in record.results if r.ok)
    vocab, _ = load_vocab(k4)
    colours = {}
    for _, record, label in runs:
        for r in record.results:
            figure = figures[f"{label}: {r.prompt_id} ({r.category}), k={record.params.k}"]
            assert [accepted for accepted, _ in figure["steps"]] == list(r.counters.step_accepted)
            text = NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", "".join(token_texts(vocab, r.output_ids)))
            assert figure["text"] == text
            for accepted, colour in figure["steps"]:
                assert colours.setdefault(accepted, colour) == colour
    assert len(set(colours.values())) == len(colours) > 1
    assert "rgba(0, 0, 0, 0)" not in colours.values()

    # The answer in the first screen: the verdict `crossrt parity` prints on the same records, then
    # the summary table and its chart, all above the parity section.
    summary = next(s for s in seen["sections"] if s["id"] == "summary")
    parity = next(s for s in seen["sections"] if s["id"] == "parity")
    assert seen["screen"] == list(SCREEN)
    checked = CliRunner().invoke(main, ["parity", str(runs[0][0]), str(runs[1][0]), "--no-logits"])
    (banner,) = summary["banner"]
    assert banner["text"] == checked.output.splitlines()[-1]
    assert banner["status"] == "banner " + ("ok" if checked.exit_code == 0 else "failed")
    assert 0 <= banner["place"][1] <= summary["firstTable"][0] < summary["firstTable"][1] \
        <= summary["firstChart"][0] < summary["firstChart"][1] <= min(SCREEN[1], parity["place"][0])
    # Its table and its bars hold the records' numbers: a row per run, a bar per run and category.
    header, *rows = summary["tables"][0]
    quoted = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    expected_bars = []
    for _, record, label in runs:
        whole = record.summary()
        assert (quoted[label]["tau"], quoted[label]["alpha"], quoted[label]["speedup"]) == (
            f"{whole.tau:.2f}", f"{whole.alpha:.3f}", f"{whole.speedup:.2f}")
        expected_bars += [f"{label}, {category or 'ALL'}: {record.summary(category).tau:.4g}"
                          for category in [*record.categories(), None]]
    assert sorted(summary["bars"]) == sorted(expected_bars)
    # Narrow: the page does not scroll sideways (wide tables scroll within themselves, charts shrink).
    assert seen["narrow"]["width"] <= NARROW


def test_console_errors_and_missing_resources_are_seen(tmp_path):
    """The check that a report page logs nothing is not vacuous: a page that does log is caught."""
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><head><title>broken</title></head><body><section id="s"><h2>s</h2>'
                    '<img src="missing.png"/><script>console.error("from the page"); undefined_call();</script>'
                    '</section></body></html>')
    seen, errors = read_page(page, tmp_path)
    assert [s["id"] for s in seen["sections"]] == ["s"]
    assert "from the page" in errors
    assert any("undefined_call" in error for error in errors)
    assert any("missing.png" in error or "ERR_FILE_NOT_FOUND" in error for error in errors), errors


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    """The tiny drafter standing in as the target over the same prompts as runs' k = 4: a different
    model, so its baselines part from the tiny pair's on some prompt, beyond any near-tie."""
    drafter = REPO / "models" / "tiny" / "drafter.f32.gguf"
    path = tmp_path_factory.mktemp("swapped") / "swapped.json"
    request = RunRequest(pair_from_paths(drafter, drafter), "llama-cpp", RuntimeOptions(n_ctx=256, threads=1),
                         DraftRules(4), 24, path)
    run_pair(request, load_prompts("builtin"))
    return path


def test_the_parity_verdicts_and_every_split_are_on_screen(runs, swapped, tmp_path):
    out = tmp_path / "parity.html"
    paths = (runs[0][0], swapped)
    assert CliRunner().invoke(report, [*map(str, paths), "-o", str(out)]).exit_code == 0
    seen, errors = read_page(out, tmp_path)
    assert errors == []
    by_id = {s["id"]: s for s in seen["sections"]}
    parity = by_id["parity"]
    assert parity["shown"] and parity["title"] == "Parity: where the runs part, and why"
    checked = CliRunner().invoke(main, ["parity", *map(str, paths), "--no-logits"])
    assert checked.exit_code == 1
    (banner,) = by_id["summary"]["banner"]  # the verdict first, in the first screen, above the splits
    assert banner["text"] == checked.output.splitlines()[-1] and banner["status"] == "banner failed"
    assert banner["place"][1] <= by_id["summary"]["firstChart"][1] <= min(SCREEN[1], parity["place"][0])

    # The verdict table as it reads: one row per pair of runs not identical on every prompt, failures
    # as crossrt parity counts them; the identical pairs in one line.
    header, *rows = parity["tables"][0]
    assert header == ["run A", "run B", "counters", "prompts", "identical", "explained (by cause)", "failed",
                      "not comparable"]
    assert len(parity["tables"]) == 1  # the splits' tables are folded
    assert 1 <= len(rows) <= 3  # each run's lossless check, and the two runs
    assert all(int(row[3]) == int(row[4]) + int(row[5].split()[0]) + int(row[6]) + int(row[7].split()[0])
               for row in rows)
    fails = [line for line in checked.output.splitlines() if line.startswith("FAIL ")]
    assert sum(int(row[6]) for row in rows) == len(fails) > 0

    # One line per cause on screen, FAIL before NOTE, below the verdict; each split folded under its
    # cause: hidden until opened, shown when printed.
    folds = [f for f in seen["folds"] if f["id"].startswith("cause-")]
    assert folds and all(f["shown"] for f in folds)
    assert [f["summary"].split()[0] for f in folds] == sorted((f["summary"].split()[0] for f in folds),
                                                              key=lambda status: status != "FAIL")
    assert all(parity["place"][0] < f["place"][0] for f in folds)
    splits = [s for s in seen["sections"] if s["id"].startswith("split-")]
    assert splits and not any(s["shown"] for s in splits)
    assert all(s["shown"] for s in seen["printed"]["sections"] if s["id"].startswith("split-"))
    assert sum(int(re.search(r": (\d+) splits? \(", f["summary"]).group(1)) for f in folds) == len(splits)

    # Opened: every split a section on screen with its verdict, marked FAIL or NOTE in its title as
    # its cause is, and drawn apart by its colour.
    opened = [s for s in seen["opened"]["sections"] if s["id"].startswith("split-")]
    assert len(opened) == len(splits) and all(s["shown"] for s in opened)
    backgrounds = {}
    for section in opened:
        status = section["title"].split()[0]
        assert status in ("FAIL", "NOTE") and section["mark"] == status.lower()
        verdict_header, verdict = section["tables"][0]
        assert verdict_header[0] == "verdict" and verdict[0].startswith(f"{status}: ")
        assert backgrounds.setdefault(status, section["background"]) == section["background"]
    assert "FAIL" in backgrounds and "rgba(0, 0, 0, 0)" not in backgrounds.values()
    assert len(set(backgrounds.values())) == len(backgrounds)
    for fold in folds:
        assert fold["mark"] == fold["summary"].split()[0].lower() and fold["background"] != "rgba(0, 0, 0, 0)"


sweep = test_report_sweep.sweep  # the fixture: a real sweep of the tiny pair with one failed cell


def test_a_sweep_opens_with_its_verdict_and_tau_against_k(sweep, tmp_path):
    plan, sweep_dir, _ = sweep
    out = tmp_path / "sweep.html"
    assert CliRunner().invoke(report, [str(sweep_dir), "--sweep", str(plan), "-o", str(out)]).exit_code == 0
    seen, errors = read_page(out, tmp_path)
    assert errors == []
    by_id = {s["id"]: s for s in seen["sections"]}
    summary = by_id["summary"]
    (banner,) = summary["banner"]
    assert banner["text"].startswith("parity: ")
    # The verdict, then tau against k (a point per finished cell, a cross for the failed one) in the
    # first screen, above the sweep's other charts and parity.
    assert banner["place"][1] <= summary["firstChart"][0] < summary["firstChart"][1] \
        <= min(SCREEN[1], by_id["sweep"]["place"][0], by_id["parity"]["place"][0])
    assert summary["marks"] == 5 + 2  # five cells' points and a line per schedule
    assert seen["narrow"]["width"] <= NARROW


folder = test_report_folder.folder  # the fixture: real runs of other prompts, a lossy one and a comparable pair
# A native run's note names engine metrics in one unbroken word, wider than a phone's screen.
METRIC_NOTE = ("steps and accepted_per_pos: /metrics deltas of vllm:spec_decode_num_accepted_tokens_per_pos_total"
               '{position="0",model_name="tiny"}')


def test_a_folder_of_runs_reads_at_400_px_without_scrolling_sideways(folder, tmp_path):
    record = load_record(folder["k4"])
    noted = tmp_path / "noted.json"
    save_record(dataclasses.replace(record, notes=record.notes + (METRIC_NOTE,)), noted)
    out = tmp_path / "folder.html"
    paths = [noted, *(path for name, path in folder.items() if name != "k4")]
    assert CliRunner().invoke(report, [*map(str, paths), "-o", str(out)]).exit_code == 0
    seen, errors = read_page(out, tmp_path)
    assert errors == []
    (banner,) = next(s for s in seen["sections"] if s["id"] == "summary")["banner"]
    assert banner["status"] == "banner ok"  # runs of other prompts and a lossy run are not compared, not failed
    narrow = seen["narrow"]
    runs = next(s for s in narrow["sections"] if s["id"] == "runs")
    assert any(note.endswith(METRIC_NOTE) for note in runs["notes"])  # the note whole, wrapped where it must be
    assert narrow["screen"][0] == NARROW and narrow["width"] <= NARROW
