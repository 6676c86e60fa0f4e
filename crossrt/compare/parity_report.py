"""A parity verdict and its renderings: terminal text, markdown for CI summaries, JUnit XML."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from crossrt.compare.control import FLOAT_CONTROL, WEIGHTS, ControlCheck
from crossrt.compare.power import Power
from crossrt.compare.parity import COUNTERS, IDS, OWN_BASELINE, WHOLE_RUN, PromptParity
from crossrt.compare.plain import cause_plainly, power_plainly
from crossrt.compare.rescore import LogitAgreement, ScoredRows, agreement
from crossrt.compare.tolerance import Tolerance
from crossrt.compare.verification import VERIFICATION


@dataclass(frozen=True)
class LogitCheck:
    prompt_id: str
    run_a: str
    run_b: str
    agreement: LogitAgreement
    tolerance: Tolerance

    @property
    def problems(self) -> list[str]:
        return self.tolerance.problems(self.agreement)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class NotRun:
    run: str
    reason: str
    what: str = "not run"  # or "crashed": its process died mid-run (crossrt/run/isolation.py)


def comparable(comparison: PromptParity, counters_only: bool) -> bool:
    """Whether a comparison compared what the verdict needs: token ids, or (counters only) counters."""
    return comparison.comparable or (counters_only and COUNTERS in comparison.compared)


def _reasons(group: Sequence[PromptParity], counters: bool = True) -> str:
    """Why a group's comparisons compared nothing: its distinct reasons, in order (counters: with
    why their counters were not compared either)."""
    found = [c.no_ids for c in group if c.no_ids]
    if counters:
        found += [f"counters not compared: {c.no_counters}" for c in group if c.no_counters and c.run_b != OWN_BASELINE]
    return "; ".join(dict.fromkeys(found)) or "nothing to compare"


@dataclass(frozen=True)
class Incomparable:
    """A pair of runs of which nothing was compared that the verdict needs."""

    run_a: str
    run_b: str
    why: str
    counters: bool  # their counters were compared: --counters-only would accept them

    def describe(self) -> str:
        return f"{self.run_a} vs {self.run_b}: nothing compared: {self.why}"


@dataclass(frozen=True)
class ParityReport:
    comparisons: tuple[PromptParity, ...]
    logit_checks: tuple[LogitCheck, ...] = ()
    not_run: tuple[NotRun, ...] = ()
    counters_only: bool = False  # counters alone may pass a pair of runs (parity --counters-only)
    controls: tuple[ControlCheck, ...] = ()  # the float control and quantization checks (crossrt/compare/control.py)
    no_float_control: bool = False  # parity --no-float-control: logits against the ceilings only

    def incomparable(self) -> list[Incomparable]:
        """Pairs of runs whose every comparison passed by comparing nothing: a verdict about nothing
        must not pass. With counters_only an import's own lossless check is not asked for (it has no
        token ids by nature)."""
        found = []
        for run_a, run_b in _pairs(self):
            group = [c for c in self.comparisons if (c.run_a, c.run_b) == (run_a, run_b)]
            if not all(c.ok for c in group) or any(comparable(c, self.counters_only) for c in group):
                continue
            if self.counters_only and run_b == OWN_BASELINE and all(c.imported for c in group):
                continue
            found.append(Incomparable(run_a, run_b, _reasons(group), any(COUNTERS in c.compared for c in group)))
        return sorted(found, key=lambda pair: pair.run_b == OWN_BASELINE)  # pairs of two runs first

    @property
    def ok(self) -> bool:
        return (all(c.ok for c in self.comparisons) and all(c.ok for c in self.logit_checks)
                and all(c.ok for c in self.controls) and not self.not_run and not self.incomparable())

    def failures(self) -> list[str]:
        lines = [f"{c.run_a} vs {c.run_b}, {c.prompt_id}: {'; '.join(c.problems)}"
                 for c in self.comparisons if not c.ok]
        lines += [f"{c.run_a} vs {c.run_b}, {c.prompt_id}: logits: {'; '.join(c.problems)} "
                  f"(tolerance for {c.tolerance.reason})" for c in self.logit_checks if not c.ok]
        lines += [f"{' vs '.join(c.scorings)}: {c.kind}: {c.failure()}" for c in self.controls if not c.ok]
        lines += [f"{n.run}: {n.what}: {n.reason}" for n in self.not_run]
        lines += [pair.describe() for pair in self.incomparable()]
        return lines

    def compared(self) -> str:
        """What was really compared, counted: token ids, counters and logits."""
        counts = ((IDS, sum(IDS in c.compared for c in self.comparisons)),
                  (COUNTERS, sum(COUNTERS in c.compared for c in self.comparisons)),
                  ("logits", len(self.logit_checks)))
        found = ", ".join(f"{what} in {n} comparison{'s' * (n != 1)}" for what, n in counts if n) or "nothing"
        floats = [c for c in self.controls if c.kind == FLOAT_CONTROL]
        paths = [c for c in self.controls if c.kind == VERIFICATION]
        if paths:
            found += f", verification batches of {len(paths)} scorer{'s' * (len(paths) != 1)}"
        if floats:
            found += f", logits against a float control in {len(floats)} pair{'s' * (len(floats) != 1)} of scorings"
        elif self.logit_checks and (self.no_float_control or any(c.kind == WEIGHTS and not c.weights.wrong for c in self.controls)):
            why = "--no-float-control" if self.no_float_control else "the weights are another precision's"
            found += f" (against the constant ceilings only, no float control ({why}): a weaker check)"
        return found

    def weakest_power(self) -> Optional[Power]:
        """What the float control would catch, at its weakest: None when it did not run."""
        powered = [c.power for c in self.controls if c.kind == FLOAT_CONTROL and c.power]
        return max(powered, key=lambda power: power.sigma) if powered else None

    def power(self) -> str:
        weakest = self.weakest_power()
        return weakest.describe() if weakest else ""

    def plainly(self) -> list[str]:
        """The verdict's terms in plain words: each cause of a split found, then the power."""
        causes = dict.fromkeys(cause for c in self.comparisons for cause in c.causes)
        lines = [f"{cause}: {cause_plainly(cause)}" for cause in causes if cause_plainly(cause)]
        weakest = self.weakest_power()
        return lines + ([f"{weakest.describe()}: {power_plainly(weakest)}"] if weakest else [])

    def verdict(self) -> str:
        """The closing line: OK or FAILED, and what was compared (a pair of runs that compared
        nothing is named, with why and what would compare it)."""
        incomparable = self.incomparable()
        if incomparable:
            first = incomparable[0]
            more = f" (and {len(incomparable) - 1} more pair(s) of runs)" if len(incomparable) > 1 else ""
            hint = ("; pass --counters-only to accept their counters alone"
                    if first.counters and not self.counters_only else "")
            return f"parity: FAILED: nothing compared between {first.run_a} and {first.run_b}{more}: {first.why}{hint}"
        only = ", counters only" if self.counters_only else ""
        power = self.power()
        return f"parity: {'OK' if self.ok else 'FAILED'}{only}; compared {self.compared()}" + (
            f"; {power}" if power else "")


def explained(report: ParityReport) -> list[str]:
    """Divergences explained as numerics, and counts that did not fit: reported, not failed."""
    return [f"{c.run_a} vs {c.run_b}, {c.prompt_id}: {line}" for c in report.comparisons for line in c.explained]


def _pairs(report: ParityReport) -> list[tuple[str, str]]:
    return sorted({(c.run_a, c.run_b) for c in report.comparisons})


def _counting(group: Sequence[PromptParity]) -> str:
    if group[0].run_b == OWN_BASELINE:
        return "lossless check"
    if any(COUNTERS in c.compared for c in group):
        return "counters compared"
    why = "; ".join(dict.fromkeys(c.no_counters for c in group if c.no_counters))
    return f"counters not compared ({why})" if why else "counters not compared"


@dataclass(frozen=True)
class Headline:
    """One pair of runs, counted honestly: prompts identical, explained (by cause), failed, and
    not comparable (passed, but with nothing the verdict needs compared: an import's missing
    token ids, a failed prompt's missing output), with why."""

    prompts: int
    identical: int
    # (causes, prompts explained by them): each prompt once, under its causes joined by " + ", so the
    # counts sum to explained_prompts
    explained: tuple[tuple[str, int], ...]
    explained_prompts: int
    failed: int
    not_comparable: int = 0
    why_not: str = ""  # why those were not comparable
    whole_run: str = ""  # the problem of two runs no prompt of which was compared (no saved run, not run)

    @classmethod
    def of(cls, group: Sequence[PromptParity], counters_only: bool = False) -> "Headline":
        whole = [c for c in group if c.prompt_id == WHOLE_RUN]
        if whole:
            return cls(0, 0, (), 0, len(whole), whole_run="; ".join(dict.fromkeys(p for c in whole for p in c.problems)))
        passed = [c for c in group if c.ok]
        explained = [c for c in passed if comparable(c, counters_only) and not c.identical]
        incomparable = [c for c in passed if not comparable(c, counters_only)]
        causes: dict[str, int] = {}
        for comparison in explained:
            joined = " + ".join(dict.fromkeys(comparison.causes or ("noted",)))
            causes[joined] = causes.get(joined, 0) + 1
        return cls(len(group), sum(c.identical and comparable(c, counters_only) for c in group),
                   tuple(sorted(causes.items())),
                   len(explained), sum(not c.ok for c in group), len(incomparable),
                   _reasons(incomparable, counters=False) if incomparable else "")

    def by_cause(self) -> str:
        return ", ".join(f"{cause} {n}" for cause, n in self.explained)

    def describe(self) -> str:
        if self.whole_run:
            return f"no prompt compared: {self.whole_run}"
        return (f"{self.prompts} prompts: {self.identical} identical, {self.explained_prompts} explained"
                + (f" ({self.by_cause()})" if self.explained else "") + f", {self.failed} failed, "
                + f"{self.not_comparable} not comparable" + (f" ({self.why_not})" if self.not_comparable else ""))


def headlines(report: ParityReport) -> list[tuple[str, str, Headline, str]]:
    """(run A, run B, its headline, how counters were compared) per pair of runs."""
    found = []
    for run_a, run_b in _pairs(report):
        group = [c for c in report.comparisons if (c.run_a, c.run_b) == (run_a, run_b)]
        found.append((run_a, run_b, Headline.of(group, report.counters_only), _counting(group)))
    return found


def render_text(report: ParityReport) -> str:
    lines = [f"{run_a} vs {run_b}: {headline.describe()}" + ("" if headline.whole_run else f"; {counting}")
             for run_a, run_b, headline, counting in headlines(report)]
    checks = report.logit_checks
    if checks:
        worst = max(checks, key=lambda c: c.agreement.max_abs_diff)
        lines.append(f"logits along common outputs: {sum(c.ok for c in checks)}/{len(checks)} within tolerance; "
                     f"worst {worst.agreement.max_abs_diff:.3g} ({worst.run_a} vs {worst.run_b}, {worst.prompt_id}), "
                     f"top-1 agreement {min(c.agreement.top1_agreement for c in checks):.3f} at worst")
        for tolerance in sorted({c.tolerance for c in checks}, key=lambda t: t.reason):
            group = [c.agreement for c in checks if c.tolerance == tolerance]
            lines.append(f"  {len(group)} checks against {tolerance.describe()}: mean KL "
                         f"{max(g.kl_mean for g in group):.3g}, p99 KL {max(g.kl_p99 for g in group):.3g}, "
                         f"max KL {max(g.kl_max for g in group):.3g}, RMS dp {max(g.rms_delta_p for g in group):.3g} "
                         "(worst prompt each)")
    lines += [("  " if c.ok else "  FAILED ") + c.describe() for c in report.controls]
    lines += [f"NOTE {line}" for line in explained(report)]
    lines += [f"FAIL {line}" for line in report.failures()]
    lines += [f"in plain words: {line}" for line in report.plainly()]
    lines.append(report.verdict())
    return "\n".join(lines)


def render_markdown(report: ParityReport) -> str:
    only = " (counters only)" if report.counters_only else ""
    lines = ["## crossrt parity: " + ("passed" if report.ok else "FAILED") + only, "", report.verdict(), "",
             "| run A | run B | prompts | identical | explained (by cause) | failed | not comparable | "
             "first divergences | counters |", "|---|---|---|---|---|---|---|---|---|"]
    for run_a, run_b, headline, counting in headlines(report):
        group = [c for c in report.comparisons if (c.run_a, c.run_b) == (run_a, run_b)]
        parted = ", ".join(f"{c.prompt_id}@{c.divergence}" for c in group if c.divergence is not None) or "none"
        causes = headline.by_cause()
        lines.append(f"| {run_a} | {run_b} | {headline.prompts} | {headline.identical} | {headline.explained_prompts}"
                     f"{f' ({causes})' if causes else ''} | {headline.failed} | {headline.not_comparable}"
                     f"{f' ({headline.why_not})' if headline.not_comparable else ''} | {parted} | {counting} |")
    if report.logit_checks:
        lines += ["", "| run A | run B | prompt | max abs logit diff | same top-1 | top-5 overlap | KL mean | "
                  "KL median | KL p99 | KL max | RMS dp | tolerance |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {c.run_a} | {c.run_b} | {c.prompt_id} | {c.agreement.max_abs_diff:.3g} | "
                  f"{c.agreement.top1_agreement:.3f} | {c.agreement.top5_overlap:.3f} | {c.agreement.kl_mean:.3g} | "
                  f"{c.agreement.kl_median:.3g} | {c.agreement.kl_p99:.3g} | {c.agreement.kl_max:.3g} | "
                  f"{c.agreement.rms_delta_p:.3g} | {c.tolerance.describe()} |" for c in report.logit_checks]
    if report.controls:
        lines += ["", "| check | scoring A | scoring B | prompts | rows | max abs logit diff | KL mean | KL p99 | "
                  "same top-1 | bounds | power | verdict |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {c.kind} | {c.scorings[0]} | {c.scorings[1]} | {c.prompts} | {c.measured.positions} | "
                  f"{c.measured.max_abs_diff:.3g} | {c.measured.kl_mean:.3g} | {c.measured.kl_p99:.3g} | "
                  f"{c.measured.top1_agreement:.3f} | {c.bounds.describe()} | "
                  f"{c.power.describe() if c.power else ''} | {'ok' if c.ok else 'FAILED'} |" for c in report.controls
                  if c.measured is not None]
        lines += [f"- {c.describe()}: {'ok' if c.ok else 'FAILED'}" for c in report.controls if c.measured is None]
    notes = explained(report)
    if notes:
        lines += ["", "### Explained (numerics, not failures)", ""] + [f"- {line}" for line in notes]
    failures = report.failures()
    if failures:
        lines += ["", "### Failures", ""] + [f"- {line}" for line in failures]
    return "\n".join(lines) + "\n"


def render_junit(report: ParityReport) -> str:
    suite = ElementTree.Element("testsuite", name="crossrt-parity")
    cases = [(f"{c.run_a} vs {c.run_b}", c.prompt_id, c.ok, "; ".join(c.problems)) for c in report.comparisons]
    cases += [(f"logits {c.run_a} vs {c.run_b}", c.prompt_id, c.ok, "; ".join(c.problems))
              for c in report.logit_checks]
    cases += [(f"{c.kind} {' vs '.join(c.scorings)}", "logits", c.ok, "; ".join(c.problems)) for c in report.controls]
    cases += [(n.run, "run", False, f"{n.what}: {n.reason}") for n in report.not_run]
    cases += [(f"{pair.run_a} vs {pair.run_b}", "compared", False, pair.describe()) for pair in report.incomparable()]
    for classname, name, ok, message in cases:
        case = ElementTree.SubElement(suite, "testcase", classname=classname, name=name)
        if not ok:
            ElementTree.SubElement(case, "failure", message=message).text = message
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(sum(1 for case in cases if not case[2])))
    return ElementTree.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def logit_checks(comparisons: Sequence[PromptParity], scored: dict[tuple[str, str], np.ndarray],
                 tolerance: Callable[[str, str], Tolerance]) -> tuple[LogitCheck, ...]:
    """LogitChecks for the comparisons whose both runs were scored: scored maps
    (run label, prompt id) -> logits rows along that run's output; tolerance(run_a, run_b)
    gives the bounds for that pair of runs (crossrt/compare/tolerance.py)."""
    checks = []
    analysed: dict[int, ScoredRows] = {}  # runs one scoring serves share their rows (verification.scored_with_path_checks): analysed once
    rows = {key: analysed.setdefault(id(logits), ScoredRows(logits)) for key, logits in scored.items()}
    for comparison in comparisons:
        a, b = rows.get((comparison.run_a, comparison.prompt_id)), rows.get((comparison.run_b, comparison.prompt_id))
        if a is None or b is None:
            continue
        # Both rows along the prompt's one reference sequence (crossrt/compare/verification.scored_with_path_checks).
        checks.append(LogitCheck(comparison.prompt_id, comparison.run_a, comparison.run_b,
                                 agreement(a, b), tolerance(comparison.run_a, comparison.run_b)))
    return tuple(checks)
