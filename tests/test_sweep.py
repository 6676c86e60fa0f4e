"""crossrt sweep: plans from sweep files, the local executor and the store (real runtimes,
tiny pair), and the Ray executor on a real Ray cluster started on this machine (one for the
module, 2 CPUs), checked cell for cell against the same cells run one by one here."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.cli import main
from crossrt.inputs.prompts import load_prompts
from crossrt.run.driver import LoadedModels
from crossrt.records.record_json import load_record, record_from_json
from crossrt.sweep.cell_run import CellJob, run_job
from crossrt.sweep.plan import SweepError, load_sweep
from crossrt.sweep.runner import Executor, run_sweep
from crossrt.sweep.store import SweepStore

# Two runtimes (in-process llama.cpp driven, llama.cpp's own server native) x k = 1..4: 8 cells,
# 8 more skipped (modes the runtimes lack). One code and one prose prompt, 8 new tokens, 1 thread.
SWEEP = """
name = "tiny-k"
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
[ray]
max_retries = 2
"""


def write_sweep(folder: Path, text: str = SWEEP) -> Path:
    prompts = {p.id: p for p in load_prompts("builtin")}
    with open(folder / "two.jsonl", "w") as out:
        for prompt_id in ("code-fib", "prose-river"):
            p = prompts[prompt_id]
            out.write(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n")
    path = folder / "sweep.toml"
    path.write_text(text)
    return path


def outputs(store: SweepStore) -> dict:
    """Per cell id, what must not depend on where a cell ran: per prompt, token ids and counters."""
    return {cell.meta["id"]: [(r.prompt_id, r.status, r.prompt_ids, r.output_ids, r.baseline_ids, r.counters)
                              for r in cell.record().results] for cell in store.stored()}


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory):
    return write_sweep(tmp_path_factory.mktemp("sweep"))


@pytest.fixture(scope="module")
def local_store(sweep_file, tmp_path_factory):
    """The reference: every cell run one by one in this process."""
    store = SweepStore(tmp_path_factory.mktemp("local"))
    progress = run_sweep(load_sweep(sweep_file), store, Executor())
    assert progress.total == 8 and not progress.failed
    return store


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'crossrt[ray]')")
    # Two logical GPUs (no device behind them: the cells run on the CPU) so GPU scheduling is exercised.
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_plan_lists_cells_with_stable_ids_and_skips(sweep_file):
    sweep = load_sweep(sweep_file)
    skipped = {p.cell.name: p.skipped for p in sweep.cells if p.skipped}
    assert len(sweep.runnable()) == 8 and len(skipped) == 8
    assert skipped["tiny-llama-cpp-native-k1-two-n8"] == "llama-cpp has no native mode (it has: driven)"
    assert "no driven mode" in skipped["tiny-llama-server-driven-k4-two-n8"]
    assert [c.id for c in load_sweep(sweep_file).runnable()] == [c.id for c in sweep.runnable()]
    assert len({c.id for c in sweep.runnable()}) == 8
    result = CliRunner().invoke(main, ["sweep", "plan", str(sweep_file)])
    assert result.exit_code == 0, result.output
    assert "16 cells: 8 to run, 8 skipped" in result.output


def test_exclude_include_and_resources(tmp_path):
    path = write_sweep(tmp_path, SWEEP + """
[[exclude]]
runtime = "llama-server"
k = [1, 2]
[[include]]
runtime = "transformers"
mode = ["driven", "native"]
k = 7
[resources.transformers]
threads = 2
num_gpus = 0.5
""")
    sweep = load_sweep(path)
    names = {c.name for c in sweep.runnable()}
    assert "tiny-llama-server-native-k1-two-n8" not in names and "tiny-llama-server-native-k3-two-n8" in names
    added = [c for c in sweep.runnable() if c.runtime == "transformers"]
    # The include's own product; its other settings from the one-value axes (prompts, max_new_tokens).
    assert sorted((c.mode, c.k, c.threads, c.max_new_tokens, c.prompts) for c in added) == [
        ("driven", 7, 2, 8, "two.jsonl"), ("native", 7, 2, 8, "two.jsonl")]
    assert sweep.needs(added[0]).num_gpus == 0.5 and sweep.needs(added[0]).cpus == 2


def test_settings_are_checked_and_gpu_splits_are_values(tmp_path):
    path = write_sweep(tmp_path, SWEEP + "[[include]]\nruntime = \"llama-cpp\"\ngpu_split = [1, 1]\nk = 2\n")
    (split,) = [c for c in load_sweep(path).runnable() if c.gpu_split]
    assert split.gpu_split == (1.0, 1.0) and split.name == "tiny-llama-cpp-driven-k2-two-n8-split1,1"
    with pytest.raises(SweepError, match=r"k = '4': expected int"):
        load_sweep(write_sweep(tmp_path, SWEEP.replace("k = [1, 2, 3, 4]", 'k = "4"')))
    with pytest.raises(SweepError, match=r"unknown setting\(s\) threads \(threads are set per runtime"):
        load_sweep(write_sweep(tmp_path, SWEEP.replace("max_new_tokens = 8", "max_new_tokens = 8\nthreads = 2")))


def test_local_store_index_and_query(local_store):
    assert len(local_store.done()) == 8
    columns, rows = local_store.query(
        "SELECT runtime, k, category, 1 + sum(accepted) / sum(steps) AS tau FROM prompts "
        "WHERE status = 'ok' AND category IN ('code', 'prose') GROUP BY ALL ORDER BY ALL")
    assert columns == ["runtime", "k", "category", "tau"] and len(rows) == 16
    # The index holds what the records hold: tau per cell from the records' own summaries.
    taus = dict(local_store.query("SELECT cell_id, tau FROM cells")[1])
    for cell in local_store.stored():
        assert taus[cell.meta["id"]] == pytest.approx(cell.record().summary().tau)
    result = CliRunner().invoke(main, ["sweep", "query", str(local_store.root), "SELECT count(*) AS n FROM prompts"])
    assert result.exit_code == 0 and result.output.split()[-1] == "16", result.output


def test_rerun_does_nothing(sweep_file, local_store):
    before = {p: p.stat().st_mtime_ns for p in local_store.root.rglob("*")}
    progress = run_sweep(load_sweep(sweep_file), local_store, Executor())
    assert progress.total == 0
    assert {p: p.stat().st_mtime_ns for p in local_store.root.rglob("*")} == before


@pytest.mark.parametrize("text, message", [
    ("", "an empty sweep file"),
    ("# only a comment\n", "an empty sweep file"),
    ('name = "x"\n[axis]\nk = [1, 2]\n', "unknown top-level key(s) axis (did you mean 'axes'?)"),
    ('runtimes = ["llama-cpp"]\n[axes]\nk = 1\n', "unknown top-level key(s) runtimes"),
    ('name = "x"\n', "no [axes] table"),
    ("[axes]\n", "no [axes] table"),
    ("axes = 3\n", "[axes] must be a table"),
    ("[axes]\nk = []\n", "k = []: an axis needs at least one value"),
    ('[axes]\nruntime = "llama-cp"\n', "unknown runtime 'llama-cp' (did you mean 'llama-cpp'?)"),
    ('name = "../elsewhere"\n[axes]\nk = 1\n', "expected a folder name"),
    ("[axes]\nk = 1\n[ray]\nmax_retries = -1\n", "max_retries = -1"),
    ("[axes]\nk = 1\n[ray]\nretries = 1\n", "[ray]: unknown key(s) retries"),
    ("[axes]\nk = 1\n[resources.llama-cpp]\nthreads = 0\n", "threads = 0"),
    ("[axes]\nk = 1\n[resources.llama-cp]\nthreads = 1\n", "[resources.llama-cp]: unknown runtime"),
    ("[axes]\nk = 1\nexclude = 3\n", "unknown setting(s) exclude"),
    ("[axes]\nk = 1\n[[include]]\nthreads = 2\n", "[[include]] 1: unknown setting(s) threads"),
    ("[axes]\nk = [" + ", ".join(map(str, range(1, 501))) + "]\nmax_new_tokens = [" + ", ".join(
        map(str, range(1, 501))) + "]\n", "250000 cells, more than 100000"),
    ("[axes]\nk = 1\n\xff\n", "not TOML"),
    ("[axes]\nmax_new_tokens = [8, 0]\n", "max_new_tokens = 0: expected at least 1"),
], ids=["empty", "comment", "axis", "runtimes", "no-axes", "empty-axes", "axes-scalar", "empty-axis", "misspelt-runtime",
        "name-path", "ray-retries", "ray-key", "threads", "resource-runtime", "exclude-in-axes", "include-threads",
        "too-large", "not-toml", "no-budget"])
def test_a_sweep_file_crossrt_does_not_understand_is_one_line(tmp_path, text, message):
    path = tmp_path / "sweep.toml"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    for command in ("plan", "run"):
        result = CliRunner().invoke(main, ["sweep", command, str(path), "--dir", str(tmp_path / "out")])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert result.output.startswith("Error: ") and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "out").exists()


def test_plan_warns_on_duplicates_k_above_the_budget_and_large_plans(tmp_path):
    path = write_sweep(tmp_path, SWEEP.replace("k = [1, 2, 3, 4]", "k = [1, 2, 2, 8, 9]") + """
[[include]]
runtime = "llama-cpp"
k = 1
""")
    sweep = load_sweep(path)
    assert len(sweep.runnable()) == 8  # k 2 once, the include's cell already in the product
    warnings = "\n".join(sweep.warnings)
    assert "[axes] k lists 2 more than once" in warnings and "5 cell(s) given more than once" in warnings
    assert "k at or above the token budget (k 8 with max_new_tokens 8, k 9 with max_new_tokens 8)" in warnings
    result = CliRunner().invoke(main, ["sweep", "plan", str(path)])
    assert result.exit_code == 0 and result.output.count("warning: ") == 3, result.output
    large = write_sweep(tmp_path, "[axes]\nk = [" + ", ".join(map(str, range(1, 61))) + "]\nmax_new_tokens = ["
                        + ", ".join(map(str, range(100, 200))) + "]\n")
    assert any("6000 cells: a large sweep" in w for w in load_sweep(large).warnings)


def test_a_query_reads_the_store_and_nothing_else(local_store, tmp_path):
    outside = tmp_path / "outside"
    secret = tmp_path / "secret.txt"
    secret.write_text("not the store's\n")
    before = {p: p.read_bytes() for p in local_store.root.rglob("*") if p.is_file()}
    cases = {
        f"COPY (SELECT 42 AS x) TO '{outside}.csv'": "a COPY statement is refused",
        f"COPY (SELECT 1 AS x) TO '{local_store.root / 'index.parquet'}' (FORMAT parquet)": "a COPY statement",
        f"COPY (SELECT 1 AS x) TO '{local_store.record_path('x')}'": "a COPY statement",
        f"EXPORT DATABASE '{outside}'": "an EXPORT statement is refused",
        f"ATTACH '{outside}.db'": "an ATTACH statement is refused",
        "INSTALL httpfs": "an INSTALL statement is refused",
        "LOAD httpfs": "a LOAD statement is refused",
        "CREATE TABLE t AS SELECT 1": "a CREATE statement is refused",
        "SET enable_external_access = true": "a SET statement is refused",
        "SELECT 1; SELECT 2": "2 statements given",
        "": "no SQL given",
        "   ": "no SQL given",
        "SELEC 1": "query failed: Parser Error",
        f"SELECT * FROM read_text('{secret}')": "file system operations are disabled",
        f"SELECT * FROM read_parquet('{local_store.root / 'index.parquet'}')": "file system operations are disabled",
        f"SELECT * FROM '{secret}'": "does not exist",  # no replacement scan of files
        f"SELECT * FROM glob('{tmp_path}/*')": "file system operations are disabled",
        "SELECT * FROM no_such_table": "query failed: Catalog Error",
    }
    for sql, message in cases.items():
        result = CliRunner().invoke(main, ["sweep", "query", str(local_store.root), sql])
        assert result.exit_code == 1 and result.output.startswith("Error: ") and message in result.output, (sql, result.output)
        assert len(result.output.strip().splitlines()) == 1, (sql, result.output)
    assert not list(tmp_path.glob("outside*"))
    assert {p: p.read_bytes() for p in local_store.root.rglob("*") if p.is_file()} == before
    # What a query may do: FROM-first, WITH, the cells view.
    result = CliRunner().invoke(main, ["sweep", "query", str(local_store.root),
                                       "WITH c AS (FROM cells) SELECT count(*) AS n FROM c"])
    assert result.exit_code == 0 and result.output.split()[-1] == "8", result.output


@pytest.fixture
def copied_store(local_store, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(local_store.root, root)
    return SweepStore(root)


@pytest.mark.parametrize("damage", ["foreign", "bytes", "empty"])
def test_a_damaged_or_foreign_index_is_rebuilt_from_the_cells(copied_store, damage):
    index = copied_store.root / "index.parquet"
    expected = copied_store.query("SELECT cell_id, prompt_id, accepted FROM prompts ORDER BY ALL")
    if damage == "foreign":  # what `COPY (SELECT 1 AS x) TO 'DIR/index.parquet'` wrote before queries were read-only
        import duckdb
        with duckdb.connect() as con:
            con.execute(f"COPY (SELECT 1 AS x) TO '{index}' (FORMAT parquet)")
    else:
        index.write_bytes(b"PAR1 not a parquet file" if damage == "bytes" else b"")
    assert copied_store.query("SELECT cell_id, prompt_id, accepted FROM prompts ORDER BY ALL") == expected


def test_a_damaged_cell_record_is_run_again(sweep_file, local_store, copied_store):
    (victim, *_), total = sorted(copied_store.done()), len(copied_store.done())
    record = copied_store.record_path(victim)
    record.write_bytes(record.read_bytes()[:200])  # cut short, as a full disk or a crash elsewhere leaves it
    assert victim not in copied_store.done() and copied_store.damaged() == [victim]
    plan = CliRunner().invoke(main, ["sweep", "plan", str(sweep_file), "--dir", str(copied_store.root)])
    assert f"16 cells: 1 to run (1 damaged, run again), {total - 1} done, 8 skipped" in plan.output, plan.output
    query = CliRunner().invoke(main, ["sweep", "query", str(copied_store.root), "SELECT count(*) AS n FROM cells"])
    assert query.exit_code == 0 and f"1 cell(s) damaged and left out ({victim})" in query.output, query.output
    assert query.output.split()[-1] == str(total - 1)
    progress = run_sweep(load_sweep(sweep_file), copied_store, Executor())
    assert progress.total == 1 and not progress.failed and not copied_store.damaged()
    assert outputs(copied_store) == outputs(local_store)


def test_a_finished_sweep_plans_and_runs_nothing_and_says_what_it_skipped(sweep_file, copied_store):
    plan = CliRunner().invoke(main, ["sweep", "plan", str(sweep_file), "--dir", str(copied_store.root)])
    assert "16 cells: 0 to run, 8 done, 8 skipped" in plan.output, plan.output
    run = CliRunner().invoke(main, ["sweep", "run", str(sweep_file), "--dir", str(copied_store.root)])
    assert run.exit_code == 0, run.output
    skipped = [line for line in run.stderr.splitlines() if line.startswith("skipped ")]
    assert len(skipped) == 8 and any("llama-cpp has no native mode" in line for line in skipped), run.stderr
    assert run.stdout.startswith("0 cells run, 0 failed"), run.stdout


def test_a_sweep_with_nothing_runnable_is_one_line(tmp_path):
    path = write_sweep(tmp_path, SWEEP.replace('mode = ["driven", "native"]', 'mode = "native"').replace(
        'runtime = ["llama-cpp", "llama-server"]', 'runtime = "llama-cpp"'))
    result = CliRunner().invoke(main, ["sweep", "run", str(path), "--dir", str(tmp_path / "out")])
    assert result.exit_code == 1 and "Error: nothing to run: all 4 cells are skipped" in result.stderr, result.output
    assert "index" not in result.output and not (tmp_path / "out").exists()


def test_one_writer_per_sweep_directory(sweep_file, copied_store):
    with copied_store.writing():
        result = CliRunner().invoke(main, ["sweep", "run", str(sweep_file), "--dir", str(copied_store.root)])
        assert result.exit_code == 1 and "being written by another `crossrt sweep run`" in result.output, result.output
        with pytest.raises(SweepError, match="pass another --dir"):
            run_sweep(load_sweep(sweep_file), copied_store, Executor())
    assert run_sweep(load_sweep(sweep_file), copied_store, Executor()).total == 0
    assert not (copied_store.root / "sweep.lock").exists()


def test_local_worker_processes_give_the_same_records(local_store, tmp_path):
    path = write_sweep(tmp_path, SWEEP.replace("k = [1, 2, 3, 4]", "k = [1, 2]"))
    store = SweepStore(tmp_path / "out")
    progress = run_sweep(load_sweep(path), store, Executor(thread_budget=2))
    assert progress.total == 4 and not progress.failed
    assert {c.meta["executor"] for c in store.stored()} == {"local-process"}
    for cell_id, results in outputs(store).items():
        assert results == outputs(local_store)[cell_id]


def test_an_actor_loads_a_pair_once_for_its_driven_cells(sweep_file, local_store):
    """What an actor does with its cells (CellRunner): driven cells of one runtime, pair and
    options share two loaded sessions, and give the records of fresh loads."""
    sweep = load_sweep(sweep_file)
    driven = [c for c in sweep.runnable() if c.mode == "driven"]
    models = LoadedModels()
    try:
        results = [run_job(CellJob.of(sweep, cell), models=models) for cell in driven]
        assert len(driven) == 4 and len(models) == 2  # target and drafter, loaded by the first cell
    finally:
        models.close()
    kept = {cell.id: [(r.prompt_id, r.status, r.prompt_ids, r.output_ids, r.baseline_ids, r.counters)
                      for r in record_from_json(result["record"]).results] for cell, result in zip(driven, results)}
    assert kept == {cell.id: outputs(local_store)[cell.id] for cell in driven}


def test_failed_cell_is_kept_as_failed_and_retried(tmp_path):
    path = write_sweep(tmp_path, SWEEP.replace('"two.jsonl"', '"later.jsonl"').replace(
        'runtime = ["llama-cpp", "llama-server"]', 'runtime = "llama-cpp"').replace("k = [1, 2, 3, 4]", "k = 2"))
    store = SweepStore(tmp_path / "out")
    result = CliRunner().invoke(main, ["sweep", "run", str(path), "--dir", str(store.root)])
    assert result.exit_code == 1 and "1 cells failed" in result.output, result.output
    (cell_id, reason), = store.failures().items()
    assert "later.jsonl" in reason and not store.done()
    (tmp_path / "two.jsonl").rename(tmp_path / "later.jsonl")
    progress = run_sweep(load_sweep(path), store, Executor())
    assert progress.total == 1 and not progress.failed
    assert store.done() == {cell_id} and not store.failures()


def test_ray_tasks_give_the_records_of_local_runs(sweep_file, local_store, ray_cluster, tmp_path):
    store = SweepStore(tmp_path / "ray")
    progress = run_sweep(load_sweep(sweep_file), store, Executor(ray="auto", strategy="task"))
    assert progress.total == 8 and not progress.failed
    assert outputs(store) == outputs(local_store)
    assert {c.meta["executor"] for c in store.stored()} == {"ray-task"}
    # Ray ran them in its workers, not in this process.
    assert all(c.meta["pid"] != local_store.stored()[0].meta["pid"] for c in store.stored())
    assert run_sweep(load_sweep(sweep_file), store, Executor(ray="auto")).total == 0


def test_ray_actors_give_the_records_of_local_runs(sweep_file, local_store, ray_cluster, tmp_path):
    store = SweepStore(tmp_path / "ray-actors")
    progress = run_sweep(load_sweep(sweep_file), store, Executor(ray="auto", strategy="actor"))
    assert progress.total == 8 and not progress.failed
    assert outputs(store) == outputs(local_store)
    # One actor per (runtime, pair): each runtime's four cells ran in one worker process.
    pids = {}
    for cell in store.stored():
        pids.setdefault(cell.meta["params"]["runtime"], set()).add(cell.meta["pid"])
    assert all(len(p) == 1 for p in pids.values()) and len(pids) == 2


@pytest.mark.parametrize("strategy", ["task", "actor"])
def test_a_worker_killed_mid_cell_is_retried(strategy, sweep_file, local_store, ray_cluster, tmp_path):
    path = write_sweep(tmp_path, SWEEP.replace('runtime = ["llama-cpp", "llama-server"]', 'runtime = "llama-cpp"')
                       .replace("k = [1, 2, 3, 4]", "k = 3"))
    marker = tmp_path / "killed"
    store = SweepStore(tmp_path / "ray")
    progress = run_sweep(load_sweep(path), store, Executor(ray="auto", strategy=strategy, kill_once=marker))
    assert marker.is_file(), "the hook did not kill the worker"
    assert progress.total == 1 and not progress.failed
    (cell,) = store.stored()
    assert cell.meta["pid"] != int(marker.read_text())  # a new worker ran it again, whole
    assert outputs(store)[cell.meta["id"]] == outputs(local_store)[cell.meta["id"]]
    assert load_record(cell.record_path).results[0].prompt_id == "code-fib"


def test_gpu_cells_pack_by_share_and_get_fresh_workers(sweep_file, local_store, ray_cluster, tmp_path):
    # Three cells, not four: each fresh worker costs a Python start and crossrt's imports, and three
    # pids already cannot come from the two CPU workers reused.
    path = write_sweep(tmp_path, SWEEP.replace('runtime = ["llama-cpp", "llama-server"]', 'runtime = "llama-cpp"')
                       .replace("k = [1, 2, 3, 4]", "k = [1, 2, 3]")
                       .replace("threads = 1\n", "threads = 1\nnum_gpus = 0.5\n", 1))
    sweep = load_sweep(path)
    assert {sweep.needs(c).num_gpus for c in sweep.runnable()} == {0.5} and len(sweep.runnable()) == 3
    store = SweepStore(tmp_path / "ray")
    assert not run_sweep(sweep, store, Executor(ray="auto", strategy="task")).failed
    # A GPU task's worker exits after it (max_calls=1), so each of the three cells ran in a process of
    # its own, where two CPU workers would otherwise have run them all.
    assert len({c.meta["pid"] for c in store.stored()}) == 3
    for cell_id, results in outputs(store).items():
        assert results == outputs(local_store)[cell_id]


def test_a_query_stops_at_its_memory_and_time_limits_in_one_line(local_store):
    """A sort over millions of generated rows took 3.2 GB and 21 s with no limit: now the query
    stops at --memory-limit (spilling to disk up to a cap first) or at --timeout, in one line."""
    import time

    sort = "SELECT * FROM range(200000000) t(i) ORDER BY hash(i)"
    started = time.monotonic()
    slow = CliRunner().invoke(main, ["sweep", "query", str(local_store.root), sort, "--timeout", "1"])
    assert time.monotonic() - started < 30
    assert slow.exit_code == 1 and slow.output.strip().splitlines() == \
        ["Error: query stopped after 1 s, its time limit (--timeout)"], slow.output
    greedy = CliRunner().invoke(main, ["sweep", "query", str(local_store.root),
                                       "SELECT list(i) FROM range(50000000) t(i)", "--memory-limit", "64MB"])
    assert greedy.exit_code == 1 and len(greedy.output.strip().splitlines()) == 1, greedy.output
    assert "--memory-limit" in greedy.output, greedy.output


@pytest.mark.parametrize("sql", ["SELECT range(200000000)", "SELECT repeat('x', 1500000000)"],
                         ids=["a-huge-list", "a-huge-string"])
def test_a_value_past_the_memory_limit_stops_in_one_line_and_this_process_stays_small(sql, local_store):
    """Values DuckDB builds outside its own limit (and Python's copy of them) reached 6.2 GB and
    3 GB (issue 58): the process may grow by --memory-limit only while the query runs."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    limit = resource.getrlimit(resource.RLIMIT_DATA)
    result = CliRunner().invoke(main, ["sweep", "query", str(local_store.root), sql])
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert "query failed" in result.output and "--memory-limit" in result.output, result.output
    assert grown < 1 << 30, f"grew by {grown >> 20} MiB"
    assert resource.getrlimit(resource.RLIMIT_DATA) == limit  # given back once the query ended
