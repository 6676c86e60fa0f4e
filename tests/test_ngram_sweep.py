"""n-gram settings as sweep axes and n-gram records in `crossrt analyze` (docs/ngram.md), on real
runs of the tiny pair: a sweep over two lookups, two schedules and two n-gram lengths runs each
lookup natively and driven where it runs, skips the rest saying why, keeps every cell in the
store like any; each native cell equals its driven reproduction; analyze reads their acceptance
per content type from the records' own counters."""


import pytest
from click.testing import CliRunner

from crossrt.analyze import analysis
from crossrt.cli import main
from crossrt.inputs.prompts import load_prompts
from crossrt.run.repeating import repeating, write_jsonl
from crossrt.sweep.cell import STRATEGY_DEFAULTS
from crossrt.sweep.plan import load_sweep
from crossrt.sweep.runner import Executor, run_sweep
from crossrt.sweep.store import SweepStore

SWEEP = """
name = "ngram"
[axes]
runtime = ["llama-cpp", "llama-server", "transformers"]
mode = ["driven", "native"]
schedule = ["hf-assisted", "llama-server"]
drafting = ["hf-prompt-lookup", "llama-ngram-simple"]
ngram_max = [2, 3]
ngram_min = [1, 2]
k = [3]
prompts = "repeating.jsonl"
max_new_tokens = 16
f32_kv_cache = true
flash_attn = false
[[exclude]]
runtime = "transformers"
mode = "driven"
[resources.llama-cpp]
threads = 1
[resources.llama-server]
threads = 1
[resources.transformers]
threads = 1
"""
COUNTERS = ("steps", "drafted", "accepted", "emitted", "unverified", "cut", "accepted_per_pos")


@pytest.fixture(scope="module")
def store(tiny_sessions, tmp_path_factory):
    """Three built-in prompts (code, prose, structured), each followed by the target's greedy
    continuation and the prompt again, so lookups find something."""
    target, _ = tiny_sessions
    folder = tmp_path_factory.mktemp("ngram-sweep")
    chosen = [p for p in load_prompts("builtin") if p.id in ("code-fib", "prose-river", "structured-json")]
    write_jsonl(repeating(target, chosen, 12), folder / "repeating.jsonl")
    (folder / "sweep.toml").write_text(SWEEP)
    sweep = load_sweep(folder / "sweep.toml")
    found = SweepStore(folder / "store")
    progress = run_sweep(sweep, found, Executor())
    assert not progress.failed
    return sweep, found


def settings(cell):
    """The cell's settings; a strategy setting at its default is left out of the stored ones."""
    return {**STRATEGY_DEFAULTS, **cell.meta["params"]}


def test_each_lookup_runs_natively_and_driven_at_each_ngram_max(store):
    sweep, found = store
    cells = {(s["runtime"], s["mode"], s["drafting"], s["ngram_max"]): cell
             for cell in found.stored() for s in [settings(cell)]}
    # ngram_min means nothing to either lookup: the cells that differ only there are one cell.
    assert all(settings(cell)["ngram_min"] == 1 for cell in found.stored())
    pairs = [(("llama-server", "native", "llama-ngram-simple"), ("llama-cpp", "driven", "llama-ngram-simple")),
             (("transformers", "native", "hf-prompt-lookup"), ("llama-cpp", "driven", "hf-prompt-lookup"))]
    assert len(cells) == len(found.stored()) == 2 * len(pairs) * 2
    accepted = 0
    for native, driven in pairs:
        for ngram_max in (2, 3):
            ours, theirs = cells[(*driven, ngram_max)].record(), cells[(*native, ngram_max)].record()
            assert ours.params.ngram_max == theirs.params.ngram_max == ngram_max
            assert ours.params.drafting == theirs.params.drafting == native[2]
            for a, b in zip(ours.results, theirs.results, strict=True):
                assert a.output_ids == b.output_ids, (native, ngram_max, a.prompt_id)
                assert [getattr(a.counters, n) for n in COUNTERS] == [getattr(b.counters, n) for n in COUNTERS]
                accepted += a.counters.accepted
    assert accepted > 0
    # What cannot run is skipped with its reason, not run and failed.
    reasons = [planned.skipped for planned in sweep.cells if planned.skipped]
    assert any("llama-ngram-simple is reproduced under the llama-spec-simple or llama-server" in reason
               for reason in reasons)
    assert any("native mode does not draft by llama-ngram-simple" in reason for reason in reasons)


def test_the_index_holds_the_ngram_settings(store):
    _, found = store
    columns, rows = found.query("SELECT drafting, ngram_max, count(*) AS cells FROM cells GROUP BY ALL ORDER BY ALL")
    assert columns == ["drafting", "ngram_max", "cells"]
    assert rows == [("hf-prompt-lookup", 2, 2), ("hf-prompt-lookup", 3, 2), ("llama-ngram-simple", 2, 2),
                    ("llama-ngram-simple", 3, 2)]


def test_analyze_reads_ngram_records_per_content_type(store):
    """Native llama-server, native transformers and driven records alike: per content type, the
    records' own drafted and accepted tokens, and the CLI prints a row for each."""
    _, found = store
    for cell in found.stored():
        record = cell.record()
        stats = {s.category: s for s in analysis.category_stats(analysis.grouped(record, "content-type"))}
        assert set(stats) == {"code", "prose", "structured", None}
        for kind, entry in stats.items():
            results = [r for r in record.results if r.ok and kind in (None, r.category)]  # built-in: content types
            assert entry.drafted == sum(r.counters.drafted for r in results)
            assert entry.accepted == sum(r.counters.accepted for r in results)
        shown = CliRunner().invoke(main, ["analyze", str(cell.record_path), "--by", "content-type"])
        assert shown.exit_code == 0, shown.output
        assert all(any(line.startswith(kind) for line in shown.output.splitlines())
                   for kind in ("code", "prose", "structured", "ALL"))
