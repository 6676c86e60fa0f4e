"""One list of metrics (crossrt/records/metrics.py) with their formulas, read by every reader, and
the record's three descriptions held to each other: the dataclasses (crossrt/records/schema.py),
the JSON Schema (crossrt/data/run-record.schema.json) and docs/schema.md. Adding a field without
the others fails here; adding a metric is one entry in the list and one line in docs/schema.md."""

import dataclasses
import json
import re

import pytest
from click.testing import CliRunner

from crossrt.analyze.claims import OK, check_record, load_claims
from crossrt.cli import main
from crossrt.records import metrics, schema
from crossrt.records.record_json import SUMMARY_COUNTS, load_record, record_from_json, record_to_json, save_record
from crossrt.records.schema import RecordError
from crossrt.records.tables import summary_table
from crossrt.sweep.plan import Cell, SweepError
from crossrt.sweep.store import TOTALS, SweepStore

from conftest import REPO, TINY_PAIR
from test_schema import record  # noqa: F401 (the fixture: three tiny-pair prompts at k=3 and a failed one)

JSON_SCHEMA = json.loads((REPO / "crossrt" / "data" / "run-record.schema.json").read_text(encoding="utf-8"))
DEFS = JSON_SCHEMA["$defs"]
# (node of the JSON Schema, its dataclass, properties the JSON form adds: derived blocks)
NODES = [
    (JSON_SCHEMA, schema.RunRecord, {"summary"}),
    (JSON_SCHEMA["properties"]["runtime"], schema.RuntimeInfo, set()),
    (JSON_SCHEMA["properties"]["pair"], schema.PairInfo, set()),
    (JSON_SCHEMA["properties"]["params"], schema.RunParams, set()),
    (DEFS["model"], schema.ModelInfo, set()),
    (DEFS["result"], schema.PromptResult, {"derived"}),
    (DEFS["counters"], schema.Counters, set()),
    (DEFS["timings"], schema.Timings, set()),
    (DEFS["pass_view"], schema.PassView, set()),
    (DEFS["unfit_counts"], schema.UnfitCounts, set()),
    (DEFS["imported"], schema.ImportInfo, set()),
    (DEFS["prompt_format"], schema.PromptFormat, set()),
]
# A metric no crossrt has: what adding one takes, with no other file touched.
EXTRA = metrics.Metric("draft_per_step", "draft/step", 2, False, lambda t: metrics.ratio(t.drafted, t.steps),
                       "draft tokens verified per step: drafted / steps")


def fields_of(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@pytest.fixture
def extra_metric(monkeypatch):
    monkeypatch.setattr(metrics, "METRICS", metrics.METRICS + (EXTRA,))


def test_the_list_names_each_metric_once_with_its_formula():
    assert metrics.names() == ("tau", "alpha", "tokens_per_s", "baseline_tokens_per_s", "speedup")
    assert metrics.hardware_bound() == ("tokens_per_s", "baseline_tokens_per_s", "speedup")
    assert metrics.named("alpha").format(0.51234) == "0.512" and metrics.named("tau").format(None) == "-"
    totals = metrics.Totals(steps=4, drafted=12, accepted=6, emitted=10, decode_s=2.0, baseline_tokens=10,
                            baseline_decode_s=5.0)
    assert metrics.values(totals) == {"tau": 2.5, "alpha": 0.5, "tokens_per_s": 5.0, "baseline_tokens_per_s": 2.0,
                                      "speedup": 2.5}
    assert totals.tau == 2.5 and metrics.values(None) == dict.fromkeys(metrics.names())
    assert metrics.values(metrics.Totals()) == dict.fromkeys(metrics.names())  # nothing counted, nothing timed
    with pytest.raises(AttributeError):
        totals.no_such_metric


def test_the_values_are_the_former_formulas_on_a_tiny_pair_record(record):
    """The formulas the record, the summary and the index wrote before the list held them."""
    data = record_to_json(record)
    done = [r for r in record.results if r.ok]
    for result, written in zip(record.results, data["results"], strict=True):
        if not result.ok:
            assert written["derived"] == {"lossless": None, **dict.fromkeys(metrics.names())}
            continue
        c, t = result.counters, result.timings
        tps, base = c.emitted / t.decode_s, len(result.baseline_ids) / t.baseline_decode_s
        assert written["derived"] == {"lossless": result.output_ids == result.baseline_ids,
                                      "tau": 1 + c.accepted / c.steps, "alpha": c.accepted / c.drafted,
                                      "tokens_per_s": tps, "baseline_tokens_per_s": base, "speedup": tps / base}
    steps, drafted, accepted, emitted = (sum(getattr(r.counters, n) for r in done)
                                         for n in ("steps", "drafted", "accepted", "emitted"))
    tps = emitted / sum(r.timings.decode_s for r in done)
    base = sum(len(r.baseline_ids) for r in done) / sum(r.timings.baseline_decode_s for r in done)
    assert data["summary"]["overall"] == {
        "prompts": 4, "failed": 1, "lossless": sum(1 for r in done if r.lossless), "steps": steps,
        "drafted": drafted, "accepted": accepted, "emitted": emitted, "tau": 1 + accepted / steps,
        "alpha": accepted / drafted, "tokens_per_s": tps, "baseline_tokens_per_s": base, "speedup": tps / base}
    summary = record.summary()
    assert (summary.tau, summary.speedup) == (1 + accepted / steps, tps / base)
    assert record.results[0].counters.tau == 1 + done[0].counters.accepted / done[0].counters.steps


def test_an_added_metric_reaches_every_reader(record, extra_metric, tmp_path):
    """One entry in the list, nothing else: the derived blocks, show, the report, claims and the
    sweep index (its prompt rows and its cells view) all carry it."""
    done = [r for r in record.results if r.ok]
    data = record_to_json(record)
    assert [r["derived"]["draft_per_step"] for r in data["results"]] == \
        [r.counters.drafted / r.counters.steps for r in done] + [None]
    expected = sum(r.counters.drafted for r in done) / sum(r.counters.steps for r in done)
    assert data["summary"]["overall"]["draft_per_step"] == expected == record.summary().draft_per_step
    path = tmp_path / "run.json"
    save_record(record, path)
    assert load_record(path) == record

    table = summary_table([(path, record)])
    assert table.columns[-1].heading == "draft/step" and table.rows[-1][-1].text == f"{expected:.2f}"
    shown = CliRunner().invoke(main, ["show", str(path)])
    assert shown.exit_code == 0 and "draft/step" in shown.output and f"{expected:.2f}" in shown.output

    page = tmp_path / "report.md"
    assert CliRunner().invoke(main, ["report", str(path), "--out", str(page)]).exit_code == 0
    assert "draft/step" in page.read_text()

    claims = tmp_path / "claims.toml"
    claims.write_text(f'[[claim]]\nid = "mine"\nsource = "test"\nruntime = "llama.cpp"\nk = 3\nsampling = "greedy"\n'
                      f'hardware = "any"\npair = "{TINY_PAIR}"\n[claim.expect.all]\ndraft_per_step = {expected}\n')
    (check,) = check_record(load_claims(claims)[0], record, None)
    assert check.verdict == OK and check.measured == expected

    store = SweepStore(tmp_path / "sweep")
    cell = Cell(pair=str(TINY_PAIR), runtime="llama-cpp", mode="driven", schedule="crossrt", k=3, draft_n_min=3,
                draft_p_min=0.0, spec_type="draft", prompts="builtin", max_new_tokens=24, n_ctx=512, n_gpu_layers=0,
                gpu_split=None, f32_kv_cache=False, flash_attn=False)
    store.put(cell, {"record": data, "host": "here", "pid": 1, "wall_s": 1.0}, "local")
    columns, rows = store.query("SELECT prompt_id, draft_per_step, speedup FROM prompts ORDER BY prompt_id")
    assert columns == ["prompt_id", "draft_per_step", "speedup"]
    assert dict((p, d) for p, d, _ in rows) == {r["prompt_id"]: r["derived"]["draft_per_step"] for r in data["results"]}
    (cells,) = store.query("SELECT draft_per_step, tau, speedup, n_prompts, failed FROM cells")[1]
    overall = data["summary"]["overall"]
    assert cells[:3] == pytest.approx((expected, overall["tau"], overall["speedup"])) and cells[3:] == (4, 1)
    # Any grouping, by the same formula: the metric function over a struct of sums.
    sums = ", ".join(f"{name} := sum({name})::{kind}" for name, kind in TOTALS)
    by_category = dict(store.query(f"SELECT category, crossrt_metric('draft_per_step', struct_pack({sums})) "
                                   "FROM prompts GROUP BY category")[1])
    assert by_category == pytest.approx({c: record.summary(c).draft_per_step for c in record.categories()})
    with pytest.raises(SweepError, match="crossrt_metric: no metric 'nope'; metrics are tau, alpha"):
        store.query(f"SELECT crossrt_metric('nope', struct_pack({sums})) FROM prompts")


def test_a_record_written_before_a_metric_loads(record, monkeypatch, tmp_path):
    path = tmp_path / "before.json"
    save_record(record, path)
    monkeypatch.setattr(metrics, "METRICS", metrics.METRICS + (EXTRA,))
    assert "draft_per_step" not in json.loads(path.read_text())["summary"]["overall"]
    assert load_record(path) == record  # the new metric is recomputed from the counters, never read

    data = record_to_json(record)  # and one written with a metric this crossrt has dropped, or lacks
    for block in [*(r["derived"] for r in data["results"]), data["summary"]["overall"]]:
        del block["speedup"]
    assert record_from_json(data) == record
    data["results"][0]["derived"]["draft_per_step"] = 99.0  # a key present still matches its formula
    with pytest.raises(RecordError, match="draft_per_step is 99.0 but the counters give"):
        record_from_json(data)


def test_the_json_schema_names_the_counts_and_leaves_the_metrics_to_the_list():
    assert set(DEFS["derived"]["properties"]) == set(DEFS["derived"]["required"]) == {"lossless"}
    assert tuple(DEFS["summary"]["properties"]) == SUMMARY_COUNTS == tuple(DEFS["summary"]["required"])
    rate = {"type": ["number", "null"]}
    assert DEFS["derived"]["additionalProperties"] == DEFS["summary"]["additionalProperties"] == rate
    # a summary is the group's totals (what the formulas read) and its prompt counts
    assert fields_of(schema.Summary) == fields_of(metrics.Totals) + ["prompts", "failed", "lossless"]
    assert set(SUMMARY_COUNTS) <= set(fields_of(schema.Summary))


@pytest.mark.parametrize("node, cls, added", NODES, ids=[cls.__name__ for _, cls, _ in NODES])
def test_the_json_schema_describes_each_dataclass(node, cls, added):
    assert set(node["properties"]) == set(fields_of(cls)) | added
    without_default = {f.name for f in dataclasses.fields(cls)
                       if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert without_default <= set(node.get("required", ())), f"{cls.__name__}: required in the dataclass"


def test_docs_schema_names_every_field_and_every_metric():
    text = (REPO / "docs" / "schema.md").read_text(encoding="utf-8")
    fields_section = text[text.index("## Fields"):text.index("## Journals beside a record")]
    named = set(re.findall(r"`([a-z_0-9]+)`", fields_section))
    missing = {f"{cls.__name__}.{name}" for _, cls, _ in NODES for name in fields_of(cls) if name not in named}
    assert not missing, f"docs/schema.md does not describe {sorted(missing)}"
    metrics_section = text[text.index("### Metrics"):text.index("## Journals beside a record")]
    documented = re.findall(r"^\| `([a-z_0-9]+)` \|", metrics_section, re.MULTILINE)
    assert documented == list(metrics.names()), "docs/schema.md's metrics table is the list, one line each"
