"""EAGLE3 drafting in crossrt's loop, as llama.cpp drafts with a head (common/speculative.cpp,
common_speculative_impl_draft_eagle3; docs/drafter-heads.md has the walk-through).

The head's context is a map from position P to a pair (t_{P+1}, g_P): the token after P and a
hidden state g (fc of the target's features at P for verified positions, the head's own pre for
positions it drafted). The target's every decode (its prefill and each verification batch) is
tapped (ModelSession.tap_layers): rows but the last become pairs at once; the last is held back
(pending), as its next token is not known yet. A draft seeds the pending position with the
token just chosen and runs the head from there, one token per pass, each pass adding its own
pair; drafts stop at n_max, or before a token whose top-10 probability is below p_min. After
verification the pending position moves to the last accepted one, whose g the next draft seeds
with. Speculative pairs are dropped on the next draft; verified ones are rewritten from the
target's features. So llama-speculative-simple (the last prompt token not decoded first) seeds
its first draft at the prompt's second-to-last position, and llama-server at its last.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from crossrt.errors import SettingsError
from crossrt.speculative.acceptance import Proposal
from crossrt.speculative.session import ModelSession

# The schedules whose head drafting this reproduces: llama.cpp's two tools.


def head_folder(path) -> Optional[Path]:
    """The torch-format folder of a head file (speculators' or z-lab's DFlash): path itself if a
    folder, else the folder holding the GGUF beside its config.json (as `crossrt drafter` writes
    them); None otherwise."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return folder if isinstance(config, dict) and ("speculators_model_type" in config or "dflash_config" in config) \
        else None


def load_eagle3(folder: Path, target: ModelSession, f32_kv_cache: bool = False):
    """The EAGLE3 head in folder (speculators' format, as `crossrt drafter eagle3` writes it),
    with target's token embeddings; its keys and values rounded to float16 as llama.cpp's draft
    cache stores them, unless f32_kv_cache (the runtimes' -ctkd f32). head.kv_dtype says which."""
    import torch

    from crossrt.builders.eagle3 import TargetShape, load_head
    from crossrt.builders.head_files import read_speculators, settings_of

    config, tensors = read_speculators(Path(folder))
    layer = config["transformer_layer_config"]
    shape = TargetShape(int(config["target_hidden_size"]), layer["num_attention_heads"], layer["num_key_value_heads"],
                        layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
                        layer["intermediate_size"], float(layer["rms_norm_eps"]), float(layer.get("rope_theta", 1e4)),
                        layer["vocab_size"], 0, layer.get("max_position_embeddings", 2048))
    embeddings = target.input_embeddings()
    if tuple(embeddings.shape) != (shape.vocab, shape.hidden):
        raise SettingsError(f"{folder}: the head is for a target of {shape.vocab} tokens x {shape.hidden}, this target's "
                            f"embeddings are {tuple(embeddings.shape)}: {json.dumps(config.get('architectures'))} "
                            "head of another target")
    head = load_head(tensors, shape, settings_of(config), embeddings.detach().float().cpu())
    head.eval()
    head.kv_dtype = None if f32_kv_cache else torch.float16
    _draft_in(target)
    return head


class Eagle3Drafter:
    """A Drafter (crossrt/speculative/drafters.py) proposing the head's greedy chain (module docstring)."""

    past_budget = False
    own_n_min = True
    sessions: tuple = ()  # the head's context is its pairs, as long as the target's

    def __init__(self, head, target: ModelSession, k: int, n_min: int,
                 unsure: Optional[Callable[[np.ndarray], bool]]):
        self.head, self.target, self.k, self.n_min, self.unsure = head, target, k, n_min, unsure
        self.calls = 0
        self._reset()
        target.tap_layers(head.settings.layer_ids, self.process)

    def _reset(self) -> None:
        self.pairs: dict[int, tuple[int, object]] = {}
        # Each position's keys and values, with the pair and the head's kv_dtype they were computed
        # for: stale once the pair is replaced, or a replay switches the head's arithmetic.
        self.kv: dict[int, tuple] = {}
        self.pending_pos, self.pending_g, self.verified_first, self.verified_g = -1, None, -1, None

    def close(self) -> None:
        self.target.tap_layers((), None)

    def process(self, start: int, tokens: Sequence[int], features: np.ndarray) -> None:
        """The target decoded tokens at positions start, start + 1, ... with these features
        ([tokens, 3 x hidden], float32)."""
        import torch

        if start == 0:
            self._reset()
        g = self.head.encode(torch.from_numpy(features))
        if (self.pending_pos >= 0 and self.pending_pos + 1 == start
                and self.pending_pos > max(self.pairs, default=-1)):  # a prefill split in two batches
            self.pairs[self.pending_pos] = (tokens[0], self.pending_g)
        for k in range(len(tokens) - 1):
            self.pairs[start + k] = (int(tokens[k + 1]), g[k])
        self.verified_first, self.verified_g = start, g
        self.pending_pos, self.pending_g = start + len(tokens) - 1, g[-1]

    def prefill(self, ids: Sequence[int]) -> None:
        """Nothing: the target's prefill, tapped, gave the head its pairs."""

    def mirror(self, n_keep: int, batch: Sequence[int]) -> None:
        """Nothing: the target's verification batch, tapped, gives the head its pairs."""

    def keep(self, n_keep: int) -> None:
        """The target kept n_keep tokens: the next draft seeds at the last accepted position."""
        if self.verified_g is None:
            return
        index = max(0, min(n_keep - 1 - self.verified_first, len(self.verified_g) - 1))
        self.pending_pos, self.pending_g = self.verified_first + index, self.verified_g[index]

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        """Unlike draft-simple, llama.cpp's EAGLE3 drafts up to k whatever the step's limit,
        drops a draft shorter than n_min, and only then cuts it to the limit (n_max)."""
        if self.pending_pos < 0 or n_max <= 0:
            return Proposal.chain(())
        seed = self.pending_pos
        for position in [p for p in self.pairs if p >= seed]:
            del self.pairs[position]
        self.pairs[seed] = (int(context[-1]), self.pending_g)
        draft: list[int] = []
        pre, row = self._pass(seed)
        while self.unsure is None or not self.unsure(row):
            token = int(row.argmax())
            draft.append(token)
            if len(draft) >= self.k:
                break
            self.pairs[seed + len(draft)] = (token, pre)
            pre, row = self._pass(seed + len(draft))
        return Proposal.chain(draft[:n_max] if len(draft) >= self.n_min else ())

    def _pass(self, position: int):
        """The head's pre and full-vocabulary logits (-inf outside its draft vocabulary) at
        position, attending to every pair up to it. A pair's keys and values depend on it alone,
        so they are kept while the pair stands (as llama.cpp's draft cache keeps them), computed
        once each, not every pass over the whole context."""
        import torch

        self.calls += 1
        kv_dtype = self.head.kv_dtype
        positions = sorted(p for p in self.pairs if p <= position)
        fresh = [p for p in positions if p not in self.kv or self.kv[p][0] is not self.pairs[p]
                 or self.kv[p][1] is not kv_dtype]
        if fresh:
            x, _ = self.head.inputs(torch.tensor([[self.pairs[p][0] for p in fresh]]),
                                    torch.stack([self.pairs[p][1] for p in fresh])[None])
            k, v = self.head.keys_values(x, torch.tensor(fresh), kv_dtype)
            for i, p in enumerate(fresh):
                self.kv[p] = (self.pairs[p], kv_dtype, k[0, i], v[0, i])
        token, g = self.pairs[position]
        x, xg = self.head.inputs(torch.tensor([[token]]), g[None, None])
        k = torch.stack([self.kv[p][2] for p in positions])[None]
        v = torch.stack([self.kv[p][3] for p in positions])[None]
        pre, logits = self.head.attend(x, xg, g[None, None], torch.tensor([position]), k, v, causal=False)
        row = np.full(self.head.shape.vocab, -np.inf, dtype=np.float32)
        row[self.head.draft_ids.numpy()] = logits[0, -1].numpy()
        return pre[0, -1], row


def load_dflash(folder: Path, target: ModelSession, f32_kv_cache: bool = False):
    """The DFlash drafter in folder (z-lab's DFlashDraftModel format, as `crossrt drafter dflash`
    writes it), with target's token embeddings as its embeddings and LM head (a tied target's)."""
    import torch
    from safetensors.torch import load_file

    from crossrt.builders.dflash import DFlashDrafter
    from crossrt.builders.eagle3 import TargetShape
    from crossrt.builders.head_settings import DFlashSettings

    try:
        config = json.loads((Path(folder) / "config.json").read_text())
        tensors = load_file(str(Path(folder) / "model.safetensors"))
        dflash = config["dflash_config"]
        settings = DFlashSettings(tuple(dflash["target_layer_ids"]), int(dflash.get("block_size", config.get(
            "block_size", 16))), int(dflash["mask_token_id"]), int(config["num_hidden_layers"]))
        shape = TargetShape(config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
                            config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                            config["intermediate_size"], float(config["rms_norm_eps"]),
                            float(config.get("rope_theta", 1e4)), config["vocab_size"], 0,
                            config.get("max_position_embeddings", 2048))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SettingsError(f"{folder}: not a readable DFlash drafter folder: {error}") from None
    embeddings = target.input_embeddings().detach().float().cpu()
    if tuple(embeddings.shape) != (shape.vocab, shape.hidden):
        raise SettingsError(f"{folder}: the drafter is for a target of {shape.vocab} tokens x {shape.hidden}, this "
                            f"target's embeddings are {tuple(embeddings.shape)}")
    # A tied target (SmolLM2) heads with its embeddings; llama.cpp borrows the same table.
    drafter = DFlashDrafter(shape, settings, embeddings, embeddings)
    drafter.quantized_head = bool(getattr(target, "embeddings_quantized", False))
    drafter.load_zlab(tensors)
    drafter.eval()
    drafter.kv_dtype = None if f32_kv_cache else torch.float16
    _draft_in(target)
    return drafter


def _draft_in(target: ModelSession) -> None:
    """torch set to draft beside target: no gradients, and the target's thread count (--threads),
    not torch's default of every core, whose idle threads spin against the target's on a busy
    machine (a driven EAGLE3 run took 4x the CPU time of one thread on 2 busy cores, the same drafts)."""
    import torch

    torch.set_grad_enabled(False)
    if target.threads:
        torch.set_num_threads(target.threads)


class DFlashBlockDrafter:
    """A Drafter proposing a DFlash block, as llama.cpp drafts one (common/speculative.cpp, the
    dflash implementation): the target's every decode (tapped) gives the drafter the features of
    its positions; positions the target drops (rejected drafts) are dropped too. A draft is one
    pass over [the newest token, mask x (B - 1)] at its position onward, attending to the features
    of every position before it and to the whole block; its rows are taken in order while each
    top-10 probability is at least p_min, up to min(k, B - 1); a draft shorter than n_min is
    dropped, and only then cut to the step's limit."""

    past_budget = False
    own_n_min = True
    sessions: tuple = ()

    def __init__(self, drafter, target: ModelSession, k: int, n_min: int,
                 unsure: Optional[Callable[[np.ndarray], bool]]):
        self.drafter, self.target, self.unsure = drafter, target, unsure
        self.k = min(k, drafter.settings.block_size - 1)
        self.n_min = min(n_min, self.k)
        self.calls = 0
        self.features: list = []  # one float32 row per position the target holds
        target.tap_layers(tuple(i + 1 for i in drafter.settings.layer_ids), self.process)

    def close(self) -> None:
        self.target.tap_layers((), None)

    def process(self, start: int, tokens: Sequence[int], features: np.ndarray) -> None:
        del self.features[start:]
        self.features.extend(features)

    def prefill(self, ids: Sequence[int]) -> None:
        """Nothing: the target's prefill, tapped, gave the drafter its features."""

    def mirror(self, n_keep: int, batch: Sequence[int]) -> None:
        """Nothing: the target's verification batch, tapped, gives the drafter its features."""

    def keep(self, n_keep: int) -> None:
        del self.features[n_keep:]

    def propose(self, context: Sequence[int], n_max: int) -> Proposal:
        import torch

        anchor = len(context) - 1  # the newest token, which the target has not decoded yet
        if n_max <= 0 or len(self.features) < anchor:
            return Proposal.chain(())
        self.calls += 1
        features = torch.from_numpy(np.stack(self.features[:anchor])) if anchor else \
            torch.zeros(0, len(self.drafter.settings.layer_ids) * self.drafter.shape.hidden)
        logits = self.drafter(features, torch.tensor([anchor]), torch.tensor([int(context[-1])]),
                              kv_dtype=self.drafter.kv_dtype)[0].numpy()
        draft: list[int] = []
        for row in logits[:self.k]:
            if self.unsure is not None and self.unsure(row):
                break
            draft.append(int(row.argmax()))
        return Proposal.chain(draft[:n_max] if len(draft) >= self.n_min else ())


def load_head(spec_type: str, folder: Path, target: ModelSession, f32_kv_cache: bool = False):
    """The head of spec_type (eagle3, dflash) in folder, for crossrt's loop."""
    return (load_eagle3 if spec_type == "eagle3" else load_dflash)(folder, target, f32_kv_cache)


def head_drafter(spec_type: str, head, target: ModelSession, k: int, n_min: int,
                 unsure: Optional[Callable[[np.ndarray], bool]]):
    """The Drafter that proposes with head under llama.cpp's rules for spec_type."""
    drafter_class = Eagle3Drafter if spec_type == "eagle3" else DFlashBlockDrafter
    return drafter_class(head, target, k, n_min, unsure)

