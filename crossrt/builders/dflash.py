"""A DFlash block drafter in torch: what `crossrt drafter dflash` trains and crossrt's loop drafts
with, as llama.cpp's src/models/dflash.cpp computes it (docs/drafter-heads.md).

The drafter reads the target's features F (its outputs of a few layers, HF hidden_states[i + 1])
at every committed position and drafts a whole block in one pass:

    g        = rms(fc(F))                                 per committed position, no attention
    K, V     = rope(k_norm(Wk g)), Wv g                   each layer's context keys (no input norm)
    x        = target_embed([anchor, MASK, ..., MASK])    the block, at positions pos0 .. pos0 + B - 1
    each layer (Qwen3-style, q and k normed): attention over the context and the whole block,
    non-causal; then its MLP
    logits   = target_lm_head(rms(x))                     row i (1 .. B - 1) drafts the token at pos0 + i

The anchor is the newest token, one the target has not processed yet, at pos0; the context holds
the features of positions 0 .. pos0 - 1. Embeddings and LM head are the target's (borrowed, not
stored). RoPE is HF's rotate_half, which llama.cpp runs as NEOX for this architecture.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.nn.functional as functional

from crossrt.builders.eagle3 import TargetShape, linear, rms, rope
from crossrt.builders.head_training import IGNORED
from crossrt.builders.head_settings import DFlashSettings

LAYER_TENSORS = ("input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
                 "post_attention_layernorm", "gate_proj", "up_proj", "down_proj")
# z-lab's tensor names under a layer (DFlashDraftModel), as llama.cpp's converter reads them.
SUBMODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "q_norm": "self_attn", "k_norm": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class DFlashDrafter(torch.nn.Module):
    def __init__(self, shape: TargetShape, settings: DFlashSettings, embeddings: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.shape, self.settings = shape, settings
        h, hd, ff = shape.hidden, shape.head_dim, shape.intermediate
        q, kv = shape.heads * hd, shape.kv_heads * hd
        self.fc = linear(h, len(settings.layer_ids) * h)
        self.hidden_norm = torch.nn.Parameter(torch.ones(h))
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.blocks = torch.nn.ModuleList()
        for _ in range(settings.layers):
            block = torch.nn.Module()
            block.input_layernorm = torch.nn.Parameter(torch.ones(h))
            block.q_proj, block.k_proj, block.v_proj = linear(q, h), linear(kv, h), linear(kv, h)
            block.o_proj = linear(h, q, 0.3)
            block.q_norm, block.k_norm = torch.nn.Parameter(torch.ones(hd)), torch.nn.Parameter(torch.ones(hd))
            block.post_attention_layernorm = torch.nn.Parameter(torch.ones(h))
            block.gate_proj, block.up_proj, block.down_proj = linear(ff, h), linear(ff, h), linear(h, ff, 0.3)
            self.blocks.append(block)
        self.register_buffer("embeddings", embeddings.detach().float(), persistent=False)
        self.register_buffer("lm_head", lm_head.detach().float(), persistent=False)
        # The borrowed LM head is quantized in the target's GGUF: ggml's matmul then quantizes the
        # activations too (8 bits per block of 32), which crossrt's loop does as llama.cpp does.
        self.quantized_head = False

    def forward(self, features: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor,
                head_rows: Optional[torch.Tensor] = None, kv_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Logits of each anchor's block rows 1 .. B - 1: features [T, n x hidden] at positions
        0 .. T - 1; anchors [A] (anchor a's context is positions 0 .. a - 1, its block a .. a + B - 1);
        anchor_tokens [A]. head_rows: only these rows of the LM head (training); kv_dtype: keys and
        values rounded as a runtime's cache stores them (llama.cpp's draft cache: float16)."""
        s, eps, size = self.shape, self.shape.eps, self.settings.block_size
        n_anchors, length = anchors.numel(), features.shape[0]
        g = rms(features @ self.fc.T, self.hidden_norm, eps)
        tokens = torch.full((n_anchors, size), self.settings.mask_token_id, dtype=torch.int64)
        tokens[:, 0] = anchor_tokens
        positions = (anchors[:, None] + torch.arange(size)[None]).reshape(-1)  # [A x B]
        x = self.embeddings[tokens]  # [A, B, hidden]
        hidden_mask = torch.arange(length)[None, :] >= anchors[:, None]  # [A, T]: context keys past the anchor
        group = s.heads // s.kv_heads
        for block in self.blocks:
            context_k = rope(rms((g @ block.k_proj.T).view(length, s.kv_heads, s.head_dim), block.k_norm, eps),
                             torch.arange(length), s.rope_theta)
            context_v = (g @ block.v_proj.T).view(length, s.kv_heads, s.head_dim)
            h = rms(x, block.input_layernorm, eps).reshape(n_anchors * size, -1)
            q = rope(rms((h @ block.q_proj.T).view(-1, s.heads, s.head_dim), block.q_norm, eps), positions, s.rope_theta)
            k = rope(rms((h @ block.k_proj.T).view(-1, s.kv_heads, s.head_dim), block.k_norm, eps), positions,
                     s.rope_theta)
            v = (h @ block.v_proj.T).view(-1, s.kv_heads, s.head_dim)
            if kv_dtype is not None:
                context_k, context_v = context_k.to(kv_dtype).float(), context_v.to(kv_dtype).float()
                k, v = k.to(kv_dtype).float(), v.to(kv_dtype).float()
            q = q.view(n_anchors, size, s.heads, s.head_dim)
            k = k.view(n_anchors, size, s.kv_heads, s.head_dim).repeat_interleave(group, 2)
            v = v.view(n_anchors, size, s.kv_heads, s.head_dim).repeat_interleave(group, 2)
            scale = 1.0 / math.sqrt(s.head_dim)
            to_context = torch.einsum("abhd,thd->ahbt", q, context_k.repeat_interleave(group, 1)) * scale
            to_context = to_context.masked_fill(hidden_mask[:, None, None, :], float("-inf"))
            to_block = torch.einsum("abhd,achd->ahbc", q, k) * scale
            weights = torch.cat([to_context, to_block], -1).softmax(-1)
            attended = (torch.einsum("ahbt,thd->abhd", weights[..., :length], context_v.repeat_interleave(group, 1))
                        + torch.einsum("ahbc,achd->abhd", weights[..., length:], v))
            x = x + attended.reshape(n_anchors, size, -1) @ block.o_proj.T
            m = rms(x, block.post_attention_layernorm, eps)
            x = x + (functional.silu(m @ block.gate_proj.T) * (m @ block.up_proj.T)) @ block.down_proj.T
        head = self.lm_head if head_rows is None else self.lm_head[head_rows]
        out = rms(x[:, 1:], self.norm, eps)
        return (q8_0(out) if self.quantized_head else out) @ head.T

    def zlab_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors under z-lab's DFlashDraftModel names, as llama.cpp's converter reads them."""
        tensors = {"fc.weight": self.fc, "hidden_norm.weight": self.hidden_norm, "norm.weight": self.norm}
        for index, block in enumerate(self.blocks):
            for name in LAYER_TENSORS:
                where = f"layers.{index}." + (f"{SUBMODULE[name]}." if name in SUBMODULE else "")
                tensors[f"{where}{name}.weight"] = getattr(block, name)
        return {name: tensor.detach().float().contiguous() for name, tensor in tensors.items()}

    def load_zlab(self, tensors: dict[str, torch.Tensor]) -> None:
        mine = dict(self.named_parameters())
        by_name = {}
        for name in mine:
            if name.startswith("blocks."):
                _, index, leaf = name.split(".")
                by_name[f"layers.{index}." + (f"{SUBMODULE[leaf]}." if leaf in SUBMODULE else "") + f"{leaf}.weight"] = name
            else:
                by_name[f"{name}.weight"] = name
        with torch.no_grad():
            for name, tensor in tensors.items():
                if name in by_name:
                    mine[by_name[name]].copy_(tensor.float())


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """x as ggml's quantize_row_q8_0 leaves it for a dot product with quantized weights: per block
    of 32, round(x / d) with d = max |x| / 127, times d stored as float16."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    rounded = torch.sign(blocks * inverse) * torch.floor((blocks * inverse).abs() + 0.5)  # roundf: half away from 0
    return (rounded * d.half().float()).reshape(x.shape)


# Training recipe, chosen on the SmolLM2 corpus with a held-out sixth (docs/drafter-heads.md):
# rows weighted exp(-(i - 1) / ROW_DECAY), as DFlash's paper weighs block positions, since a
# block is accepted only up to its first miss, so row 1 matters most (equal weights: 4% held-out
# row-1 agreement; these: 11%); one sequence per step, gradients clipped at CLIP, the learning
# rate on a cosine to 0 (higher rates or larger steps collapse the rows to one frequent token).
ROW_DECAY = 1.0
CLIP = 1.0


def _block_labels(item, n_prompt: int, size: int, index: torch.Tensor):
    """Anchors and their rows' labels (draft-vocabulary indices) for one corpus sequence. In the
    continuation, the next size - 1 greedy tokens; at a prompt position only row 1, the target's
    argmax there (the tokens after it are the prompt's, not the target's), which more than doubles
    row 1's data (held-out row-1 agreement 11% -> 26%)."""
    ids = item.ids
    anchors = torch.arange(1, ids.numel() - 1)
    labels = torch.full((anchors.numel(), size - 1), IGNORED, dtype=torch.int64)
    for row, anchor in enumerate(anchors.tolist()):
        if anchor < n_prompt - 1:
            labels[row, 0] = index[item.labels[anchor]]
        else:
            following = ids[anchor + 1:anchor + size]
            labels[row, :following.numel()] = index[following]
    return anchors, labels


def train_dflash(drafter: DFlashDrafter, featured, draft_ids: torch.Tensor, corpus, training, progress=None):
    """Self-distillation: at every anchor a in the target's greedy continuation, the block drafts
    the target's next block_size - 1 greedy tokens from the features of positions before a (at a
    prompt position, row 1 only: _block_labels).
    featured[i] goes with corpus[i] (its n_prompt); the softmax is over draft_ids (the target's most
    predicted tokens; the LM head itself is the target's, frozen). Returns (steps, seconds, loss,
    first-token agreement), the last two over the last epoch."""
    torch.manual_seed(training.seed)
    generator = torch.Generator().manual_seed(training.seed)
    index = torch.full((drafter.shape.vocab,), IGNORED, dtype=torch.int64)
    index[draft_ids] = torch.arange(draft_ids.numel())
    size = drafter.settings.block_size
    weights = torch.exp(-torch.arange(size - 1, dtype=torch.float32) / ROW_DECAY)
    total = -(-len(featured) // training.batch) * training.epochs
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=training.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 0.5 * (1 + math.cos(math.pi * done / total)))
    step, started = 0, time.monotonic()
    for _ in range(training.epochs):
        order = torch.randperm(len(featured), generator=generator).tolist()
        losses, hits, counted = [], 0, 0
        for start in range(0, len(order), training.batch):
            optimizer.zero_grad()
            for i in order[start:start + training.batch]:
                item, ids = featured[i], featured[i].ids
                anchors, labels = _block_labels(item, corpus[i].n_prompt, size, index)
                if anchors.numel() == 0:
                    continue
                logits = drafter(item.features, anchors, ids[anchors], head_rows=draft_ids)
                per_token = functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     ignore_index=IGNORED, reduction="none").view(labels.shape)
                weight = (labels != IGNORED).float() * weights
                loss = (per_token * weight).sum() / weight.sum().clamp(min=1e-6)
                (loss / training.batch).backward()
                losses.append(float(loss.detach()))
                first = labels[:, 0]
                hits += int(((logits[:, 0].argmax(-1) == first) & (first != IGNORED)).sum())
                counted += int((first != IGNORED).sum())
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), CLIP)
            optimizer.step()
            schedule.step()
            step += 1
            if progress is not None:
                progress(step, total)
    return step, time.monotonic() - started, sum(losses) / max(len(losses), 1), hits / max(counted, 1)
