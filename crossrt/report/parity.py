"""The parity of a report's runs, on its page (`crossrt report` with two or more records, and
`crossrt parity --html`; docs/report.md).

The verdicts are crossrt/compare/parity.py's and crossrt/compare/diagnosis.py's, computed as `crossrt parity`
computes them; this module only shows them: the closing verdict as the page's banner
(verdict_banner), per pair of runs the headline (identical, explained by cause, failed; pairs
identical on every prompt in one line), then one line per cause of split with its count and
prompts, and folded under it one section per split with everything a person needs to tell a
near-tie from a bug without reading JSON: the text up to the split, the two emitted tokens decoded, the
gap each side's pass put between them and the pass shapes, the verdict (flip against threshold),
the candidates each pass recorded near its choice, and the two continuations side by side.

A split is shown once, however many comparisons hold it (a run's lossless failure is a link of
each of its cross-run comparisons too), and names them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from crossrt.compare.splits import Side, Split, first_divergence, pass_shape
from crossrt.speculative.numerics import CLOSE_MAX, CLOSE_WINDOW
from crossrt.compare.parity import GREEDY_ONLY, OWN_BASELINE, PromptParity
from crossrt.compare.parity_report import ParityReport, headlines
from crossrt.compare.plain import cause_plainly, power_plainly
from crossrt.compare.replay import Replayer
from crossrt.compare.tau_gap import PairGap
from crossrt.report.gaps import run_gaps
from crossrt.report.groups import Grouping, group_runs, grouped_comparisons
from crossrt.report.layout import report_sections
from crossrt.report.page import Banner, Section, Table, page, to_html
from crossrt.report.runs import ReportRun, report_run
from crossrt.report.steps import Vocab, load_vocab, token_texts
from crossrt.run.isolation import RESCORING, call_safely
from crossrt.records.schema import PassView, PromptResult, RunRecord

CONTEXT_TOKENS = 12  # tokens of text shown before a split
CONTINUATION_TOKENS = 16  # tokens of each side shown from a split on
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\"}


@dataclass(frozen=True)
class Sequences:
    """What a split parts: the tokens both sides share before it, each side's tokens from it on,
    and the pass views that chose them (None where the run recorded none)."""

    prefix: tuple[int, ...]
    sides: tuple[tuple[str, tuple[int, ...]], ...]  # (side, its tokens from the split on)
    views: tuple[Optional[PassView], ...]  # per side, the view whose row index chose its token


@dataclass(frozen=True)
class ShownSplit:
    split: Split
    record: Optional[RunRecord]  # whose vocabulary decodes the tokens (None: a saved baseline not on the page)
    sequences: Optional[Sequences]  # None: the split has no token sequences (a tokenization note)
    comparisons: tuple[str, ...]  # "A vs B" for every comparison that holds the split
    failed: bool


def visible(text: str) -> str:
    """Token text on one line: line breaks, tabs and control characters as escapes."""
    return "".join(_ESCAPES.get(c, f"\\x{ord(c):02x}" if ord(c) < 32 or c in "\x7f\ufffe\uffff" else c)
                   for c in text)


def _results(runs: dict[str, RunRecord], label: str, prompt_id: str) -> Optional[PromptResult]:
    record = runs.get(label)
    return next((r for r in record.results if r.prompt_id == prompt_id), None) if record else None


def _lossless(label: str, result: PromptResult, index: int) -> Sequences:
    out, base = result.output_ids, result.baseline_ids
    return Sequences(tuple(result.prompt_ids) + tuple(out[:index]),
                     ((f"{label} speculative", tuple(out[index:])), (f"{label} baseline", tuple(base[index:]))),
                     (result.output_view, result.baseline_view))


def _placed(comparison: PromptParity, runs: dict[str, RunRecord]) -> list[tuple[RunRecord, Optional[Sequences]]]:
    """Per split of the comparison, in order, the record that decodes it and what it parts. The
    splits come as crossrt/compare/parity.py makes them: a lossless check holds the run's own lossless
    failure then its template split; two runs whose outputs part hold the links output A -
    baseline A - baseline B - output B that split; two whose outputs agree, their counters'."""
    a, b = comparison.run_a, comparison.run_b
    result_a, record_a = _results(runs, a, comparison.prompt_id), runs.get(a)
    if result_a is None:
        return []
    placed = []
    if b == OWN_BASELINE:
        if result_a.ok and result_a.lossless is False:
            placed.append((record_a, _lossless(a, result_a, first_divergence(result_a.output_ids,
                                                                             result_a.baseline_ids))))
        if result_a.template_ids is not None:
            at = first_divergence(result_a.template_ids, result_a.prompt_ids) or 0
            placed.append((record_a, Sequences(tuple(result_a.prompt_ids[:at]), (
                (f"{a}'s own rendering", tuple(result_a.template_ids[at:])),
                ("crossrt's rendering", tuple(result_a.prompt_ids[at:]))), (None, None))))
        return placed
    result_b = _results(runs, b, comparison.prompt_id)
    if result_b is None:
        return []
    if comparison.divergence is None:
        index = comparison.splits[0].index if comparison.splits else None
        prefix = tuple(result_a.prompt_ids) + tuple(result_a.output_ids[:index or 0])
        return [(record_a, Sequences(prefix, (), ()) if index is not None else None)] * len(comparison.splits)
    for label, result in ((a, result_a), (b, result_b)):
        if result.lossless is False:
            placed.append((runs[label], _lossless(label, result, first_divergence(result.output_ids,
                                                                                  result.baseline_ids))))
        at = first_divergence(result_a.baseline_ids, result_b.baseline_ids) if label == a else None
        if at is not None:
            placed.append((record_a, Sequences(
                tuple(result_a.prompt_ids) + tuple(result_a.baseline_ids[:at]),
                ((f"{a} baseline", tuple(result_a.baseline_ids[at:])),
                 (f"{b} baseline", tuple(result_b.baseline_ids[at:]))),
                (result_a.baseline_view, result_b.baseline_view))))
    return placed


def shown_splits(report: ParityReport, runs: Sequence[tuple[str, RunRecord]], strict: bool = False) -> list[ShownSplit]:
    """Every split of the report once, with the comparisons that hold it. A split fails unless it
    is numerics (a near-tie), and numerics fail too under --strict, as crossrt parity counts."""
    by_label = dict(runs)
    # One split seen again with the same tokens around it (a lossless failure in each of its run's
    # comparisons) is one finding; the same verdict on other tokens is another.
    found: dict[tuple[Split, Optional[Sequences]], ShownSplit] = {}
    for comparison in report.comparisons:
        placed = _placed(comparison, by_label)
        if len(placed) != len(comparison.splits):  # splits this module cannot place: shown without their text
            placed = [(by_label.get(comparison.run_b, by_label.get(comparison.run_a)), None)] * len(comparison.splits)
        name = f"{comparison.run_a} vs {comparison.run_b}"
        for split, (record, sequences) in zip(comparison.splits, placed):
            known = found.get((split, sequences))
            if known is None:
                found[split, sequences] = ShownSplit(split, record, sequences, (name,), strict or not split.numerics)
            elif name not in known.comparisons:
                found[split, sequences] = ShownSplit(split, known.record, known.sequences,
                                                     known.comparisons + (name,), known.failed)
    return list(found.values())


def _texts(vocab: Optional[Vocab], ids: Sequence[int]) -> list[str]:
    return token_texts(vocab, ids) if vocab is not None else [f"[{i}]" for i in ids]


def _token(vocab: Optional[Vocab], token: int) -> str:
    return f'{token} "{visible(_texts(vocab, [token])[0])}"' if vocab is not None else str(token)


def _verdict(shown: ShownSplit) -> Table:
    split, status = shown.split, "FAIL" if shown.failed else "NOTE"
    verdict = split.verdict
    if verdict is None:
        row = (f"{status}: {split.kind}", split.detail, "-", "", "-")
    else:
        bound = "at least " if any(gap.at_least for gap in verdict.gaps) else ""
        word = "near-tie: numerics" if verdict.near else "beyond numerics"
        row = (f"{status}: {split.kind} ({word})", verdict.threshold_reason, f"{bound}{verdict.flip:.3g}",
               "<=" if verdict.near else ">", f"{verdict.threshold:g}")
    return Table(("verdict", "threshold for", "flip (logits)", "", "threshold"), (row,), 2,
                 "verdict: the two gaps summed (the flip) against the near-tie threshold of what is compared")


def _sides(vocab: Optional[Vocab], sides: Sequence[Side]) -> Table:
    rows = tuple((side.label, _token(vocab, side.token), pass_shape(side.pass_tokens) if side.pass_tokens else "-",
                  _token(vocab, side.other),
                  side.gap.describe() if side.gap is not None else "no pass recorded or re-scored") for side in sides)
    return Table(("side", "emitted", "in", "the other side's token", "its place in this side's pass"), rows, 5,
                 "the two emitted tokens, and how far each side's pass put the other's below its own")


def _candidates(vocab: Optional[Vocab], split: Split, sequences: Sequences) -> Optional[Table]:
    """The candidates each side's recorded pass held near its choice at the split."""
    rows, index = [], split.index
    others = [tokens[0] if tokens else None for _, tokens in reversed(sequences.sides)]
    for (label, tokens), view, other in zip(sequences.sides, sequences.views, others):
        if view is None or not tokens or index is None or index >= len(view.margins):
            continue
        if view.close_ids is not None:
            near = list(zip(view.close_ids[index], view.close_gaps[index]))
        else:  # records written before close candidates: the runner-up alone
            near = [(view.runner_up[index], view.margins[index])]
        for rank, (token, gap) in enumerate([(tokens[0], 0.0), *near], start=1):
            role = "emitted" if rank == 1 else "the other side's token" if token == other else ""
            rows.append((label, _token(vocab, token), role, str(rank), f"{gap:.4g}"))
        if other is not None and other != tokens[0] and other not in [t for t, _ in near]:
            rows.append((label, _token(vocab, other), "the other side's token", "-",
                         f"more than {CLOSE_WINDOW:g} (outside the recorded window)"))
    if not rows:
        return None
    return Table(("pass of", "candidate", "", "rank", "logits below the choice"), tuple(rows), 3,
                 f"candidates near each side's choice, as its pass recorded them (within {CLOSE_WINDOW:g} logits, "
                 f"at most {CLOSE_MAX})")


def _continuations(vocab: Optional[Vocab], sequences: Sequences) -> Table:
    texts = [_texts(vocab, sequences.prefix + tokens)[len(sequences.prefix):] for _, tokens in sequences.sides]
    start = len(sequences.prefix)
    longest = min(CONTINUATION_TOKENS, max(len(tokens) for _, tokens in sequences.sides))
    rows = []
    for offset in range(longest):
        cells = [f'{tokens[offset]} "{visible(text[offset])}"' if offset < len(tokens) else "(ended)"
                 for (_, tokens), text in zip(sequences.sides, texts)]
        rows.append((str(offset), *cells))
    joined = (("text", *(visible("".join(text[:CONTINUATION_TOKENS])) for text in texts)),)
    return Table(("from the split", *(label for label, _ in sequences.sides)), tuple(rows) + joined,
                 1 + len(sequences.sides),
                 f"the two continuations side by side from the split on (first {CONTINUATION_TOKENS} tokens; "
                 f"sequence position {start} onward)")


def split_section(number: int, shown: ShownSplit) -> Section:
    split, sequences = shown.split, shown.sequences
    vocab, problem = load_vocab(shown.record) if shown.record else (None, "its runs are not on this page")
    status = "FAIL" if shown.failed else "NOTE"
    where = f" at token {split.index}" if split.index is not None else ""
    tables = [_verdict(shown)]
    if sequences is not None:
        before = _texts(vocab, sequences.prefix)[-CONTEXT_TOKENS:]
        tables.append(Table(("text before the split", "its last tokens"),
                            ((visible("".join(before)), " ".join(str(t) for t in sequences.prefix[-CONTEXT_TOKENS:])),),
                            2, f"the last {CONTEXT_TOKENS} tokens both sides share (prompt and output)"))
    if split.sides:
        tables.append(_sides(vocab, split.sides))
    if sequences is not None:
        candidates = _candidates(vocab, split, sequences)
        if candidates is not None:
            tables.append(candidates)
        if sequences.sides:
            tables.append(_continuations(vocab, sequences))
    notes = [f"in: {', '.join(shown.comparisons)}"]
    if vocab is None:
        notes.append(f"no token text: {problem}")
    if sequences is not None and sequences.sides and not any(sequences.views):
        notes.append("no pass views in these records (native runs): the gaps above come from a driven twin or a "
                     "re-score, and no candidates were recorded")
    return Section(f"split-{number}", f"{status} split {number}: {split.prompt_id}, {split.kind}{where}",
                   f"{status}: {split.kind}: {split.detail}", None, tuple(tables), tuple(notes),
                   mark="fail" if shown.failed else "note")


def verdict_banner(report: ParityReport, grouping: Optional[Grouping] = None) -> Banner:
    """parity's closing line, as `crossrt parity` prints it, and its prompt comparisons counted;
    grouping: which runs a report compared, where it left some out. With no greedy run there is
    no verdict: the banner says nothing was judged, neither OK nor FAILED."""
    said = [grouping.describe()] if grouping and not grouping.whole else []
    if not report.comparisons:
        lossy = grouping and not grouping.groups and len(grouping.lossy) == len(grouping.alone)
        return Banner(None, "parity: nothing judged" + (f": every run is lossy ({GREEDY_ONLY})" if lossy else ""),
                      "; ".join(said))
    counted = [headline for _, _, headline, _ in headlines(report)]
    said.append(f"{len(counted)} comparison{'s' * (len(counted) != 1)} of runs (each run's own lossless check "
                f"among them), {sum(h.prompts for h in counted)} prompts compared: "
                f"{sum(h.identical for h in counted)} identical, {sum(h.explained_prompts for h in counted)} "
                f"explained, {sum(h.failed for h in counted)} failed, {sum(h.not_comparable for h in counted)} "
                "not comparable")
    if not report.logit_checks:  # the report re-scores no outputs: say so rather than let OK stand for it
        said.append("logits not compared here (`crossrt parity` re-scores the outputs to compare them)")
    power = report.weakest_power()
    if power:
        said.append(f"in plain words, {power_plainly(power)}")
    return Banner(report.ok, report.verdict(), "; ".join(said))


def _cause_groups(shown: Sequence[ShownSplit]) -> list[Section]:
    """The splits by cause (FAIL or NOTE and the split's kind), findings first, then the most
    common: one line each with the count and the prompts, every split's evidence folded under it."""
    groups: dict[tuple[bool, str], list[tuple[int, ShownSplit]]] = {}
    for number, split in enumerate(shown, start=1):
        groups.setdefault((split.failed, split.split.kind), []).append((number, split))
    ordered = sorted(groups.items(), key=lambda item: (not item[0][0], -len(item[1]), item[0][1]))
    sections = []
    for n, ((failed, kind), members) in enumerate(ordered, start=1):
        prompts = ", ".join(dict.fromkeys(s.split.prompt_id for _, s in members))
        status = "FAIL" if failed else "NOTE"
        plainly = cause_plainly(kind)
        sections.append(Section(f"cause-{n}", f"{status} {kind}: {len(members)} split{'s' * (len(members) != 1)} "
                                f"({prompts})", f"In plain words: {plainly}." if plainly else "", None, (), (),
                                mark="fail" if failed else "note", fold=True,
                                parts=tuple(split_section(number, s) for number, s in members)))
    return sections


def parity_section(runs: Sequence[tuple[str, RunRecord]], report: ParityReport, rescored: bool,
                   grouping: Optional[Grouping] = None, strict: bool = False) -> Section:
    """The verdict per pair of runs (pairs identical on every prompt in one line), which runs were
    compared where a report left some out (grouping), the causes found in plain words, then every
    split once, grouped by cause, and the failures no split shows."""
    shown = shown_splits(report, runs, strict)
    counted = headlines(report)
    identical = [f"{run_a} vs {run_b}" for run_a, run_b, h, _ in counted if h.identical == h.prompts]
    verdicts = tuple((run_a, run_b, counting, str(h.prompts), str(h.identical),
                      f"{h.explained_prompts}" + (f" ({h.by_cause()})" if h.explained else ""), str(h.failed),
                      f"{h.not_comparable}" + (f" ({h.why_not})" if h.not_comparable else ""))
                     for run_a, run_b, h, counting in counted if h.identical != h.prompts)
    tables = (Table(("run A", "run B", "counters", "prompts", "identical", "explained (by cause)", "failed",
                     "not comparable"),
                    verdicts, 3, "verdicts per pair of runs (run B `its baseline`: the run's own lossless check; "
                    "a prompt with several causes counts once, under them joined by +)"),
              ) if verdicts else ()
    tables += (grouping.table(),) if grouping and not grouping.whole else ()
    split_failures = {(c.run_a, c.run_b, c.prompt_id) for c in report.comparisons if c.splits}
    unshown = [f"FAIL {c.run_a} vs {c.run_b}, {c.prompt_id}: {'; '.join(c.problems)}"
               for c in report.comparisons if not c.ok and (c.run_a, c.run_b, c.prompt_id) not in split_failures]
    unshown += [f"FAIL {line}" for line in report.failures()[sum(not c.ok for c in report.comparisons):]]
    said = [f"identical on every prompt: {'; '.join(identical)}"] if identical else []
    said += [f"in plain words: {line}" for line in report.plainly()]
    how = ("Native runs' splits without a driven twin were re-scored in-process in their schedule's pass shapes "
           "(crossrt/compare/replay.py)." if rescored else
           "Re-scoring was off (--no-rescore): a native run's split without a driven twin stays unexplained.")
    return Section("parity", "Parity: where the runs part, and why",
                   "Each greedy run against its own plain greedy baseline, then every pair of comparable runs, "
                   "prompt by prompt, as `crossrt parity` compares them (docs/parity.md). A split is numerics (NOTE) "
                   "when the two emitted tokens lie within the near-tie threshold of what is compared in both sides' passes; "
                   f"anything else is a finding (FAIL). {how} Below, one line per cause; open it for each split's "
                   "evidence.", None, tables,
                   (*said, *unshown, *(() if shown else ("no split: the runs agree token for token",))),
                   parts=tuple(_cause_groups(shown)))


def report_parity(runs: Sequence[ReportRun], rescore: bool = True) -> Optional[tuple[Banner, Section]]:
    """`crossrt report`'s verdict and parity section over its runs, labelled as the page labels
    them; None for a single run (its lossless failures are in the runs section's notes). Splits
    are re-scored where crossrt/run/isolation.py places RESCORING (a process of its own)."""
    if len(runs) < 2:
        return None
    labelled = [(run.label, run.record) for run in runs]
    grouping = group_runs(labelled)
    comparisons = (call_safely(RESCORING, _rescored, labelled, grouping) if rescore
                   else grouped_comparisons(labelled, grouping))
    report = ParityReport(tuple(comparisons))
    return verdict_banner(report, grouping), parity_section(labelled, report, rescore, grouping)


def _rescored(labelled: Sequence[tuple[str, RunRecord]], grouping: Grouping) -> list[PromptParity]:
    with Replayer() as replay:
        return grouped_comparisons(labelled, grouping, replay)


def parity_html(runs: Sequence[tuple[str, RunRecord]], report: ParityReport, paths: Sequence[Optional[Path]],
                rescored: bool, strict: bool, title: str = "crossrt parity", gaps: Sequence[PairGap] = ()) -> str:
    """`crossrt parity --html`: the report page of the runs parity compared, with its verdict and
    the tau gaps it printed (crossrt/compare/tau_gap.py's pair_gaps: one build for both), drawn."""
    report_runs = [report_run(label, path, record, index)
                   for index, ((label, record), path) in enumerate(zip(runs, paths, strict=True))]
    parity = (verdict_banner(report), parity_section(runs, report, rescored, strict=strict))
    return to_html(page(title, report_sections(report_runs, parity, run_gaps(report_runs, gaps))))
