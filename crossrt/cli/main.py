"""The crossrt command line: thin click commands that parse, call and print."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import click

from crossrt.cli.common import (PROMPTS_HELP, distinct_records, echo_note, echo_table, format_option, resume_command,
                                user_errors)
from crossrt.cli.analysis import analyze, simulate_command
from crossrt.cli.cache import cache
from crossrt.cli.compare import diff, parity
from crossrt.cli.drafter import drafter
from crossrt.cli.imports import import_command
from crossrt.cli.options import executable_option, pair_options, runtime_options, strategy_options, with_executable
from crossrt.cli.prompt_options import chat_options, fed_prompts, first_answers
from crossrt.cli.report import report
from crossrt.cli.reproduce import reproduce
from crossrt.cli.sweep import sweep
from crossrt import progress
from crossrt.records.printable import SafeStream, one_line
from crossrt.run.baselines import BaselineStore
from crossrt.run.driver import RunRequest
from crossrt.run.isolation import RuntimeCrashed, kept, run_pair_safely
from crossrt.imports.importer import import_summary
from crossrt.speculative.loop import SCHEDULE, SCHEDULES
from crossrt.inputs.pairs import run_k, run_spec_type
from crossrt.inputs.prompts import load_prompts
from crossrt.run.record_name import default_record_path
from crossrt.run.rules import run_rules
from crossrt.run.runtime import SPEC_TYPES, availability, runtime_class, runtime_names, usable_runtimes
from crossrt.records.journal import journal_path
from crossrt.records.record_json import load_record
from crossrt.records.timing import timing_table
from crossrt.records.tables import format_table, record_notes, stored_baselines_note, summary_table

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="crossrt")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars (shown on stderr when it is a terminal).")
def main(quiet: bool) -> None:
    """Run one drafter/target pair through several runtimes, normalize their speculative
    decoding statistics into one schema, and compare them.

    \b
    Typical session:
      crossrt runtimes                          # what can run here
      crossrt run --pair tiny --k 4             # tiny pair, built-in prompts -> runs/*.json
      crossrt show runs/tiny-llama-cpp-k4.json  # tau, alpha, lossless, speed per category
    """
    progress.decide(quiet)
    # Everything a command prints, whatever string from outside it holds, goes through one filter.
    if not isinstance(sys.stdout, SafeStream):
        sys.stdout, sys.stderr = SafeStream(sys.stdout), SafeStream(sys.stderr)


@main.command()
@user_errors
@pair_options
@click.option("--runtime", "runtime_name", type=click.Choice(runtime_names()), default="llama-cpp",
              show_default=True, help="Runtime to run the pair on (see `crossrt runtimes`).")
@click.option("--mode", type=click.Choice(["driven", "native"]),
              help="driven: crossrt's shared loop over the runtime's forward pass; native: the "
              "runtime's own speculative decoding, its statistics normalized. Default: driven, where the "
              "runtime has no driven mode (llama-server, endpoint, ...) native.")
@click.option("--schedule", type=click.Choice(SCHEDULES), default=SCHEDULE, show_default=True,
              help="Driven mode: whose schedule the loop follows (when drafts start, how they are "
              "cut near the budget), so counts can match a native runtime's exactly.")
@click.option("--k", type=click.IntRange(min=1),
              help="Draft tokens per verification step (--k-policy online: the first step's; content: "
              "the k of a content type --content-k leaves out). Default: the pair's [defaults] k, else 4.")
@click.option("--spec-type", type=click.Choice(SPEC_TYPES),
              help="Native mode's drafting method: draft (a drafter model) or one some runtimes have "
              "(n-gram, MTP, DFlash...); driven mode drafts as --drafting says. Default: the pair's "
              "[defaults] spec_type, else draft.")
@click.option("--draft-n-min", type=click.IntRange(min=0),
              help="llama.cpp drafting rule: drafts shorter than this are dropped. Default: k.")
@click.option("--draft-p-min", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="llama.cpp drafting rule: stop drafting when the drafter's top probability "
              "falls below this.")
@click.option("--prompts", "prompt_source", default="builtin", show_default=True,
              help=PROMPTS_HELP)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False),
              help="Run record to write, after every prompt. Default: runs/<pair>-<runtime>-k<k>.json, with a "
              "part for each setting that differs from a plain run (mode, schedule, drafting, k policy, "
              "acceptance, draft rules), so runs of other settings never share a file.")
@click.option("--trace", is_flag=True, help="Also record per-token traces (driven mode, crossrt or hf-assisted "
              "schedule) in <out stem>.trace.npz beside the record, for `crossrt analyze`.")
@click.option("--resume", is_flag=True, help="Continue the record at --out, skipping finished prompts.")
@click.option("--overwrite", is_flag=True, help="Replace the record at --out.")
@strategy_options
@chat_options
@runtime_options
@executable_option
@click.option("--fresh-baseline", is_flag=True, help="Decode every plain baseline here and now (and replace its "
              "baseline store entry) instead of taking it from the store (crossrt cache ls).")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run each prompt N times, plain baseline then speculative, interleaved, every baseline timed "
              "here (never from the store): tok/s and speedup as mean ± std over the N, TTFT and TPOT "
              "percentiles (crossrt show). The repetitions must emit the first's tokens.")
def run(pair, runtime_name, mode, schedule, k, spec_type, draft_n_min, draft_p_min, prompt_source,
        max_new_tokens, out, trace, resume, overwrite, chat, chat_template, template_vars, turn, first_answers_file,
        options, executable, fresh_baseline, repeat, strategy) -> None:
    """Run a pair over prompts: plain greedy baseline and speculative decoding, per prompt.

    Writes a run record (JSON, schema in docs/schema.md) after every prompt, so an
    interrupted run keeps what finished; --resume continues it.
    """
    if resume and overwrite:  # one keeps the record's prompts, the other throws them away
        raise click.UsageError("--resume and --overwrite contradict each other: --resume continues the record at "
                               "--out, --overwrite replaces it; pass one")
    prompts = ()  # read below; an interrupt before then keeps nothing
    try:
        k = run_k(pair, k)
        mode = mode or ("driven" if "driven" in runtime_class(runtime_name).modes else "native")
        options = with_executable(options, runtime_name, executable)
        rules, warnings = run_rules(runtime_name, mode, schedule, max_new_tokens, k, draft_n_min, draft_p_min,
                                    run_spec_type(pair, spec_type))
        default_mode = runtime_class(runtime_name).modes[0]
        named_out = out or default_record_path(pair.name, runtime_name, mode, default_mode, k, schedule, strategy,
                                               rules)
        answers = first_answers(turn, first_answers_file, named_out.parent, pair, options, max_new_tokens)
        prompts, rendering, prompt_format = fed_prompts(load_prompts(prompt_source), pair, chat, chat_template,
                                                        template_vars, answers)
        out = named_out
        request = RunRequest(pair=pair, runtime=runtime_name, options=options, rules=rules,
                             max_new_tokens=max_new_tokens, out=out, mode=mode, schedule=schedule, resume=resume,
                             overwrite=overwrite, trace=trace, chat=rendering, prompt_format=prompt_format,
                             baselines=BaselineStore.default(refresh=fresh_baseline), strategy=strategy,
                             repeat=repeat)
        for warning in warnings:
            click.echo(f"warning: {warning}", err=True)
        with progress.bar(f"{runtime_name}, k {strategy.k_setting(k)}", len(prompts)) as bar:
            def advance(prompt, result):
                bar.set_postfix_str(one_line(f"{prompt.id}: {'skipped (done)' if result is None else result.status}"),
                                    refresh=False)
                bar.update(1)
            record = run_pair_safely(request, prompts, on_prompt=advance)
    except RuntimeCrashed as crash:
        raise click.ClickException(f"{crash}; continue with: {resume_command(out)}") from None
    except KeyboardInterrupt:
        if out is None:  # interrupted before a record was named: nothing to resume
            raise click.Abort() from None
        finished = kept(out, len(prompts)) if out.exists() or journal_path(out).exists() else "no prompt finished"
        if finished != "no prompt finished":
            click.echo(f"\ninterrupted: {finished}; continue with:\n  {resume_command(out)}", err=True)
        else:  # interrupted while loading, attaching or in the first prompt (--resume starts it anew)
            click.echo(f"\ninterrupted before any prompt finished: nothing is kept in {out} yet; continue with:\n"
                       f"  {resume_command(out)}", err=True)
        sys.exit(130)  # the shell's code for a run ended by SIGINT
    echo_table(summary_table([(out, record)]), "table")
    if repeat > 1:
        click.echo(f"\ntimings over {repeat} repetitions: mean and std, TTFT and TPOT percentiles")
        echo_table(timing_table([(out, record)]), "table")
    note = stored_baselines_note(record)
    if note:
        click.echo(note, err=True)
    for line in record_notes([record]):
        click.echo(line, err=True)
    if options.gpu_split and record.runtime.device == "cpu":
        click.echo(f"warning: --gpu-split {','.join(f'{share:g}' for share in options.gpu_split)} had no effect: the run "
                   "used no GPU (none found here, or --n-gpu-layers 0)", err=True)
    failed = [r for r in record.results if not r.ok]
    for result in failed:
        click.echo(f"failed: {result.prompt_id}: {result.error}", err=True)
    click.echo(f"record: {out}")
    if record.results and len(failed) == len(record.results):
        raise click.ClickException(f"all {len(failed)} prompts failed (first: {failed[0].error})")


@main.command()
@user_errors
@click.argument("records", nargs=-1, required=True, type=click.Path(path_type=Path))
@format_option
@click.option("--timings", is_flag=True, help="Only the timings table: per category, repetitions (run --repeat), "
              "tok/s and speedup mean and std over them, TTFT and TPOT p50 and p90 in ms.")
def show(records: Sequence[Path], output_format: str, timings: bool) -> None:
    """Summary table of run records: which run each row is of (file, pair, runtime, mode,
    schedule, drafting, k or the k policy, acceptance, lossy), then per category and overall the
    prompts, lossless prompts, steps, k used (drafted per step), tau (tokens per step, bonus
    included), alpha (accepted/drafted), tokens/s and speedup. Imported records (`crossrt import`)
    follow the table with what their source lacks. Runs made with `run --repeat N` are followed
    by their timings table (--timings: that table alone, in any format)."""
    distinct_records(records)
    loaded = [load_record(path) for path in records]
    runs = list(zip(records, loaded))
    if timings:
        echo_table(timing_table(runs), output_format)
        return
    echo_table(summary_table(runs), output_format)
    if any(record.params.repeat > 1 for record in loaded):
        if output_format == "table":
            click.echo("\ntimings over repetitions (run --repeat): mean and std, TTFT and TPOT percentiles")
            echo_table(timing_table(runs), output_format)
        else:
            echo_note("timings over repetitions: crossrt show --timings", output_format)
    for path, record in zip(records, loaded):
        if record.imported:
            echo_note(f"{path}: {import_summary(record)}", output_format)
    for line in record_notes(loaded):
        echo_note(line, output_format)


@main.command()
@click.option("--usable", is_flag=True, help="Print only the names of usable runtimes, one per line.")
def runtimes(usable: bool) -> None:
    """Which runtimes can run on this machine and, for the others, why not."""
    if usable:
        for name in usable_runtimes():
            click.echo(name)
        return
    reasons = {name: availability(name) for name in runtime_names()}
    rows = [[name, "yes" if reason is None else "no", reason or ""] for name, reason in reasons.items()]
    click.echo(format_table([["runtime", "usable", "why not"]] + rows))
    notes = [line for name, reason in reasons.items() if reason is None for line in runtime_class(name).build_notes()]
    for line in dict.fromkeys(notes):  # runtimes sharing one build say it once
        click.echo(line)


main.add_command(parity)
main.add_command(diff)
main.add_command(reproduce)
main.add_command(analyze)
main.add_command(simulate_command)
main.add_command(report)
main.add_command(drafter)
main.add_command(import_command)
main.add_command(sweep)
main.add_command(cache)
