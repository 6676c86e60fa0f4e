"""`crossrt drafter`: make drafter models from a target model."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import click

from crossrt.builders.head_settings import DFLASH_TRAINING, TrainingSettings
from crossrt.builders.layer_skip import LayerSkipError, layer_skip
from crossrt.errors import CrossrtError


@click.group()
def drafter() -> None:
    """Make a drafter model from a target model.

    \b
    Example (Gemma 3 270M has 18 blocks):
      crossrt drafter layer-skip gemma.gguf gemma-blocks17.gguf --blocks 17
      crossrt run --target gemma.gguf --drafter gemma-blocks17.gguf --k 7
    """


@drafter.command("layer-skip", short_help="Cut a GGUF model to its first N blocks: a drafter sharing its vocabulary.")
@click.argument("source", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("output", type=click.Path(path_type=Path, dir_okay=False))
@click.option("--blocks", type=click.IntRange(min=1), required=True,
              help="Blocks (layers) to keep, from 1 to the target's block count minus 1.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
def layer_skip_command(source: Path, output: Path, blocks: int, overwrite: bool) -> None:
    """Write OUTPUT: the GGUF model SOURCE cut to its first --blocks blocks, a drafter for SOURCE.

    It is SOURCE skipping its last blocks: embeddings, output head, tokenizer and the kept
    blocks are copied byte for byte (quantized types unchanged), so it shares SOURCE's
    vocabulary exactly and needs no training. More blocks draft better but cost more per
    drafted token: on Gemma 3 270M (18 blocks) at k=7, llama.cpp, 64 tokens of crossrt's
    built-in prompts, 17 blocks had 50% of drafted tokens accepted (code 77%, prose 35%) and
    15 blocks 21% (docs/real-models.md).
    """
    try:
        result = layer_skip(source, output, blocks, overwrite)
    except LayerSkipError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"wrote {result.output}: {result.blocks} of {result.source_blocks} blocks, "
               f"{result.tensors_kept} tensors ({result.tensors_dropped} dropped), {result.size / 1e6:.1f} MB")


def _layers(value: Optional[str], count: Optional[int] = None) -> Optional[tuple[int, ...]]:
    """--layers A,B,C: count layer numbers (EAGLE3 reads exactly 3), else any number of them."""
    if value is None:
        return None
    try:
        layers = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated layer numbers, e.g. 2,15,27") from None
    if count is not None and len(layers) != count:
        raise click.BadParameter(f"{value!r}: EAGLE3 reads exactly {count} target layers, e.g. 2,15,27")
    return layers


class _StageBar:
    """One progress bar per stage on stderr: corpus, features, training, gguf."""

    def __init__(self) -> None:
        self.stage: Optional[str] = None
        self.bar = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = click.progressbar(length=total, label=f"{stage:<9}", file=sys.stderr, show_eta=True)
            self.bar.__enter__()
        self.bar.update(done - self.bar.pos)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _training_options(epochs: int):
    """TARGET, OUTPUT and the corpus and training options both head commands take."""
    def decorate(command):
        for option in reversed((
                click.argument("target", type=click.Path(path_type=Path, dir_okay=False, exists=True)),
                click.argument("output", type=click.Path(path_type=Path, file_okay=False)),
                click.option("--epochs", type=click.IntRange(min=1), default=epochs, show_default=True,
                             help="Passes over the corpus (66 prompts x --new-tokens)."),
                click.option("--new-tokens", type=click.IntRange(min=8, max=512), default=64, show_default=True,
                             help="The target's greedy tokens per corpus prompt."),
                click.option("--seed", type=int, default=0, show_default=True,
                             help="Initialization and shuffling seed."))):
            command = option(command)
        return command
    return decorate


def _machine_options(command):
    """--threads and --overwrite, as both head commands take them."""
    command = click.option("--overwrite", is_flag=True,
                           help="Replace OUTPUT if it holds something other than this head.")(command)
    return click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
                        help="CPU threads (the head is reproducible for a given thread count).")(command)


@drafter.command("eagle3", short_help="Train an EAGLE3 head for a GGUF target on this CPU, in every runtime's format.")
@_training_options(epochs=TrainingSettings.epochs)
@click.option("--layers", "layers", metavar="A,B,C", default=None,
              help="The three target layers the head reads (HF hidden_states[i], the layer's input). "
                   "Default: llama.cpp's and vLLM's [2, N//2, N-3].")
@click.option("--norm-before-residual/--no-norm-before-residual", default=False, show_default=True,
              help="Where the head's residual is taken (vLLM defaults to on when unstated, llama.cpp to off: "
                   "written explicitly either way).")
@click.option("--draft-vocab", type=click.IntRange(min=16), default=4096, show_default=True,
              help="The head's output vocabulary: the target's most predicted tokens on the corpus.")
@_machine_options
def eagle3_command(target: Path, output: Path, epochs: int, new_tokens: int, seed: int, layers: Optional[str],
                   norm_before_residual: bool, draft_vocab: int, threads: int, overwrite: bool) -> None:
    """Write OUTPUT, a folder holding an EAGLE3 head for the GGUF model TARGET: speculators'
    format (config.json, model.safetensors: what vLLM reads), eagle3.gguf (llama.cpp:
    -md OUTPUT/eagle3.gguf --spec-type draft-eagle3) and crossrt-head.json (its settings and
    how well it learned).

    The head learns from the target's own greedy outputs on crossrt's built-in code, prose and
    structured prompts (not the prompts runs default to), seeded: the same options give the same
    head, which is cached by the target's digest and the options. SmolLM2-135M: about 1 minute
    of corpus and 20 seconds per epoch on one thread (docs/drafter-heads.md).

    \b
    Example:
      crossrt drafter eagle3 .cache/models/smollm2-135m-instruct-q4_1.gguf heads/smollm2-eagle3
      crossrt run --pair smollm2-135m-eagle3 --runtime llama-server --mode native
    """
    from crossrt.run.head_making import eagle3_settings

    made = _make("eagle3", target, output, eagle3_settings(_layers(layers, 3), norm_before_residual, draft_vocab),
                 TrainingSettings(seed=seed, epochs=epochs, threads=threads), new_tokens, overwrite)
    info = made.provenance
    accuracy = ", ".join(f"{kind} {value:.0%}" for kind, value in info["accuracy_by_type"].items())
    click.echo(f"wrote {made.folder} ({'cached' if made.cached else 'trained'}): EAGLE3 head, layers "
               f"{info['settings']['layer_ids']}, {info['steps']} steps in {info['training_seconds']} s; "
               f"first-token agreement with the target on its corpus: {accuracy}")


def _make(kind: str, target: Path, output: Path, choose, training: TrainingSettings, new_tokens: int,
          overwrite: bool):
    from crossrt.run.head_making import TargetStates, make_head

    # A caller making several heads in one process may pass click a TargetStates as obj (tests do).
    states = click.get_current_context().find_object(TargetStates)
    bar = _StageBar()
    try:
        return make_head(kind, target, output, choose, training, new_tokens, overwrite, bar, states)
    except CrossrtError as error:
        raise click.ClickException(str(error)) from None
    finally:
        bar.close()


@drafter.command("dflash", short_help="Train a DFlash block drafter for a GGUF target on this CPU, in every runtime's format.")
@_training_options(epochs=DFLASH_TRAINING.epochs)
@click.option("--layers", "layers", metavar="A,B,...", default=None,
              help="The target layers whose outputs it reads (z-lab's ids, HF hidden_states[i + 1]); at most N - 2. "
                   "Default: z-lab's spacing of 4 from 1 to N - 3.")
@click.option("--block-size", type=click.IntRange(min=2, max=17), default=8, show_default=True,
              help="The anchor and block-size - 1 mask tokens: drafts of up to block-size - 1 (k = 7 at 8).")
@click.option("--mask-token", type=click.IntRange(min=0), default=16, show_default=True,
              help="The mask token's id (embedded by the target's row; SmolLM2's 16 is <empty_output>).")
@click.option("--depth", type=click.IntRange(min=1, max=8), default=2, show_default=True, help="Decoder layers.")
@click.option("--draft-vocab", type=click.IntRange(min=16), default=4096, show_default=True,
              help="Tokens training's softmax runs over: the target's most predicted on the corpus (drafting: all).")
@_machine_options
def dflash_command(target: Path, output: Path, epochs: int, new_tokens: int, seed: int, layers: Optional[str],
                   block_size: int, mask_token: int, depth: int, draft_vocab: int, threads: int,
                   overwrite: bool) -> None:
    """Write OUTPUT, a folder holding a DFlash block drafter for the GGUF model TARGET: z-lab's
    DFlashDraftModel format (config.json, model.safetensors), dflash.gguf (llama.cpp:
    -md OUTPUT/dflash.gguf --spec-type draft-dflash) and crossrt-head.json.

    It drafts a whole block in one pass from the target's outputs of a few layers, with the
    target's embeddings and LM head. It learns, seeded, from the target's greedy outputs on
    crossrt's built-in code, prose and structured prompts: at every position of a continuation,
    the next block-size - 1 greedy tokens. Cached like `crossrt drafter eagle3`.

    \b
    Example:
      crossrt drafter dflash .cache/models/smollm2-135m-instruct-q4_1.gguf heads/smollm2-dflash
      crossrt run --pair smollm2-135m-dflash --runtime llama-server --mode native
    """
    from crossrt.run.head_making import dflash_settings

    # A block drafter learns to attend to its context slowly: 3e-3 (the EAGLE3 head's) made it
    # draft one constant token; 3e-4 had 8% first-token agreement after 4 epochs, 1e-3 4.5%.
    made = _make("dflash", target, output, dflash_settings(_layers(layers), block_size, mask_token, depth, draft_vocab),
                 replace(DFLASH_TRAINING, seed=seed, epochs=epochs, threads=threads), new_tokens, overwrite)
    info = made.provenance
    click.echo(f"wrote {made.folder} ({'cached' if made.cached else 'trained'}): DFlash drafter, block "
               f"{info['settings']['block_size']}, layers {info['settings']['layer_ids']}, {info['steps']} steps in "
               f"{info['training_seconds']} s; first-token agreement with the target on its corpus: "
               f"{info['first_token_agreement']:.0%}")
