"""Pieces the crossrt commands share: option types, pair resolution, the errors shown to
users as messages rather than tracebacks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional, Sequence

import click

from crossrt.errors import CrossrtError
from crossrt.inputs.pairs import Pair, load_pair, manifest_path, pair_from_paths
from crossrt.inputs.prompts import sources_help
from crossrt.run.runtime import DTYPES

PROMPTS_HELP = sources_help()
# crossrt's own errors (crossrt/errors.py) and a missing file: one line each. Anything else is a
# bug, and keeps its traceback.
USER_ERRORS = (CrossrtError, FileNotFoundError)


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


def resolve_pair(pair: Optional[str], target: Optional[Path] = None, drafter: Optional[Path] = None) -> Pair:
    """--pair (a manifest path or a name under models/pairs), or --target with --drafter."""
    if target or drafter:
        if not (target and drafter) or pair:
            raise click.UsageError("give either --pair, or both --target and --drafter")
        return pair_from_paths(target, drafter)
    return load_pair(manifest_path(pair or "tiny"))


def device_options(command):
    """--threads, --n-ctx, --n-gpu-layers and --gpu-split, as every command that runs models
    takes them."""
    for option in reversed([
        click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
                     help="CPU threads (ggml busy-waits: more threads than free cores is very slow)."),
        click.option("--n-ctx", type=click.IntRange(min=16), default=2048, show_default=True, help="Context size."),
        click.option("--n-gpu-layers", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Layers to offload to GPU (llama.cpp); large values offload all."),
        click.option("--gpu-split", type=GpuSplit(), help="Relative model share per GPU, e.g. 1,1 for two T4s."),
    ]):
        command = option(command)
    return command


def dtype_option(command):
    """--dtype, for the runtimes that load weights in a dtype of their own (transformers)."""
    return click.option(
        "--dtype", type=click.Choice(DTYPES),
        help="transformers: the weights' (and KV cache's) element type; a GGUF's conversion is cached per dtype. "
        "Default: float32 on the CPU, bfloat16 on a GPU (float16 where it has no bfloat16). llama.cpp runs a "
        "GGUF's own types and ignores it.")(command)


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
