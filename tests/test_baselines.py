"""The baseline store (crossrt/run/baselines.py) on real runs of the tiny pair (llama.cpp in-process,
llama-server native; 1 thread, 8 new tokens): a k sweep decodes each baseline once and gives the
ids and counters a sweep without the store gives; damaged entries and other keys' entries are
never used; two writers at once leave whole entries; `crossrt cache` and `run --fresh-baseline`."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.run.baselines import Baseline, BaselineStore, RunBaselines, key_sha256, prompt_key
from crossrt.cli import main
from crossrt.run.driver import RunRequest, run_pair
from crossrt.inputs.pairs import load_pair
from crossrt.inputs.prompts import load_prompts
from crossrt.run.runtime import DraftRules, RuntimeOptions
from crossrt.sweep.plan import load_sweep
from crossrt.sweep.runner import Executor, run_sweep
from crossrt.sweep.store import SweepStore

from conftest import TINY_PAIR

SWEEP = """
name = "tiny-baselines"
[axes]
runtime = ["llama-cpp", "llama-server"]
mode = ["driven", "native"]
k = [1, 2, 3, 4]
prompts = "two.jsonl"
max_new_tokens = 8
[resources.llama-cpp]
threads = 1
[resources.llama-server]
threads = 1
"""


@pytest.fixture
def cache(tmp_path, monkeypatch) -> BaselineStore:
    monkeypatch.setenv("CROSSRT_CACHE", str(tmp_path / "cache"))
    return BaselineStore.default()


def two_prompts():
    return [p for p in load_prompts("builtin") if p.id in ("code-fib", "prose-river")]


def write_sweep(folder: Path) -> Path:
    with open(folder / "two.jsonl", "w") as out:
        for p in two_prompts():
            out.write(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n")
    (folder / "sweep.toml").write_text(SWEEP)
    return folder / "sweep.toml"


def outputs(store: SweepStore) -> dict:
    return {cell.meta["id"]: [(r.prompt_id, r.prompt_ids, r.output_ids, r.baseline_ids, r.counters, r.baseline_view)
                              for r in cell.record().results] for cell in store.stored()}


def sources(store: SweepStore) -> list:
    return [(cell.meta["id"], r.prompt_id, r.baseline_source) for cell in store.stored() for r in cell.record().results]


def test_a_k_sweep_decodes_each_baseline_once_and_matches_a_sweep_without_the_store(tmp_path, cache):
    sweep = load_sweep(write_sweep(tmp_path))
    stored, fresh = SweepStore(tmp_path / "stored"), SweepStore(tmp_path / "fresh")
    assert not run_sweep(sweep, stored, Executor()).failed
    assert not run_sweep(sweep, fresh, Executor(), fresh_baseline=True).failed
    assert outputs(stored) == outputs(fresh) and len(outputs(stored)) == 8
    with_store = sources(stored)
    assert all(source is not None for _, _, source in with_store)  # every record names its baseline's source
    # Per key (runtime, mode, prompt): one decode, by one cell; the other three cells read it.
    decoded = Counter(s.key_sha256 for _, _, s in with_store if s.origin == "decoded")
    read = Counter(s.key_sha256 for _, _, s in with_store if s.origin == "store")
    assert len(decoded) == 4 and set(decoded.values()) == {1} and read == Counter({key: 3 for key in decoded})
    # Without the store every cell decodes its own, under the same keys.
    assert {s.origin for _, _, s in sources(fresh)} == {"decoded"}
    assert {s.key_sha256 for _, _, s in sources(fresh)} == set(decoded)
    assert len(cache.entries()) == 4


def tiny_run(tmp_path, store, name, max_new_tokens=8):
    request = RunRequest(load_pair(TINY_PAIR), "llama-cpp", RuntimeOptions(n_ctx=512, threads=1), DraftRules(3),
                         max_new_tokens, tmp_path / f"{name}.json", baselines=store)
    return run_pair(request, two_prompts())


def test_a_damaged_entry_is_a_warning_and_a_fresh_decode(tmp_path, cache, capsys):
    first = tiny_run(tmp_path, cache, "first")
    paths = [cache.path(r.baseline_source.key_sha256) for r in first.results]
    entry = json.loads(paths[0].read_text())
    entry["output_ids"] = [(i + 1) % 100 for i in entry["output_ids"]]  # parses, and would be a wrong baseline
    paths[0].write_text(json.dumps(entry))
    paths[1].write_bytes(paths[1].read_bytes()[:40])  # a torn file
    again = tiny_run(tmp_path, cache, "again")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert len(warnings) == 2 and "does not match its sha256" in warnings[0]
    assert [r.baseline_source.origin for r in again.results] == ["decoded", "decoded"]
    assert [r.baseline_ids for r in again.results] == [r.baseline_ids for r in first.results]
    # ... and decoding afresh wrote the entries whole again
    assert [r.baseline_source.origin for r in tiny_run(tmp_path, cache, "third").results] == ["store", "store"]


def test_an_entry_of_another_key_is_never_used(tmp_path, cache, capsys):
    first = tiny_run(tmp_path, cache, "first")
    # Another budget is another key: decoded, though the prompts' 8-token entries are there.
    shorter = tiny_run(tmp_path, cache, "shorter", max_new_tokens=6)
    assert [r.baseline_source.origin for r in shorter.results] == ["decoded", "decoded"]
    assert all(len(r.baseline_ids) <= 6 for r in shorter.results)
    # An entry moved under another key's name (its own key inside) is refused, not read.
    source, target = (cache.path(r.baseline_source.key_sha256) for r in (first.results[0], shorter.results[0]))
    target.write_bytes(source.read_bytes())
    again = tiny_run(tmp_path, cache, "again", max_new_tokens=6)
    assert "holds another key" in capsys.readouterr().err
    assert [r.baseline_ids for r in again.results] == [r.baseline_ids for r in shorter.results]
    assert again.results[0].baseline_source.origin == "decoded"


def test_every_part_of_the_key_changes_its_digest():
    base = {"runtime": {"name": "llama-cpp", "version": "1"}, "options": {"threads": 1}, "target_sha256": "a" * 64,
            "mode": "driven", "machine": {"host": "h"}}
    key = prompt_key(base, (1, 2, 3), 8, False)
    changed = [prompt_key(base, (1, 2, 4), 8, False), prompt_key(base, (1, 2, 3), 9, False),
               prompt_key(base, (1, 2, 3), 8, True), prompt_key({**base, "mode": "native"}, (1, 2, 3), 8, False),
               prompt_key({**base, "options": {"threads": 2}}, (1, 2, 3), 8, False),
               prompt_key({**base, "target_sha256": "b" * 64}, (1, 2, 3), 8, False)]
    assert len({key_sha256(k) for k in [key] + changed}) == 7


def test_stored_is_whether_a_run_would_read_its_baseline_from_the_store(cache):
    """What a native runtime's driver asks before it starts a baseline engine (baseline_on_demand)."""
    base, ids = {"runtime": {"name": "vllm"}, "mode": "native"}, (1, 2, 3)
    run = RunBaselines(cache, base)
    assert not run.stored(ids, 8, False)
    run.get(ids, 8, False, lambda: Baseline((4, 5), "max_new_tokens", 0.1, 0.2))
    assert run.stored(ids, 8, False) and not run.stored(ids, 9, False) and not run.stored(ids, 8, True)
    assert not RunBaselines(BaselineStore(cache.root, refresh=True), base).stored(ids, 8, False)
    assert not RunBaselines(None, base).stored(ids, 8, False)


WRITER = """
import sys, time
from pathlib import Path
from crossrt.run.baselines import Baseline, BaselineStore, baseline_of
store, key, me = BaselineStore(Path(sys.argv[1])), {"k": "shared"}, int(sys.argv[2])
def decode():
    with open(Path(sys.argv[1]) / "decodes.log", "a") as log:
        log.write(f"{me}\\n")
    time.sleep(1.0)
    return Baseline((me,) * 50, "max_new_tokens", 0.1, 0.2)
print(baseline_of(store, key, decode)[0].output_ids[0])
for i in range(200):  # then overwrite the entry over and over, racing the other writer
    store.put(key, Baseline((me,) * (50 + i), "max_new_tokens", 0.1, 0.2), "2026-01-01T00:00:00+00:00", None)
"""


def test_two_writers_at_once_decode_once_and_leave_whole_entries(tmp_path, capfd):
    store = BaselineStore(tmp_path)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(n)], stdout=subprocess.PIPE,
                                text=True) for n in (1, 2)]
    seen = set()
    while any(w.poll() is None for w in writers):
        found = store.get({"k": "shared"})
        if found is not None:
            seen.add(found[0].output_ids[0])
            assert len(set(found[0].output_ids)) == 1  # one writer's whole baseline, never a mix
    answers = {w.communicate()[0].strip() for w in writers}
    assert all(w.returncode == 0 for w in writers)
    # One decoded; the other waited on the key's lock and read that baseline.
    assert len((tmp_path / "decodes.log").read_text().split()) == 1 and len(answers) == 1
    assert seen <= {1, 2} and "damaged" not in capfd.readouterr().err
    assert store.get({"k": "shared"}) is not None and not list(tmp_path.glob("*.tmp"))


def test_cache_ls_clear_and_fresh_baseline(tmp_path, cache):
    runner = CliRunner()
    arguments = ["run", "--pair", str(TINY_PAIR), "--prompts", str(tmp_path / "two.jsonl"), "--k", "2",
                 "--max-new-tokens", "8", "--threads", "1", "--n-ctx", "512", "--overwrite"]
    write_sweep(tmp_path)

    def run(*extra):
        result = runner.invoke(main, arguments + ["--out", str(tmp_path / "run.json"), *extra])
        assert result.exit_code == 0, result.output + result.stderr
        return result, json.loads((tmp_path / "run.json").read_text())["results"]

    _, results = run()
    assert {r["baseline_source"]["origin"] for r in results} == {"decoded"}
    result, results = run()
    assert {r["baseline_source"]["origin"] for r in results} == {"store"}
    assert "baseline: 2 of 2 prompts from the baseline store" in result.stderr
    _, results = run("--fresh-baseline")
    assert {r["baseline_source"]["origin"] for r in results} == {"decoded"}
    listed = runner.invoke(main, ["cache", "ls", "--format", "json"])
    assert listed.exit_code == 0 and "2 baseline(s)" in listed.stderr
    assert [(e["runtime"], e["mode"], e["schedule"], e["drafting"], e["acceptance"], e["lossy"])
            for e in json.loads(listed.stdout)] == [("llama-cpp", "driven", "crossrt,hf-assisted,llama-spec-simple",
                                                     "none", "greedy", False)] * 2
    cache.path("0" * 64).write_text("{")
    assert "damaged" in runner.invoke(main, ["cache", "ls"]).output
    cleared = runner.invoke(main, ["cache", "clear"])
    assert "removed 3 baseline(s)" in cleared.output and cache.entries() == []
