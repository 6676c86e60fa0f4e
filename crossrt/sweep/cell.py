"""One cell of a sweep: its settings (every one crossrt run takes, with the value a cell has
when a sweep file does not set it), its stable id, readable name and strategy, and why it cannot
run. crossrt/sweep/plan.py makes cells from a sweep file's axes and rules."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from crossrt.errors import CrossrtError, SettingsError
from crossrt.speculative import loop
from crossrt.run.rules import run_rules
from crossrt.run.runtime import RuntimeUnavailable, runtime_class
from crossrt.speculative.strategies import STRATEGY_PARTS, Strategy, parse_content_k

class SweepError(CrossrtError, ValueError):
    """A sweep file that cannot be read, or a sweep directory that does not match it."""


# A driven run's strategy settings (crossrt/speculative/strategies.py), as crossrt run's --drafting,
# --k-policy, --acceptance and their parameters; content_k is written as in --content-k.
STRATEGY_DEFAULTS: dict[str, Any] = {field.name: field.default for field in dataclasses.fields(Strategy)}
# A cell of a runtime that attaches to a running server (crossrt/sweep/servers.py): the server's
# URL without credentials and its identity; None for every other cell.
SERVER_DEFAULTS: dict[str, Any] = {"server": None, "server_identity": None}
# Settings a cell's id digests only where they differ from these: a cell keeps the id (and the
# store entries) it had before strategies and servers were settings.
OPTIONAL_DEFAULTS: dict[str, Any] = {**STRATEGY_DEFAULTS, **SERVER_DEFAULTS}
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
    server: Optional[str] = None
    server_identity: Optional[str] = None

    def params(self) -> dict[str, Any]:
        """Every setting, less the strategy's and the server's at their defaults (OPTIONAL_DEFAULTS)."""
        return {key: value for key, value in dataclasses.asdict(self).items()
                if key not in OPTIONAL_DEFAULTS or value != OPTIONAL_DEFAULTS[key]}

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
        if self.server is not None:  # which server: its address (host:port and path)
            parts.append("@" + self.server.split("://", 1)[-1])
        return "-".join(str(p) for p in parts)


def make_cell(values: dict[str, Any], threads: int) -> Cell:
    """The cell of one combination of settings (every key of DEFAULTS), checked and normalized:
    settings that cannot differ between runs (a native cell's schedule, a parameter of a choice
    not made) take one value, so cells differing only there are one cell."""
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
    for key, (part, choices) in STRATEGY_PARTS.items():  # a parameter of a choice the cell did not make: unused
        if values[part] not in choices:
            values[key] = STRATEGY_DEFAULTS[key]
    if values["gpu_split"] is not None:
        values["gpu_split"] = tuple(float(share) for share in values["gpu_split"])
    return Cell(**values, threads=threads)


def skip_reason(cell: Cell) -> Optional[str]:
    """Why cell cannot run on any machine (its runtime lacks the mode, its drafting rules
    contradict each other), or None. Whether the runtime is usable here is the run's to say."""
    try:
        rules, _ = run_rules(cell.runtime, cell.mode, cell.schedule or loop.SCHEDULE, cell.max_new_tokens, cell.k,
                             cell.draft_n_min, cell.draft_p_min, cell.spec_type)  # warned of by the plan
        strategy = cell.strategy
        runtime = runtime_class(cell.runtime)
    except SettingsError as error:
        return str(error)
    except RuntimeUnavailable:  # cannot be imported here: a worker elsewhere may have it
        return None
    if cell.mode not in runtime.modes:
        return f"{cell.runtime} has no {cell.mode} mode (it has: {', '.join(runtime.modes)})"
    if runtime.attaches and cell.server is None:
        return f"{cell.runtime} attaches to a server you run: give `crossrt sweep run --url URL --baseline-url URL`"
    lacking = [rule for rule, value, unset in (("n_min", rules.n_min, rules.k), ("p_min", rules.p_min, 0.0))
               if value != unset and rule not in runtime.drafting_rules]
    if cell.mode == "native" and lacking:
        return f"{cell.runtime}'s native mode has no {' or '.join(lacking)} drafting rule (Runtime.drafting_rules)"
    if cell.mode == "driven" and cell.spec_type != "draft":
        return f"crossrt's driven loop drafts with a drafter model only, not {cell.spec_type!r}"
    if cell.mode == "driven" and cell.schedule not in loop.SCHEDULES:
        return f"unknown schedule {cell.schedule!r}"
    if cell.mode == "driven":
        try:  # a lookup reproduced from a runtime runs under that runtime's schedule only, and so on
            loop.check_strategy(strategy, cell.schedule, rules)
        except SettingsError as error:
            return str(error)
    if cell.mode == "native" and not strategy.is_default and strategy.drafting not in runtime.native_draftings:
        if strategy.looks_up:
            return (f"{cell.runtime}'s native mode does not draft by {strategy.drafting}"
                    + (f" (it runs {', '.join(runtime.native_draftings)})" if runtime.native_draftings else ""))
        return f"strategy {strategy.label()} is crossrt's driven loop's: native mode drafts as the runtime does"
    return None
