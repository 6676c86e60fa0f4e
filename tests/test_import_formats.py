"""`crossrt import --from sglang-metrics` and `--from exllamav3-stats`: SGLang's per-request
meta_info as users posted it in SGLang's tracker (fixture headers cite them), its /metrics
counters, and exllamav3's per-round draft statistics. No scrape with SGLang's speculative
counters and no exllamav3 statistics were found posted anywhere: those fixtures are constructed
in the form the cited source writes, and their headers say so."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.backends.exllamav3_native import counters_from_rounds
from crossrt.cli import main
from crossrt.imports.exllamav3 import json_body
from crossrt.imports.logs import ReadOptions
from crossrt.imports.imported import ImportFailure
from crossrt.imports.importer import FORMATS, ImportRequest, import_record
from crossrt.records.record_json import load_record

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "import"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def imported(path, source, before=None, **options):
    record = import_record(ImportRequest(Path(path), source, before, options=ReadOptions(**options)))
    return record, record.results[0].counters


def counts(counters):
    return counters.steps, counters.drafted, counters.accepted, counters.accepted_per_pos


def test_sglang_meta_info_with_the_histogram_gives_every_count():
    record, counters = imported(FIXTURES / "sglang-meta-info-pr33518.json", "sglang-metrics")
    # histogram [11, 14, 11, 4, 0, 3]: passes accepting at least 1 .. 5 draft tokens
    assert counts(counters) == (43, 215, 63, (32, 18, 7, 3, 3)) and record.params.k == 5
    assert (record.runtime.name, record.params.schedule) == ("sglang", "sglang")
    # crossrt's tau and alpha are the ones SGLang printed for this request
    assert counters.tau == pytest.approx(2.4651162790697674, abs=1e-15)
    assert counters.alpha == pytest.approx(0.2930232558139535, abs=1e-15)
    assert counters.steps + counters.accepted == 106  # the completion_tokens the comment states
    assert "emitted" not in record.imported.given and "accepted_per_pos" in record.imported.given


def test_sglang_meta_info_counts_the_root_and_the_first_token_apart():
    record, counters = imported(FIXTURES / "sglang-meta-info-pr13754.json", "sglang-metrics", k=4)
    assert counts(counters) == (188, 752, 11, None)
    assert (counters.emitted, counters.unverified, counters.cut) == (200, 1, 0)
    # SGLang's own rates: accept length 200 / 188 (first token in), accept rate 11 / 940 (root in)
    assert counters.emitted / counters.steps == pytest.approx(1.0638297872340425, abs=1e-15)
    assert counters.tau == 1 + 11 / 188 and counters.alpha == 11 / 752
    assert any("940 = spec_verify_ct x (k + 1): the root counted" in note for note in record.notes)
    with pytest.raises(ImportFailure, match="give --k"):
        imported(FIXTURES / "sglang-meta-info-pr13754.json", "sglang-metrics")
    with pytest.raises(ImportFailure, match="neither spec_verify_ct 188 x k 3 nor x"):
        imported(FIXTURES / "sglang-meta-info-pr13754.json", "sglang-metrics", k=3)


def test_sglang_metrics_counters_cannot_tell_the_first_token_from_an_accepted_one(tmp_path):
    record, counters = imported(FIXTURES / "sglang-metrics-constructed-pr13754.txt", "sglang-metrics", k=4)
    exact = imported(FIXTURES / "sglang-meta-info-pr13754.json", "sglang-metrics", k=4)[1]
    assert (counters.steps, counters.drafted, counters.emitted) == (exact.steps, exact.drafted, exact.emitted)
    # generation_tokens - verify calls: the request's first token lands in accepted
    assert counters.accepted == exact.accepted + 1 and counters.unverified == 0
    assert any("accepted includes that first token, one per request" in note for note in record.notes)
    scrape = FIXTURES / "sglang-metrics-constructed-pr13754.txt"
    with pytest.raises(ImportFailure, match="is the scrape itself"):  # the same file as --before
        imported(scrape, "sglang-metrics", scrape, k=4)
    again = tmp_path / "again.txt"  # a second scrape with nothing run between
    again.write_text(scrape.read_text())
    with pytest.raises(ImportFailure, match="no verification steps counted"):
        imported(scrape, "sglang-metrics", again, k=4)
    with pytest.raises(ImportFailure, match="do not say the draft length: give --k"):
        imported(FIXTURES / "sglang-metrics-constructed-pr13754.txt", "sglang-metrics")


def test_sglang_metrics_without_counters_are_refused(tmp_path):
    with pytest.raises(ImportFailure, match="no sglang:spec_verify_calls_total"):
        imported(FIXTURES / "sglang-metrics-pr1853.txt", "sglang-metrics", k=4)
    # the gauge SGLang serves before its first decode window: SchedulerStats' default
    gauges = tmp_path / "gauges.txt"
    gauges.write_text((FIXTURES / "sglang-metrics-pr1853.txt").read_text()
                      + 'sglang:spec_accept_length{model_name="placeholder"} 0.0\n')
    with pytest.raises(ImportFailure, match="only as gauges"):
        imported(gauges, "sglang-metrics", k=4)


def test_exllamav3_eval_draft_stats_are_summed_over_traces():
    record, counters = imported(FIXTURES / "exllamav3-draft-stats-constructed.json", "exllamav3-stats")
    # accepted per round 4, 1, 0, 3 | 2, 0, 4; one token between the second trace's first rounds
    assert counts(counters) == (7, 28, 14, (5, 4, 3, 2)) and record.params.k == 4
    assert (counters.emitted, counters.unverified, counters.cut) == (22, 1, 0)
    assert (record.runtime.name, record.params.schedule) == ("exllamav3", "exllamav3")
    assert record.imported.given == ("steps", "drafted", "accepted", "accepted_per_pos", "emitted", "unverified",
                                     "cut")
    assert any("2 trace(s) without the job's new_tokens" in note for note in record.notes)


def test_exllamav3_job_reads_as_crossrts_own_exllamav3_runtime_counts_it(tmp_path):
    path = FIXTURES / "exllamav3-job-constructed.json"
    job = json_body(path.read_text())
    native = counters_from_rounds([tuple(r) for r in job["draft_stats"]], job["accepted_draft_tokens"],
                                  job["rejected_draft_tokens"], job["new_tokens"], 4)
    counters = imported(path, "exllamav3-stats")[1]
    for name in ("steps", "drafted", "accepted", "emitted", "unverified", "cut", "accepted_per_pos"):
        assert getattr(counters, name) == getattr(native, name), name
    bare = tmp_path / "rounds.json"  # json.dump(job.draft_stats): rounds alone
    bare.write_text(json.dumps(job["draft_stats"]))
    assert counts(imported(bare, "exllamav3-stats")[1]) == counts(counters)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(dict(job, accepted_draft_tokens=8)))
    with pytest.raises(ImportFailure, match="the rounds accept 7, accepted_draft_tokens is 8"):
        imported(wrong, "exllamav3-stats")
    with pytest.raises(ImportFailure, match="--k 3, but rounds verified windows of 4"):
        imported(path, "exllamav3-stats", k=3)


@pytest.mark.parametrize("text, message", [
    ("[[3, 4, 5]]", "accepted 5 of a window of 4"),
    ("[[3, 4, 2], [4, 4, 2]]", "fewer than the 3 tokens a round accepting 2 emits"),
    ('[{"file": "a.json", "category": "Coding"}]', "holds no 'stats' or 'draft_stats' list"),
    ("Generate: 100 tokens - Draft: 60 / 80 accepted", "not JSON"),
])
def test_exllamav3_text_that_is_not_its_rounds_is_one_clear_line(tmp_path, text, message):
    path = tmp_path / "stats.json"
    path.write_text(text)
    result = invoke("import", path, "--from", "exllamav3-stats", "--out", tmp_path / "r.json")
    assert result.exit_code == 1 and message in result.output, result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1


def test_cli_imports_both_and_show_reads_them(tmp_path):
    assert {"sglang-metrics", "exllamav3-stats"} <= set(FORMATS)
    for name, source, extra in (("sglang-meta-info-pr33518.json", "sglang-metrics", ()),
                                ("exllamav3-draft-stats-constructed.json", "exllamav3-stats", ())):
        result = invoke("import", FIXTURES / name, "--from", source, "--out", tmp_path / f"{name}.out", *extra)
        assert result.exit_code == 0, result.output
        assert load_record(tmp_path / f"{name}.out").imported.format == source
    shown = invoke("show", tmp_path / "sglang-meta-info-pr33518.json.out",
                   tmp_path / "exllamav3-draft-stats-constructed.json.out", "--format", "json")
    assert shown.exit_code == 0, shown.output
    rows = [(row["runtime"], row["steps"], round(row["tau"], 2), round(row["alpha"], 3))
            for row in json.loads(shown.stdout)]
    assert ("sglang", 43, 2.47, 0.293) in rows and ("exllamav3", 7, 3.0, 0.5) in rows
    refused = invoke("import", FIXTURES / "exllamav3-job-constructed.json", "--from", "exllamav3-stats",
                     "--before", FIXTURES / "exllamav3-job-constructed.json", "--out", tmp_path / "b.json")
    assert refused.exit_code == 1 and "sglang-metrics" in refused.output
    assert "exllamav3-stats text covers" in refused.output
