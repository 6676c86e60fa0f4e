"""Sweep files: axes, their product with exclude/include rules, per-runtime resources, and the
cells that come out of them (crossrt/sweep/cell.py: each with a stable id, a digest of its settings).

Endpoint cells are made one per server the command line gives (--url; crossrt/sweep/servers.py).
What does not fit the format is refused in one line; duplicates, k at or above the token budget
and plans above LARGE_PLAN cells are planned with a warning, above MAX_CELLS refused.
The format with an example: docs/scale.md, "The sweep file's format"; each refusal: the section
after it, "What a sweep file may hold".
"""

from __future__ import annotations

import collections
import difflib
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from crossrt.inputs.builtin import named
from crossrt.inputs.pairs import DEFAULT_K, PairError, load_pair, manifest_path, run_k, run_spec_type
from crossrt.run.runtime import runtime_names
from crossrt.sweep.cell import DEFAULTS, Cell, SweepError, make_cell, skip_reason
from crossrt.sweep.servers import Attachment, Servers, attach_cells, one_k_per_server

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


RESOURCE_KEYS = ("threads", "num_cpus", "num_gpus")
STRATEGIES = ("task", "actor")
TOP_KEYS = ("name", "axes", "exclude", "include", "resources", "ray")
RAY_KEYS = ("strategy", "max_retries")
# Planning is work per cell (a digest, a skip check): a product this large is a mistake in the
# file (an axis too many), refused before any cell is made.
MAX_CELLS = 100_000
LARGE_PLAN = 1_000  # more cells than this: planned, with a warning


@dataclass(frozen=True)
class Resources:
    """What one cell of a runtime needs: CPU threads it runs with, and Ray's num_cpus / num_gpus."""

    threads: int = 1
    num_cpus: Optional[float] = None  # None: as many as threads
    num_gpus: float = 0

    @property
    def cpus(self) -> float:
        return self.threads if self.num_cpus is None else self.num_cpus


@dataclass(frozen=True)
class Planned:
    cell: Cell
    skipped: Optional[str]  # why this cell cannot run (a mode the runtime lacks, ...), or None


@dataclass(frozen=True)
class Sweep:
    name: str
    source: Path
    cells: tuple[Planned, ...]
    resources: Mapping[str, Resources]
    strategy: str = "task"
    max_retries: int = 2
    warnings: tuple[str, ...] = ()  # duplicates, k at or above the budget, a very large plan
    # The servers its attaching cells run against, by URL without credentials (Cell.server).
    attachments: Mapping[str, Attachment] = field(default_factory=dict)

    def runnable(self) -> list[Cell]:
        return [p.cell for p in self.cells if p.skipped is None]

    def needs(self, cell: Cell) -> Resources:
        return self.resources.get(cell.runtime, Resources())

    def resolve(self, value: str) -> str:
        """A pair or prompt file named relative to the sweep file, as an absolute path; names
        (a pair under models/pairs, a built-in suite, specbench:PATH...) as they are."""
        return _beside(self.source, value)


def _beside(source: Path, value: str) -> str:
    kind, sep, rest = value.rpartition(":")
    path = Path(rest if sep else value)
    if path.is_absolute() or not (source.parent / path).exists():
        return value
    resolved = str((source.parent / path).resolve())
    return f"{kind}:{resolved}" if sep else resolved


def _one_name_per_pair(values: list[dict[str, Any]], source: Path) -> list[str]:
    """Each value's pair renamed to the first name given for its manifest (`tiny` and
    models/pairs/tiny.toml are one file), so its cells are planned once; a warning per alias."""
    first: dict[Path, str] = {}
    names: dict[str, tuple[str, Path]] = {}  # a name -> the first name of its manifest, and the manifest
    for value in values:
        name = value["pair"]
        if isinstance(name, str):  # another type is make_cell's to refuse
            if name not in names:
                try:  # a name no file can have (a NUL, too long) names no manifest: the cell's run says so
                    manifest = manifest_path(_beside(source, name)).resolve()
                    found = manifest.is_file()
                except (OSError, ValueError):
                    manifest, found = None, False
                names[name] = (first.setdefault(manifest, name) if found else name, manifest)
            value["pair"] = names[name][0]
    return [f"pair {alias!r} and {name!r} name one manifest ({manifest}): planned once, as {name!r}"
            for alias, (name, manifest) in names.items() if alias != name]


def _pairs_defaults(values: list[dict[str, Any]], source: Path) -> None:
    """Each value without a k or spec_type given its pair's, as crossrt run takes them (run_k,
    run_spec_type): the manifest's [defaults], else k DEFAULT_K and a drafter model, also where
    the manifest cannot be read here (its run says why)."""
    known: dict[str, tuple[int, str]] = {}
    for value in values:
        name = value["pair"]
        if isinstance(name, str):  # another type is make_cell's to refuse
            if name not in known:
                try:
                    pair = load_pair(manifest_path(_beside(source, name)))
                    known[name] = (run_k(pair), run_spec_type(pair))
                except (PairError, OSError, ValueError):
                    known[name] = (DEFAULT_K, "draft")
            k, spec_type = known[name]
            value["k"] = k if value["k"] is None else value["k"]
            value["spec_type"] = spec_type if value["spec_type"] is None else value["spec_type"]


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _normalized(table: Mapping[str, Any]) -> dict[str, Any]:
    """table with a gpu_split of numbers (one split, e.g. [1, 1]) as a one-value axis of splits."""
    table = dict(table)
    split = table.get("gpu_split")
    if isinstance(split, list) and split and not isinstance(split[0], list):
        table["gpu_split"] = [split]
    return table


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SweepError(f"{where} must be a table, not {type(value).__name__} {value!r:.60}")
    return value


def _rules(value: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise SweepError(f"{name} must be an array of tables ([[{name}]]), not {type(value).__name__}")
    return [_normalized(_table(rule, f"[[{name}]] {number}")) for number, rule in enumerate(value, start=1)]


def _checked_keys(table: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(table) - set(DEFAULTS))
    if unknown:
        hint = " (threads are set per runtime, in [resources.<runtime>])" if "threads" in unknown else \
            " (servers are given on the command line: sweep run --url)" if {"server", "url"} & set(unknown) else ""
        raise SweepError(f"{where}: unknown setting(s) {', '.join(unknown)}{hint}; settings: {', '.join(DEFAULTS)}")
    empty = [key for key, value in table.items() if value == []]
    if empty:
        raise SweepError(f"{where}: {', '.join(empty)} = []: an axis needs at least one value")


def _size(axes: Mapping[str, Any]) -> int:
    return math.prod(len(_as_list(value)) for value in axes.values())


def _product(axes: Mapping[str, Any], base: Mapping[str, Any]) -> list[dict[str, Any]]:
    keys = list(axes)
    return [{**base, **dict(zip(keys, values))} for values in itertools.product(*(_as_list(axes[k]) for k in keys))]


def _matches(values: Mapping[str, Any], rule: Mapping[str, Any]) -> bool:
    return all(values.get(key) in _as_list(wanted) for key, wanted in rule.items())


def _known_runtime(name: Any, where: str = "") -> None:
    if name not in runtime_names():
        close = difflib.get_close_matches(str(name), runtime_names(), n=1)
        raise SweepError(f"{where}{': ' if where else ''}unknown runtime {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                         + f"; runtimes: {', '.join(runtime_names())}")


def _resources(table: Any) -> dict[str, Resources]:
    table = _table(table, "[resources] (one table per runtime, e.g. [resources.llama-cpp])")
    result = {}
    for runtime, values in table.items():
        where = f"[resources.{runtime}]"
        _known_runtime(runtime, where)
        unknown = sorted(set(_table(values, where)) - set(RESOURCE_KEYS))
        if unknown:
            raise SweepError(f"{where}: unknown key(s) {', '.join(unknown)}; keys: {', '.join(RESOURCE_KEYS)}")
        for key, value in values.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or (key == "threads" and (not isinstance(value, int) or value < 1)) or value < 0:
                raise SweepError(f"{where} {key} = {value!r}: expected " +
                                 ("a whole number of threads, at least 1" if key == "threads" else "a number >= 0"))
        result[runtime] = Resources(**values)
    return result


def _ray(table: Any) -> tuple[str, int]:
    table = _table(table, "[ray]")
    unknown = sorted(set(table) - set(RAY_KEYS))
    if unknown:
        raise SweepError(f"[ray]: unknown key(s) {', '.join(unknown)}; keys: {', '.join(RAY_KEYS)}")
    strategy, retries = table.get("strategy", "task"), table.get("max_retries", 2)
    if strategy not in STRATEGIES:
        raise SweepError(f"[ray] strategy {strategy!r}: choose from {', '.join(STRATEGIES)}")
    if not isinstance(retries, int) or isinstance(retries, bool) or retries < 0:
        raise SweepError(f"[ray] max_retries = {retries!r}: expected a whole number >= 0")
    return strategy, retries


def _name(data: Mapping[str, Any], source: Path) -> str:
    """The sweep's name, also its default directory under runs/sweeps: one plain folder name."""
    name = data.get("name", source.stem)
    if not isinstance(name, str) or not name.strip() or name in (".", "..") or "/" in name or "\\" in name:
        raise SweepError(f"name = {name!r}: expected a folder name (no '/', not empty, not '.' or '..')")
    return name


def _top_level(data: Mapping[str, Any]) -> None:
    if not data:
        raise SweepError("an empty sweep file: it needs an [axes] table (docs/scale.md)")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        hints = [f"{key} (did you mean {close[0]!r}?)" if close else key
                 for key, close in ((key, difflib.get_close_matches(key, TOP_KEYS, n=1)) for key in unknown)]
        raise SweepError(f"unknown top-level key(s) {', '.join(hints)}; a sweep file holds: {', '.join(TOP_KEYS)} "
                         "(settings go in [axes])")
    if not _table(data.get("axes", {}), "[axes]"):
        raise SweepError("no [axes] table, or an empty one: name at least one setting (docs/scale.md)")


def _warnings(cells: Sequence[Planned], axes: Mapping[str, Any], duplicates: int) -> tuple[str, ...]:
    warnings = []
    for key, value in axes.items():
        counts = collections.Counter(repr(v) for v in _as_list(value))
        repeated = sorted(text for text, count in counts.items() if count > 1)
        if repeated:
            warnings.append(f"[axes] {key} lists {', '.join(repeated)} more than once: planned once")
    if duplicates:
        warnings.append(f"{duplicates} cell(s) given more than once (an [[include]] repeating the axes, or repeated "
                        "values): each is planned once")
    over = sorted({(p.cell.k, p.cell.max_new_tokens) for p in cells if p.cell.k >= p.cell.max_new_tokens})
    if over:
        warnings.append("k at or above the token budget (" + ", ".join(f"k {k} with max_new_tokens {n}"
                                                                      for k, n in over[:5])
                        + (", ..." if len(over) > 5 else "") + "): a draft of k tokens cannot be taken whole")
    if len(cells) > LARGE_PLAN:
        warnings.append(f"{len(cells)} cells: a large sweep (check the axes; `crossrt sweep run` keeps each cell "
                        "as it finishes, so it can be stopped and continued)")
    return tuple(warnings)


def parse_sweep(data: Mapping[str, Any], source: Path, servers: Servers = Servers()) -> Sweep:
    _top_level(data)
    axes = _normalized(data["axes"])
    _checked_keys(axes, "[axes]")
    rules = {name: _rules(data.get(name, []), name) for name in ("exclude", "include")}
    for name, entries in rules.items():
        for number, rule in enumerate(entries, start=1):
            _checked_keys(rule, f"[[{name}]] {number}")
    resources = _resources(data.get("resources", {}))
    strategy, max_retries = _ray(data.get("ray", {}))
    size = _size(axes) + sum(_size(rule) for rule in rules["include"])
    if size > MAX_CELLS:
        raise SweepError(f"the axes and includes give {size} cells, more than {MAX_CELLS} crossrt plans: split the "
                         "sweep or drop an axis")
    single = {key: value for key, value in axes.items() if len(_as_list(value)) == 1}
    values = [v for v in _product(axes, DEFAULTS) if not any(_matches(v, rule) for rule in rules["exclude"])]
    for rule in rules["include"]:
        values += _product(rule, {**DEFAULTS, **{k: _as_list(v)[0] for k, v in single.items()}})
    aliases = _one_name_per_pair(values, source)
    values, attachments, attached = attach_cells(values, servers)
    _pairs_defaults(values, source)
    one_k_per_server(values, attachments)
    planned: dict[str, Planned] = {}
    seen: set[str] = set()
    duplicates = 0
    for value in values:
        _known_runtime(value["runtime"])
        cell = make_cell(value, resources.get(value["runtime"], Resources()).threads)
        raw = repr(sorted(value.items()))
        duplicates += raw in seen
        seen.add(raw)
        planned.setdefault(cell.id, Planned(cell, skip_reason(cell)))
    cells = tuple(planned.values())
    return Sweep(_name(data, source), source, cells, resources, strategy, max_retries,
                 (*aliases, *attached, *_warnings(cells, axes, duplicates)), attachments)


def load_sweep(path: Path, servers: Servers = Servers()) -> Sweep:
    """The sweep a file plans: a path, or a built-in sweep's name (tiny)."""
    path = named("sweeps", path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SweepError(f"no sweep file at {path}") from None
    except IsADirectoryError:
        raise SweepError(f"{path} is a folder, not a sweep file") from None
    except UnicodeDecodeError:
        raise SweepError(f"{path} is not a text (UTF-8) file") from None
    except OSError as error:
        raise SweepError(f"cannot read {path}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise SweepError(f"{path} is not TOML: {error}") from None
    try:
        return parse_sweep(data, path, servers)
    except SweepError as error:
        raise SweepError(f"{path}: {error}") from None


def unloadable_pairs(sweep: Sweep) -> dict[str, str]:
    """Each pair of the runnable cells whose manifest does not load here, with why: `sweep run`
    here would fail every cell of it, so the plan says so first."""
    found: dict[str, str] = {}
    for name in dict.fromkeys(cell.pair for cell in sweep.runnable()):
        try:
            load_pair(manifest_path(sweep.resolve(name)))
        except (PairError, OSError, ValueError) as error:
            found[name] = str(error)
    return found


def plan_rows(sweep: Sweep, done: Sequence[str] = (), failing: Mapping[str, str] = {}) -> list[list[str]]:
    """The plan as a table: id, name, what it needs, and to run / done / skipped with the reason;
    failing: pairs that do not load here (unloadable_pairs), whose cells `sweep run` would fail."""
    rows = [["cell", "name", "threads", "gpus", "status"]]
    for planned in sweep.cells:
        needs = sweep.needs(planned.cell)
        status = (f"skipped: {planned.skipped}" if planned.skipped else
                  "done" if planned.cell.id in done else
                  f"fails here: {failing[planned.cell.pair]}" if planned.cell.pair in failing else "to run")
        rows.append([planned.cell.id, planned.cell.name, str(needs.threads), f"{needs.num_gpus:g}", status])
    return rows
