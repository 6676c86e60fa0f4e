"""One list of metrics (crossrt/records/metrics.py), and the record's three descriptions held to each
other: the dataclasses (crossrt/records/schema.py), the JSON Schema (crossrt/data/run-record.schema.json)
and docs/schema.md. Adding a field or a metric without the others fails here."""

import dataclasses
import json
import re

import pytest

from crossrt.records import metrics, schema

from conftest import REPO

COUNT_FIELDS = ("prompts", "failed", "lossless", "steps", "drafted", "accepted", "emitted")
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
    (DEFS["summary"], schema.Summary, set()),
    (DEFS["pass_view"], schema.PassView, set()),
    (DEFS["unfit_counts"], schema.UnfitCounts, set()),
    (DEFS["imported"], schema.ImportInfo, set()),
    (DEFS["prompt_format"], schema.PromptFormat, set()),
]


def fields_of(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_the_metrics_are_the_summary_rates_and_the_derived_block():
    assert tuple(fields_of(schema.Summary)) == COUNT_FIELDS + metrics.NAMES
    assert set(DEFS["derived"]["properties"]) == {"lossless", *metrics.NAMES}
    assert metrics.HARDWARE_BOUND == ("tokens_per_s", "baseline_tokens_per_s", "speedup")
    assert metrics.BY_NAME["alpha"].format(0.51234) == "0.512" and metrics.BY_NAME["tau"].format(None) == "-"


@pytest.mark.parametrize("node, cls, added", NODES, ids=[cls.__name__ for _, cls, _ in NODES])
def test_the_json_schema_describes_each_dataclass(node, cls, added):
    assert set(node["properties"]) == set(fields_of(cls)) | added
    without_default = {f.name for f in dataclasses.fields(cls)
                       if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert without_default <= set(node.get("required", ())), f"{cls.__name__}: required in the dataclass"


def test_docs_schema_names_every_field():
    text = (REPO / "docs" / "schema.md").read_text(encoding="utf-8")
    fields_section = text[text.index("## Fields"):text.index("## Journals beside a record")]
    named = set(re.findall(r"`([a-z_0-9]+)`", fields_section))
    missing = {f"{cls.__name__}.{name}" for _, cls, _ in NODES for name in fields_of(cls) if name not in named}
    assert not missing, f"docs/schema.md does not describe {sorted(missing)}"
