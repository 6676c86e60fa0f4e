"""Which of a report's runs its parity compares (docs/report.md). Any folder of records may hold
runs that `crossrt parity` would never be asked to compare: other prompts, another token budget,
another vocabulary, a lossy acceptance rule. Comparing those prompt by prompt fails on what was
never the same question, so the report judges each greedy run against its own baseline, and runs
against each other only within a group of comparable runs: token ids of one vocabulary (what
parity itself requires), the same prompts (ids, and texts where both records hold their digests)
and the same max new tokens. A run in no group of two is not compared with another, and the page
says why; a lossy run is compared with nothing, as parity compares greedy runs only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from crossrt.compare.diagnosis import Explainer, twins_of
from crossrt.compare.parity import GREEDY_ONLY, PromptParity, compare_records, lossless_checks, lossy_rule
from crossrt.records.schema import RunRecord
from crossrt.report.page import Table

COMPARABLE = "the same vocabulary, prompts and max new tokens"
SHOWN_DIFFERENCES = 3  # other runs named in why a run is compared with none


def difference(a: RunRecord, b: RunRecord) -> str:
    """What keeps two greedy runs from being compared prompt by prompt, "" when nothing does. An
    import holds no prompts to compare, and a setting a record does not state differs from none."""
    found = []
    if a.pair.target and b.pair.target and a.pair.target.vocab_fingerprint != b.pair.target.vocab_fingerprint:
        found.append("another vocabulary")
    if not a.imported and not b.imported:
        texts_a = {r.prompt_id: r.prompt_sha256 for r in a.results}
        texts_b = {r.prompt_id: r.prompt_sha256 for r in b.results}
        if texts_a.keys() != texts_b.keys():
            found.append(f"other prompts ({len(texts_a)} vs {len(texts_b)}, {len(texts_a.keys() & texts_b.keys())} "
                         "in common)")
        else:
            other = [key for key, text in texts_a.items() if None not in (text, texts_b[key]) and text != texts_b[key]]
            if other:
                found.append(f"other prompt texts under the same ids ({', '.join(other[:SHOWN_DIFFERENCES])}"
                             + (", ..." if len(other) > SHOWN_DIFFERENCES else "") + ")")
    budgets = (a.params.max_new_tokens, b.params.max_new_tokens)
    if None not in budgets and budgets[0] != budgets[1]:
        found.append(f"max new tokens {budgets[0]} vs {budgets[1]}")
    return ", ".join(found)


@dataclass(frozen=True)
class Grouping:
    """The runs' places: groups of comparable runs (two or more each, compared with each other),
    and the runs compared with no other, with why (lossy runs among them)."""

    groups: tuple[tuple[str, ...], ...]
    alone: tuple[tuple[str, str], ...]  # (label, why it is compared with no other run)
    lossy: frozenset[str]

    @property
    def whole(self) -> bool:
        """Every run compared with every other: the page reads as `crossrt parity` of the runs."""
        return not self.alone and len(self.groups) <= 1

    def describe(self) -> str:
        """The grouping in one sentence, for the banner; "" where every run is in one group."""
        if self.whole:
            return ""
        lossy = f", {len(self.lossy)} of them lossy" if self.lossy else ""
        groups = f"{len(self.groups)} group{'s' * (len(self.groups) != 1)}"
        compared = (f"{sum(map(len, self.groups))} runs compared in {groups} of {COMPARABLE}" if self.groups
                    else f"no two greedy runs have {COMPARABLE}")
        return f"{compared}; {len(self.alone)} run(s) not compared with another{lossy} (the parity section says why)"

    def table(self) -> Table:
        rows = tuple((label, f"group {number}", ", ".join(other for other in group if other != label))
                     for number, group in enumerate(self.groups, start=1) for label in group)
        rows += tuple((label, "not compared", why) for label, why in self.alone)
        return Table(("run", "parity", "compared with, or why not"), rows, 3,
                     f"which runs were compared with which: greedy runs with {COMPARABLE} (every greedy run is also "
                     "checked against its own plain greedy baseline)")


def _why_alone(label: str, record: RunRecord, others: Sequence[tuple[str, RunRecord]]) -> str:
    if len(others) < 2:
        return "the only greedy run"
    named = [f"{other}: {difference(record, other_record)}" for other, other_record in others
             if other != label][:SHOWN_DIFFERENCES]
    more = len(others) - 1 - len(named)
    return f"no other run has {COMPARABLE}: " + "; ".join(named) + (f"; {more} more run(s) differ too" if more else "")


def group_runs(runs: Sequence[tuple[str, RunRecord]]) -> Grouping:
    """Each greedy run joins the first group every member of which it is comparable with, in the
    order given; runs left alone, and lossy runs, are named with why."""
    lossy = [(label, f"lossy: ran {lossy_rule(record)}; {GREEDY_ONLY}") for label, record in runs
             if record.params.lossy]
    greedy = [(label, record) for label, record in runs if not record.params.lossy]
    found: list[list[tuple[str, RunRecord]]] = []
    for label, record in greedy:
        group = next((group for group in found if not any(difference(record, other) for _, other in group)), None)
        if group is None:
            found.append([(label, record)])
        else:
            group.append((label, record))
    alone = [(label, _why_alone(label, record, greedy)) for group in found if len(group) == 1
             for label, record in group]
    return Grouping(tuple(tuple(label for label, _ in group) for group in found if len(group) > 1),
                    tuple(alone + lossy), frozenset(label for label, _ in lossy))


def grouped_comparisons(runs: Sequence[tuple[str, RunRecord]], grouping: Grouping,
                        replay=None) -> list[PromptParity]:
    """As compare_all, within the grouping: every greedy run against its own baseline, then every
    pair of runs of each group, every prompt. Twins lend pass views across groups (they share ids)."""
    greedy = [(label, record) for label, record in runs if label not in grouping.lossy]
    by_label = dict(greedy)
    explainer = Explainer(twins_of(greedy), replay)
    checks = [check for label, record in greedy for check in lossless_checks(label, record, explainer)]
    for group in grouping.groups:
        checks += [comparison for i, label_a in enumerate(group) for label_b in group[i + 1:]
                   for comparison in compare_records(by_label[label_a], by_label[label_b], 0.0, (label_a, label_b),
                                                     explainer)]
    return checks
