"""Bugs planted in one runtime's verification path only, to show what parity catches.

Where crossrt/builders/plants.py edits a model file (a bug in the model's function), these edit
how the transformers runtime computes a *verification-shaped* call: more than one token on a
non-empty cache, the shape of a speculative step and never of plain greedy decoding (a prompt
pass runs on an empty cache, a decode is one token). Plain greedy output stays exact; only
speculative output can leave it, as with the bugs users report (llama.cpp#27306, vllm#54506).

A plant is switched on by CROSSRT_PLANT_VERIFY=<kind>[:<size>][,...] in the environment, so every process of
a command (each run's, the re-scoring's) carries it; the transformers runtime installs it before
a model loads (TransformersRuntime.load). scripts/planted_bugs.py --verification prints
which kinds parity catches; tests/test_planted_path.py asserts each fails.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np

from crossrt.errors import SettingsError

PLANT_ENV = "CROSSRT_PLANT_VERIFY"


@dataclass(frozen=True)
class PathPlant:
    name: str
    what: str


PATH_PLANTS = (
    PathPlant("attention-scale", "every layer's query scaled (x1.13 unless sized): attention at another temperature"),
    PathPlant("positions", "positions off by one within the batch: every token after the first one further on"),
    PathPlant("mask", "the causal mask lets each token of the batch see the next one"),
    PathPlant("kv-slots", "the batch's last two tokens' keys and values written to each other's slots"),
    PathPlant("drafter-rollback", "the drafter's cache not rolled back after a rejection (the target's is; "
                                  "drafter-rollback:N: models of fewer than N layers)"),
)
# Not a verification-path bug: fresh random noise on every call's logits, whatever its shape (a
# nondeterministic runtime, whose noise control would otherwise widen with it).
CALL_NOISE = PathPlant("call-noise", "fresh Gaussian noise of sigma 0.01 on every call's logits")
# The kinds that change the target's verification-shaped calls (the drafter's rollback is apart).
VERIFICATION_KINDS = tuple(plant.name for plant in PATH_PLANTS if plant.name != "drafter-rollback")
SCALE = 1.13
NOISE_SIGMA = 0.01


def plants() -> dict[str, str]:
    """The kinds named in the environment (kind[:size], comma-separated: a plant in the target's
    verification path and one in the drafter's rollback are independent), each with its size as
    given ("" for none); an unknown name is an error, not ignored."""
    value = os.environ.get(PLANT_ENV)
    if not value:
        return {}
    kinds = [plant.name for plant in (*PATH_PLANTS, CALL_NOISE)]
    found = {}
    for part in value.split(","):
        name, _, given = part.strip().partition(":")
        if name not in kinds:
            raise SettingsError(f"{PLANT_ENV}={value!r}: kinds are {', '.join(kinds)} (attention-scale:SCALE, "
                                "call-noise:SIGMA and drafter-rollback:LAYERS take a size), comma-separated")
        found[name] = given
    return found


def size(name: str, default: float) -> float:
    """The size the environment gives plant name (kind:size), else default."""
    given = plants().get(name, "")
    try:
        return float(given) if given else default
    except ValueError:
        raise SettingsError(f"{PLANT_ENV}: {given!r} is not a number") from None


def install(session: type) -> None:
    """Wrap the transformers runtime's session class so that each call follows the plant the
    environment names at that moment (none: the clean call). Once per process."""
    if not plants() or getattr(session, "_plants_installed", False):
        return
    clean_forward, clean_drop, clean_init = session._forward, session._drop, session.__init__
    session._plants_installed = True

    def forward(self, tokens, rows):
        names = plants()
        if "call-noise" in names:
            logits = clean_forward(self, tokens, rows)
            return logits + _rng.normal(0.0, size("call-noise", NOISE_SIGMA), logits.shape).astype(logits.dtype)
        name = next((name for name in names if name in VERIFICATION_KINDS), None)
        if name is None or len(tokens) < 2 or self._n_past == 0:
            return clean_forward(self, tokens, rows)
        if name == "attention-scale":
            with _scaled_queries(self._model):
                return clean_forward(self, tokens, rows)
        if name == "kv-slots":
            logits = clean_forward(self, tokens, rows)
            _swap_last_two(self._cache)
            return logits
        return _forward_with(self, tokens, rows, name)

    def init(self, loaded, options):
        clean_init(self, loaded, options)
        layers = self._model.config.get_text_config().num_hidden_layers
        _layers_seen.append(layers)
        # The drafter: a model of fewer layers than drafter-rollback:N says, else than the largest loaded.
        self._plant_skips_crop = layers < size("drafter-rollback", max(_layers_seen))

    def drop(self, n_keep):
        if "drafter-rollback" in plants() and n_keep > 0 and self._plant_skips_crop:
            return None  # the rejected drafts stay in the cache, read by every later draft
        return clean_drop(self, n_keep)

    session._forward, session._drop, session.__init__ = forward, drop, init


_layers_seen: list[int] = []  # hidden layers of each model loaded in this process
_rng = np.random.default_rng()  # unseeded: every call's noise is new


@contextlib.contextmanager
def _scaled_queries(model):
    """Every attention layer's query (after its norm, where it has one) scaled by SCALE."""
    scale = size("attention-scale", SCALE)
    hooks = []
    for module in model.modules():
        target = getattr(module, "q_norm", None) or getattr(module, "q_proj", None)
        if target is not None and hasattr(module, "k_proj"):
            hooks.append(target.register_forward_hook(lambda _m, _i, output: output * scale))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def _swap_last_two(cache) -> None:
    import torch

    with torch.inference_mode():
        _swap(cache)


def _swap(cache) -> None:
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if keys is not None and keys.shape[-2] >= 2:
            for tensor in (layer.keys, layer.values):
                last = tensor[..., -1, :].clone()
                tensor[..., -1, :] = tensor[..., -2, :]
                tensor[..., -2, :] = last


def _forward_with(session, tokens, rows, name):
    """The session's forward with wrong positions or a leaking mask for this batch."""
    import torch

    from crossrt.run.runtime import Rows

    n = len(tokens)
    past = session._n_past
    input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=session._device)
    positions = torch.arange(past, past + n, device=session._device)
    extra = {}
    if name == "positions":
        positions = positions + (torch.arange(n, device=session._device) > 0).long()
    else:  # mask: token j sees the cache, itself and the tokens up to j + 1
        dtype = session._model.dtype
        allowed = torch.ones(n, past + n, dtype=torch.bool, device=session._device)
        allowed[:, past:] = torch.tril(torch.ones(n, n, dtype=torch.bool, device=session._device), diagonal=1)
        mask = torch.zeros(n, past + n, dtype=dtype, device=session._device)
        mask[~allowed] = torch.finfo(dtype).min
        extra["attention_mask"] = mask[None, None]
    with torch.inference_mode():
        keep = 1 if rows is Rows.LAST else 0
        output = session._model(input_ids=input_ids, position_ids=positions.unsqueeze(0), cache=session._cache,
                                use_cache=True, logits_to_keep=keep, **extra)
    if rows is Rows.NONE:
        return np.empty((0, session.n_vocab), dtype=np.float32)
    return output.logits[0].float().cpu().numpy()
