"""A sweep directory: each finished cell's run record (cells/<id>.json, the format of
`crossrt run`) with what ran it (cells/<id>.cell.json), each failed cell's reason
(failed/<id>.txt, retried on the next run), and index.parquet: one row per prompt with the
cell's settings, counters, timings and verdicts, for SQL (DuckDB) or any dataframe library.

Only the sweep's driver writes here, one cell at a time, each file atomically: a run killed
between cells keeps every finished one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from crossrt.journal import write_atomically
from crossrt.record_json import load_record, record_from_json, save_record
from crossrt.schema import RecordError, RunRecord
from crossrt.sweep.plan import Cell, SweepError

INDEX = "index.parquet"
# The index's columns and their SQL types: the cell's settings, then one prompt's result.
CELL_COLUMNS = [
    ("cell_id", "VARCHAR"), ("cell_name", "VARCHAR"), ("pair", "VARCHAR"), ("runtime", "VARCHAR"),
    ("mode", "VARCHAR"), ("schedule", "VARCHAR"), ("k", "INTEGER"), ("draft_n_min", "INTEGER"),
    ("draft_p_min", "DOUBLE"), ("spec_type", "VARCHAR"), ("prompts", "VARCHAR"), ("max_new_tokens", "INTEGER"),
    ("n_ctx", "INTEGER"), ("threads", "INTEGER"), ("n_gpu_layers", "INTEGER"), ("gpu_split", "VARCHAR"),
    ("f32_kv_cache", "BOOLEAN"), ("flash_attn", "BOOLEAN"),
    ("runtime_version", "VARCHAR"), ("device", "VARCHAR"), ("kv_cache", "VARCHAR"), ("record_schedule", "VARCHAR"),
    ("host", "VARCHAR"), ("executor", "VARCHAR"), ("cell_wall_s", "DOUBLE"),
]
PROMPT_COLUMNS = [
    ("prompt_id", "VARCHAR"), ("category", "VARCHAR"), ("status", "VARCHAR"), ("error", "VARCHAR"),
    ("prompt_tokens", "INTEGER"), ("output_tokens", "INTEGER"), ("stop_reason", "VARCHAR"),
    ("steps", "INTEGER"), ("drafted", "INTEGER"), ("accepted", "INTEGER"), ("emitted", "INTEGER"),
    ("unverified", "INTEGER"), ("cut", "INTEGER"), ("tau", "DOUBLE"), ("alpha", "DOUBLE"), ("lossless", "BOOLEAN"),
    ("prefill_s", "DOUBLE"), ("decode_s", "DOUBLE"), ("baseline_prefill_s", "DOUBLE"), ("baseline_decode_s", "DOUBLE"),
    ("tokens_per_s", "DOUBLE"), ("baseline_tokens_per_s", "DOUBLE"),
]
COLUMNS = CELL_COLUMNS + PROMPT_COLUMNS
# Per cell, for `SELECT ... FROM cells`: tau and alpha from summed counters, as records derive them.
CELLS_VIEW = """
CREATE VIEW cells AS SELECT cell_id, any_value(cell_name) AS cell_name, any_value(pair) AS pair,
  any_value(runtime) AS runtime, any_value(mode) AS mode, any_value(schedule) AS schedule, any_value(k) AS k,
  any_value(prompts) AS prompts, count(*) AS n_prompts, count(*) FILTER (status <> 'ok') AS failed,
  count(*) FILTER (lossless) AS lossless, 1 + sum(accepted) / nullif(sum(steps), 0) AS tau,
  sum(accepted) / nullif(sum(drafted), 0) AS alpha, any_value(cell_wall_s) AS cell_wall_s, any_value(host) AS host
FROM prompts GROUP BY cell_id"""


@dataclass(frozen=True)
class StoredCell:
    meta: dict[str, Any]  # the cell's settings, id, name, and where and how long it ran
    record_path: Path

    def record(self) -> RunRecord:
        return load_record(self.record_path)


def _sql_text(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def _duckdb():
    try:
        import duckdb
    except ImportError:
        raise SweepError("the sweep index needs duckdb: pip install 'crossrt[sweep]'") from None
    return duckdb


class SweepStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.cells_dir = self.root / "cells"
        self.failed_dir = self.root / "failed"

    def record_path(self, cell_id: str) -> Path:
        return self.cells_dir / f"{cell_id}.json"

    def _meta_path(self, cell_id: str) -> Path:
        return self.cells_dir / f"{cell_id}.cell.json"

    def done(self) -> set[str]:
        """Ids of the finished cells: their record and its meta both written (meta goes last)."""
        if not self.cells_dir.is_dir():
            return set()
        return {p.name[:-len(".cell.json")] for p in self.cells_dir.glob("*.cell.json")
                if self.record_path(p.name[:-len(".cell.json")]).is_file()}

    def failures(self) -> dict[str, str]:
        if not self.failed_dir.is_dir():
            return {}
        return {p.stem: p.read_text().strip() for p in self.failed_dir.glob("*.txt")}

    def put(self, cell: Cell, outcome: dict[str, Any], executor: str) -> Optional[RunRecord]:
        """Keep what a worker sent back for cell: its record and meta, or its failure. Returns
        the record, or None for a failure."""
        failure = self.failed_dir / f"{cell.id}.txt"
        if "error" in outcome:
            self.failed_dir.mkdir(parents=True, exist_ok=True)
            write_atomically(failure, (outcome["error"] + "\n").encode(), "the sweep directory")
            return None
        record = record_from_json(outcome["record"])  # validated here too: a worker's bytes are not trusted
        self.cells_dir.mkdir(parents=True, exist_ok=True)
        save_record(record, self.record_path(cell.id))
        meta = {"id": cell.id, "name": cell.name, "params": cell.params(), "executor": executor,
                "host": outcome.get("host"), "pid": outcome.get("pid"), "wall_s": outcome.get("wall_s"),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        write_atomically(self._meta_path(cell.id), (json.dumps(meta, indent=1) + "\n").encode(), "the sweep directory")
        failure.unlink(missing_ok=True)
        return record

    def stored(self) -> list[StoredCell]:
        cells = []
        for cell_id in sorted(self.done()):
            try:
                meta = json.loads(self._meta_path(cell_id).read_text())
            except ValueError as error:
                raise SweepError(f"{self._meta_path(cell_id)} is not JSON: {error}") from None
            cells.append(StoredCell(meta, self.record_path(cell_id)))
        return cells

    def rows(self) -> Iterator[tuple]:
        for stored in self.stored():
            try:
                record = stored.record()
            except RecordError as error:
                raise SweepError(f"sweep cell {stored.meta['id']}: {error}") from None
            params = stored.meta["params"]
            split = params["gpu_split"]
            cell = (stored.meta["id"], stored.meta["name"], *(params[name] for name, _ in CELL_COLUMNS[2:15]),
                    ",".join(f"{v:g}" for v in split) if split else None, params["f32_kv_cache"],
                    params["flash_attn"], record.runtime.version, record.runtime.device, record.runtime.kv_cache,
                    record.params.schedule, stored.meta["host"], stored.meta["executor"], stored.meta["wall_s"])
            for r in record.results:
                c, t = r.counters, r.timings
                yield cell + (r.prompt_id, r.category, r.status, r.error, len(r.prompt_ids), len(r.output_ids),
                              r.stop_reason, *((c.steps, c.drafted, c.accepted, c.emitted, c.unverified, c.cut,
                                                c.tau, c.alpha) if c else (None,) * 8),
                              r.lossless, *((t.prefill_s, t.decode_s, t.baseline_prefill_s, t.baseline_decode_s)
                                            if t else (None,) * 4), r.tokens_per_s, r.baseline_tokens_per_s)

    def index_path(self) -> Path:
        """index.parquet, rebuilt first when a cell was written after it (or it is missing)."""
        path = self.root / INDEX
        newest = max((p.stat().st_mtime for p in self.cells_dir.glob("*.cell.json")), default=None) \
            if self.cells_dir.is_dir() else None
        if newest is None:
            raise SweepError(f"{self.root}: no finished cells (run `crossrt sweep run` first)")
        if not path.is_file() or path.stat().st_mtime < newest:
            self._write_index(path)
        return path

    def _write_index(self, path: Path) -> None:
        con = _duckdb().connect()
        con.execute("CREATE TABLE prompts (" + ", ".join(f"{n} {t}" for n, t in COLUMNS) + ")")
        con.executemany(f"INSERT INTO prompts VALUES ({', '.join('?' * len(COLUMNS))})", list(self.rows()))
        partial = path.with_name(path.name + ".partial")
        con.execute(f"COPY prompts TO {_sql_text(partial)} (FORMAT parquet)")
        con.close()
        partial.replace(path)  # atomically: a reader sees the old index or the new one

    def query(self, sql: str) -> tuple[list[str], list[tuple]]:
        """Column names and rows of sql over the tables `prompts` (one row per prompt) and
        `cells` (one row per cell)."""
        duckdb = _duckdb()
        con = duckdb.connect()
        con.execute(f"CREATE VIEW prompts AS SELECT * FROM read_parquet({_sql_text(self.index_path())})")
        con.execute(CELLS_VIEW)
        try:
            result = con.execute(sql)
            return [d[0] for d in result.description], result.fetchall()
        except duckdb.Error as error:
            raise SweepError(f"query failed: {str(error).splitlines()[0]}") from None
        finally:
            con.close()


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
