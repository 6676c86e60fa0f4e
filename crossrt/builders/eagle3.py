"""An EAGLE3 head in torch: what `crossrt drafter eagle3` trains and crossrt's loop drafts with.

EAGLE3 (Li et al. 2025) drafts from the target's own hidden states. Its forward, as llama.cpp's
src/models/eagle3.cpp and vLLM's llama_eagle3.py compute it (docs/drafter-heads.md):

    F_p = concat(L[a][p], L[b][p], L[c][p])     the target's inputs to 3 layers (HF hidden_states[i])
    g_p = fc(F_p)                               [hidden]
    x   = concat(rms(embed(t_{p+1})), rms(g_p)) embedding first: attention takes 2 x hidden
    h   = attention(x, RoPE at p, causal) + (rms(g_p) if norm_before_residual else g_p)
    pre = h + mlp(rms(h))                       the next draft step's g (fc is never applied to it)
    logits over the draft vocabulary = lm_head(rms(pre)); draft id i is target id draft_ids[i]

The pair at position p, (t_{p+1}, g_p), predicts t_{p+2}. Embeddings are the target's (not
stored in the head), so every runtime borrows the same ones. No biases anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as functional

from crossrt.builders.head_settings import Eagle3Settings


@dataclass(frozen=True)
class TargetShape:
    """What a head takes from its target's config."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    vocab: int
    layers: int
    max_positions: int

    @classmethod
    def of(cls, config) -> "TargetShape":
        """From a transformers config of a Llama-like target."""
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") \
            or getattr(config, "rope_theta", 10000.0)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   config.intermediate_size, float(config.rms_norm_eps), float(theta), config.vocab_size,
                   config.num_hidden_layers, config.max_position_embeddings)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's rotate_half RoPE; x is [..., L, heads, head_dim], positions [L]. llama.cpp's converter
    permutes q/k rows for ggml's rope, which makes the two the same."""
    half = x.shape[-1] // 2
    inverse = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angle = positions[:, None].float() * inverse[None]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[:, None]
    sin = torch.cat([angle.sin(), angle.sin()], -1)[:, None]
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def linear(rows: int, columns: int, scale: float = 1.0) -> torch.nn.Parameter:
    """A projection's weight drawn at random, its outputs of about scale's size for unit inputs."""
    return torch.nn.Parameter(torch.randn(rows, columns) * (scale / math.sqrt(columns)))


class Eagle3Head(torch.nn.Module):
    """The head's weights under speculators' names (HEAD_TENSORS) and its forward."""

    def __init__(self, shape: TargetShape, settings: Eagle3Settings, draft_ids: torch.Tensor,
                 embeddings: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.shape, self.settings = shape, settings
        h, q, kv, ff = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
        self.fc = linear(h, 3 * h)
        self.input_layernorm = torch.nn.Parameter(torch.ones(h))
        self.hidden_norm = torch.nn.Parameter(torch.ones(h))
        self.q_proj, self.k_proj, self.v_proj = linear(q, 2 * h), linear(kv, 2 * h), linear(kv, 2 * h)
        self.o_proj = linear(h, q, 0.3)
        self.post_attention_layernorm = torch.nn.Parameter(torch.ones(h))
        self.gate_proj, self.up_proj, self.down_proj = linear(ff, h), linear(ff, h), linear(h, ff, 0.3)
        self.norm = torch.nn.Parameter(torch.ones(h))
        # Starts as the target's own output rows of the draft vocabulary: a head whose pre is close
        # to the target's last hidden state already ranks tokens as the target does.
        self.lm_head = torch.nn.Parameter(lm_head[draft_ids].detach().clone().float())
        self.register_buffer("draft_ids", draft_ids.to(torch.int64), persistent=False)
        self.register_buffer("embeddings", embeddings.detach().float(), persistent=False)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """g from the target's features [..., 3 x hidden]."""
        return features @ self.fc.T

    def forward(self, tokens: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
                kv_dtype: Optional[torch.dtype] = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """pre and draft-vocabulary logits of pairs (tokens [B, L], g [B, L, hidden]) at positions
        [L], each attending causally to the pairs before it; kv_dtype: keys and values rounded to
        it, as a runtime's KV cache stores them (llama.cpp's draft cache: float16 by default).
        last_only: the last pair's alone ([B, 1, ...]), all a draft pass reads: the query, the MLP
        and the LM head then run on one row, as llama.cpp's one-token draft passes do."""
        x, xg = self.inputs(tokens, g)
        k, v = self.keys_values(x, positions, kv_dtype)
        if last_only:  # the last query attends to every pair: no mask
            return self.attend(x[:, -1:], xg[:, -1:], g[:, -1:], positions[-1:], k, v, causal=False)
        return self.attend(x, xg, g, positions, k, v, causal=True)

    def inputs(self, tokens: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (the attention's input, [B, L, 2 x hidden]) and rms(g) of pairs (tokens [B, L], g [B, L, hidden])."""
        xg = rms(g, self.hidden_norm, self.shape.eps)
        return torch.cat([rms(self.embeddings[tokens], self.input_layernorm, self.shape.eps), xg], -1), xg

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor,
                    kv_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE at positions [L]) and values [B, L, kv_heads, head_dim] of inputs x, rounded
        to kv_dtype: each pair's own, so a drafter may keep them as a runtime's cache does."""
        s, batch, length = self.shape, x.shape[0], x.shape[1]
        k = rope((x @ self.k_proj.T).view(batch, length, s.kv_heads, s.head_dim), positions, s.rope_theta)
        v = (x @ self.v_proj.T).view(batch, length, s.kv_heads, s.head_dim)
        if kv_dtype is not None:
            k, v = k.to(kv_dtype).float(), v.to(kv_dtype).float()
        return k, v

    def attend(self, x: torch.Tensor, xg: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """pre and logits of the queries x (inputs at positions, with their rms(g) and g) over keys
        and values k, v of every pair they see (keys_values); causal: x are all the pairs."""
        s, eps = self.shape, self.shape.eps
        batch, queries = x.shape[0], x.shape[1]
        q = rope((x @ self.q_proj.T).view(batch, queries, s.heads, s.head_dim), positions, s.rope_theta)
        group = s.heads // s.kv_heads
        attended = functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2),
            v.repeat_interleave(group, 2).transpose(1, 2), is_causal=causal)
        h = attended.transpose(1, 2).reshape(batch, queries, -1) @ self.o_proj.T
        h = h + (xg if self.settings.norm_before_residual else g)
        m = rms(h, self.post_attention_layernorm, eps)
        pre = h + (functional.silu(m @ self.gate_proj.T) * (m @ self.up_proj.T)) @ self.down_proj.T
        return pre, rms(pre, self.norm, eps) @ self.lm_head.T

    def speculators_tensors(self) -> dict[str, torch.Tensor]:
        """The head's tensors under speculators' names, d2t as offsets (draft id + d2t = target id)
        and t2d as a mask over the target's vocabulary, as vLLM and llama.cpp's converter read them."""
        weights = {name: parameter.detach().float().contiguous() for name, parameter in self.named_parameters()}
        tensors = {SPECULATORS_NAMES.get(name, name): tensor for name, tensor in weights.items()}
        tensors["d2t"] = (self.draft_ids - torch.arange(self.draft_ids.numel())).to(torch.int64)
        tensors["t2d"] = torch.zeros(self.shape.vocab, dtype=torch.bool).index_fill_(0, self.draft_ids, True)
        return tensors


SPECULATORS_NAMES = {
    "fc": "fc.weight",
    "input_layernorm": "layers.0.input_layernorm.weight",
    "hidden_norm": "layers.0.hidden_norm.weight",
    "q_proj": "layers.0.self_attn.q_proj.weight",
    "k_proj": "layers.0.self_attn.k_proj.weight",
    "v_proj": "layers.0.self_attn.v_proj.weight",
    "o_proj": "layers.0.self_attn.o_proj.weight",
    "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
    "gate_proj": "layers.0.mlp.gate_proj.weight",
    "up_proj": "layers.0.mlp.up_proj.weight",
    "down_proj": "layers.0.mlp.down_proj.weight",
    "norm": "norm.weight",
    "lm_head": "lm_head.weight",
}


def load_head(tensors: dict[str, torch.Tensor], shape: TargetShape, settings: Eagle3Settings,
              embeddings: torch.Tensor) -> Eagle3Head:
    """A head from its speculators tensors (crossrt/builders/head_files.py reads them)."""
    offsets = tensors["d2t"].to(torch.int64)
    draft_ids = offsets + torch.arange(offsets.numel())
    head = Eagle3Head(shape, settings, draft_ids, embeddings, tensors["lm_head.weight"].new_zeros(shape.vocab, shape.hidden))
    by_speculators = {value: key for key, value in SPECULATORS_NAMES.items()}
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name in by_speculators:
                getattr(head, by_speculators[name]).copy_(tensor.float())
    return head
