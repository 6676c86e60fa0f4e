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
