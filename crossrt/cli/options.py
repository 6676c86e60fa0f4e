"""The option groups every command that loads models shares, each declared once and handed to
the command as the one object it builds: pair_options -> Pair (pair=), runtime_options ->
RuntimeOptions (options=), strategy_options -> Strategy (strategy=); and executable_option (the
program a runtime runs). A group's errors are crossrt's own: @user_errors, above the groups,
turns them into one-line exits."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import click

from crossrt.cli.common import GpuSplit
from crossrt.errors import SettingsError
from crossrt.inputs.pairs import resolve_pair
from crossrt.run.runtime import DTYPES, RuntimeOptions, runtime_class
from crossrt.speculative.lookup import LOOKUPS
from crossrt.speculative.strategies import ACCEPTANCES, DRAFTINGS, K_POLICIES, STRATEGY_PARTS, Strategy, parse_content_k


def _group(options: Sequence[Callable], build: Callable[[dict[str, Any]], None]):
    """A decorator adding options to a command; build turns their values in the command's
    keyword arguments into the object the command takes, before it runs."""
    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, **kwargs):
            build(kwargs)
            return command(*args, **kwargs)
        for option in reversed(options):
            wrapper = option(wrapper)
        return wrapper
    return decorate


# ---- the pair: Pair ----------------------------------------------------------------------------

PAIR_OPTIONS = [
    click.option("--pair", "pair_name", help="Pair manifest (.toml path, or a name under models/pairs such as "
                 "'tiny'). Default: the tiny test pair."),
    click.option("--target", type=click.Path(path_type=Path), help="Target model file/folder (instead of --pair)."),
    click.option("--drafter", type=click.Path(path_type=Path), help="Drafter model file/folder (with --target)."),
]


def _build_pair(kwargs: dict[str, Any]) -> None:
    kwargs["pair"] = resolve_pair(kwargs.pop("pair_name"), kwargs.pop("target"), kwargs.pop("drafter"))


pair_options = _group(PAIR_OPTIONS, _build_pair)
pair_options.__doc__ = """--pair, or --target with --drafter, given to the command as the Pair they name (pair=)."""


# ---- numerics and device: RuntimeOptions --------------------------------------------------------

RUNTIME_OPTIONS = [
    click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
                 help="CPU threads (ggml busy-waits: more threads than free cores is very slow)."),
    click.option("--n-ctx", type=click.IntRange(min=16), default=2048, show_default=True,
                 help="Context size in tokens: prompt, output and a draft must fit in it."),
    click.option("--n-gpu-layers", type=click.IntRange(min=0), default=0, show_default=True,
                 help="Layers to offload to GPU (llama.cpp); large values offload all."),
    click.option("--gpu-split", type=GpuSplit(), help="Relative model share per GPU, e.g. 1,1 for two T4s."),
    click.option("--f32-kv-cache", is_flag=True,
                 help="F32 KV cache where the runtime allows, for logit comparisons across runtimes: logits then "
                 "agree to ~1e-5 on F32 weights instead of ~1e-3 (the default F16 cache is llama.cpp's own)."),
    click.option("--flash-attn/--no-flash-attn", default=True, show_default=True,
                 help="llama.cpp's flash attention (on, as its own tools run). Off, with --f32-kv-cache, gives "
                 "logits within ~1e-5 of transformers on F32 weights; on, ~5e-3."),
    click.option("--dtype", type=click.Choice(DTYPES),
                 help="transformers: the weights' (and KV cache's) element type; a GGUF's conversion is cached per "
                 "dtype. Default: float32 on the CPU, bfloat16 on a GPU (float16 where it has no bfloat16). "
                 "llama.cpp runs a GGUF's own types and ignores it."),
    click.option("--url", help="Runtime endpoint: the running llama-server, vLLM or SGLang server to attach to, "
                 "e.g. http://127.0.0.1:8080 (an API key comes from CROSSRT_ENDPOINT_API_KEY; docs/endpoint.md)."),
    click.option("--baseline-url", help="Runtime endpoint: a plain server of the same target (no drafter) for "
                 "the greedy baseline."),
]
RUNTIME_FIELDS = tuple(field.name for field in dataclasses.fields(RuntimeOptions) if field.name != "executable")


def runtime_options_of(values: Mapping[str, Any]) -> RuntimeOptions:
    """The RuntimeOptions of a command's parsed runtime options (values: its parameters)."""
    return RuntimeOptions(**{name: values[name] for name in RUNTIME_FIELDS})


def _build_runtime_options(kwargs: dict[str, Any]) -> None:
    kwargs["options"] = runtime_options_of({name: kwargs.pop(name) for name in RUNTIME_FIELDS})


runtime_options = _group(RUNTIME_OPTIONS, _build_runtime_options)
runtime_options.__doc__ = """--threads, --n-ctx, --n-gpu-layers, --gpu-split, --f32-kv-cache, --flash-attn, --dtype and the
endpoint runtime's --url and --baseline-url,
as every command that loads models takes them, given to it as one RuntimeOptions (options=)."""


executable_option = click.option(
    "--executable", type=click.Path(path_type=Path, dir_okay=False),
    help="The program of a runtime that runs one (llama-server's llama-server, llama-spec-cli's "
    "llama-speculative-simple: your own llama.cpp build). Default: the one scripts/build_llama_tools built, "
    "else PATH.")


def with_executable(options: RuntimeOptions, runtime_name: str, executable: Optional[Path]) -> RuntimeOptions:
    """options running executable as runtime_name's program; SettingsError for a runtime that
    runs none (its Runtime.program says)."""
    if executable is None:
        return options
    program = runtime_class(runtime_name).program
    if program is None:
        raise SettingsError(f"--executable {executable}: runtime {runtime_name!r} runs in crossrt's process, no "
                            "program of its own")
    return dataclasses.replace(options, executable=executable)


# ---- drafting, k policy, acceptance: Strategy ---------------------------------------------------

STRATEGY_OPTIONS = {
    "drafting": click.option(
        "--drafting", type=click.Choice(DRAFTINGS), default="model", show_default=True,
        help="How drafts are proposed: model (the pair's drafter model drafts a chain), "
        + ", ".join(f"{lookup.name} ({lookup.about})" for lookup in LOOKUPS.values())
        + " (these copy from the text: no drafter model), tree (the drafter proposes a static --tree, verified in "
        "one pass; llama-cpp)."),
    "tree": click.option(
        "--tree", help="--drafting tree: WxD (every path of width W and depth D) or a JSON choice-list file "
        "([[0], [0, 0], [1]]; `crossrt simulate --tree best:N --out` fits one)."),
    "ngram_max": click.option("--ngram-max", type=click.IntRange(min=1),
                              help=f"--drafting {', '.join(LOOKUPS)}: the longest n-gram looked up "
                              "(transformers' max_matching_ngram_size; vLLM's prompt_lookup_max; the one length "
                              "llama.cpp's types look up: size_n, ngram-mod's n_match). "
                              "Default: 3."),
    "ngram_min": click.option("--ngram-min", type=click.IntRange(min=1),
                              help=f"--drafting {', '.join(STRATEGY_PARTS['ngram_min'][1])}: the shortest n-gram "
                              "looked up (vLLM's prompt_lookup_min). Default: 1."),
    "k_policy": click.option(
        "--k-policy", type=click.Choice(K_POLICIES), default="fixed", show_default=True,
        help="How long each step's draft is: fixed (--k), content (by the content type of the text so far, "
        "--content-k), online (one longer after a fully accepted draft, else one past the tokens accepted; up to "
        "--k-max), "
        "confidence (draft up to --k, stop before a token the drafter gives top-1 probability below --min-p1)."),
    "content_k": click.option("--content-k", metavar="TYPE=K,...",
                              help="--k-policy content: k per content type, e.g. code=7,prose=3."),
    "k_max": click.option("--k-max", type=click.IntRange(min=1),
                          help="--k-policy online: the longest draft it grows to. Default: 8."),
    "min_p1": click.option("--min-p1", type=click.FloatRange(0.0, 1.0, min_open=True),
                           help="--k-policy confidence: stop drafting before a token whose drafter top-1 "
                           "probability is below this, e.g. 0.5."),
    "acceptance": click.option(
        "--acceptance", type=click.Choice(ACCEPTANCES), default="greedy", show_default=True,
        help="Which draft tokens the target accepts: greedy (its own argmax only: lossless), relaxed (also a "
        "token among its --top-m best within --delta logits of the best: lossy, labelled so in the record, "
        "never counted as lossless)."),
    "top_m": click.option("--top-m", type=click.IntRange(min=1),
                          help="--acceptance relaxed: accept a draft token among the target's top m. Default: 2."),
    "delta": click.option("--delta", type=click.FloatRange(min=0.0),
                          help="--acceptance relaxed: ... within this many logits of the target's top-1. "
                          "Default: 1."),
}
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def strategy_of(values: Mapping[str, Any]) -> Strategy:
    """The Strategy of a command's parsed strategy options; SettingsError (one line) for a
    parameter given without its part (--top-m without --acceptance relaxed) or a bad combination."""
    given = {name: value for name, value in values.items() if value is not None}
    for name, (part, choices) in STRATEGY_PARTS.items():
        if name in given and given.get(part) not in choices:
            raise SettingsError(f"{_flag(name)} is for {_flag(part)} {' or '.join(choices)}: add it, or drop "
                                f"{_flag(name)}")
    if "content_k" in given:
        given["content_k"] = parse_content_k(given["content_k"])
    return Strategy(**given)


def strategy_options(command=None, *, own_trees: bool = False):
    """--drafting, --k-policy and --acceptance with their parameters, given to the command as one
    Strategy (strategy=). own_trees: the command declares --tree itself (simulate's, repeatable,
    best:N too); it then also takes the --drafting choice (drafting=), and strategy= is the chain
    part (drafting model) of a --drafting tree."""
    names = [name for name in STRATEGY_OPTIONS if not (own_trees and name == "tree")]

    def build(kwargs: dict[str, Any]) -> None:
        values = {name: kwargs.pop(name) for name in names}
        if own_trees:
            kwargs["drafting"] = values["drafting"]
            values["drafting"] = "model" if values["drafting"] == "tree" else values["drafting"]
        kwargs["strategy"] = strategy_of(values)

    decorate = _group([STRATEGY_OPTIONS[name] for name in names], build)
    return decorate if command is None else decorate(command)
