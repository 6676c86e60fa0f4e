"""Sweep files: axes, their product with exclude/include rules, per-runtime resources, and the
cells that come out of them, each with a stable id (a digest of its parameters).

A sweep file (TOML, models/sweeps/*.toml, docs/scale.md):

    name = "tiny-k"
    [axes]                       # a list is an axis; a scalar is one value for every cell
    pair = ["tiny"]
    runtime = ["llama-cpp", "llama-server"]
    mode = ["driven", "native"]
    k = [1, 2, 3, 4]             # no k: each pair's [defaults] k, else 4
    max_new_tokens = 8
    k_policy = ["fixed", "online"]  # driven strategies: drafting, k_policy, acceptance and their
                                    # parameters (tree, content_k = "code=7,prose=3", top_m, ...)
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

Anything else is refused: a top-level key other than these six, a file without [axes], an
axis without values, a runtime crossrt does not know, a product above MAX_CELLS cells.
Duplicates (two names of one pair manifest too), k at or above the token budget and very
large plans are planned, with a warning.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from crossrt.run import loop
from crossrt.errors import CrossrtError, SettingsError
from crossrt.inputs.pairs import DEFAULT_K, PairError, load_pair, manifest_path, run_k, run_spec_type
from crossrt.run.runtime import DraftRules, RuntimeUnavailable, runtime_class, runtime_names
from crossrt.run.strategies import Strategy, parse_content_k

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class SweepError(CrossrtError, ValueError):
    """A sweep file that cannot be read, or a sweep directory that does not match it."""


# A driven run's strategy settings (crossrt/run/strategies.py), as crossrt run's --drafting,
# --k-policy, --acceptance and their parameters; content_k is written as in --content-k.
STRATEGY_DEFAULTS: dict[str, Any] = {field.name: field.default for field in dataclasses.fields(Strategy)}
# Each strategy parameter, and the choice it belongs to (crossrt run refuses it without that choice).
STRATEGY_PARTS = {"tree": ("drafting", "tree"), "ngram_max": ("drafting", "prompt-lookup"),
                  "ngram_min": ("drafting", "prompt-lookup"), "content_k": ("k_policy", "content"),
                  "k_max": ("k_policy", "online"), "min_p1": ("k_policy", "confidence"),
                  "top_m": ("acceptance", "relaxed"), "delta": ("acceptance", "relaxed")}
# Every setting of one cell, with the value a cell has when neither the axes nor a rule set it;
# k and spec_type None: the pair's, as crossrt run takes them (run_k, run_spec_type).
DEFAULTS: dict[str, Any] = {
    "pair": "tiny", "runtime": "llama-cpp", "mode": "driven", "schedule": loop.SCHEDULE, "k": None,
    "draft_n_min": None, "draft_p_min": 0.0, "spec_type": None, "prompts": "builtin",
    "max_new_tokens": 64, "n_ctx": 2048, "n_gpu_layers": 0, "gpu_split": None,
    "f32_kv_cache": False, "flash_attn": True, **STRATEGY_DEFAULTS,
}
# The TOML types each setting takes (None where the default is None); a cell's id digests them.
KINDS: dict[str, tuple[type, ...]] = {
    "pair": (str,), "runtime": (str,), "mode": (str,), "schedule": (str,), "k": (int,), "draft_n_min": (int,),
    "draft_p_min": (float, int), "spec_type": (str,), "prompts": (str,), "max_new_tokens": (int,),
    "n_ctx": (int,), "n_gpu_layers": (int,), "gpu_split": (list,), "f32_kv_cache": (bool,), "flash_attn": (bool,),
    "drafting": (str,), "tree": (str,), "ngram_max": (int,), "ngram_min": (int,), "k_policy": (str,),
    "content_k": (str,), "k_max": (int,), "min_p1": (float, int), "acceptance": (str,), "top_m": (int,),
    "delta": (float, int),
}
RESOURCE_KEYS = ("threads", "num_cpus", "num_gpus")
STRATEGIES = ("task", "actor")
TOP_KEYS = ("name", "axes", "exclude", "include", "resources", "ray")
RAY_KEYS = ("strategy", "max_retries")
# Planning is work per cell (a digest, a skip check): a product this large is a mistake in the
# file (an axis too many), refused before any cell is made.
MAX_CELLS = 100_000
LARGE_PLAN = 1_000  # more cells than this: planned, with a warning


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
    # The strategy (STRATEGY_DEFAULTS), its content_k as text.
    drafting: str = "model"
    tree: Optional[str] = None
    ngram_max: int = 3
    ngram_min: int = 1
    k_policy: str = "fixed"
    content_k: Optional[str] = None
    k_max: int = 8
    min_p1: float = 0.0
    acceptance: str = "greedy"
    top_m: int = 2
    delta: float = 1.0

    def params(self) -> dict[str, Any]:
        """Every setting, less the strategy's at their defaults: a cell of the default strategy
        keeps the id (and the store entries) it had before strategies were sweep settings."""
        return {key: value for key, value in dataclasses.asdict(self).items()
                if key not in STRATEGY_DEFAULTS or value != STRATEGY_DEFAULTS[key]}

    @property
    def strategy(self) -> Strategy:
        """The cell's Strategy; SettingsError for contradicting settings (skip_reason says so)."""
        values = {key: getattr(self, key) for key in STRATEGY_DEFAULTS}
        values["content_k"] = parse_content_k(self.content_k) if self.content_k is not None else None
        return Strategy(**values)

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
            if value == DEFAULTS[key] or (key == "spec_type" and value == "draft"):  # a drafter model: unnamed
                continue
            if isinstance(value, bool):
                parts.append(label if value else f"no{label}")
            else:
                parts.append(label + (",".join(f"{v:g}" for v in value) if key == "gpu_split" else str(value)))
        if any(getattr(self, key) != value for key, value in STRATEGY_DEFAULTS.items()):
            try:
                parts.append(self.strategy.label())
            except SettingsError:  # skipped, skip_reason says why
                parts.append("bad-strategy")
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
    warnings: tuple[str, ...] = ()  # duplicates, k at or above the budget, a very large plan

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
        if isinstance(name, str):  # another type is _cell's to refuse
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
        if isinstance(name, str):  # another type is _cell's to refuse
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
        hint = " (threads are set per runtime, in [resources.<runtime>])" if "threads" in unknown else ""
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


def _cell(values: dict[str, Any], threads: int) -> Cell:
    values = dict(values)
    for key, kinds in KINDS.items():
        value = values[key]
        if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            raise SweepError(f"{key} = {value!r}: expected {' or '.join(kind.__name__ for kind in kinds)}")
    for key in ("max_new_tokens", "n_ctx"):
        if values[key] < 1:
            raise SweepError(f"{key} = {values[key]}: expected at least 1")
    for key in ("draft_p_min", "min_p1", "delta"):  # 0 and 0.0 are one setting, so one id
        values[key] = float(values[key])
    if values["mode"] == "native":  # the runtime's own schedule: cells differing only there are one cell
        values["schedule"] = None
    for key, (part, choice) in STRATEGY_PARTS.items():  # a parameter of a choice the cell did not make: unused
        if values[part] != choice:
            values[key] = STRATEGY_DEFAULTS[key]
    if values["gpu_split"] is not None:
        values["gpu_split"] = tuple(float(share) for share in values["gpu_split"])
    return Cell(**values, threads=threads)


def skip_reason(cell: Cell) -> Optional[str]:
    """Why cell cannot run on any machine (its runtime lacks the mode, its drafting rules
    contradict each other), or None. Whether the runtime is usable here is the run's to say."""
    try:
        DraftRules(cell.k, cell.draft_n_min, cell.draft_p_min, cell.spec_type)
        strategy = cell.strategy
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
    if cell.mode == "native" and not strategy.is_default:
        return f"strategy {strategy.label()} is crossrt's driven loop's: native mode drafts as the runtime does"
    return None


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


def parse_sweep(data: Mapping[str, Any], source: Path) -> Sweep:
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
    _pairs_defaults(values, source)
    planned: dict[str, Planned] = {}
    seen: set[str] = set()
    duplicates = 0
    for value in values:
        _known_runtime(value["runtime"])
        cell = _cell(value, resources.get(value["runtime"], Resources()).threads)
        raw = repr(sorted(value.items()))
        duplicates += raw in seen
        seen.add(raw)
        planned.setdefault(cell.id, Planned(cell, skip_reason(cell)))
    cells = tuple(planned.values())
    return Sweep(_name(data, source), source, cells, resources, strategy, max_retries,
                 (*aliases, *_warnings(cells, axes, duplicates)))


def load_sweep(path: Path) -> Sweep:
    path = Path(path)
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
