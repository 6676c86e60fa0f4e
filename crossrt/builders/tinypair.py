"""Deterministic builder for small drafter/target pairs of llama models sharing a vocabulary.

    build_pair(out_dir, preset="tiny", seed=0) -> list[pathlib.Path]   # the files written

Presets "tiny" (the committed models/tiny), "tiny-hd64" (head size 64, for vLLM's CPU
attention) and "bench" (~60M + ~10M, for timings); byte-identical for the same seed and
library versions. Random weights alone give near-tied logits, so the models carry a small
designed grammar: greedy margins of several logits, outputs that depend on the KV cache.
Why, how, and each preset: docs/design.md, "Why the tiny pair has a grammar".
"""
from __future__ import annotations

import codecs
import contextlib
import io
import json
import math
import platform
import string
import textwrap
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from crossrt.builders.model_files import (BOS, BOS_ID, CONTEXT_LENGTH, EOS, EOS_ID, RMS_EPS, ROPE_THETA,
                                 LlamaShape, train_tokenizer, write_gguf, write_hf)
from crossrt.inputs.builtin import model_home

EOS_SOURCE = "."  # followed by EOS when the token before it has bit 0, so some outputs end
NORM_JITTER = 0.1  # norm weights are 1 + jitter, so a converter that drops one shows up
# Residual dimensions the grammar uses; the others hold a token identity code of unit rms.
U, W, Z = 0, 1, 2  # constant (feeds the previous-token head), own bit, previous token's bit
EMBED_U, EMBED_W, PREV_BIT = 2.0, 2.0, 6.0  # their sizes; PREV_BIT stands above layer noise
ATTN_GAP = 14.0  # score of the previous position over any other: the softmax leaks ~e^-14
BIT_SHARE = 0.3  # logit the bit gives its map's successors, as a share of successor_strength


@dataclass(frozen=True)
class ModelSpec(LlamaShape):
    successor_strength: float  # logit of the grammar's successor of the current token
    residual_gain: float  # size of the random layers' output next to the embedding
    logit_noise: float  # std of the random, context-dependent part of the logits


@dataclass(frozen=True)
class PairPreset:
    vocab_size: int
    target: ModelSpec
    drafter: ModelSpec
    drafter_disagreement: float  # share of grammar pairs whose drafter successor differs
    formats: tuple[str, ...]  # of "f32", "f16", "hf"


PRESETS = {
    "tiny": PairPreset(512, ModelSpec("target", 64, 4, 4, 2, 128, 30.0, 0.5, 2.0),
                       ModelSpec("drafter", 32, 2, 2, 1, 64, 30.0, 0.3, 2.0),
                       0.15, ("f32", "f16", "hf")),
    # No grammar: a plain random pair whose greedy top-2 margins fall to ~1e-4, so F16 and F32
    # weights part at near-ties: what `crossrt diff` must call numerics.
    "random": PairPreset(512, ModelSpec("target", 64, 4, 4, 2, 128, 0.0, 0.5, 2.0),
                         ModelSpec("drafter", 32, 2, 2, 1, 64, 0.0, 0.3, 2.0),
                         0.15, ("f32", "f16")),
    # The tiny pair's design at head size 64, which vLLM's CPU attention runs (it refuses 16):
    # HF folders for vLLM and transformers, an F32 GGUF for llama.cpp.
    "tiny-hd64": PairPreset(512, ModelSpec("target", 128, 2, 2, 1, 256, 30.0, 0.5, 2.0),
                            ModelSpec("drafter", 64, 1, 1, 1, 128, 30.0, 0.3, 2.0),
                            0.15, ("f32", "hf")),
    # For setup's probe of the llama.cpp build (backends/llama_build_probe.py): n_embd 256, so
    # quantized to Q4_K, Q8_0 or Q4_0 every matmul keeps its type and its type's kernels (K-quants
    # need rows of 256; smaller rows fall back to other types).
    "probe": PairPreset(512, ModelSpec("target", 256, 2, 4, 2, 512, 30.0, 0.5, 2.0),
                        ModelSpec("drafter", 256, 1, 4, 2, 512, 30.0, 0.3, 2.0),
                        0.15, ("f32",)),
    "bench": PairPreset(512, ModelSpec("target", 640, 13, 10, 5, 1792, 30.0, 0.5, 2.0),
                        ModelSpec("drafter", 384, 6, 6, 6, 896, 30.0, 0.3, 2.0),
                        0.15, ("f32",)),
}


# ---------------------------------------------------------------- tokenizer

def training_texts(prompts_file: Path) -> list[str]:
    """Prose and code: the built-in prompts plus a few stdlib sources of this interpreter."""
    texts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines() if line]
    texts += [Path(m.__file__).read_text(encoding="utf-8") for m in (textwrap, json)]
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    return texts + [codecs.decode(this.s, "rot13")]


# ---------------------------------------------------------------- grammar

@dataclass(frozen=True)
class Grammar:
    """After `prev`, `cur` the next token is succ[bit[prev], cur]. Normal tokens come in
    pairs, one of each bit, that share their successors."""

    bit: np.ndarray  # (vocab,) 0 or 1
    partner: np.ndarray  # (vocab,) the other token of the pair; BOS and EOS are their own
    succ: np.ndarray  # (2, vocab)


def grammars(tok: Tokenizer, rng: np.random.Generator,
             disagreement: float) -> tuple[Grammar, Grammar]:
    """The target's grammar and the drafter's.

    A pair holds one token of each bit and shares a successor, so (bit of previous, current)
    -> (bit of current, next) is one-to-one: greedy chains run through long cycles instead of
    collapsing into short ones. Map 0 leads into one half of the vocabulary (EOS included) and
    map 1 into the other, so the bit acts through one output direction; BOS and EOS lead to
    the one normal token left over. The drafter's maps hand the successors of a random
    `disagreement` share of pairs round among them: a discrete difference, so its margins
    stay large too."""
    n = tok.get_vocab_size()
    normal = np.arange(2, n)
    half = normal.size // 2
    assert normal.size % 2 == 0, "pairs need an even number of normal tokens"
    bit = np.zeros(n, dtype=np.int64)
    bit[rng.permutation(normal)[:half]] = 1
    zeros, ones = (rng.permutation(normal[bit[normal] == v]) for v in (0, 1))
    source = tok.token_to_id(EOS_SOURCE)  # into the last pair, which map 0 sends to EOS
    side = zeros if bit[source] == 0 else ones
    k = np.flatnonzero(side == source)[0]
    side[[k, half - 1]] = side[[half - 1, k]]
    partner = np.arange(n)
    partner[zeros], partner[ones] = ones, zeros
    order = rng.permutation(normal)
    into = [np.append(order[:half - 1], EOS_ID), order[half - 1:-1]]

    def build(targets: list[np.ndarray]) -> Grammar:
        succ = np.empty((2, n), dtype=np.int64)
        for b in (0, 1):
            succ[b, zeros] = succ[b, ones] = targets[b]
        succ[:, [BOS_ID, EOS_ID]] = order[-1]  # EOS too: prompts may spell out EOS
        return Grammar(bit, partner, succ)

    drafter = []
    for b in (0, 1):
        pick = np.flatnonzero(rng.random(half) < disagreement)
        pick = pick[into[b][pick] != EOS_ID]  # both models end on EOS alike
        targets = into[b].copy()
        targets[pick] = np.roll(targets[pick], 1)  # a derangement: each gets another's
        drafter.append(targets)
    return build(into), build(drafter)


# ---------------------------------------------------------------- weights

def model_weights(spec: ModelSpec, grammar: Grammar, rng: np.random.Generator
                  ) -> dict[str, np.ndarray]:
    """F32 weights under HF names (rotate-half rope layout): random, then the grammar."""
    w = random_weights(spec, grammar.bit.size, rng)
    embed_grammar(w, grammar)
    previous_token_head(w, spec)
    w["lm_head.weight"] += successor_rows(w, spec, grammar)
    return w


def random_weights(spec: ModelSpec, vocab: int, rng: np.random.Generator
                   ) -> dict[str, np.ndarray]:
    d, hd = spec.n_embd, spec.head_dim
    # Residual branches shrink with 1/sqrt(n_layer): deep and shallow models get equal noise.
    out_std = spec.residual_gain / math.sqrt(spec.n_layer)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm():
        return (1.0 + NORM_JITTER * rng.standard_normal(d)).astype(np.float32)

    w = {"model.embed_tokens.weight": normal((vocab, d), 1.0)}
    for i in range(spec.n_layer):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "self_attn.q_proj.weight"] = normal((spec.n_head * hd, d), d ** -0.5)
        w[p + "self_attn.k_proj.weight"] = normal((spec.n_head_kv * hd, d), d ** -0.5)
        w[p + "self_attn.v_proj.weight"] = normal((spec.n_head_kv * hd, d), d ** -0.5)
        w[p + "self_attn.o_proj.weight"] = normal((d, spec.n_head * hd), out_std * d ** -0.5)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.weight"] = normal((spec.n_ff, d), d ** -0.5)
        w[p + "mlp.up_proj.weight"] = normal((spec.n_ff, d), d ** -0.5)
        w[p + "mlp.down_proj.weight"] = normal((d, spec.n_ff), out_std * spec.n_ff ** -0.5)
    w["model.norm.weight"] = norm()
    w["lm_head.weight"] = normal((vocab, d), spec.logit_noise * d ** -0.5)
    return w


def embed_grammar(w: dict[str, np.ndarray], grammar: Grammar) -> None:
    """Embedding = [EMBED_U, +-EMBED_W for the bit, 0 for the previous bit, identity code].
    A pair shares its code (it shares its successors: fewer codes to tell apart); all rows
    have one norm, so RMSNorm scales every token alike."""
    e = w["model.embed_tokens.weight"]
    code = e[np.minimum(np.arange(len(e)), grammar.partner), Z + 1:]
    e[:, Z + 1:] = code * math.sqrt(code.shape[1]) / np.linalg.norm(code, axis=1, keepdims=True)
    e[:, U], e[:, W], e[:, Z] = EMBED_U, EMBED_W * (2 * grammar.bit - 1), 0.0


def rms(*parts: float, d: int) -> float:
    """RMS of a hidden state: the grammar's dimensions plus a unit-rms identity code."""
    return math.sqrt((sum(p * p for p in parts) + d - (Z + 1)) / d)


def previous_token_head(w: dict[str, np.ndarray], spec: ModelSpec) -> None:
    """Layer 0, head 0 (on kv head 0) attends to the previous position and copies its bit to Z.

    Query and key read only the constant U, so scores depend on position alone: rope pair k
    turns by w_k per position, and key (a, 0) with query a*exp(-i w_k) scores
    a^2 sum_k cos(w_k (i - j - 1)) / sqrt(head_dim), highest at i - j = 1. With equal
    amplitudes the runner-up over 0..2048 is the current position, short by
    a^2 sum_k (1 - cos w_k) / sqrt(head_dim) = ATTN_GAP."""
    hd, h2 = spec.head_dim, spec.head_dim // 2
    p = "model.layers.0."
    x = w[p + "input_layernorm.weight"] / rms(EMBED_U, EMBED_W, d=spec.n_embd)  # per dim
    omega = ROPE_THETA ** (-np.arange(h2) * 2.0 / hd)
    amp = math.sqrt(ATTN_GAP * math.sqrt(hd) / np.sum(1 - np.cos(omega))) / (x[U] * EMBED_U)
    q, k = w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"]
    v, o = w[p + "self_attn.v_proj.weight"], w[p + "self_attn.o_proj.weight"]
    q[:hd], k[:hd], v[0], o[:, 0] = 0.0, 0.0, 0.0, 0.0
    q[:h2, U], q[h2:hd, U] = amp * np.cos(-omega), amp * np.sin(-omega)
    k[:h2, U] = amp
    v[0, W] = 1.0 / (x[W] * EMBED_W)  # value +-1: the previous token's bit
    o[Z, 0] = PREV_BIT


def successor_rows(w: dict[str, np.ndarray], spec: ModelSpec, grammar: Grammar) -> np.ndarray:
    """Output rows that give the grammar's choice a large margin.

    The final RMSNorm maps [.., +-PREV_BIT, code c] to g*h/rms. Row j gets the normed code of
    the pair it follows over its squared norm (logit successor_strength when that pair is
    current) and, in Z, the sign of the map that leads to j: the previous bit adds
    BIT_SHARE * successor_strength to its map's successors and takes it from the other's.
    What competes is cross-talk between codes, and the random layers' noise."""
    strength = spec.successor_strength
    scale = w["model.norm.weight"].astype(np.float64) / rms(EMBED_U, EMBED_W, PREV_BIT,
                                                            d=spec.n_embd)
    code = w["model.embed_tokens.weight"][:, Z + 1:] * scale[Z + 1:]
    rows = np.zeros((grammar.bit.size, spec.n_embd))
    for t, j in sorted({(min(t, grammar.partner[t]), j)
                        for (_, t), j in np.ndenumerate(grammar.succ)}):
        rows[j, Z + 1:] += strength * code[t] / np.sum(code[t] ** 2)
    for b, sign in ((0, -1.0), (1, 1.0)):
        rows[grammar.succ[b], Z] = sign * BIT_SHARE * strength / (scale[Z] * PREV_BIT)
    # BOS's and EOS's successor follows under either bit: no Z sign, a bigger code term.
    spare = grammar.succ[0, BOS_ID]
    rows[spare, Z] = 0.0
    rows[spare, Z + 1:] *= 1.0 + BIT_SHARE
    return rows.astype(np.float32)


def eos_example(tok: Tokenizer, grammar: Grammar) -> str:
    """A short prompt whose greedy continuation is EOS at once, for tests."""
    for c in string.ascii_letters:
        ids = tok.encode(c + EOS_SOURCE).ids
        if len(ids) == 3 and grammar.succ[grammar.bit[ids[1]], ids[2]] == EOS_ID:
            return c + EOS_SOURCE
    raise AssertionError("no letter before EOS_SOURCE has bit 0")


def write_readme(path: Path, preset: str, seed: int, pair: PairPreset,
                 counts: dict[str, int], eos_prompt: str) -> None:
    versions = ", ".join(f"{d} {version(d)}" for d in ("numpy", "tokenizers", "gguf",
                                                       "safetensors"))
    rows = "\n".join(f"| {s.name} | {s.n_embd} | {s.n_layer} | {s.n_head} | {s.n_head_kv} "
                     f"| {s.head_dim} | {s.n_ff} | {counts[s.name]:,} |"
                     for s in (pair.target, pair.drafter))
    path.write_text(f"""# crossrt {preset} pair

Built by `python scripts/build_tiny_pair.py --shape {preset} --seed {seed}`
(`crossrt.builders.tinypair.build_pair`) with Python {platform.python_version()}, {versions}.
Do not edit by hand. The tokenizer trains on the built-in prompts and this interpreter's
textwrap.py, json/__init__.py and `this`: other versions may give other (equally good) files.

Tokenizer: byte-level BPE, {pair.vocab_size} tokens, `{BOS}` = {BOS_ID} (added at the start),
`{EOS}` = {EOS_ID}; GGUF `tokenizer.ggml.pre = "gpt-2"`. Models: llama, untied output, RMS eps
{RMS_EPS:g}, rope theta {ROPE_THETA:g}, context {CONTEXT_LENGTH}. F16 GGUFs keep norms in F32;
the HF folders hold the F32 weights (the GGUFs' q/k rows carry llama.cpp's rope permutation).

| model | n_embd | layers | heads | kv heads | head_dim | ff | parameters |
|---|---|---|---|---|---|---|---|
{rows}

Random weights plus a designed grammar (see `crossrt/builders/tinypair.py`): the next token is
succ[bit(previous token), current token], so greedy top-2 margins are several logits, outputs
depend on the previous position's KV entry, and the drafter's grammar differs from the
target's at {pair.drafter_disagreement:.0%} of its pairs. EOS follows `{EOS_SOURCE}` after a
bit-0 token: the prompt `{eos_prompt}` is followed by EOS at once.
""")


# ---------------------------------------------------------------- entry point

def build_pair(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> list[Path]:
    """Build the `preset` pair from `seed` into `out_dir`; returns the files written."""
    pair, out = PRESETS[preset], Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(training_texts(Path(__file__).parents[1] / "data" / "prompts" /
                                         "builtin.jsonl"), pair.vocab_size)
    both = grammars(tok, np.random.default_rng([seed, 0]), pair.drafter_disagreement)
    files, counts = [], {}
    for stream, (spec, grammar) in enumerate(zip((pair.target, pair.drafter), both), start=1):
        w = model_weights(spec, grammar, np.random.default_rng([seed, stream]))
        counts[spec.name] = sum(a.size for a in w.values())
        for fmt in pair.formats:
            if fmt == "hf":
                files += write_hf(out / f"{spec.name}-hf", w, spec, tok)
            else:
                files.append(out / f"{spec.name}.{fmt}.gguf")
                write_gguf(files[-1], w, spec, tok, f16=fmt == "f16")
    files.append(out / "README.md")
    write_readme(files[-1], preset, seed, pair, counts, eos_example(tok, both[0]))
    return files


if __name__ == "__main__":  # python -m crossrt.builders.tinypair: the tiny pair where its manifests look
    for written in build_pair(model_home() / "tiny"):
        print(written)
