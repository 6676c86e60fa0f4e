#!/usr/bin/env python3
"""Generate splits on purpose and print how crossrt explained them (crossrt/compare/census.py).

    .venv/bin/python scripts/split_census.py --pair trained --batches 3
    .venv/bin/python scripts/split_census.py --target t.gguf --drafter d.gguf --max-new-tokens 48
    .venv/bin/python scripts/split_census.py --pair gemma3-270m --batch 8 --batches 1 --max-new-tokens 24

Each batch of generated prompts runs through llama.cpp in-process under three numerics variants
(F16 and F32 KV cache, flash attention off; --two-threads adds 2 threads) and llama-server
natively; every
record of a batch is compared with every other (`crossrt parity`'s comparisons, with native
splits re-scored), and the splits are counted by kind and cause. Exit 1 if any comparison failed
or a batch compared no token ids at all.
"""

import sys
import tempfile
from pathlib import Path

import click
from click.testing import CliRunner

from crossrt.compare.census import MORE_NATIVE, NUMERICS_VARIANTS, TWO_THREADS, take_census
from crossrt.cli import main
from crossrt.records.record_json import load_record


@click.command()
@click.option("--pair", help="Pair manifest or name (default: --target/--drafter).")
@click.option("--target", type=click.Path(exists=True, path_type=Path))
@click.option("--drafter", type=click.Path(exists=True, path_type=Path))
@click.option("--batch", type=click.IntRange(min=1), default=20, show_default=True, help="Prompts per batch.")
@click.option("--batches", type=click.IntRange(min=1), default=5, show_default=True, help="At most this many.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--k", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--two-threads", is_flag=True, help="Add a 2-thread variant (on an idle machine: ggml threads busy-wait).")
@click.option("--more-native", is_flag=True, help="Add llama-server under an F32 cache and without flash attention, "
              "and llama-speculative-simple: more native splits per prompt.")
def census(pair, target, drafter, batch, batches, max_new_tokens, k, two_threads, more_native):
    models = ["--pair", pair] if pair else ["--target", target, "--drafter", drafter]

    def run_one(variant, prompts, out):
        result = CliRunner().invoke(main, ["run", *(variant.models or models), "--runtime", variant.runtime, "--mode", variant.mode,
                                           "--prompts", prompts, "--max-new-tokens", max_new_tokens, "--k", k,
                                           "--out", out, *variant.options], catch_exceptions=False)
        if result.exit_code != 0:
            last = result.output.strip().splitlines()[-1]
            if f"{variant.runtime} crashed: " in last:  # a verdict on that variant: the others still run
                return last.removeprefix("Error: ")
            sys.exit(f"{variant.name}: {last}")
        return load_record(out)

    with tempfile.TemporaryDirectory() as folder:
        variants = NUMERICS_VARIANTS + ((TWO_THREADS,) if two_threads else ()) + (MORE_NATIVE if more_native else ())
        found = take_census(run_one, Path(folder), variants, batch=batch, max_batches=batches,
                            on_batch=lambda c: click.echo(f"{c.prompts} prompts: {dict(c.kinds)}", err=True))
    click.echo(found.render())
    sys.exit(1 if found.failures else 0)


if __name__ == "__main__":
    census()
