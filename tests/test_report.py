"""`crossrt report` over real tiny-pair runs in llama.cpp: HTML (parsed as XML) and Markdown
hold the records' numbers, the step-coloured output texts follow the records' steps and read as
llama.cpp reads the tokens, record text is escaped, bad input gives a message."""

import dataclasses
import itertools
import json
import re
import shutil
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from crossrt.analyze import analysis
from crossrt.cli import main
from crossrt.cli.report import report
from crossrt.compare.tau_gap import PARTS
from crossrt.run.driver import RunRequest, run_pair
from crossrt.errors import CrossrtError
from crossrt.inputs.prompts import Prompt, content_type, load_prompts
from crossrt.report.page import Section, page
from crossrt.inputs.vocabulary import read_vocabulary
from crossrt.report.steps import load_vocab, step_spans, token_texts, vocab_at
from crossrt.run.runtime import DraftRules, RuntimeOptions
from crossrt.report.svg import Bars, bar_chart, nice_ticks

from conftest import assert_clean_error

XHTML = "{http://www.w3.org/1999/xhtml}"
SVG = "{http://www.w3.org/2000/svg}"
CHARTED = ("summary", "tau", "positions", "entropy", "entropy-types", "speedup", "iid")
# The answer first (the verdict and the summary, parity), the details after, the runs last.
SECTIONS = ("summary", "parity", "tau", "positions", "steps", "entropy", "entropy-types", "speedup", "iid", "runs")
HEADINGS = (XHTML + "h2", XHTML + "h3", XHTML + "h4", XHTML + "summary")
NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")  # shown as \xNN on the page
HOSTILE_ID = '<script>alert("id")</script>&amp;'
HOSTILE_CATEGORY = 'a<b>&"c"|d'


def record(tiny_pair, out, k, prompts, trace=False, n_ctx=256, max_new_tokens=24):
    request = RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=n_ctx, threads=1), DraftRules(k),
                         max_new_tokens, out, trace=trace)
    return run_pair(request, prompts)


@pytest.fixture(scope="module")
def runs(tiny_pair, tmp_path_factory):
    """k = 4 with traces and k = 2 without, over the built-in prompts."""
    folder = tmp_path_factory.mktemp("report")
    prompts = load_prompts("builtin")
    k4 = record(tiny_pair, folder / "k4.json", 4, prompts, trace=True)
    k2 = record(tiny_pair, folder / "k2.json", 2, prompts)
    return [(folder / "k4.json", k4, "llama-cpp/driven crossrt k=4"),
            (folder / "k2.json", k2, "llama-cpp/driven crossrt k=2")]


def invoke(*args):
    return CliRunner().invoke(report, [str(a) for a in args])


def html_sections(path):
    root = ET.parse(path).getroot()  # fails unless the page is well-formed
    return root, {s.get("id"): s for s in root.iter(XHTML + "section")}


def title(section):
    """A section's title: its heading, or the summary line it is folded under."""
    return next(child for child in section if child.tag in HEADINGS).text


def html_table(section):
    """(header, rows) of a section's table, as text."""
    table = section.find(f"{XHTML}table")
    return ([th.text for th in table.iter(XHTML + "th")],
            [[td.text or "" for td in tr.iter(XHTML + "td")] for tr in table.find(f"{XHTML}tbody")])


def html_rows(section):
    header, rows = html_table(section)
    return [dict(zip(header, row, strict=True)) for row in rows]


def markdown_table(text, title):
    """(header, rows) of the first table after the `## title` heading (or ###, ####), cells unescaped."""
    lines = re.split(f"#{{2,4}} {re.escape(title)}\n", text, maxsplit=1)[1].split("\n#", 1)[0].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    cells = [[re.sub(r"\\(.)", r"\1", c.strip()) for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table]
    return cells[0], cells[2:]


def markdown_rows(text, title):
    header, rows = markdown_table(text, title)
    return [dict(zip(header, row, strict=True)) for row in rows]


def expected_summary(record, category):
    s = record.summary(category)
    return {"prompts": str(s.prompts), "failed": str(s.failed), "lossless": f"{s.lossless}/{s.prompts - s.failed}",
            "steps": str(s.steps), "tau": f"{s.tau:.2f}", "alpha": f"{s.alpha:.3f}",
            "tok/s": f"{s.tokens_per_s:.1f}", "base tok/s": f"{s.baseline_tokens_per_s:.1f}",
            "speedup": f"{s.speedup:.2f}"}


def check_summary_tables(rows_of, runs):
    """The tau and speedup tables hold each record's summary per category and overall."""
    tau = {(row["run"], row["category"]): row for row in rows_of("tau")}
    speedup = {(row["run"], row["category"]): row for row in rows_of("speedup")}
    expected_keys = set()
    for _, record, label in runs:
        for category in [*record.categories(), None]:
            key = (label, category or "ALL")
            expected_keys.add(key)
            expected = expected_summary(record, category)
            assert {name: tau[key][name] for name in expected} == expected
            assert {name: speedup[key][name] for name in ("tok/s", "base tok/s", "speedup")} == \
                {name: expected[name] for name in ("tok/s", "base tok/s", "speedup")}
    assert set(tau) == set(speedup) == expected_keys


def test_html_report_charts_and_tables_hold_the_records_numbers(runs, tmp_path):
    out = tmp_path / "report.html"
    result = invoke(runs[0][0], runs[1][0], "-o", out)
    assert result.exit_code == 0, result.output
    root, sections = html_sections(out)
    # Two records: the summary with parity's verdict first, then parity (its splits, if any, vary by
    # machine: test_report_parity.py), the details, and the runs last.
    assert [name for name in sections if not name.startswith("split-")] == list(SECTIONS)
    for name in CHARTED:
        assert len(list(sections[name].iter(SVG + "svg"))) == 1, name
    assert not list(sections["runs"].iter(SVG + "svg")) and not list(sections["steps"].iter(SVG + "svg"))
    # Self-contained: no scripts, nothing loaded from elsewhere.
    assert not [e for e in root.iter() if e.tag.endswith("script") or e.get("src") or e.get("href")]

    (k4_path, k4, k4_label), (k2_path, k2, k2_label) = runs
    header = {row["run"]: row for row in html_rows(sections["runs"])}
    assert header[k4_label]["record"] == str(k4_path) and header[k4_label]["trace"] == "10 prompts"
    assert header[k2_label]["trace"] == "none" and header[k2_label]["k"] == "2"
    check_summary_tables(lambda name: html_rows(sections[name]), runs)

    # One bar per run and category, its tooltip holding the tau it is drawn for.
    bars = [rect.find(SVG + "title").text for rect in sections["tau"].iter(SVG + "rect") if rect.get("class") == "bar"]
    assert len(bars) == 2 * 4
    assert f"{k4_label}, ALL: {k4.summary().tau:.4g}" in bars
    # Position chart: one line per run, one point per draft position.
    positions = sections["positions"]
    assert len([e for e in positions.iter(SVG + "polyline")]) == 2
    assert len([e for e in positions.iter(SVG + "circle")]) == 4 + 2
    rates = {row["run"]: row for row in html_rows(positions)}
    first = analysis.position_acceptance(k4)[0]
    assert rates[k4_label]["pos 1"] == f"{first.rate:.3f} ({first.reached})" and rates[k2_label]["pos 3"] == ""

    # Entropy: only the traced run, every reached draft position counted once; the other named.
    entropy = sections["entropy"]
    rows = html_rows(entropy)
    assert {row["run"] for row in rows} == {k4_label}
    overall = analysis.category_stats(k4)[-1]
    assert sum(int(row["reached"]) for row in rows) == overall.reached
    assert sum(int(row["accepted"]) for row in rows) == overall.accepted
    legend = [t.text for t in entropy.iter(SVG + "text")]
    assert k4_label in legend and k2_label not in legend
    assert f"no trace (run with --trace): {k2_label}" in [li.text for li in entropy.iter(XHTML + "li")]

    # i.i.d. fit: measured tau and both predictions per category; two point sets per run.
    fits = {(cells[0], cells[1]): cells for cells in html_table(sections["iid"])[1]}
    for fit in analysis.iid_fit(k2):
        cells = fits[(k2_label, fit.category or "ALL")]
        assert cells[3:7] == [f"{fit.measured_tau:.2f}", f"{fit.alpha:.3f}", f"{fit.predicted_tau:.2f}",
                              f"{fit.error:+.2f}"]
        assert cells[8] == f"{fit.predicted_tau_reached:.2f}"
    points = [c.find(SVG + "title").text for c in sections["iid"].iter(SVG + "circle")]
    assert len(points) == 2 * 2 * 4
    overall = analysis.iid_fit(k2)[-1]
    assert f"{k2_label}: a = alpha, ALL: ({overall.measured_tau:.4g}, {overall.predicted_tau:.4g})" in points


def step_figures(section):
    """(caption, [(data-accepted or None for plain text, text)]) per figure of the steps section."""
    figures = []
    for figure in section.iter(XHTML + "figure"):
        if figure.get("class") != "steps":
            continue
        spans = [(int(span.get("data-accepted")) if span.get("class") == "step" else None, span.text or "")
                 for span in figure.find(XHTML + "p")]
        figures.append((figure.find(XHTML + "figcaption").text, spans))
    return figures


def test_output_text_is_cut_into_its_steps_and_coloured_by_accepted_length(runs, tiny_sessions, tmp_path):
    out = tmp_path / "report.html"
    assert invoke(runs[0][0], runs[1][0], "-o", out).exit_code == 0
    _, sections = html_sections(out)
    figures = dict(step_figures(sections["steps"]))
    rows = {(row["run"], row["prompt"]): row for row in html_rows(sections["steps"])}
    target = tiny_sessions[0]
    vocab, problem = load_vocab(runs[0][1])
    assert problem is None
    for _, record, label in runs:
        k = record.params.k
        for result in record.results:
            counters = result.counters
            spans = figures[f"{label}: {result.prompt_id} ({result.category}), k={k}"]
            # crossrt's schedule: every token from a step, each step accepted + 1 tokens, in order.
            assert [accepted for accepted, _ in spans] == list(counters.step_accepted)
            texts = token_texts(vocab, result.output_ids)
            assert "".join(texts) == target.detokenize(result.output_ids)  # as llama.cpp reads the ids
            assert "".join(text for _, text in spans) == NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}",
                                                                      "".join(texts))
            row = rows[(label, result.prompt_id)]
            assert (row["steps"], row["tokens"], row["tau"]) == (str(counters.steps), str(len(result.output_ids)),
                                                                 f"{counters.tau:.2f}")
            assert [row[f"accepting {j}"] for j in range(k + 1)] == \
                [str(list(counters.step_accepted).count(j)) for j in range(k + 1)]
            assert all(row[f"accepting {j}"] == "" for j in range(k + 1, 5))
    # One colour per accepted length, the same in every run: the legend's (0 .. 4, the largest k).
    legend = {int(span.text): span.get("style") for span in sections["steps"].iter(XHTML + "span")
              if span.get("class") == "swatch"}
    assert list(legend) == [0, 1, 2, 3, 4] and len(set(legend.values())) == 5
    styles = {(int(span.get("data-accepted")), span.get("style")) for span in sections["steps"].iter(XHTML + "span")
              if span.get("class") == "step"}
    assert styles == {(accepted, legend[accepted]) for accepted, _ in styles}


def test_llama_server_schedule_steps_leave_its_unverified_tokens_unshaded(tiny_pair, tiny_sessions, tmp_path):
    """llama-server takes its first token from the prompt pass and decodes without a draft where
    none fits the budget: those tokens are outside any step, the steps' own in between."""
    path = tmp_path / "server.json"
    request = RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(4), 24, path,
                         schedule="llama-server")
    server = run_pair(request, load_prompts("builtin"))
    out = tmp_path / "report.html"
    assert invoke(path, "-o", out).exit_code == 0
    _, sections = html_sections(out)
    figures = dict(step_figures(sections["steps"]))
    vocab, _ = load_vocab(server)
    for result in server.results:
        counters = result.counters
        assert counters.unverified >= 1
        spans = figures[f"llama-cpp/driven llama-server k=4: {result.prompt_id} ({result.category}), k=4"]
        assert spans[0][0] is None  # the prompt pass's token
        assert [accepted for accepted, _ in spans if accepted is not None] == list(counters.step_accepted)
        # Its steps always draft (n_min >= 1): the unshaded tokens are the prompt pass's and the
        # one-token decodes', wherever they fall, and they are all the unverified tokens.
        plain = [i for span in step_spans(result, "llama-server") if span.step is None
                 for i in range(span.start, span.stop)]
        assert plain == [i for i, size in enumerate(result.output_view.pass_tokens) if i == 0 or size == 1]
        assert len(plain) == counters.unverified
        assert "".join(text for _, text in spans) == NOT_XML.sub(
            lambda m: f"\\x{ord(m.group()):02x}", "".join(token_texts(vocab, result.output_ids)))


def test_real_model_tokens_read_as_llama_cpp_reads_them(real_pair, llama_runtime):
    """SentencePiece pieces (U+2581 spaces, <0xNN> byte tokens, characters split across tokens)
    decode from the GGUF vocabulary alone as llama.cpp's own detokenizer decodes them."""
    path = real_pair.path("target", "gguf")
    session = llama_runtime.load(path)
    text = "def f(x):\n\treturn x ** 2  # the square\nNaïve café, 漢字, \U0001F600 and Gothic \U00010348 \x0c."
    ids = session.tokenize(text)
    vocab, problem = vocab_at(str(path), read_vocabulary(path).fingerprint)
    assert problem is None
    assert vocab_at(str(path), "0" * 16) == (None, f"{path} holds another vocabulary than the run's "
                                             f"(fingerprint {read_vocabulary(path).fingerprint})")
    texts = token_texts(vocab, ids)
    assert "".join(texts) == session.detokenize(ids)
    # Gothic hwair has no token of its own: four <0xNN> byte tokens, the character shown with the last.
    at = [i for i, token in enumerate(ids) if len(vocab.pieces[token]) == 1 and vocab.pieces[token][0] >= 0x80]
    assert [texts[i] for i in at] == ["", "", "", "\U00010348"]


def test_an_hf_folder_reads_as_the_same_tokenizer_in_gguf(tiny_pair):
    """The tiny pair's target as an HF folder (tokenizer.json, ByteLevel decoder, special added
    tokens) gives every token the bytes its GGUF gives, which llama.cpp's reading checks above."""
    folder, gguf = tiny_pair.path("target", "hf"), tiny_pair.path("target", "gguf")
    hf_vocab, problem = vocab_at(str(folder), read_vocabulary(folder).fingerprint)
    assert problem is None
    assert hf_vocab == vocab_at(str(gguf), read_vocabulary(gguf).fingerprint)[0]


def test_entropy_per_content_type_splits_the_traced_buckets(runs, tmp_path):
    out = tmp_path / "report.html"
    assert invoke(runs[0][0], runs[1][0], "-o", out).exit_code == 0
    _, sections = html_sections(out)
    (k4_path, k4, k4_label), (_, _, k2_label) = runs
    rows = html_rows(sections["entropy-types"])
    assert {row["run"] for row in rows} == {k4_label}  # only the traced run
    trace = analysis.load_trace(k4_path, k4)
    typed = analysis.grouped(k4, "content-type")
    kinds = sorted({content_type(r.category) or r.category for r in k4.results})
    assert sorted({row["content type"] for row in rows}) == kinds
    for kind in kinds:
        buckets = [b for b in analysis.entropy_acceptance(typed, trace, category=kind)]
        mine = [row for row in rows if row["content type"] == kind]
        assert sum(int(row["reached"]) for row in mine) == sum(b.tokens for b in buckets)
        assert sum(int(row["accepted"]) for row in mine) == sum(b.accepted for b in buckets)
    # The content types' buckets add up to the run's own.
    assert sum(int(row["reached"]) for row in rows) == sum(int(row["reached"]) for row in html_rows(sections["entropy"]))
    bars = [rect.find(SVG + "title").text for rect in sections["entropy-types"].iter(SVG + "rect")
            if rect.get("class") == "bar"]
    assert len(bars) == sum(1 for row in rows if row["P(accept)"] != "-")
    assert all(title.startswith(f"{k4_label}: ") for title in bars)


def test_page_joins_sections_of_any_origin_and_refuses_a_shared_id():
    first, second = (Section(name, name, "", None, (), ()) for name in ("a", "b"))
    assert [s.id for s in page("t", [second, first]).sections] == ["b", "a"]
    with pytest.raises(CrossrtError, match="share the id"):
        page("t", [first, second, first])
    with pytest.raises(CrossrtError, match="share the id"):  # a section within another is an anchor too
        page("t", [first, dataclasses.replace(second, parts=(first,))])


def banner(section):
    """(status, verdict line, detail) of a section's banner."""
    shown = next(p for p in section.iter(XHTML + "p") if "banner" in (p.get("class") or ""))
    return shown.get("class").split()[1], shown.text, shown.find(XHTML + "span").text


def test_the_page_opens_with_the_verdict_and_the_numbers_people_quote(runs, tmp_path):
    out, md = tmp_path / "r.html", tmp_path / "r.md"
    assert invoke(runs[0][0], runs[1][0], "-o", out, "--markdown", md).exit_code == 0
    root, sections = html_sections(out)
    summary = sections["summary"]
    assert next(iter(sections)) == "summary"
    # The verdict is the one `crossrt parity` prints on the same records (it re-scores no logits here).
    checked = CliRunner().invoke(main, ["parity", str(runs[0][0]), str(runs[1][0]), "--no-logits"])
    status, verdict, detail = banner(summary)
    assert verdict == checked.output.splitlines()[-1] and verdict.startswith("parity: ")
    assert status == ("ok" if checked.exit_code == 0 else "failed")
    assert "prompts compared" in detail
    # One row per run: the numbers `crossrt show` prints, then tau per category.
    rows = {row["run"]: row for row in html_rows(summary)}
    bars = {rect.find(SVG + "title").text for rect in summary.iter(SVG + "rect") if rect.get("class") == "bar"}
    expected_bars = set()
    for _, record, label in runs:
        expected = expected_summary(record, None)
        row = rows[label]
        assert {name: row[name] for name in ("tau", "alpha", "lossless", "tok/s", "speedup")} == \
            {name: expected[name] for name in ("tau", "alpha", "lossless", "tok/s", "speedup")}
        for category in record.categories():
            assert row[f"tau {category}"] == f"{record.summary(category).tau:.2f}"
        expected_bars |= {f"{label}, {category or 'ALL'}: {record.summary(category).tau:.4g}"
                          for category in [*record.categories(), None]}
    assert bars == expected_bars
    # ... and `crossrt show` prints them so, run by run (its ALL rows, in the records' order).
    header, _, *shown = CliRunner().invoke(main, ["show", str(runs[0][0]), str(runs[1][0]), "--format", "md"]
                                           ).stdout.splitlines()

    def cells(line):
        return [cell.strip() for cell in line.strip("|").split("|")]
    printed = [row for row in (dict(zip(cells(header), cells(line))) for line in shown) if row["category"] == "ALL"]
    assert [[row[name] for name in ("tau", "alpha", "lossless", "tok/s", "speedup")] for row in printed] == \
        [[rows[label][name] for name in ("tau", "alpha", "lossless", "tok/s", "speedup")] for _, _, label in runs]
    # The Markdown opens the same way.
    text = md.read_text()
    assert text.split("\n## ")[1].startswith("Summary\n\n**parity: ")
    # One run: no parity across runs, and the summary says so.
    alone = tmp_path / "alone.html"
    assert invoke(runs[0][0], "-o", alone).exit_code == 0
    _, sections = html_sections(alone)
    assert not [p for p in sections["summary"].iter(XHTML + "p") if p.get("class")]
    assert "One run: no parity" in "".join(sections["summary"].itertext())


@pytest.fixture(scope="module")
def server_schedule(tiny_pair, runs):
    """The k = 4 run's prompts through the driven loop in llama-server's schedule: another schedule,
    so its tau differs from crossrt's by a gap `crossrt parity` decomposes."""
    path = runs[0][0].parent / "server-schedule.json"
    request = RunRequest(tiny_pair, "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(4), 24, path,
                         schedule="llama-server")
    run_pair(request, load_prompts("builtin"))
    return path


def test_tau_gaps_are_drawn_as_parity_prints_them(runs, server_schedule, tmp_path):
    out = tmp_path / "r.html"
    assert invoke(runs[0][0], server_schedule, "-o", out).exit_code == 0
    _, sections = html_sections(out)
    assert list(sections)[:3] == ["summary", "tau-gap", "parity"]
    checked = CliRunner().invoke(main, ["parity", str(runs[0][0]), str(server_schedule), "--no-logits", "--html",
                                        str(tmp_path / "parity.html")])
    said = [line for line in checked.output.splitlines() if line.startswith("tau gap ")]
    overall = next(line for line in said if ", ALL (" in line)
    # "tau gap A (schedule) vs B (schedule), ALL (n prompts): a - b = gap = counting +x + ... + residual +x"
    figures = re.findall(r"[-+]?\d+\.\d+", overall.split("): ", 1)[1])
    gap = sections["tau-gap"]
    folded = next(gap.iter(XHTML + "details"))  # the tables, under the charts
    tau_rows = html_rows(folded)
    assert [[row["tau A"], row["tau B"], row["gap"], *(row[part] for part in PARTS)]
            for row in tau_rows if row["category"] == "ALL"] == [figures]
    assert len(tau_rows) == len(said)  # a row per category and ALL, as parity prints a line for each
    # `crossrt parity --html` draws the gaps it printed too.
    in_parity = html_rows(next(html_sections(tmp_path / "parity.html")[1]["tau-gap"].iter(XHTML + "details")))
    assert [row[2:] for row in map(list, (r.values() for r in in_parity))] == \
        [row[2:] for row in map(list, (r.values() for r in tau_rows))]
    # The waterfall: run B's tau, each part, run A's tau, in that order, each bar's tooltip its figure.
    charts = list(gap.iter(SVG + "svg"))
    assert len(charts) == 2  # tau, and alpha
    bars = [rect.find(SVG + "title").text for rect in charts[0].iter(SVG + "rect") if "bar" in rect.get("class")]
    assert [bar.split(": ")[0] for bar in bars] == ["B", *PARTS, "A"]
    a, b, *parts = (float(x) for x in figures[:2] + figures[3:])
    shown = [float(bar.split(": ")[1]) for bar in bars]
    assert shown[0] == pytest.approx(b, abs=0.005) and shown[-1] == pytest.approx(a, abs=0.005)
    assert shown[1:-1] == pytest.approx(parts, abs=0.005)
    # Without the option the page has none, and with runs of one schedule it has none either.
    assert invoke(runs[0][0], server_schedule, "-o", out, "--no-tau-gap").exit_code == 0
    assert "tau-gap" not in html_sections(out)[1]
    assert invoke(runs[0][0], runs[1][0], "-o", out).exit_code == 0
    assert "tau-gap" not in html_sections(out)[1]


def test_markdown_report_has_the_same_tables(runs, tmp_path):
    html, markdown = tmp_path / "r.html", tmp_path / "r.md"
    result = invoke(runs[0][0], runs[1][0], "-o", html, "--markdown", markdown)
    assert result.exit_code == 0, result.output
    text = markdown.read_text()
    assert "<svg" not in text and "<svg" in html.read_text()
    check_summary_tables(lambda name: markdown_rows(text, {"tau": "Tau per category", "speedup": "Speedup"}[name]),
                         runs)
    # Every table, iid fit and trace buckets included, cell for cell as in the HTML.
    root, sections = html_sections(html)
    titles = {s.get("id"): title(s) for s in root.iter(XHTML + "section")}
    for name, section in sections.items():
        if section.find(f"{XHTML}table") is not None:  # parity's verdicts: no table where every pair is identical
            assert markdown_table(text, titles[name]) == html_table(section), name
    # The same sections in the same order.
    headings = [re.sub(r"\\(.)", r"\1", line.split(" ", 1)[1]) for line in text.splitlines()
                if re.match("#{2,4} ", line)]
    assert headings == [title(e) for e in root.iter() if e.tag in (XHTML + "section", XHTML + "details")]
    # -o picks the format from the suffix.
    alone = tmp_path / "alone.md"
    assert invoke(runs[0][0], runs[1][0], "-o", alone).exit_code == 0
    assert alone.read_text() == text


def test_failed_prompts_and_hostile_text_are_escaped(tiny_pair, tmp_path):
    prompts = [Prompt(HOSTILE_ID, "prose", "word " * 200),  # too long for the context: fails
               Prompt("fine", HOSTILE_CATEGORY, "def add(a, b):\n    return")]
    path = tmp_path / "hostile.json"
    hostile = record(tiny_pair, path, 3, prompts, n_ctx=64, max_new_tokens=8)
    assert [r.ok for r in hostile.results] == [False, True]
    out, md = tmp_path / "r.html", tmp_path / "r.md"
    assert invoke(path, "-o", out, "--markdown", md).exit_code == 0
    raw = out.read_text()
    assert "<script" not in raw and "&lt;script&gt;" in raw
    root, sections = html_sections(out)
    assert not [e for e in root.iter() if e.tag.endswith("script")]
    notes = [li.text for li in sections["runs"].iter(XHTML + "li")]
    assert any(f"prompt {HOSTILE_ID} (prose) failed: " in note for note in notes)
    # The category reads back exactly from the table and from the chart's group label.
    assert HOSTILE_CATEGORY in [row["category"] for row in html_rows(sections["tau"])]
    assert HOSTILE_CATEGORY in [t.text for t in sections["tau"].iter(SVG + "text")]
    prose = {row["category"]: row for row in html_rows(sections["tau"])}["prose"]
    assert (prose["failed"], prose["tau"], prose["speedup"]) == ("1", "-", "-")

    text = md.read_text()
    # Markdown escapes with a backslash: no `<` may stand unescaped.
    assert not re.search(r"(?<!\\)<", text) and r"\<script\>" in text
    rows = {row["category"]: row for row in markdown_rows(text, "Tau per category")}
    assert rows[HOSTILE_CATEGORY]["tau"] == f"{hostile.summary(HOSTILE_CATEGORY).tau:.2f}"


def test_runs_sharing_a_label_are_told_apart_and_a_missing_trace_is_reported(runs, tmp_path):
    k4_path, _, label = runs[0]
    copy = tmp_path / "copy.json"
    shutil.copy(k4_path, copy)  # without its trace file
    out = tmp_path / "r.html"
    result = invoke(k4_path, copy, "-o", out)
    assert result.exit_code == 0, result.output
    _, sections = html_sections(out)
    labels = [row["run"] for row in html_rows(sections["runs"])]
    assert labels == [f"{label} ({k4_path})", f"{label} ({copy})"]
    assert [row["trace"] for row in html_rows(sections["runs"])] == ["10 prompts", "unreadable"]
    notes = [li.text for li in sections["entropy"].iter(XHTML + "li")]
    assert any(note.startswith(f"{labels[1]}: ") and "missing" in note for note in notes)


@pytest.mark.parametrize("setup, args, message", [
    (None, ["missing.json", "-o", "r.html"], "no run record at"),
    ("not json", ["bad.json", "-o", "r.html"], "is not JSON"),
    ({"schema_version": 1}, ["bad.json", "-o", "r.html"], "does not follow schema"),
    ({}, ["bad.json", "-o", "r.pdf"], "name the output .html or .md"),
    ({}, ["bad.json"], "give -o report.html"),
    (None, [".", "-o", "r.html"], "is a folder with no sweep cell in it"),
])
def test_bad_input_gives_a_clear_error(tmp_path, monkeypatch, setup, args, message):
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        (tmp_path / "bad.json").write_text(setup if isinstance(setup, str) else json.dumps(setup))
    result = invoke(*args)
    assert_clean_error(result, re.escape(message))
    assert not (tmp_path / "r.html").exists()


def test_a_record_given_twice_is_refused(runs, tmp_path):
    result = invoke(runs[0][0], runs[0][0], "-o", tmp_path / "r.html")
    assert result.exit_code == 1 and "is given twice" in result.output


def test_nice_ticks_cover_the_range_in_round_steps():
    assert nice_ticks(4.12) == (0, 1, 2, 3, 4, 5)
    assert nice_ticks(1.0) == (0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert nice_ticks(0.58) == (0, 0.2, 0.4, 0.6)
    assert nice_ticks(37) == (0, 10, 20, 30, 40)


def test_bar_chart_skips_missing_values_and_turns_long_labels():
    groups = ["x" * 60, "short", "c", "d", "e", "f"]
    chart = ET.fromstring(bar_chart("t", groups, [Bars("a", (None, 1.0, 1, 1, 1, 1), "#000"),
                                                  Bars("b", (3.0, 2.0, None, None, None, None), "#111")], "y"))
    bars = [e for e in chart.iter(SVG + "rect") if e.get("class") == "bar"]
    assert len(bars) == 7
    assert [b.find(SVG + "title").text for b in bars[:3]] == ["b, " + "x" * 60 + ": 3", "a, short: 1", "b, short: 2"]
    labels = [t for t in chart.iter(SVG + "text") if t.get("transform", "").startswith("rotate(-35")]
    assert len(labels) == len(groups)
    assert labels[0].find(SVG + "title").text == "x" * 60  # cut on the chart, whole in the tooltip
    assert "".join(labels[0].itertext()) == "x" * 60 + "x" * 31 + "\u2026"
    assert float(chart.get("viewBox").split()[0]) < 0  # widened leftwards for the turned labels
