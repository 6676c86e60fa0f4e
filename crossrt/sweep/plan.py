"""Sweep files: axes, their product with exclude/include rules, per-runtime resources, and the
cells that come out of them, each with a stable id (a digest of its parameters).

A sweep file (TOML, models/sweeps/*.toml, docs/scale.md):

    name = "tiny-k"
    [axes]                       # a list is an axis; a scalar is one value for every cell
    pair = ["tiny"]
    runtime = ["llama-cpp", "llama-server"]
    mode = ["driven", "native"]
    k = [1, 2, 3, 4]
    max_new_tokens = 8
    [[exclude]]                  # cells matching every key (a list: any of its values) are dropped
    runtime = "llama-server"
    k = [1, 2]
    [[include]]                  # extra cells: its own product, other keys from the one-value axes
    runtime = "transformers"
    mode = "native"
    [resources.transformers]     # per runtime: CPU threads (--threads, and Ray's num_cpus), GPUs
    threads = 2
    num_gpus = 0
    [ray]
    strategy = "task"            # "task": one Ray task per cell; "actor": one actor per (runtime, pair)
    max_retries = 2              # a cell whose worker dies is run again this many times
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from crossrt import loop
from crossrt.errors import CrossrtError, SettingsError
from crossrt.runtime import DraftRules, RuntimeUnavailable, runtime_class, runtime_names

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class SweepError(CrossrtError, ValueError):
    """A sweep file that cannot be read, or a sweep directory that does not match it."""


# Every setting of one cell, with the value a cell has when neither the axes nor a rule set it.
DEFAULTS: dict[str, Any] = {
    "pair": "tiny", "runtime": "llama-cpp", "mode": "driven", "schedule": loop.SCHEDULE, "k": 4,
    "draft_n_min": None, "draft_p_min": 0.0, "spec_type": "draft", "prompts": "builtin",
    "max_new_tokens": 64, "n_ctx": 2048, "n_gpu_layers": 0, "gpu_split": None,
    "f32_kv_cache": False, "flash_attn": True,
}
# The TOML types each setting takes (None where the default is None); a cell's id digests them.
KINDS: dict[str, tuple[type, ...]] = {
    "pair": (str,), "runtime": (str,), "mode": (str,), "schedule": (str,), "k": (int,), "draft_n_min": (int,),
    "draft_p_min": (float, int), "spec_type": (str,), "prompts": (str,), "max_new_tokens": (int,),
    "n_ctx": (int,), "n_gpu_layers": (int,), "gpu_split": (list,), "f32_kv_cache": (bool,), "flash_attn": (bool,),
}
RESOURCE_KEYS = ("threads", "num_cpus", "num_gpus")
STRATEGIES = ("task", "actor")


@dataclass(frozen=True)
class Cell:
    """One run: a pair on a runtime with one set of settings. schedule is None in native mode
    (the runtime's own); threads come from the runtime's resources."""

    pair: str
    runtime: str
    mode: str
    schedule: Optional[str]
    k: int
    draft_n_min: Optional[int]
    draft_p_min: float
    spec_type: str
    prompts: str
    max_new_tokens: int
    n_ctx: int
    n_gpu_layers: int
    gpu_split: Optional[tuple[float, ...]]
    f32_kv_cache: bool
    flash_attn: bool
    threads: int = 1

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def id(self) -> str:
        """12 hex digits of the parameters' digest: the same cell has the same id in any sweep."""
        text = json.dumps(self.params(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        """Readable, not unique alone: pair, runtime, mode, schedule, k, prompts, then what differs
        from the defaults."""
        parts = [Path(self.pair).stem, self.runtime, self.mode]
        if self.schedule not in (None, loop.SCHEDULE):
            parts.append(self.schedule)
        parts += [f"k{self.k}", Path(self.prompts).stem]
        labels = {"draft_n_min": "nmin", "draft_p_min": "pmin", "spec_type": "", "n_ctx": "ctx", "max_new_tokens": "n",
                  "n_gpu_layers": "ngl", "gpu_split": "split", "f32_kv_cache": "f32kv", "flash_attn": "fa"}
        for key, label in labels.items():
            value = getattr(self, key)
            if value == DEFAULTS[key]:
                continue
            if isinstance(value, bool):
                parts.append(label if value else f"no{label}")
            else:
                parts.append(label + (",".join(f"{v:g}" for v in value) if key == "gpu_split" else str(value)))
        return "-".join(str(p) for p in parts)


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

    def runnable(self) -> list[Cell]:
        return [p.cell for p in self.cells if p.skipped is None]

    def needs(self, cell: Cell) -> Resources:
        return self.resources.get(cell.runtime, Resources())

    def resolve(self, value: str) -> str:
        """A pair or prompt file named relative to the sweep file, as an absolute path; names
        (a pair under models/pairs, a built-in suite, specbench:PATH...) as they are."""
        kind, sep, rest = value.rpartition(":")
        path = Path(rest if sep else value)
        if path.is_absolute() or not (self.source.parent / path).exists():
            return value
        resolved = str((self.source.parent / path).resolve())
        return f"{kind}:{resolved}" if sep else resolved


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def _normalized(table: Mapping[str, Any]) -> dict[str, Any]:
    """table with a gpu_split of numbers (one split, e.g. [1, 1]) as a one-value axis of splits."""
    table = dict(table)
    split = table.get("gpu_split")
    if isinstance(split, list) and split and not isinstance(split[0], list):
        table["gpu_split"] = [split]
    return table


def _checked_keys(table: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(table) - set(DEFAULTS))
    if unknown:
        hint = " (threads are set per runtime, in [resources.<runtime>])" if "threads" in unknown else ""
        raise SweepError(f"{where}: unknown setting(s) {', '.join(unknown)}{hint}; settings: {', '.join(DEFAULTS)}")


def _product(axes: Mapping[str, Any], base: Mapping[str, Any]) -> list[dict[str, Any]]:
    keys = list(axes)
    return [{**base, **dict(zip(keys, values))} for values in itertools.product(*(_as_list(axes[k]) for k in keys))]


def _matches(values: Mapping[str, Any], rule: Mapping[str, Any]) -> bool:
    return all(values.get(key) in _as_list(wanted) for key, wanted in rule.items())


def _cell(values: dict[str, Any], threads: int) -> Cell:
    values = dict(values)
    for key, kinds in KINDS.items():
        value = values[key]
        if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            raise SweepError(f"{key} = {value!r}: expected {' or '.join(kind.__name__ for kind in kinds)}")
    values["draft_p_min"] = float(values["draft_p_min"])  # 0 and 0.0 are one setting, so one id
    if values["mode"] == "native":  # the runtime's own schedule: cells differing only there are one cell
        values["schedule"] = None
    if values["gpu_split"] is not None:
        values["gpu_split"] = tuple(float(share) for share in values["gpu_split"])
    return Cell(**values, threads=threads)


def skip_reason(cell: Cell) -> Optional[str]:
    """Why cell cannot run on any machine (its runtime lacks the mode, its drafting rules
    contradict each other), or None. Whether the runtime is usable here is the run's to say."""
    if cell.runtime not in runtime_names():
        return f"unknown runtime {cell.runtime!r}"
    try:
        DraftRules(cell.k, cell.draft_n_min, cell.draft_p_min, cell.spec_type)
        modes = runtime_class(cell.runtime).modes
    except SettingsError as error:
        return str(error)
    except RuntimeUnavailable:  # cannot be imported here: a worker elsewhere may have it
        return None
    if cell.mode not in modes:
        return f"{cell.runtime} has no {cell.mode} mode (it has: {', '.join(modes)})"
    if cell.mode == "driven" and cell.spec_type != "draft":
        return f"crossrt's driven loop drafts with a drafter model only, not {cell.spec_type!r}"
    if cell.mode == "driven" and cell.schedule not in loop.SCHEDULES:
        return f"unknown schedule {cell.schedule!r}"
    return None


def _resources(table: Any) -> dict[str, Resources]:
    if not isinstance(table, dict):
        raise SweepError("[resources] must hold one table per runtime, e.g. [resources.llama-cpp]")
    result = {}
    for runtime, values in table.items():
        unknown = sorted(set(values) - set(RESOURCE_KEYS))
        if unknown:
            raise SweepError(f"[resources.{runtime}]: unknown key(s) {', '.join(unknown)}; keys: {', '.join(RESOURCE_KEYS)}")
        result[runtime] = Resources(**values)
    return result


def parse_sweep(data: Mapping[str, Any], source: Path) -> Sweep:
    axes = _normalized(data.get("axes", {}))
    _checked_keys(axes, "[axes]")
    rules = {name: [_normalized(rule) for rule in data.get(name, [])] for name in ("exclude", "include")}
    for name, entries in rules.items():
        for number, rule in enumerate(entries, start=1):
            _checked_keys(rule, f"[[{name}]] {number}")
    resources = _resources(data.get("resources", {}))
    ray = data.get("ray", {})
    strategy = ray.get("strategy", "task")
    if strategy not in STRATEGIES:
        raise SweepError(f"[ray] strategy {strategy!r}: choose from {', '.join(STRATEGIES)}")
    single = {key: value for key, value in axes.items() if len(_as_list(value)) == 1}
    values = [v for v in _product(axes, DEFAULTS) if not any(_matches(v, rule) for rule in rules["exclude"])]
    for rule in rules["include"]:
        values += _product(rule, {**DEFAULTS, **{k: _as_list(v)[0] for k, v in single.items()}})
    planned: dict[str, Planned] = {}
    for value in values:
        cell = _cell(value, resources.get(value["runtime"], Resources()).threads)
        planned.setdefault(cell.id, Planned(cell, skip_reason(cell)))
    return Sweep(str(data.get("name", source.stem)), source, tuple(planned.values()), resources, strategy,
                 int(ray.get("max_retries", 2)))


def load_sweep(path: Path) -> Sweep:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SweepError(f"no sweep file at {path}") from None
    except tomllib.TOMLDecodeError as error:
        raise SweepError(f"{path} is not TOML: {error}") from None
    try:
        return parse_sweep(data, path)
    except SweepError as error:
        raise SweepError(f"{path}: {error}") from None


def plan_rows(sweep: Sweep, done: Sequence[str] = ()) -> list[list[str]]:
    """The plan as a table: id, name, what it needs, and to run / done / skipped with the reason."""
    rows = [["cell", "name", "threads", "gpus", "status"]]
    for planned in sweep.cells:
        needs = sweep.needs(planned.cell)
        status = (f"skipped: {planned.skipped}" if planned.skipped else
                  "done" if planned.cell.id in done else "to run")
        rows.append([planned.cell.id, planned.cell.name, str(needs.threads), f"{needs.num_gpus:g}", status])
    return rows
