"""The commands that compare runs: `crossrt parity` (and `crossrt diff`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import click

from crossrt.cli.common import (PROMPTS_HELP, CommaChoice, distinct_records, refuse_inputs_as_outputs, resume_command,
                                user_errors)
from crossrt.cli.options import runtime_options
from crossrt.cli.prompt_options import chat_options, fed_prompts, first_answers
from crossrt.compare.diff import diff_records, record_splits, render_diff, render_record_splits
from crossrt.errors import ComparisonError
from crossrt.records.journal import write_atomically
from crossrt.inputs.pairs import resolve_pair, run_k
from crossrt.compare.parity import labelled
from crossrt.compare.parity_report import ParityReport, render_junit, render_markdown, render_text
from crossrt.compare.control import not_one_function
from crossrt.compare.parity_run import Checks, Matrix, compare_safely, run_matrix, verdicts_and_gaps
from crossrt.inputs.prompts import load_prompts
from crossrt.records.record_json import load_record
from crossrt.report.parity import parity_html
from crossrt.run.isolation import kept
from crossrt.run.runtime import runtime_names, usable_runtimes


@click.command()
@user_errors
@click.argument("records", nargs=-1, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--pair", help="Run the matrix on this pair (manifest path or name; default: tiny) "
              "instead of comparing RECORDS.")
@click.option("--runtimes", type=CommaChoice((*runtime_names(), "usable")), default="llama-cpp", show_default=True,
              help="Comma-separated runtimes to run; `usable`: every runtime usable here (`crossrt runtimes`).")
@click.option("--modes", type=CommaChoice(("driven", "native")), default="driven,native", show_default=True,
              help="Comma-separated modes; a runtime runs the modes it has (others are skipped, not failed).")
@click.option("--prompts", "prompt_source", default="builtin", show_default=True,
              help=PROMPTS_HELP)
@click.option("--k", type=click.IntRange(min=1), help="Draft length. Default: the pair's [defaults] k, else 4.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--out-dir", type=click.Path(path_type=Path, file_okay=False), default=Path("runs/parity"),
              show_default=True, help="Where the matrix's run records go.")
@click.option("--resume", is_flag=True, help="Continue an interrupted matrix: each cell's record in --out-dir "
              "keeps its finished prompts (the same settings only; other settings are refused, naming them).")
@click.option("--against", "baselines", multiple=True, type=click.Path(path_type=Path, dir_okay=False),
              help="Saved record(s) to compare the new runs with (same runtime, mode and k); repeatable.")
@click.option("--counter-tolerance", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Allowed relative difference of counters between runs with the same schedule.")
@click.option("--logit-tolerance", type=click.FloatRange(min=0),
              help="Allowed max absolute logit difference along common outputs. Default: chosen by what is "
              "compared (F32 weights and cache 1e-4; float weights with an F16 cache 1e-2; quantized weights: "
              "KL divergence and same-top-1 bounds instead; docs/parity.md).")
@click.option("--strict", is_flag=True, help="Fail on every divergence, also those explained as numerics "
              "(a near-tie a verification batch or another runtime breaks the other way).")
@click.option("--no-logits", is_flag=True, help="Skip re-scoring outputs to compare logits.")
@click.option("--no-float-control", is_flag=True, help="Compare logits against the constant ceilings only, "
              "without the float control (each target scored in F32, a quantized GGUF through its float twin, "
              "against the measured noise of one-token decodes): cheaper (~25 s less on Gemma 3 270M) and much "
              "weaker (quantized ceilings pass a wrong RoPE base); the verdict says so. docs/parity.md.")
@click.option("--counters-only", is_flag=True, help="Accept a pair of runs whose counters alone were compared: "
              "imported records (crossrt import) hold no token ids. Without it such a pair fails, since parity "
              "compared none of its outputs; with it the verdict says `counters only`. A pair whose counters "
              "were not compared either fails whatever the option.")
@click.option("--no-rescore", is_flag=True, help="Explain splits only from what the runs recorded: a native run's "
              "split with no driven twin stays unexplained (and fails) instead of being re-scored in-process in "
              "its schedule's pass shapes.")
@click.option("--no-tau-gap", is_flag=True, help="Leave out why tau differs between runs whose schedules differ "
              "(its oracle runs the pair once more in llama.cpp), as `crossrt report --no-tau-gap`.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run this many (runtime, mode) cells of the matrix at once, each in a process of its own "
              "with --threads threads (the first cell runs alone first: its tokenization feeds every "
              "other). Cells that run at once share the machine, so their timings do too. With 2 or more, "
              "the verdict's drafter checks and the tau gaps' oracle run beside its other checks.")
@click.option("--junit", type=click.Path(path_type=Path, dir_okay=False), help="Write a JUnit XML report.")
@click.option("--markdown", type=click.Path(path_type=Path, dir_okay=False), help="Write a markdown summary.")
@click.option("--html", type=click.Path(path_type=Path, dir_okay=False),
              help="Write crossrt report's page of the runs with every split explained (docs/report.md).")
@chat_options
@runtime_options
def parity(records: Sequence[Path], pair, runtimes, modes, prompt_source, k, max_new_tokens, out_dir, resume,
           baselines, counter_tolerance, logit_tolerance, strict, no_logits, no_float_control, counters_only, no_rescore,
           no_tau_gap, jobs, junit, markdown, html, chat, chat_template, template_vars, turn, first_answers_file,
           options) -> None:
    """Check that runs agree: same token ids over the full length, counters equal between runs
    that counted and drafted alike (schedule, k, rules, drafting), each run lossless, logits close along common outputs.

    \b
    Compare saved records:  crossrt parity runs/a.json runs/b.json
    Run a matrix:           crossrt parity --pair tiny --runtimes llama-cpp,transformers --modes driven,native
    Guard an upgrade:       crossrt parity --pair tiny --against runs/saved.json

    Each pair of runs is counted identical / explained / failed / not comparable, and the last
    line says what was compared (token ids, counters, logits). Exit code 0 only when everything
    agrees; 1 when something differs or could not run, or when a pair of runs compared nothing
    (imported records: no token ids; see --counters-only).
    """
    written = {option: path for option, path in (("--junit", junit), ("--markdown", markdown), ("--html", html))
               if path}
    refuse_inputs_as_outputs(written, [*records, *baselines])  # before anything runs
    not_run, skipped = [], []
    if records and resume:
        raise click.UsageError("--resume continues a matrix's runs (--pair ...); records given are compared "
                               "as they are")
    if records:
        distinct_records([*records, *baselines])
        runs = labelled([load_record(path) for path in records], [str(path) for path in records])
    else:
        resolved = resolve_pair(pair)
        answers = first_answers(turn, first_answers_file, out_dir, resolved, options, max_new_tokens)
        prompts, rendering, prompt_format = fed_prompts(load_prompts(prompt_source), resolved, chat,
                                                        chat_template, template_vars, answers)
        if "usable" in runtimes:
            usable = usable_runtimes()
            runtimes = tuple(dict.fromkeys(n for name in runtimes for n in (usable if name == "usable" else (name,))))
        matrix = Matrix(resolved, runtimes, modes, options, run_k(resolved, k), max_new_tokens, out_dir,
                        chat=rendering, prompt_format=prompt_format, resume=resume)
        try:
            records_run, not_run, skipped = run_matrix(
                matrix, prompts, jobs=jobs, on_run=lambda label: click.echo(f"running {label}", err=True),
                on_warning=lambda line: click.echo(f"warning: {line}", err=True))
        except KeyboardInterrupt:
            _interrupted(matrix, len(prompts))
        runs = labelled(records_run, [""] * len(records_run))
    # Explaining splits and re-scoring logits load runtimes: in a process of their own, where a crash
    # is a FAIL and the runs are still compared from what they recorded.
    checks = Checks(counter_tolerance=counter_tolerance, logit_tolerance=logit_tolerance, strict=strict,
                    rescore=not no_rescore, logits=not no_logits, control=not no_float_control, jobs=jobs)
    verdicts, crashed, gaps = verdicts_and_gaps(runs, [load_record(path) for path in baselines], checks,
                                                None if no_tau_gap else options.threads)
    if verdicts.passes:
        click.echo(f"explaining: {verdicts.passes} passes re-scored in {verdicts.explain_s:.1f} s", err=True)
    click.echo(verdicts.cost(runs), err=True)
    report = ParityReport(verdicts.comparisons, verdicts.logit_checks, tuple(not_run) + tuple(crashed), counters_only,
                          verdicts.controls, no_float_control and not no_logits)
    for line in skipped:
        click.echo(f"skipped {line}", err=True)
    if len(runs) < 2 and not baselines:
        click.echo("note: fewer than two runs, so nothing was compared across runs", err=True)
    text = render_text(report).splitlines()
    # Runs whose schedules differ: their tau gap in named parts, before the verdict (crossrt/compare/tau_gap.py).
    click.echo("\n".join(text[:-1] + [line for gap in gaps for line in gap.lines()] + text[-1:]))
    # Each file whole or not at all; a full disk or a read-only folder is a one-line error (user_errors).
    if junit:
        write_atomically(junit, render_junit(report).encode(), option="--junit")
    if markdown:
        write_atomically(markdown, render_markdown(report).encode(), option="--markdown")
    if html:
        page = parity_html(runs, report, list(records) or [None] * len(runs), not no_rescore, strict, gaps=gaps)
        write_atomically(html, page.encode(), option="--html")
    sys.exit(0 if report.ok else 1)


def _interrupted(matrix: Matrix, prompts: int) -> None:
    """A parity matrix interrupted while its runs ran: what each of its records holds, and how to go on."""
    paths = [path for name in matrix.runtimes for mode in matrix.modes
             if (path := matrix.record_path(name, mode)).exists()]
    said = [kept(path, prompts) for path in paths]
    lines = [f"  {line}" for line in said if line != "no prompt finished"]
    kept_lines = "\n".join(lines) if lines else "  no record was written yet"
    click.echo(f"\ninterrupted: the runs' records in {matrix.out_dir}:\n{kept_lines}\ncontinue with:\n  "
               f"{resume_command()}", err=True)
    sys.exit(130)


@click.command()
@user_errors
@click.argument("records", nargs=-1, required=True, type=click.Path(path_type=Path, dir_okay=False))
def diff(records: tuple[Path, ...]) -> None:
    """Where runs part, and why: one record's lossless failures, or two runs of the same pair.

    \b
    crossrt diff RUN.json          each prompt whose speculative output left the run's own
                                   greedy baseline: the position, both tokens decoded with the
                                   margin and pass shape the run saw, and the cause
    crossrt diff A.json B.json     per prompt: tokenization first, then each run against its
                                   own baseline, then where the two baselines part

    Verdicts name the cause: tokenization or template, batch-shape numerics inside a runtime
    (a verification batch and a one-token decode swap a near-tie), near-tie (cross-runtime
    numerics), or disagreement (a real difference: weights, conventions, or two runs that parity's
    float control finds are not one function). The last line is `crossrt parity`'s verdict on the
    same records; the exit code is parity's: 0 when it passes, 1 when it fails (for one record:
    1 when a split is not numerics).
    """
    if len(records) > 2:
        raise click.UsageError("give one record (its lossless failures) or two (where they part)")
    distinct_records(records)
    runs = labelled([load_record(path) for path in records], [str(path) for path in records])
    imported = [label for label, record in runs if record.imported]
    if imported:
        raise ComparisonError(f"{', '.join(imported)}: imported from another runtime's statistics, no token ids: "
                         "nothing to diff")
    if len(runs) == 1:
        (label, record), = runs
        splits = record_splits(label, record)
        click.echo(render_record_splits(label, splits, sum(r.ok for r in record.results)))
        sys.exit(0 if all(split.numerics for split in splits) else 1)
    (label_a, a), (label_b, b) = runs
    if a.pair.target.vocab_fingerprint != b.pair.target.vocab_fingerprint:
        raise ComparisonError("the two runs used different vocabularies: their token ids cannot be compared")
    # One verdict with parity's: its comparisons, logit checks and float control, in a process of its own.
    verdicts, crashed = compare_safely(runs, [])
    verdict = ParityReport(verdicts.comparisons, verdicts.logit_checks, tuple(crashed), controls=verdicts.controls)
    failed = [c.failure() for c in not_one_function(verdicts.controls)]
    click.echo(render_diff(diff_records(label_a, a, label_b, b, failed)))
    click.echo("\n".join([""] + [f"FAIL {line}" for line in verdict.failures()] + [verdict.verdict()]))
    sys.exit(0 if verdict.ok else 1)
