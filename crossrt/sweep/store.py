"""A sweep directory: each finished cell's run record (cells/<id>.json, the format of
`crossrt run`) with what ran it (cells/<id>.cell.json, naming the record's sha256), each failed
cell's reason (failed/<id>.txt, retried on the next run), and index.parquet: one row per prompt
with the cell's settings, counters, timings and verdicts, for SQL (DuckDB) or any dataframe
library.

One `crossrt sweep run` writes here at a time (sweep.lock, as a record has its lock), one cell at
a time, each file atomically: a run killed between cells keeps every finished one. A cell counts
as finished only when its meta reads, digests to its id and names the sha256 of the record
beside it: a damaged or replaced record is not done, so the next run runs it again. The index
carries the digest of the cells it was built from; one that does not match (stale, damaged,
written by something else) is rebuilt from the cell records before it is read.

`sweep query` reads the index into a DuckDB database of its own, opened read-only with external
access off and its configuration locked, and runs one SELECT there: a query reads the tables
`prompts` and `cells` and nothing else, and writes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import time
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from crossrt.records import metrics
from crossrt.records.journal import write_atomically
from crossrt.records.metrics import Totals
from crossrt.records.record_json import load_record, record_from_json, save_record
from crossrt.run.run_writer import RecordBusy, lock_path, record_lock
from crossrt.records.schema import RecordError, RunRecord
from crossrt.sweep.cell import STRATEGY_DEFAULTS, Cell, SweepError
from crossrt.sweep.limits import QueryLimits

INDEX = "index.parquet"
LOCK = "sweep"  # record_lock(root / LOCK) holds root/sweep.lock
STATE_KEY = "crossrt_sweep_state"  # the index's parquet key-value metadata: the digest it was built from
# The query's database: read-only, no file but its own, no extension loaded, settings fixed.
LOCKED = {"enable_external_access": False, "autoinstall_known_extensions": False,
          "autoload_known_extensions": False, "lock_configuration": True}
# The index's columns and their SQL types (columns()): the cell's settings, then one prompt's result.
CELL_COLUMNS = [
    ("cell_id", "VARCHAR"), ("cell_name", "VARCHAR"), ("pair", "VARCHAR"), ("runtime", "VARCHAR"),
    ("mode", "VARCHAR"), ("schedule", "VARCHAR"), ("k", "INTEGER"), ("draft_n_min", "INTEGER"),
    ("draft_p_min", "DOUBLE"), ("spec_type", "VARCHAR"), ("prompts", "VARCHAR"), ("max_new_tokens", "INTEGER"),
    ("n_ctx", "INTEGER"), ("threads", "INTEGER"), ("n_gpu_layers", "INTEGER"), ("gpu_split", "VARCHAR"),
    ("f32_kv_cache", "BOOLEAN"), ("flash_attn", "BOOLEAN"),
    ("drafting", "VARCHAR"), ("k_policy", "VARCHAR"), ("acceptance", "VARCHAR"), ("lossy", "BOOLEAN"),
    ("runtime_version", "VARCHAR"), ("device", "VARCHAR"), ("kv_cache", "VARCHAR"), ("record_schedule", "VARCHAR"),
    ("host", "VARCHAR"), ("executor", "VARCHAR"), ("cell_wall_s", "DOUBLE"),
    ("server", "VARCHAR"),  # an attaching cell's server, its URL without credentials; else NULL
    # a lookup drafting's n-gram lengths as its record states them; NULL where they mean nothing
    ("ngram_max", "INTEGER"), ("ngram_min", "INTEGER"),
]
PROMPT_COLUMNS = [
    ("prompt_id", "VARCHAR"), ("category", "VARCHAR"), ("status", "VARCHAR"), ("error", "VARCHAR"),
    ("prompt_tokens", "INTEGER"), ("output_tokens", "INTEGER"), ("baseline_tokens", "INTEGER"),
    ("stop_reason", "VARCHAR"), ("steps", "INTEGER"), ("drafted", "INTEGER"), ("accepted", "INTEGER"),
    ("emitted", "INTEGER"), ("unverified", "INTEGER"), ("cut", "INTEGER"), ("lossless", "BOOLEAN"),
    ("prefill_s", "DOUBLE"), ("decode_s", "DOUBLE"), ("baseline_prefill_s", "DOUBLE"), ("baseline_decode_s", "DOUBLE"),
]
# A cell's strategy choices, each a column (a cell written before strategies were kept: the default's).
STRATEGY_CHOICES = ("drafting", "k_policy", "acceptance")
# crossrt_metric('tau', struct_pack(steps := ..., ...)): a metric by its own formula, in SQL, over
# a struct of the columns named as metrics.Totals' fields (sums, in the cells view).
METRIC_FUNCTION = "crossrt_metric"
TOTALS = [(f.name, "BIGINT" if typing.get_type_hints(Totals)[f.name] is int else "DOUBLE") for f in fields(Totals)]


def columns() -> list[tuple[str, str]]:
    """The index's columns and their SQL types: the cell's settings, one prompt's result, then
    each metric of crossrt/records/metrics.py over that prompt (computed by its formula here)."""
    return CELL_COLUMNS + PROMPT_COLUMNS + [(metric.name, "DOUBLE") for metric in metrics.METRICS]


def _metric_of(name: str, sums: dict[str, Optional[float]]) -> Optional[float]:
    if name not in metrics.names():  # the query fails with this line (sweep query prints its first)
        raise ValueError(f"{METRIC_FUNCTION}: no metric {name!r}; metrics are {', '.join(metrics.names())}")
    # A sum over no row is NULL in SQL, 0 to the formula (as an untimed prompt's seconds).
    given = {key: value for key, value in (sums or {}).items() if value is not None}
    return metrics.named(name).of(Totals(**given))


def _add_metric_function(duckdb, con) -> None:
    totals = duckdb.struct_type(dict(TOTALS))
    con.create_function(METRIC_FUNCTION, _metric_of, ["VARCHAR", totals], "DOUBLE", null_handling="special")


def cells_view() -> str:
    """`cells`, one row per cell: counts of its prompts, its summed counters and seconds, and
    each metric over those sums by the metric's own formula, as records derive their summary."""
    sums = ", ".join(f"sum({name})::{kind} AS {name}" for name, kind in TOTALS)
    totals = "struct_pack(" + ", ".join(f"{name} := {name}" for name, _ in TOTALS) + ")"
    rates = ", ".join(f"{METRIC_FUNCTION}('{metric.name}', {totals}) AS {metric.name}" for metric in metrics.METRICS)
    return f"""
CREATE VIEW cells AS SELECT *, {rates} FROM (SELECT cell_id, any_value(cell_name) AS cell_name,
  any_value(pair) AS pair, any_value(runtime) AS runtime, any_value(mode) AS mode, any_value(schedule) AS schedule,
  any_value(k) AS k, any_value(drafting) AS drafting, any_value(k_policy) AS k_policy,
  any_value(acceptance) AS acceptance, any_value(lossy) AS lossy, any_value(prompts) AS prompts,
  any_value(server) AS server, any_value(ngram_max) AS ngram_max, any_value(ngram_min) AS ngram_min,
  any_value(runtime_version) AS runtime_version, any_value(device) AS device,
  count(*) AS n_prompts, count(*) FILTER (status <> 'ok') AS failed,
  count(*) FILTER (lossless) AS lossless, {sums}, any_value(cell_wall_s) AS cell_wall_s, any_value(host) AS host
FROM prompts GROUP BY cell_id)"""


@dataclass(frozen=True)
class StoredCell:
    meta: dict[str, Any]  # the cell's settings, id, name, and where and how long it ran
    record_path: Path

    def record(self) -> RunRecord:
        """The cell's record; SweepError where it does not read though its meta names its digest
        (written over by hand): `sweep run` skips such a cell until its meta is gone."""
        try:
            return load_record(self.record_path, remake=None)
        except RecordError as error:
            meta = self.record_path.with_name(f"{self.meta['id']}.cell.json")
            raise SweepError(f"sweep cell {self.meta['id']}: {error}; delete {meta} and `crossrt sweep run` "
                             "runs the cell again") from None


def _sql_text(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def _duckdb():
    try:
        import duckdb
    except ImportError:
        raise SweepError("the sweep index needs duckdb: pip install 'crossrt[sweep]'") from None
    return duckdb


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def select_statement(duckdb, sql: str) -> str:
    """sql if it is one SELECT (FROM-first, WITH and VALUES included), else SweepError."""
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as error:
        raise SweepError(f"query failed: {str(error).splitlines()[0]}") from None
    if not statements:
        raise SweepError('no SQL given: e.g. "SELECT runtime, k, tau FROM cells ORDER BY ALL"')
    if len(statements) > 1:
        raise SweepError(f"{len(statements)} statements given: sweep query runs one SELECT at a time")
    kind = statements[0].type
    if kind != duckdb.StatementType.SELECT:
        # DuckDB files INSTALL (and FORCE INSTALL) under LOAD: name the statement as written.
        name = statements[0].query.split()[0].upper() if kind == duckdb.StatementType.LOAD else kind.name
        article = "an" if name[0] in "AEIOU" else "a"
        raise SweepError(f"{article} {name} statement is refused: sweep query runs one SELECT over the tables "
                         "prompts and cells, and writes nothing")
    return statements[0].query


class SweepStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.cells_dir = self.root / "cells"
        self.failed_dir = self.root / "failed"

    def record_path(self, cell_id: str) -> Path:
        return self.cells_dir / f"{cell_id}.json"

    def _meta_path(self, cell_id: str) -> Path:
        return self.cells_dir / f"{cell_id}.cell.json"

    def _finished_meta(self, cell_id: str) -> Optional[dict[str, Any]]:
        """The meta of a finished cell, with the record's sha256; None where the meta is not
        JSON, is not this cell's, or the record beside it is missing or not the one written."""
        try:
            meta = json.loads(self._meta_path(cell_id).read_bytes())
            record = self.record_path(cell_id).read_bytes()
        except (OSError, ValueError, RecursionError):
            return None
        try:
            if not isinstance(meta, dict) or Cell(**meta["params"]).id != cell_id or meta.get("id") != cell_id:
                return None
        except (KeyError, TypeError):
            return None
        digest = _sha256(record)
        if "record_sha256" not in meta:  # kept before digests were: the record must read
            try:
                load_record(self.record_path(cell_id))
            except RecordError:
                return None
            meta = {**meta, "record_sha256": digest}
        return meta if meta["record_sha256"] == digest else None

    def _finished(self) -> dict[str, dict[str, Any]]:
        if not self.cells_dir.is_dir():
            return {}
        ids = sorted(p.name[:-len(".cell.json")] for p in self.cells_dir.glob("*.cell.json"))
        return {cell_id: meta for cell_id in ids if (meta := self._finished_meta(cell_id)) is not None}

    def done(self) -> set[str]:
        """Ids of the finished cells: their record and its meta both written (meta goes last),
        the record the one the meta names."""
        return set(self._finished())

    def damaged(self) -> list[str]:
        """Ids of cells with a record or meta that is not a finished cell's (cut short, replaced,
        half of a pair): the next `sweep run` runs them again."""
        if not self.cells_dir.is_dir():
            return []
        ids = {p.name.split(".")[0] for p in self.cells_dir.glob("*.json")}
        return sorted(ids - self.done())

    def failures(self) -> dict[str, str]:
        if not self.failed_dir.is_dir():
            return {}
        return {p.stem: p.read_text(errors="replace").strip() for p in self.failed_dir.glob("*.txt")}

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the sweep directory's lock (SweepError at once if another process holds it)."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(record_lock(self.root / LOCK, option="--dir"))  # sweep run's option
            except RecordBusy:
                holder = lock_path(self.root / LOCK).read_text(errors="replace").strip() or "unknown"
                raise SweepError(f"{self.root} is being written by another `crossrt sweep run` (pid {holder}): "
                                 "wait for it to end, or pass another --dir") from None
            yield

    def put(self, cell: Cell, outcome: dict[str, Any], executor: str) -> Optional[RunRecord]:
        """Keep what a worker sent back for cell: its record and meta, or its failure. Returns
        the record, or None for a failure."""
        failure = self.failed_dir / f"{cell.id}.txt"
        if "error" in outcome:
            self.failed_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(failure, (outcome["error"] + "\n").encode(), "--dir")
            return None
        record = record_from_json(outcome["record"])  # validated here too: a worker's bytes are not trusted
        self.cells_dir.mkdir(parents=True, exist_ok=True)
        written = save_record(record, self.record_path(cell.id), "--dir")
        meta = {"id": cell.id, "name": cell.name, "params": cell.params(), "executor": executor,
                "host": outcome.get("host"), "pid": outcome.get("pid"), "wall_s": outcome.get("wall_s"),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "record_sha256": _sha256(written)}
        write_atomically(self._meta_path(cell.id), (json.dumps(meta, indent=1) + "\n").encode(), "--dir")
        failure.unlink(missing_ok=True)
        return record

    def stored(self) -> list[StoredCell]:
        return [StoredCell(meta, self.record_path(cell_id)) for cell_id, meta in self._finished().items()]

    def rows(self, stored: Sequence[StoredCell]) -> Iterator[tuple]:
        for cell in stored:
            record = cell.record()
            params = cell.meta["params"]
            split = params["gpu_split"]
            settings = (cell.meta["id"], cell.meta["name"], *(params[name] for name, _ in CELL_COLUMNS[2:15]),
                    ",".join(f"{v:g}" for v in split) if split else None, params["f32_kv_cache"],
                    params["flash_attn"], *(params.get(part, STRATEGY_DEFAULTS[part]) for part in STRATEGY_CHOICES),
                    record.params.lossy, record.runtime.version, record.runtime.device, record.runtime.kv_cache,
                    record.params.schedule, cell.meta["host"], cell.meta["executor"], cell.meta["wall_s"],
                    params.get("server"), record.params.ngram_max, record.params.ngram_min)
            for r in record.results:
                c, t = r.counters, r.timings
                yield settings + (r.prompt_id, r.category, r.status, r.error, len(r.prompt_ids), len(r.output_ids),
                                  len(r.baseline_ids), r.stop_reason,
                                  *((c.steps, c.drafted, c.accepted, c.emitted, c.unverified, c.cut)
                                    if c else (None,) * 6),
                                  r.lossless, *((t.prefill_s, t.decode_s, t.baseline_prefill_s, t.baseline_decode_s)
                                                if t else (None,) * 4), *metrics.values(r.totals).values())

    def index_path(self) -> Path:
        """index.parquet, rebuilt first unless it carries the digest of the finished cells as
        they are now (a cell written since, a damaged or foreign index: rebuilt)."""
        path = self.root / INDEX
        finished = self._finished()
        if not finished:
            raise SweepError(f"{self.root}: no finished cells (run `crossrt sweep run` first)")
        state = _sha256(json.dumps([columns(), sorted((i, m["record_sha256"]) for i, m in finished.items())]).encode())
        if self._index_state(path) != state:
            self._write_index(path, [StoredCell(meta, self.record_path(i)) for i, meta in finished.items()], state)
        return path

    @staticmethod
    def _index_state(path: Path) -> Optional[str]:
        """The digest the index at path was built from, or None (missing, unreadable, foreign)."""
        if not path.is_file():
            return None
        duckdb = _duckdb()
        with duckdb.connect() as con:
            try:
                found = con.execute(f"SELECT value FROM parquet_kv_metadata({_sql_text(path)}) "
                                    f"WHERE key = '{STATE_KEY}'").fetchall()
            except duckdb.Error:
                return None
        return found[0][0].decode(errors="replace") if len(found) == 1 else None

    def _write_index(self, path: Path, stored: Sequence[StoredCell], state: str) -> None:
        # This process's own partial file: a query rebuilding the index beside a run does not mix bytes with it.
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with _duckdb().connect() as con:
            con.execute("CREATE TABLE prompts (" + ", ".join(f"{n} {t}" for n, t in columns()) + ")")
            con.executemany(f"INSERT INTO prompts VALUES ({', '.join('?' * len(columns()))})", list(self.rows(stored)))
            try:
                con.execute(f"COPY prompts TO {_sql_text(partial)} (FORMAT parquet, KV_METADATA {{{STATE_KEY}: "
                            f"'{state}'}})")
                partial.replace(path)  # atomically: a reader sees the old index or the new one
            except BaseException:
                partial.unlink(missing_ok=True)
                raise

    def query(self, sql: str) -> tuple[list[str], list[tuple]]:
        """Column names and every row of one SELECT (results())."""
        with self.results(sql) as (columns, batches):
            return columns, [row for rows in batches for row in rows]

    @contextlib.contextmanager
    def results(self, sql: str, batch: int = 1000, limits: "QueryLimits" = None,
                ) -> Iterator[tuple[list[str], Iterator[list[tuple]]]]:
        """Column names and the rows of one SELECT over the tables `prompts` (one row per prompt)
        and `cells` (one row per cell), in a read-only database holding those alone; the rows in
        batches as DuckDB streams them, so a result of millions of rows costs one batch. The
        query runs within limits (memory, spill to disk, time): past one it stops, in one line."""
        limits = limits or QueryLimits()
        duckdb = _duckdb()
        select = select_statement(duckdb, sql)
        index = self.index_path()
        with tempfile.TemporaryDirectory(prefix="crossrt-query-") as work:
            database = str(Path(work) / "sweep.duckdb")
            with duckdb.connect(database) as con:
                con.execute(f"CREATE TABLE prompts AS SELECT * FROM read_parquet({_sql_text(index)})")
                _add_metric_function(duckdb, con)  # the view names it: it binds only where the function is
                con.execute(cells_view())
            config = LOCKED | limits.config(Path(work) / "spill")
            with limits.process_memory(), duckdb.connect(database, read_only=True, config=config) as con:
                _add_metric_function(duckdb, con)
                # DuckDB has no statement timeout: a timer interrupts the connection instead.
                timer = threading.Timer(limits.seconds, con.interrupt)
                timer.daemon = True
                timer.start()
                try:
                    try:
                        result = con.execute(select)
                    except (duckdb.Error, MemoryError) as error:
                        raise limits.error(error, timer) from None

                    def batches() -> Iterator[list[tuple]]:
                        while True:
                            try:
                                rows = result.fetchmany(batch)
                            except (duckdb.Error, MemoryError) as error:  # later rows' errors come as fetched
                                raise limits.error(error, timer) from None
                            if not rows:
                                return
                            yield rows

                    yield [d[0] for d in result.description], batches()
                finally:
                    timer.cancel()



def check_sweep_dir(path: Path) -> SweepStore:
    store = SweepStore(path)
    if not store.root.is_dir():
        raise SweepError(f"no sweep directory at {path}")
    return store


def format_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table_rows(columns: Sequence[str], rows: Sequence[tuple]) -> list[list[str]]:
    return [list(columns)] + [[format_value(v) for v in row] for row in rows]
