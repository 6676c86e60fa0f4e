"""`crossrt import` refuses what it does not understand: every format's malformed, cut short,
negative, non-integer or out-of-range line is one line naming its line number (never dropped
in silence), counts stay exact integers, and huge numbers cost no more work than small ones.
The inputs are the recorded fixtures (tests/fixtures/import) with one line changed."""

import json
import os
import random
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.imports import importer
from crossrt.imports.logs import ReadOptions
from crossrt.imports.importer import ImportRequest, import_record
from crossrt.imports.imported import ImportFailure, counts_of_rate, fitting, shown

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "import"
# Work per input does not grow with its numbers: a case that took seconds would be a run-away.
BOUND_S = 5.0


def changed(tmp_path: Path, name: str, old: str, new: str, count: int = 1) -> Path:
    text = (FIXTURES / name).read_text()
    assert old in text, old
    path = tmp_path / name
    path.write_text(text.replace(old, new, count))
    return path


def refused(path: Path, source: str, *extra) -> str:
    """The one `Error:` line `crossrt import` prints for path, within BOUND_S."""
    start = time.perf_counter()
    result = CliRunner().invoke(main, ["import", str(path), "--from", source, "--out", str(path) + ".rec.json",
                                       *map(str, extra)])
    assert time.perf_counter() - start < BOUND_S, f"{path.name}: {time.perf_counter() - start:.1f} s"
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and str(path) in lines[0], result.output
    assert not Path(str(path) + ".rec.json").exists()
    return lines[0]


def counters_of(path: Path, source: str, **options):
    return import_record(ImportRequest(path, source, options=ReadOptions(**options))).results[0].counters


LLAMA_LINE = "draft acceptance = 0.50000 (   18 accepted /    36 generated), mean len =  3.00"


@pytest.mark.parametrize("new, message", [
    ("draft acceptance = 0.50000 (   -5 accepted /    36 generated), mean len =  3.00", "line 36: a 'draft acceptance'"),
    ("draft acceptance = 0.50000 (   18 accepted /    36 gen", "line 36: a 'draft acceptance'"),
    ("draft acceptance = 0.50000 (   " + "7" * 26 + " accepted /    36 generated), mean len =  3.00",
     "line 36: accepted 77777777777777777777777777 is out of range"),
    ("draft acceptance = 0.50000 (   18 accepted /    0 generated), mean len =  3.00", "line 36: 18 accepted / 0"),
    ("draft acceptance = 0.50000 (   40 accepted /    36 generated), mean len =  3.00", "line 36: 40 accepted / 36"),
], ids=["negative", "cut-short", "26-digits", "none-generated", "more-than-generated"])
def test_llama_server_log_lines_are_read_whole_or_refused_by_number(tmp_path, new, message):
    assert counters_of(FIXTURES / "llama-server-log-tiny.log", "llama-server-log", k=4).steps == 82
    assert message in refused(changed(tmp_path, "llama-server-log-tiny.log", LLAMA_LINE, new),
                              "llama-server-log", "--k", 4)


def test_a_llama_server_log_cut_inside_its_last_request_line_is_refused(tmp_path):
    text = (FIXTURES / "llama-server-log-tiny.log").read_text()
    last = text.rindex("draft acceptance")
    path = tmp_path / "cut.log"
    path.write_text(text[:last + 40])
    line = text[:last].count("\n") + 1
    assert f"line {line}: a 'draft acceptance'" in refused(path, "llama-server-log", "--k", 4)


SGLANG_LINE = "accept len: 1.95, accept rate: 0.49"


@pytest.mark.parametrize("new, message", [
    ("accept len: -2.00, accept rate: 0.49", "line 7: a decode line without a readable"),
    ("accept len: 1e308, accept rate: 0.49", "line 7: a decode line without a readable"),
    ("accept len: 0.50, accept rate: 0.49", "line 7: accept len 0.50 is not between 1"),
    ("accept len: " + "9" * 400 + ".00, accept rate: 0.49", "line 7: accept len 99999"),
], ids=["negative", "exponent", "below-one", "400-digits"])
def test_sglang_decode_lines_are_read_whole_or_refused_by_number(tmp_path, new, message):
    assert message in refused(changed(tmp_path, "sglang-log-11948.log", SGLANG_LINE, new), "sglang-log")


def test_sglang_huge_running_requests_are_bounded_work(tmp_path):
    huge = changed(tmp_path, "sglang-log-11948.log", "#running-req: 1,", "#running-req: " + "9" * 30 + ",", 6)
    assert "line 6: #running-req 99999" in refused(huge, "sglang-log")
    # Within 2^63: the accepted count behind each accept len is found by bisection, not by trying each.
    start = time.perf_counter()
    big = changed(tmp_path, "sglang-log-11948.log", "#running-req: 1,", "#running-req: 1000000000000000,", 6)
    try:
        counters_of(big, "sglang-log")
    except ImportFailure as error:
        assert "accepted counts, not one" in str(error)
    assert time.perf_counter() - start < BOUND_S


VLLM_COUNTS = "Accepted: 489 tokens, Drafted: 1572 tokens"


@pytest.mark.parametrize("new, message", [
    ("Accepted: 1e29 tokens, Drafted: 1572 tokens", "line 7: cannot read 'Accepted: 1e29"),
    ("Accepted: " + "1" + "0" * 29 + " tokens, Drafted: 1572 tokens", "line 7: Accepted 1000000000000000000000000"
                                                                     "00000 is out of range"),
    ("Accepted: -5 tokens, Drafted: 1572 tokens", "line 7: cannot read 'Accepted: -5"),
    ("Accepted: 1600 tokens, Drafted: 1572 tokens", "line 7: Accepted 1600 tokens of Drafted 1572"),
], ids=["exponent", "30-digits", "negative", "more-than-drafted"])
def test_vllm_log_lines_are_read_whole_or_refused_by_number(tmp_path, new, message):
    assert message in refused(changed(tmp_path, "vllm-log-club3090-105.log", VLLM_COUNTS, new), "vllm-log")


def test_vllm_counts_near_2_to_the_63_are_bounded_work(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("SpecDecoding metrics: Mean acceptance length: 2.00, Accepted: 4000000000000000000 tokens, "
                    "Drafted: 8000000000000000000 tokens, Per-position acceptance rate: 0.500, 0.500\n")
    start = time.perf_counter()
    counters = counters_of(path, "vllm-log")  # many draft counts fit: drafted / k, said in the notes
    assert time.perf_counter() - start < BOUND_S
    assert (counters.steps, counters.accepted) == (4 * 10 ** 18, 4 * 10 ** 18)


METRICS = """vllm:spec_decode_num_drafts_total{engine="0"} 9007199254740993
vllm:spec_decode_num_draft_tokens_total{engine="0"} 36028797018963972
vllm:spec_decode_num_accepted_tokens_total{engine="0"} 9007199254740993
"""


def test_counters_above_2_to_the_53_stay_exact(tmp_path):
    path = tmp_path / "vllm.prom"
    path.write_text(METRICS)
    counters = counters_of(path, "vllm-metrics", k=4)
    assert (counters.steps, counters.drafted, counters.accepted) == (9007199254740993, 36028797018963972,
                                                                     9007199254740993)
    # The record on disk keeps the digits too.
    result = CliRunner().invoke(main, ["import", str(path), "--from", "vllm-metrics", "--k", "4",
                                       "--out", str(tmp_path / "vllm.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "vllm.json").read_text())["results"][0]["counters"]["steps"] == 9007199254740993
    path.write_text(METRICS.replace("9007199254740993\nvllm:spec_decode_num_draft", "9.007199254740993e15\n"
                                    "vllm:spec_decode_num_draft", 1))
    assert "a float above 2^53 may be a rounded count" in refused(path, "vllm-metrics", "--k", 4)


@pytest.mark.parametrize("name, source, old, new, message", [
    ("sglang-metrics-constructed-pr13754.txt", "sglang-metrics", "} 188.0", "} 1e300", "is out of range"),
    ("sglang-metrics-constructed-pr13754.txt", "sglang-metrics", "} 188.0", "} 188.5", "is not a whole number"),
    ("sglang-metrics-constructed-pr13754.txt", "sglang-metrics", "} 188.0", "} -188", "never negative"),
    ("sglang-metrics-constructed-pr13754.txt", "sglang-metrics", "} 188.0", "} NaN", "never negative or infinite"),
    ("llama-server-metrics-after-tiny.txt", "llama-server-metrics", "spec_decode_num_drafts_total 82",
     "spec_decode_num_drafts_total -82", "never negative"),
    ("llama-server-metrics-after-tiny.txt", "llama-server-metrics", "spec_decode_num_drafts_total 82",
     "spec_decode_num_drafts_total 82.5", "is not a whole number"),
    ("llama-server-metrics-after-tiny.txt", "llama-server-metrics", "spec_decode_num_drafts_total 82",
     "spec_decode_num_drafts_total 8.2e+01", "6 significant digits"),
    ("llama-server-metrics-after-tiny.txt", "llama-server-metrics", "llamacpp:n_decode_total 121",
     "llamacpp:n_decode_total 121\nllamacpp:n_decode_total 5", "again (first at line"),
    ("llama-server-metrics-after-tiny.txt", "llama-server-metrics", "llamacpp:n_decode_total 121",
     "llamacpp:n_decode_total 1", "not a Prometheus sample"),
    ("llama-server-metrics-after-tiny.txt", "llama-server-metrics", '{position="3"}', '{position="99999999999"}',
     "is beyond any draft"),
], ids=["sglang-1e300", "sglang-fraction", "sglang-negative", "sglang-nan", "llama-negative", "llama-fraction",
        "llama-rounded", "llama-twice", "llama-cut", "llama-position"])
def test_metrics_values_are_whole_counts_or_refused(tmp_path, name, source, old, new, message):
    path = changed(tmp_path, name, old, new)
    if new == "llamacpp:n_decode_total 1":  # a scrape cut inside a line
        text = path.read_text()
        path.write_text(text.replace("llamacpp:n_decode_total 1\n", "llamacpp:n_decode_tot\n"))
    line = refused(path, source, "--k", 4)
    assert message in line and "line " in line, line


def meta_info(tmp_path: Path, **changes) -> Path:
    data = json.loads("\n".join(line for line in (FIXTURES / "sglang-meta-info-pr33518.json").read_text()
                                .splitlines() if not line.startswith("#")))
    first = data[0] if isinstance(data, list) else data
    info = first.get("meta_info", first)
    info.update(changes)
    path = tmp_path / "meta.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("changes, message", [
    ({"spec_verify_ct": -3}, "spec_verify_ct -3 is negative"),
    ({"spec_verify_ct": "12"}, "spec_verify_ct is '12', not a count"),
    ({"spec_verify_ct": 12.0}, "not a count"),
    ({"completion_tokens": 10 ** 30}, "out of range"),
    ({"spec_correct_drafts_histogram": [1, -1, 2]}, "spec_correct_drafts_histogram[1] -1 is negative"),
], ids=["negative", "string", "float", "huge", "histogram"])
def test_sglang_meta_info_counts_are_checked(tmp_path, changes, message):
    assert message in refused(meta_info(tmp_path, **changes), "sglang-metrics")


@pytest.mark.parametrize("row, message", [
    ([12, 4, 3, 10 ** 30], None),  # the ema: not a count, not read
    ([10 ** 30, 4, 3], "new_tokens 1000000000000000000000000000000 is out of range"),
    ([12, 10 ** 30, 3], "window 1000000000000000000000000000000 is out of range"),
    ([12, 100000, 3], "window 100000 is not a draft length"),
    ([12, 4, -1], "accepted -1 is negative"),
], ids=["huge-ema", "31-digit-tokens", "31-digit-window", "window-beyond-k", "negative"])
def test_exllamav3_rounds_are_bounded_counts(tmp_path, row, message):
    path = tmp_path / "rounds.json"
    path.write_text(json.dumps([[5, 4, 4], row]))
    if message is None:
        assert counters_of(path, "exllamav3-stats").steps == 2
    else:
        assert message in refused(path, "exllamav3-stats")


def test_k_beyond_any_draft_is_refused_before_reading(tmp_path):
    result = CliRunner().invoke(main, ["import", str(FIXTURES / "sglang-metrics-constructed-pr13754.txt"),
                                       "--from", "sglang-metrics", "--k", str(10 ** 12)])
    assert result.exit_code == 2 and "is not in the range 1<=x<=4096" in result.output, result.output


def test_import_never_writes_over_its_input(tmp_path):
    path = tmp_path / "server.log"
    path.write_text((FIXTURES / "vllm-log-club3090-105.log").read_text())
    before = path.read_bytes()
    for out in (path, tmp_path / "." / "server.log"):
        result = CliRunner().invoke(main, ["import", str(path), "--from", "vllm-log", "--out", str(out),
                                           "--overwrite"])
        assert result.exit_code == 1 and "is an input" in result.output, result.output
    assert path.read_bytes() == before


def test_bisection_finds_exactly_the_counts_trying_each_finds():
    """fitting() against the brute force it replaced, on seeded small cases of both shapes: a
    rate c / d (growing in c) and a mean length 1 + accepted / n (falling in n)."""
    rng = random.Random(7)
    for _ in range(2000):
        d, decimals = rng.randrange(1, 2000), rng.choice([1, 2, 3])
        printed = f"{rng.randrange(d + 1) / d:.{decimals}f}"
        assert list(counts_of_rate(printed, d)) == [c for c in range(d + 1) if shown(c / d, printed)], (d, printed)
        accepted, low = rng.randrange(2000), rng.randrange(1, 50)
        high = low + rng.randrange(2000)
        mean = f"{1 + accepted / rng.randrange(low, high + 1):.2f}"
        assert list(fitting(lambda n: 1 + accepted / n, mean, low, high)) == [
            n for n in range(low, high + 1) if shown(1 + accepted / n, mean)], (accepted, low, high, mean)


# Issue 40: garbage inside a field a reader parses, the 2^53 + 1 boundary, and messages that
# named a later fault before the real one.
@pytest.mark.parametrize("name, source, old, new, message", [
    ("sglang-log-11948.log", "sglang-log", SGLANG_LINE, "accept len: 1.95, accept rate: abc",
     "line 7: cannot read 'accept rate: abc"),
    ("sglang-log-11948.log", "sglang-log", SGLANG_LINE, "accept len: 1.95x, accept rate: 0.49",
     "line 7: a decode line without a readable"),
    ("llama-server-log-tiny.log", "llama-server-log", LLAMA_LINE, LLAMA_LINE.replace("3.00", "2.0x"),
     "line 36: a 'draft acceptance' line crossrt cannot read"),
    ("vllm-log-club3090-105.log", "vllm-log", "Mean acceptance length: 2.72,", "Mean acceptance length: 2.72x,",
     "line 9: cannot read 'Mean acceptance length: 2.72x"),
    ("vllm-log-club3090-105.log", "vllm-log", "rate: 0.740, 0.473, 0.309,", "rate: 0.740, 0.473abc, 0.309,",
     "line 7: cannot read 'Per-position acceptance rate:"),
], ids=["sglang-rate", "sglang-len", "llama-server-mean-len", "vllm-mean", "vllm-rates"])
def test_garbage_inside_a_parsed_field_is_refused_by_line(tmp_path, name, source, old, new, message):
    extra = ("--k", 4) if source == "llama-server-log" else ()
    assert message in refused(changed(tmp_path, name, old, new), source, *extra)


def test_an_aiperf_sum_of_2_to_the_53_plus_1_is_refused_not_rounded(tmp_path):
    """JSON parses 9007199254740993.0 to the float 2^53: a whole float at 2^53 may be a rounded count."""
    for value in ("9007199254740993.0", "9007199254740992.0"):
        path = changed(tmp_path, "aiperf-aggregate-mock.json", '"total_spec_decode_steps": {\n    "avg": 16.0',
                       '"total_spec_decode_steps": {\n    "avg": ' + value)
        assert "total_spec_decode_steps.avg is '9007199254740992.0', not a count (a whole number, exact as a " \
               "float below 2^53)" in refused(path, "aiperf", "--k", 4)


def test_import_says_the_real_fault_first(tmp_path):
    # A crossrt record (an import's) given as an AIPerf export: it is a record, not AIPerf with speculation off.
    record = tmp_path / "server.json"
    result = CliRunner().invoke(main, ["import", str(FIXTURES / "llama-server-log-tiny.log"), "--from",
                                       "llama-server-log", "--k", "4", "--out", str(record)])
    assert result.exit_code == 0, result.output
    line = refused(record, "aiperf")
    assert "a crossrt record (crossrt reads it as it is: no import), not an AIPerf export" in line
    assert "speculative decoding was off" not in line
    # A missing file is missing, in whatever format it was named.
    line = refused(tmp_path / "gone.log", "vllm-log")
    assert line == f"Error: no file {tmp_path / 'gone.log'}"
    # --before naming the scrape itself (also through another path) counts nothing: refused as such.
    scrape = tmp_path / "after.txt"
    scrape.write_text((FIXTURES / "llama-server-metrics-after-tiny.txt").read_text())
    for before in (scrape, tmp_path / "." / "after.txt"):
        line = refused(scrape, "llama-server-metrics", "--before", before)
        assert f"--before {before} is the scrape itself ({scrape})" in line and "nothing was drafted" not in line


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_what_is_not_a_bounded_regular_file_is_refused_before_it_is_read(kind, tmp_path, monkeypatch):
    """`import` of a FIFO hung, of /dev/zero grew to 3 GB, of a 1 GB log was killed at 2.4 GB (issue 58)."""
    if kind == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
        expected = "is not a regular file"
    elif kind == "device":
        path, expected = "/dev/zero", "is not a regular file"
    else:
        monkeypatch.setattr(importer, "LOG_BYTES", 1024)  # a sparse 1 GiB file would do, at 1 GiB of disk
        path = tmp_path / "vllm.log"
        path.write_text("x" * 2048)
        expected = "more than the 0 MiB crossrt reads of a log"
    started = time.monotonic()
    result = CliRunner().invoke(main, ["import", str(path), "--from", "vllm-log", "--out", str(tmp_path / "r.json")])
    assert time.monotonic() - started < 10
    assert result.exit_code == 1 and expected in result.output, result.output
