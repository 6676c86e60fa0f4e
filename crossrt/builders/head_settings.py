"""What a drafter head is made with: every setting that changes the head, in one place, free of
torch so the command line can show defaults without loading it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Eagle3Settings:
    """Every setting runtimes default differently, written explicitly into the head's files."""

    layer_ids: tuple[int, int, int]  # the target layers whose inputs F concatenates, in this order
    norm_before_residual: bool = False  # vLLM defaults to True when absent, llama.cpp to False
    draft_vocab: int = 4096  # the head's output vocabulary: the target's most predicted tokens

    @staticmethod
    def default_layers(layers: int) -> tuple[int, int, int]:
        """llama.cpp's and vLLM's default when a head names none: [2, N // 2, N - 3]."""
        return (2, layers // 2, layers - 3)


@dataclass(frozen=True)
class TrainingSettings:
    seed: int = 0
    epochs: int = 6
    unroll: int = 2  # passes on the head's own pre after the first (training-time test)
    learning_rate: float = 3e-3
    batch: int = 8  # sequences per optimizer step
    threads: int = 1


# A DFlash drafter's training defaults (crossrt/builders/dflash.py says why these).
DFLASH_TRAINING = TrainingSettings(epochs=8, learning_rate=3e-4, batch=1)


@dataclass(frozen=True)
class DFlashSettings:
    """A DFlash block drafter's settings, written explicitly into its files (docs/drafter-heads.md)."""

    # The target layers whose outputs it reads, in z-lab's convention (HF hidden_states[i + 1];
    # llama.cpp's GGUF stores i + 1, the input of the next layer): at most N - 2 for a Llama
    # target, whose graph exposes no input past its last layer.
    layer_ids: tuple[int, ...]
    block_size: int = 8  # the anchor and block_size - 1 mask tokens: drafts of up to block_size - 1
    mask_token_id: int = 16  # SmolLM2's <empty_output>, unused in text; the target's row embeds it
    layers: int = 2  # decoder layers of the drafter
    draft_vocab: int = 4096  # training's softmax over the target's most predicted tokens (inference: all)

    @staticmethod
    def default_layers(layers: int, count: int = 4) -> tuple[int, ...]:
        """z-lab's spacing: count ids from 1 to N - 3, evenly."""
        if count == 1:
            return (layers // 2,)
        return tuple(round(1 + (layers - 4) * i / (count - 1)) for i in range(count))
