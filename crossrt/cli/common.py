"""Pieces the crossrt commands share: option types, the checks of their inputs and outputs, and
user_errors, which shows crossrt's own errors as one-line exits rather than tracebacks."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Mapping, Sequence

import click

from crossrt.errors import USER_ERRORS
from crossrt.inputs.prompts import sources_help
from crossrt.records.record_json import RECORD_BYTES
from crossrt.records.schema import RecordError
from crossrt.records.tables import FORMATS, Table, render
from crossrt.run.runtime import without_user_info

PROMPTS_HELP = sources_help()


def user_errors(command):
    """The command's crossrt errors and missing files (crossrt.errors.USER_ERRORS) as one-line
    exits (click's `Error: ...`, exit code 1); any other exception is a bug and keeps its traceback."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as error:
            raise click.ClickException(str(error)) from None
    return wrapper


def format_option(command):
    """--format, given to the command as output_format=: how it prints its table (crossrt/records/tables.py)."""
    return click.option("--format", "output_format", type=click.Choice(FORMATS), default="table", show_default=True,
                        help="table: aligned columns under the identity every row shares (file, pair, runtime, "
                        "mode, schedule, drafting, k, acceptance, lossy); csv, json (a list of row objects, numbers "
                        "as numbers) or md (a GitHub Markdown table): every column on every row, notes on "
                        "stderr.")(command)


def echo_table(table: Table, output_format: str) -> None:
    """Print table in output_format (an aligned table of no rows prints nothing)."""
    text = render(table, output_format)
    if text:
        click.echo(text)


def echo_note(line: str, output_format: str) -> None:
    """A line about a table: under an aligned one, on stderr beside the others (their stdout is the table alone)."""
    click.echo(line, err=output_format != "table")


class GpuSplit(click.ParamType):
    """`1,1` or `3,1`: relative shares of the model per GPU."""

    name = "SHARES"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            shares = tuple(float(part) for part in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers, e.g. 1,1", param, ctx)
        if any(share < 0 for share in shares) or not any(shares):
            self.fail(f"{value!r}: shares must be non-negative and not all zero", param, ctx)
        return shares


class CommaChoice(click.ParamType):
    """A comma-separated list of names from a fixed set, e.g. `llama-cpp,transformers`."""

    name = "LIST"

    def __init__(self, choices: Sequence[str]):
        self.choices = tuple(choices)

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        names = tuple(part.strip() for part in str(value).split(",") if part.strip())
        unknown = [name for name in names if name not in self.choices]
        if unknown or not names:
            self.fail(f"{value!r}: choose from {', '.join(self.choices)}", param, ctx)
        return names


class Increasing(click.ParamType):
    """Comma-separated increasing numbers (bucket edges, thresholds); `inf` allowed."""

    name = "NUMBERS"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            edges = tuple(float(part) for part in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of numbers", param, ctx)
        if any(b <= a for a, b in zip(edges, edges[1:])):
            self.fail(f"{value!r}: give increasing numbers", param, ctx)
        return edges


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)  # links and hard links too
    return a.resolve() == b.resolve()


def refuse_inputs_as_outputs(outputs: Mapping[str, Path], inputs: Sequence[Path]) -> None:
    """ClickException (one line) when an output (option -> path) is one of the inputs or another output: no
    command writes over what it reads, or writes one file twice."""
    named = list(outputs.items())
    for index, (option, path) in enumerate(named):
        for source in inputs:
            if _same_file(Path(path), Path(source)):
                raise click.ClickException(f"{option} {path} is an input ({source}): name another file")
        for other, earlier in named[:index]:
            if _same_file(Path(path), Path(earlier)):
                raise click.ClickException(f"{option} and {other} name the same file {path}: name two files")


def distinct_records(paths: Sequence[Path]) -> None:
    """RecordError when one record is given twice (as `report` refuses it): the same path, or
    another path to the same content (a hard link, a copy, a copy written again with other
    spacing or key order): a run compared with itself agrees by construction, and its prompts
    would count twice. Only regular files are read (/dev/zero would never end), and not past
    RECORD_BYTES; what is not a readable JSON record is left to loading, which says why."""
    seen: dict[str, Path] = {}
    for path in paths:
        try:
            if not Path(path).is_file() or Path(path).stat().st_size > RECORD_BYTES:
                continue
            content = json.loads(Path(path).read_bytes())
        except (OSError, ValueError, RecursionError):
            continue
        key = hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        if key in seen:
            same = "" if Path(path).resolve() == Path(seen[key]).resolve() else f" (the same record as {seen[key]})"
            raise RecordError(f"{path} is given twice{same}")
        seen[key] = path


def resume_command(out: Path | None = None) -> str:
    """This command line, made to continue what it wrote (with --out out where it named none).
    A URL's user info and query (a password, an API key) are left out, with a word saying so: a
    message never carries them."""
    args = [_shown(arg) for arg in sys.argv[1:] if arg not in ("--resume", "--overwrite")]
    if out is not None and not any(arg == "--out" or arg.startswith("--out=") for arg in args):
        args += ["--out", str(out)]
    command = shlex.join(["crossrt", *args, "--resume"])
    hidden = [arg for arg in sys.argv[1:] if _shown(arg) != arg]
    return command + ("  (a URL's user info and query are left out here: give them again)" if hidden else "")


def _shown(arg: str) -> str:
    """arg with any URL in it shown without user info or query (--url=URL, or URL alone)."""
    option, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    return option + equals + without_user_info(value) if "://" in value else arg
