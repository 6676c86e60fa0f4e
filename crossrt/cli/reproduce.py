"""`crossrt reproduce`: run the claims this machine can run and compare them with what they claim
(planned, run and checked in crossrt/analyze/reproduce.py)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Sequence

import click

from crossrt.analyze.claims import ClaimError, Outcome, check_record, exit_code, load_claims, render
from crossrt.analyze.reproduce import Settings, reproduce_claim
from crossrt.cli.common import PROMPTS_HELP, user_errors
from crossrt.cli.options import runtime_options
from crossrt.records.record_json import load_record
from crossrt.records.schema import RunRecord
from crossrt.run.runtime import runtime_names


def _measured(item: str) -> tuple[str, Path]:
    claim_id, separator, path = item.partition("=")
    if not separator or not claim_id or not path:
        raise ClaimError(f"--measured {item!r}: give CLAIM=RECORD, e.g. community-vllm=runs/imported/vllm.log.json")
    return claim_id, Path(path)


def _measured_record(claim_id: str, path: Path) -> RunRecord:
    """The --measured record of claim_id; a damaged one is named with what makes it anew here."""
    return load_record(path, remake=f"make it again (its crossrt import or run, with --overwrite), or drop "
                                    f"--measured {claim_id}=... so reproduce runs the claim")


@click.command()
@user_errors
@click.argument("claims_files", nargs=-1, required=True, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--claim", "only", multiple=True, help="Only the claim with this id; repeatable.")
@click.option("--prompts", "prompt_source", default="categories", show_default=True,
              help="Prompts for claims that name none, kept to each claim's categories. " + PROMPTS_HELP)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="Token budget per prompt for claims that state none.")
@click.option("--out-dir", type=click.Path(path_type=Path, file_okay=False), default=Path("runs/claims"),
              show_default=True, help="Where each claim's run record goes (<claim id>.json).")
@click.option("--hardware", help="This machine as claims describe theirs, e.g. '2x NVIDIA T4'. tokens/s and "
              "speedups are compared only with claims made on the same hardware (case and spacing ignored); "
              "otherwise they are shown as not comparable here, not failed.")
@click.option("--strict", is_flag=True, help="Also fail when a claim, category or number could not be checked here.")
@click.option("--resume", is_flag=True, help="Continue the records in --out-dir instead of replacing them.")
@click.option("--measured", multiple=True, metavar="CLAIM=RECORD",
              help="Check the claim with this id against RECORD instead of running it: a record of the claimed "
              "runtime imported from its own statistics (crossrt import), say; repeatable.")
@click.option("--runtime", "runtime_name", type=click.Choice(runtime_names()),
              help="Run every claim on this crossrt runtime instead of the claim's crossrt_runtime: endpoint with "
              "--url (and --baseline-url) checks the claims on a server you run, at the server's own draft length "
              "(a claim with another k is not run, with that reason).")
@runtime_options
def reproduce(claims_files: Sequence[Path], only, prompt_source, max_new_tokens, out_dir, hardware, strict, resume,
              measured, runtime_name, options) -> None:
    """Check published speculative decoding numbers: run every claim this machine can (claims
    format: docs/claims.md) and print claimed against measured, with tolerances.

    \b
    crossrt reproduce community          # built-in claims files by name: community, measured
    crossrt reproduce my-claims.toml --claim tiny-llama-cpp-k4 --hardware '2x NVIDIA T4'
    crossrt reproduce my-claims.toml --runtime endpoint --url http://gpu:8080 --baseline-url http://gpu:8081

    Claims that cannot run here (runtime unavailable, pair paths not filled in, a drafting
    method crossrt lacks...) are listed with the reason. Exit code 0 when every number that
    ran is within tolerance; 1 when one misses or a run breaks, or when no claimed number at all
    could be compared here, and with --strict also when anything claimed could not be checked.
    """
    claims = [claim for path in claims_files for claim in load_claims(path)]
    if runtime_name is not None:
        claims = [dataclasses.replace(claim, crossrt_runtime=runtime_name) for claim in claims]
    ids = [claim.id for claim in claims]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ClaimError(f"claim id(s) {', '.join(repeated)} appear in more than one claims file")
    given = dict(_measured(item) for item in measured)
    unknown = [name for name in (*only, *given) if name not in ids]
    if unknown:
        raise ClaimError(f"no claim {', '.join(map(repr, unknown))} (claims: {', '.join(ids)})")
    settings = Settings(options, max_new_tokens, prompt_source, out_dir, hardware, resume)
    say = functools.partial(click.echo, err=True)  # which claim runs now, beside the verdicts on stdout
    outcomes = [Outcome(claim, check_record(claim, _measured_record(claim.id, given[claim.id]), hardware),
                        record=given[claim.id], measured=True) if claim.id in given
                else reproduce_claim(claim, settings, say) for claim in claims if not only or claim.id in only]
    click.echo(render(outcomes))
    if outcomes and all(outcome.skipped for outcome in outcomes):
        click.echo("none of these claims can run here; `crossrt reproduce measured` checks crossrt's own claims on "
                   "the real models scripts/setup fetches", err=True)
    sys.exit(exit_code(outcomes, strict))
