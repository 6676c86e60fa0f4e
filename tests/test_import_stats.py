"""`crossrt import` on text recorded from real runs: log excerpts users posted in vLLM's,
SGLang's and llama.cpp's trackers (each fixture's header cites it), crossrt's own llama-server
runs of the tiny pair, and a live round trip through crossrt's llama-server runtime.
Named test_import_stats: tests/test_import.py is about lazy imports."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.backends.llama_server import Launcher
from crossrt.cli import main
from crossrt.run.driver import RunRequest, run_pair
from crossrt.imports.logs import ReadOptions
from crossrt.imports.importer import ImportRequest, import_record
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules, RuntimeOptions, availability
from crossrt.records.schema import RecordError
from crossrt.records.record_json import load_record, record_from_json

from conftest import TINY_PAIR, assert_clean_error

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "import"
COUNTERS = ("steps", "drafted", "accepted", "emitted", "unverified", "cut", "accepted_per_pos")
# The record of the run the llama-server-*-tiny fixtures were recorded from, summed (their headers).
RECORDED = {"steps": 82, "drafted": 328, "accepted": 199, "emitted": 320, "unverified": 39, "cut": 0,
            "accepted_per_pos": (60, 51, 47, 41)}
needs_server = pytest.mark.skipif(availability("llama-server") is not None,
                                  reason=f"llama-server not usable: {availability('llama-server')}")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def imported(name, source, **options):
    request = ImportRequest(FIXTURES / name, source, options=ReadOptions(**options))
    record = import_record(request)
    return record, record.results[0].counters


def counts(counters):
    return counters.steps, counters.drafted, counters.accepted, counters.accepted_per_pos


def totals(record):
    """Every counter of a record summed over its finished prompts (per position too)."""
    done = [r.counters for r in record.results if r.ok]
    summed = {name: sum(getattr(c, name) for c in done) for name in COUNTERS[:-1]}
    summed["accepted_per_pos"] = tuple(map(sum, zip(*(c.accepted_per_pos for c in done))))
    return summed


def test_vllm_line_gives_the_one_drafts_count_its_rates_allow(tmp_path):
    record, counters = imported("vllm-log-pr24127.log", "vllm-log")
    assert counts(counters) == (59, 295, 262, (58, 56, 54, 52, 42))
    assert (record.params.k, record.runtime.name, record.runtime.version, record.params.schedule) == (
        5, "vllm", "unknown", "vllm")
    assert f"{counters.tau:.2f}" == "5.44" and f"{100 * counters.alpha:.1f}" == "88.8"  # as the line prints them
    assert record.imported.given == ("steps", "drafted", "accepted", "accepted_per_pos")
    out = tmp_path / "vllm.json"
    result = invoke("import", FIXTURES / "vllm-log-pr24127.log", "--from", "vllm-log", "--out", out)
    assert result.exit_code == 0, result.output
    assert load_record(out) == record
    assert json.loads(out.read_text())["imported"]["format"] == "vllm-log"


def test_vllm_log_intervals_are_summed():
    record, counters = imported("vllm-log-club3090-105.log", "vllm-log")
    # 1572 / 6 = 262 and 1590 / 6 = 265 drafts; per position 194+193, 124+118, ...
    assert counts(counters) == (527, 3162, 944, (387, 242, 154, 89, 46, 26))
    assert record.params.k == 6 and record.summary().tau == 1 + 944 / 527


def test_several_fitting_draft_counts_take_full_drafts_and_say_so():
    # Nothing accepted: any 99 .. 495 drafts print mean length 1.00; vLLM drafts k tokens each.
    record, counters = imported("vllm-log-vllm-ascend-13665.log", "vllm-log")
    assert counts(counters) == (297, 1485, 0, (0, 0, 0, 0, 0)) and counters.tau == 1.0
    assumed = [note for note in record.notes if "taken: drafted / k = 99" in note]
    assert len(assumed) == 3 and "397 draft counts (99-495) fit the printed rates" in assumed[0]


def test_vllm_line_without_a_mean_length_is_refused_in_one_line():
    result = invoke("import", FIXTURES / "vllm-log-pr15902.log", "--from", "vllm-log")
    assert_clean_error(result, "^Error: .*", exit_codes=(1,))
    assert result.output.count("\n") == 1
    assert "line 4: this vLLM version prints no mean acceptance length" in result.output


def test_vllm_spec_decode_printout_keeps_exact_counts_only():
    record, counters = imported("vllm-spec-decode-example-pr43091.txt", "vllm-metrics")
    assert counts(counters) == (36593, 109779, 65181, None)
    assert record.params.k == 3 and counters.emitted == 36593 + 65181
    assert "accepted_per_pos" not in record.imported.given
    assert "per-position acceptance counts" in record.imported.missing


def test_sglang_windows_agree_with_the_token_counts_the_reader_ignores():
    record, counters = imported("sglang-log-11948.log", "sglang-log")
    assert counts(counters) == (160, 480, 144, None) and record.params.k == 3  # 4 windows of 40; 4 draft tokens
    text = (FIXTURES / "sglang-log-11948.log").read_text()
    used = [int(n) for n in re.findall(r"Decode batch\. .*?#token: (\d+)", text)]
    assert used[-1] - used[0] == counters.accepted + counters.steps  # the KV cache grew by what the steps emitted
    assert counts(imported("sglang-log-11948.log", "sglang-log", k=3)[1]) == counts(counters)


def test_llama_server_log_matches_the_statistics_line_it_does_not_read():
    record, counters = imported("llama-server-log-pr24536.log", "llama-server-log")
    assert counts(counters) == (87, 259, 167, (70, 55, 42)) and record.params.k == 3
    text = (FIXTURES / "llama-server-log-pr24536.log").read_text()
    assert re.search(r"#gen drafts = +87, #acc drafts = +70,", text)  # steps, and steps accepting >= 1


@pytest.mark.parametrize("name, source, extra, message", [
    ("vllm-log-pr24127.log", "sglang-log", (), "is not sglang-log output crossrt can read: no SGLang"),
    ("sglang-log-11948.log", "llama-server-metrics", (), "no llamacpp:spec_decode_num_drafts_total"),
    ("llama-server-log-pr24536.log", "vllm-log", (), "no vLLM 'SpecDecoding metrics:' line"),
    ("vllm-log-pr24127.log", "vllm-log", ("--before", FIXTURES / "vllm-log-pr24127.log"), "--before is for counter"),
    ("vllm-log-pr24127.log", "vllm-log", ("--k", 4), "--k 4, but the text shows k = 5"),
    ("sglang-log-11948.log", "sglang-log", ("--decode-log-interval", 1000), "accepted counts, not one"),
])
def test_a_file_not_in_the_named_format_is_one_clear_line(tmp_path, name, source, extra, message):
    result = invoke("import", FIXTURES / name, "--from", source, "--out", tmp_path / "r.json", *extra)
    assert result.exit_code == 1 and message in result.output, result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    assert not (tmp_path / "r.json").exists()


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """A vLLM log import and a crossrt run of the tiny pair, as records on disk."""
    folder = tmp_path_factory.mktemp("side")
    assert invoke("import", FIXTURES / "vllm-log-club3090-105.log", "--from", "vllm-log", "--spec-type", "mtp",
                  "--pair-name", "Qwen3.6-27B+MTP", "--out", folder / "vllm.json").exit_code == 0
    request = RunRequest(load_pair(TINY_PAIR), "llama-cpp", RuntimeOptions(n_ctx=256, threads=1), DraftRules(4), 24,
                         folder / "crossrt.json")
    run_pair(request, load_prompts("builtin")[:3])
    return folder / "vllm.json", folder / "crossrt.json"


def test_show_puts_an_imported_vllm_log_beside_a_crossrt_run(side_by_side):
    vllm, crossrt = side_by_side
    result = invoke("show", vllm, crossrt, "--format", "md")
    assert result.exit_code == 0, result.output
    header, _, *lines = result.stdout.splitlines()

    def cells(line):
        return [cell.strip() for cell in line.strip("|").split("|")]
    rows = {(row["runtime"], row["category"]): row for row in (dict(zip(cells(header), cells(line))) for line in lines)}
    theirs, ours = rows[("vllm", "ALL")], rows[("llama-cpp", "ALL")]
    shown = ("lossless", "steps", "tau", "alpha", "tok/s", "base tok/s", "speedup")
    assert [theirs[name] for name in shown] == ["-", "527", "2.79", "0.299", "-", "-", "-"]
    summary = load_record(crossrt).summary()
    assert [ours[name] for name in ("tau", "alpha", "lossless")] == \
        [f"{summary.tau:.2f}", f"{summary.alpha:.3f}", "3/3"]
    assert f"{vllm}: imported from vllm-log" in result.output and "no lossless check" in result.output


def test_report_puts_them_side_by_side(side_by_side, tmp_path):
    vllm, crossrt = side_by_side
    result = invoke("report", vllm, crossrt, "-o", tmp_path / "r.md")
    assert result.exit_code == 0, result.output
    text = (tmp_path / "r.md").read_text()
    assert "vllm unknown (imported from vllm-log)" in text
    tau_row = next(line for line in text.splitlines() if line.startswith("| vllm/native") and "| ALL |" in line)
    assert "| 527 | 2.79 | 0.299 |" in tau_row and "| - |" in tau_row
    assert "0.734 (527)" in text  # P(accept position 1 | reached) = 387 / 527
    assert "imported from vllm-log" in text and "token ids: no lossless check" in text
    assert "output differs from the plain greedy baseline" not in text


def test_parity_says_what_an_import_cannot_compare(side_by_side):
    vllm, crossrt = side_by_side
    result = invoke("parity", vllm, crossrt, "--no-logits")
    assert "imported from vllm-log: no token ids, no lossless check" in result.output
    assert "outputs not compared" in result.output and "counters not compared" in result.output
    # Nothing of the pair was compared (no ids; other k and schedule): a verdict about nothing fails,
    # also when counters alone would be accepted, since these were not compared either.
    assert "1 not comparable (no token ids: imported from vllm-log); counters not compared (k differs: 6 vs 4; " \
           "schedule differs: vllm vs crossrt;" in result.output
    for result in (result, invoke("parity", vllm, crossrt, "--no-logits", "--counters-only")):
        assert result.exit_code == 1, result.output
        # (without --counters-only the import's own lossless check compared nothing too)
        assert re.match(r"parity: FAILED: nothing compared between vllm/native and llama-cpp/driven( \(and 1 more "
                        r"pair\(s\) of runs\))?: no token ids", result.output.strip().splitlines()[-1]), result.output


def test_reproduce_checks_a_claim_against_an_import(side_by_side, tmp_path):
    vllm, _ = side_by_side
    claims = tmp_path / "claims.toml"
    claims.write_text('[[claim]]\nid = "club-3090"\nsource = "https://github.com/noonghunna/club-3090/issues/105"\n'
                      'runtime = "vLLM 0.20.1"\nk = 6\nsampling = "greedy"\nhardware = "2x RTX 3090"\n'
                      '[claim.expect.all]\ntau = 2.8\ntokens_per_s = 74.7\n')
    result = invoke("reproduce", claims, "--measured", f"club-3090={vllm}")
    assert result.exit_code == 0, result.output
    assert re.search(r"club-3090 +all +tau +2\.8 +±10% +2\.79 +ok", result.output)
    assert "its source (vllm-log) gives no tokens_per_s" in result.output
    assert f"checked against the given record, record: {vllm}" in result.output


@pytest.mark.parametrize("change", [lambda d: d["results"][0].update(timings=None),
                                    lambda d: d["pair"].update(target=None),
                                    lambda d: d["params"].update(max_new_tokens=None)], ids=["timings", "pair", "params"])
def test_what_only_imports_may_leave_null_stays_required_in_runs(side_by_side, change):
    data = json.loads(side_by_side[1].read_text())
    change(data)
    with pytest.raises(RecordError, match="does not follow schema v1"):
        record_from_json(data)
    data = json.loads(side_by_side[0].read_text())
    del data["imported"]  # an import passed off as a run
    with pytest.raises(RecordError, match="does not follow schema v1"):
        record_from_json(data)


def test_recorded_llama_server_metrics_delta_and_log():
    """Scrapes and the server log of crossrt's own llama-server run of the tiny pair (headers)."""
    record, counters = imported("llama-server-metrics-after-tiny.txt", "llama-server-metrics")
    before = import_record(ImportRequest(FIXTURES / "llama-server-metrics-after-tiny.txt", "llama-server-metrics",
                                         FIXTURES / "llama-server-metrics-before-tiny.txt")).results[0].counters
    assert counters == before  # the server served this run only: its snapshot is the run's delta
    assert RECORDED == {name: getattr(counters, name) for name in COUNTERS}
    assert record.imported.given == COUNTERS[:3] + ("accepted_per_pos", "emitted", "unverified", "cut")
    logged = imported("llama-server-log-tiny.log", "llama-server-log", k=4)[1]
    assert counts(logged)[:3] == counts(counters)[:3]


@needs_server
def test_llama_server_round_trip(tmp_path, monkeypatch):
    """/metrics scraped around a native llama-server run, imported, equals the run's record."""
    scrapes, servers = [], []
    start = Launcher.start

    def started(launcher):
        server = start(launcher)
        if "--metrics" in launcher.args:  # the speculative server; the baseline one has no drafter
            servers.append(server)
            scrapes.append(server.call("GET", "/metrics").decode())
        return server

    prompts = load_prompts("builtin")

    def after(prompt, result):
        if prompt is prompts[-1]:
            scrapes.append(servers[-1].call("GET", "/metrics").decode())

    monkeypatch.setattr(Launcher, "start", started)
    out = tmp_path / "native.json"
    native = run_pair(RunRequest(load_pair(TINY_PAIR), "llama-server", RuntimeOptions(n_ctx=512, threads=1),
                                 DraftRules(4), 32, out, mode="native"), prompts, on_prompt=after)
    assert len(servers) == 1 and len(scrapes) == 2
    (tmp_path / "before.txt").write_text(scrapes[0])
    (tmp_path / "after.txt").write_text(scrapes[1])
    result = invoke("import", tmp_path / "after.txt", "--before", tmp_path / "before.txt", "--from",
                    "llama-server-metrics", "--pair", TINY_PAIR, "--greedy", "--max-new-tokens", 32,
                    "--draft-n-min", 4, "--draft-p-min", 0, "--out", tmp_path / "imported.json")
    assert result.exit_code == 0, result.output
    record = load_record(tmp_path / "imported.json")
    assert totals(record) == totals(native)
    # The same files; an import read none of them, so it names none as loaded (ModelInfo.loaded).
    unread = lambda model: dataclasses.replace(model, loaded=None)
    assert record.pair == dataclasses.replace(native.pair, target=unread(native.pair.target),
                                              drafter=unread(native.pair.drafter)) and record.params.k == 4
    # --no-tau-gap: the two records state their drafting differently, so parity would add a tau gap
    # line ("not computed" for the import) after building the native run's oracle in llama.cpp,
    # which no line here reads; a gap beside an import is asserted in tests/test_tau_gap.py.
    parity = invoke("parity", out, tmp_path / "imported.json", "--no-logits", "--counters-only", "--no-tau-gap")
    assert parity.exit_code == 0, parity.output
    assert parity.output.strip().splitlines()[-1].startswith("parity: OK, counters only; compared token ids in ")
    assert "counters compared on sums over all prompts: steps, drafted, accepted, emitted, unverified, cut" \
        in parity.output
    log = tmp_path / "native.logs" / "llama-server-speculative.log"
    logged = import_record(ImportRequest(log, "llama-server-log", options=ReadOptions(k=4))).results[0].counters
    assert counts(logged)[:3] == tuple(totals(native)[name] for name in ("steps", "drafted", "accepted"))
