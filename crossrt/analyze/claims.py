"""Claims: published speculative decoding numbers, and how a run measures up to them.

A claims file (TOML, docs/claims.md) holds `[[claim]]` tables: who reported what, on which
runtime, pair, draft length and hardware, and per category the numbers they saw. This module
reads claims and compares a run record with one; running what this machine can is
crossrt/analyze/reproduce.py (`crossrt reproduce`).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from crossrt.records import metrics
from crossrt.errors import CrossrtError
from crossrt.inputs.builtin import named
from crossrt.speculative.loop import SCHEDULES
from crossrt.run.runtime import SPEC_TYPES
from crossrt.records.schema import RunRecord
from crossrt.records.tables import format_table

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# A claim names the metrics of crossrt/records/metrics.py, as a record's summary does, so it
# reads like `crossrt show`. Wall-clock ones (hardware_bound) are compared only when the
# hardware matches: elsewhere a difference says nothing about the claim.
OVERALL = "all"  # the "category" of numbers over every prompt a claim runs
MODES = ("driven", "native")
REQUIRED = ("id", "source", "runtime", "k", "sampling", "hardware", "expect")
OPTIONAL = ("crossrt_runtime", "mode", "schedule", "pair", "spec_type", "max_new_tokens", "prompts",
            "template", "tolerance", "note")
# How the claim's prompts were fed (crossrt/inputs/chat_template.py): "chat" through the model's chat
# template, "raw" as text, "auto" (the default of `crossrt run`) chat prompts templated only.
TEMPLATE_USES = ("auto", "chat", "raw")
SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # it names the claim's record file


class ClaimError(CrossrtError, ValueError):
    """A claims file that cannot be read, with the file and claim at fault."""


@dataclass(frozen=True)
class Tolerance:
    amount: float
    relative: bool  # amount is a fraction of the claimed value, else in the metric's units

    def bounds(self, low: float, high: float) -> tuple[float, float]:
        if self.relative:
            return low * (1 - self.amount), high * (1 + self.amount)
        return low - self.amount, high + self.amount

    def __str__(self) -> str:
        return f"±{self.amount * 100:g}%" if self.relative else f"±{self.amount:g}"


# ±10%: a claim is measured on its authors' prompts and reproduced on crossrt's suites, and the
# suite alone moves tau by several percent; a tighter claim states its own tolerance.
DEFAULT_TOLERANCE = Tolerance(0.10, relative=True)


@dataclass(frozen=True)
class Expectation:
    category: str
    metric: str
    low: float
    high: float  # equal to low unless the claim gives a range such as 35-37 tok/s
    tolerance: Tolerance

    def accepts(self, value: float) -> bool:
        low, high = self.tolerance.bounds(self.low, self.high)
        return low <= value <= high

    def __str__(self) -> str:
        return f"{self.low:g}" if self.low == self.high else f"{self.low:g}-{self.high:g}"


@dataclass(frozen=True)
class Claim:
    id: str
    source: str  # who reported it, and where
    runtime: str  # the runtime as the claim names it, e.g. exllamav3
    crossrt_runtime: Optional[str]  # the crossrt runtime to reproduce it on (may not exist yet)
    mode: Optional[str]  # None: native where the runtime has it, else driven
    schedule: Optional[str]  # driven mode's schedule; None: the loop's default
    pair: Optional[str]  # manifest path (relative to the claims file) or name; None: none available
    k: int
    sampling: str
    spec_type: Optional[str]  # None: the pair's [defaults] spec_type, as crossrt run takes it
    hardware: str
    max_new_tokens: Optional[int]
    # One suite for every category (filtered to the claimed ones), or (category, suite) pairs.
    prompts: Union[None, str, tuple[tuple[str, str], ...]]
    template: str  # one of TEMPLATE_USES
    expectations: tuple[Expectation, ...]
    note: str
    origin: Path  # the claims file

    @property
    def categories(self) -> tuple[str, ...]:
        return _categories(self.expectations)

    def describe_prompts(self) -> str:
        if self.prompts is None:
            return "reproduce's --prompts (the claim names none)"
        if isinstance(self.prompts, str):
            return self.prompts
        return ", ".join(f"{category}: {source}" for category, source in self.prompts)


def _categories(expectations: tuple[Expectation, ...]) -> tuple[str, ...]:
    """The claimed categories in file order, without the overall one."""
    return tuple(dict.fromkeys(e.category for e in expectations if e.category != OVERALL))


def _tolerance(value: object, where: str) -> Tolerance:
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            amount = float(value.strip()[:-1]) / 100
        except ValueError:
            raise ClaimError(f"{where}: {value!r} is not a percentage such as \"10%\"") from None
        relative = True
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        amount, relative = float(value), False
    else:
        raise ClaimError(f"{where}: a tolerance is a number (absolute) or a string like \"10%\" (relative), "
                         f"got {value!r}")
    if not math.isfinite(amount) or amount < 0 or (relative and amount >= 1):
        raise ClaimError(f"{where}: tolerance {value!r} out of range")
    return Tolerance(amount, relative)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _expectations(table: object, tolerances: dict[str, Tolerance], where: str) -> tuple[Expectation, ...]:
    if not isinstance(table, dict) or not table:
        raise ClaimError(f"{where}: [expect] needs one table per category, e.g. [claim.expect.code] tau = 2.5")
    expectations = []
    for category, values in table.items():
        if not isinstance(values, dict) or not values:
            raise ClaimError(f"{where}: expect.{category} must be a table of metrics ({', '.join(metrics.names())})")
        for metric, value in values.items():
            at = f"{where}: expect.{category}.{metric}"
            if metric not in metrics.names():
                raise ClaimError(f"{at}: unknown metric; metrics are {', '.join(metrics.names())}")
            if _number(value):
                low = high = float(value)
            elif isinstance(value, list) and len(value) == 2 and all(map(_number, value)) and value[0] <= value[1]:
                low, high = float(value[0]), float(value[1])
            else:
                raise ClaimError(f"{at}: expected a non-negative number or a range [low, high], got {value!r}")
            expectations.append(Expectation(category, metric, low, high, tolerances.get(metric, DEFAULT_TOLERANCE)))
    return tuple(expectations)


def _text(entry: dict, name: str, where: str, required: bool = True) -> Optional[str]:
    value = entry.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ClaimError(f"{where}: field {name!r} must be a non-empty string")
    return value


def _positive_int(entry: dict, name: str, where: str) -> Optional[int]:
    value = entry.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ClaimError(f"{where}: field {name!r} must be a positive integer, got {value!r}")
    return value


def _prompts(value: object, categories: tuple[str, ...], where: str):
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and all(isinstance(v, str) and v for v in value.values()):
        missing = [c for c in categories if c not in value]
        extra = [c for c in value if c not in categories]
        if missing or extra:
            raise ClaimError(f"{where}: a [prompts] table names one suite per claimed category: "
                             f"missing {missing}, not claimed {extra}")
        return tuple(value.items())
    raise ClaimError(f"{where}: prompts is a suite (string) or a table category -> suite")


def parse_claim(entry: object, index: int, origin: Path) -> Claim:
    where = f"{origin}: claim #{index}"
    if not isinstance(entry, dict):
        raise ClaimError(f"{where}: expected a [[claim]] table")
    if isinstance(entry.get("id"), str):
        where = f"{origin}: claim {entry['id']!r}"
    unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
    missing = [name for name in REQUIRED if name not in entry]
    if unknown or missing:
        raise ClaimError(f"{where}: " + "; ".join(
            ([f"unknown field(s) {', '.join(unknown)}"] if unknown else [])
            + ([f"missing field(s) {', '.join(missing)}"] if missing else [])))
    claim_id = _text(entry, "id", where)
    if not SAFE_ID.fullmatch(claim_id):
        raise ClaimError(f"{where}: id may hold only letters, digits, '.', '_' and '-'")
    k = _positive_int(entry, "k", where)
    mode = _text(entry, "mode", where, required=False)
    if mode is not None and mode not in MODES:
        raise ClaimError(f"{where}: mode must be one of {', '.join(MODES)}, got {mode!r}")
    schedule = _text(entry, "schedule", where, required=False)
    if schedule is not None and schedule not in SCHEDULES:
        raise ClaimError(f"{where}: schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    spec_type = _text(entry, "spec_type", where, required=False)
    if spec_type is not None and spec_type not in SPEC_TYPES:
        raise ClaimError(f"{where}: spec_type must be one of {', '.join(SPEC_TYPES)}, got {spec_type!r}")
    template = _text(entry, "template", where, required=False) or "auto"
    if template not in TEMPLATE_USES:
        raise ClaimError(f"{where}: template must be one of {', '.join(TEMPLATE_USES)}, got {template!r}")
    tolerance_table = entry.get("tolerance", {})
    if not isinstance(tolerance_table, dict) or set(tolerance_table) - set(metrics.names()):
        raise ClaimError(f"{where}: [tolerance] maps metrics ({', '.join(metrics.names())}) to tolerances")
    tolerances = {metric: _tolerance(value, f"{where}: tolerance.{metric}") for metric, value in tolerance_table.items()}
    expectations = _expectations(entry["expect"], tolerances, where)
    return Claim(
        id=claim_id, source=_text(entry, "source", where), runtime=_text(entry, "runtime", where),
        crossrt_runtime=_text(entry, "crossrt_runtime", where, required=False), mode=mode, schedule=schedule,
        pair=_text(entry, "pair", where, required=False), k=k, sampling=_text(entry, "sampling", where),
        spec_type=spec_type,
        hardware=_text(entry, "hardware", where), max_new_tokens=_positive_int(entry, "max_new_tokens", where),
        prompts=_prompts(entry.get("prompts"), _categories(expectations), where), template=template,
        expectations=expectations,
        note=_text(entry, "note", where, required=False) or "", origin=origin)


def load_claims(path: Path) -> list[Claim]:
    """The claims of a file: a path, or a built-in claims file's name (community)."""
    path = named("claims", path)
    if not path.is_file():
        raise ClaimError(f"claims file not found: {path}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ClaimError(f"{path} is not valid TOML: {error}") from None
    unknown = sorted(set(data) - {"claim", "description"})
    if unknown:
        raise ClaimError(f"{path}: unknown top-level key(s) {', '.join(unknown)}; claims go in [[claim]] tables")
    entries = data.get("claim")
    if not isinstance(entries, list) or not entries:
        raise ClaimError(f"{path}: no [[claim]] tables")
    claims = [parse_claim(entry, index, path) for index, entry in enumerate(entries, start=1)]
    ids = [claim.id for claim in claims]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ClaimError(f"{path}: duplicate claim id(s) {', '.join(duplicates)}")
    return claims


# ---- comparing a record with a claim -------------------------------------------------------

OK, MISS, NOT_COMPARABLE, NOT_RUN = "ok", "MISS", "not comparable here", "not run"


@dataclass(frozen=True)
class Check:
    expectation: Expectation
    verdict: str  # OK, MISS, NOT_COMPARABLE or NOT_RUN
    measured: Optional[float] = None
    why: str = ""


def same_hardware(claimed: str, here: Optional[str]) -> bool:
    """Hardware descriptions match when equal but for case and spacing: crossrt cannot tell
    whether two T4s here run like the claim's (clocks, cooling, PCIe), so the user says so."""
    return here is not None and " ".join(claimed.lower().split()) == " ".join(here.lower().split())


def check_record(claim: Claim, record: RunRecord, hardware: Optional[str]) -> tuple[Check, ...]:
    """Each of the claim's numbers against the record's, on the claim's categories."""
    checks = []
    for expected in claim.expectations:
        overall = expected.category == OVERALL
        summary = record.summary(None if overall else expected.category)
        if summary.prompts == summary.failed:
            why = (f"no prompt of category {expected.category!r} in the suite" if not summary.prompts
                   else f"every prompt of category {expected.category!r} failed")
            checks.append(Check(expected, NOT_RUN, why=why))
            continue
        metric = metrics.named(expected.metric)
        measured = metric.of(summary)
        if measured is None:
            source = f"its source ({record.imported.format})" if record.imported else "the run"
            checks.append(Check(expected, NOT_RUN, why=f"{source} gives no {expected.metric}"))
        elif metric.hardware_bound and not same_hardware(claim.hardware, hardware):
            here = hardware or "not declared (--hardware)"
            checks.append(Check(expected, NOT_COMPARABLE, measured,
                                f"claimed on {claim.hardware!r}, this machine: {here}"))
        else:
            checks.append(Check(expected, OK if expected.accepts(measured) else MISS, measured))
    return tuple(checks)


@dataclass(frozen=True)
class Outcome:
    """What became of one claim: its checks, or why it could not run here (skipped), or the
    error that broke its run."""

    claim: Claim
    checks: tuple[Check, ...] = ()
    skipped: tuple[str, ...] = ()
    error: Optional[str] = None
    record: Optional[Path] = None
    measured: bool = False  # checked against a given record (reproduce --measured), not run

    @property
    def missed(self) -> bool:
        return self.error is not None or any(check.verdict == MISS for check in self.checks)

    @property
    def complete(self) -> bool:
        """Every number the claim makes was run and compared."""
        return not self.skipped and self.error is None and all(c.verdict in (OK, MISS) for c in self.checks)


def compared(outcomes: list[Outcome]) -> int:
    """How many claimed numbers were measured and held against their claim (ok or MISS)."""
    return sum(check.verdict in (OK, MISS) for outcome in outcomes for check in outcome.checks)


def exit_code(outcomes: list[Outcome], strict: bool) -> int:
    """1 when a number that ran missed (or a run broke), or when no number at all was compared
    (a verdict about nothing must not pass); with strict, also when anything claimed could not
    be checked here."""
    if any(o.missed for o in outcomes) or (strict and not all(o.complete for o in outcomes)) \
            or not compared(outcomes):
        return 1
    return 0


def _measured(metric: str, value: Optional[float]) -> str:
    return metrics.named(metric).format(value)


def render(outcomes: list[Outcome]) -> str:
    """Claimed against measured, one row per number, then what missed and what did not run."""
    rows = [["claim", "category", "metric", "claimed", "tolerance", "measured", "verdict"]]
    for outcome in outcomes:
        checks = outcome.checks or tuple(Check(e, NOT_RUN) for e in outcome.claim.expectations)
        for check in checks:
            expected = check.expectation
            rows.append([outcome.claim.id, expected.category, expected.metric, str(expected),
                         str(expected.tolerance), _measured(expected.metric, check.measured), check.verdict])
    lines = [format_table(rows), ""]
    for outcome in outcomes:
        claim = outcome.claim
        lines.append(f"{claim.id}: {claim.source}")
        lines.append(f"  claimed: {claim.runtime}, k={claim.k}, {claim.sampling}, on {claim.hardware}")
        lines.append(f"  prompts: {claim.describe_prompts()}, template {claim.template}")
        if claim.note:
            lines.append(f"  note: {claim.note}")
        if outcome.record is not None:
            how = "checked against the given record" if outcome.measured else f"ran on {claim.crossrt_runtime}"
            lines.append(f"  {how}, record: {outcome.record}")
        for check in outcome.checks:
            expected = check.expectation
            if check.verdict == MISS:
                low, high = expected.tolerance.bounds(expected.low, expected.high)
                lines.append(f"  MISS {expected.category} {expected.metric}: claimed {expected} {expected.tolerance} "
                             f"(accepts {low:.4g} to {high:.4g}), measured {_measured(expected.metric, check.measured)}")
            elif check.why:
                lines.append(f"  {check.verdict}: {expected.category} {expected.metric}: {check.why}")
        for reason in outcome.skipped:
            lines.append(f"  not run here: {reason}")
        if outcome.error:
            lines.append(f"  run failed: {outcome.error}")
    counts = {"reproduced": sum(o.complete and not o.missed for o in outcomes),
              "partly checked": sum(not o.complete and not o.missed and not o.skipped for o in outcomes),
              "missed": sum(o.missed and o.error is None for o in outcomes),
              "failed to run": sum(o.error is not None for o in outcomes),
              "not run here": sum(bool(o.skipped) for o in outcomes)}
    numbers = sum(len(o.checks or o.claim.expectations) for o in outcomes)
    lines += ["", f"compared {compared(outcomes)} of {numbers} claimed number(s)" if compared(outcomes) else
              f"nothing compared: none of the {numbers} claimed number(s) was measured and checked here (reasons "
              "above), so reproduce fails",
              f"{len(outcomes)} claim(s): " + ", ".join(f"{n} {what}" for what, n in counts.items() if n)]
    return "\n".join(lines)
