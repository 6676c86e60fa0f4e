"""Training a drafter head on a CPU by self-distillation (the head is crossrt/builders/eagle3.py).

The labels are the target's own argmax at every position of its greedy corpus
(crossrt/run/head_corpus.py): under greedy verification a draft token is accepted exactly
when it is that argmax, so the head learns what acceptance rewards. The target runs once over the
corpus (transformers, float32: its hidden states at the head's layers and its argmax are kept),
then only the head trains, so an epoch costs the head alone.

Training-time test, simplified (EAGLE3's TTT): after the pass on the target's features, `unroll`
more passes feed the head its own pre (as drafting does after the first token), each predicting
one position further; their losses weigh 0.8^step. Attention in those passes is causal over the
same pass, not the target-feature cache inference attends to: cheaper, and close enough for a
head whose job is to be the same head in every runtime.

Seeded and single-threaded by default: the same settings give the same head, bit for bit, on one
machine (the cache key holds the torch version and thread count too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as functional

from crossrt.builders.eagle3 import Eagle3Head
from crossrt.builders.head_settings import TrainingSettings

IGNORED = -100  # a position whose label is outside the draft vocabulary, or padding


@dataclass(frozen=True)
class CorpusSequence:
    """One sequence of a head's corpus (crossrt/run/head_corpus.py writes them)."""

    category: str
    ids: tuple[int, ...]  # the prompt's tokens, then the target's greedy continuation
    n_prompt: int


@dataclass(frozen=True)
class Featured:
    """One corpus sequence with what the target computed over it."""

    category: str
    ids: torch.Tensor  # [T]
    features: torch.Tensor  # [T, 3 x hidden]: the target's inputs to the head's layers
    labels: torch.Tensor  # [T]: the target's argmax after each position


@dataclass(frozen=True)
class TrainingReport:
    steps: int
    seconds: float
    loss: float  # the last epoch's mean first-pass loss
    accuracy_by_pass: tuple[float, ...]  # top-1 agreement with the target per pass, last epoch
    accuracy_by_type: dict[str, float]  # first pass, last epoch, per content type


def target_states(model, corpus: list[CorpusSequence], state_ids: tuple[int, ...],
                  progress: Optional[Callable[[int, int], None]] = None) -> list[tuple[dict, torch.Tensor]]:
    """Per corpus sequence, the target's hidden states state_ids ({i: HF hidden_states[i], [T, hidden]})
    and its argmax after each position [T] (one pass each)."""
    states = []
    with torch.no_grad():
        for done, sequence in enumerate(corpus):
            out = model(torch.tensor(sequence.ids)[None], output_hidden_states=True)
            states.append(({i: out.hidden_states[i][0] for i in state_ids}, out.logits[0].argmax(-1)))
            if progress is not None:
                progress(done + 1, len(corpus))
    return states


def featured_of(corpus: list[CorpusSequence], states: list[tuple[dict, torch.Tensor]],
                layer_ids: tuple[int, ...]) -> list[Featured]:
    """Each corpus sequence with its states (target_states) at layer_ids, concatenated in this order."""
    return [Featured(sequence.category, torch.tensor(sequence.ids), torch.cat([held[i] for i in layer_ids], -1).float(),
                     labels) for sequence, (held, labels) in zip(corpus, states)]


def draft_vocabulary(featured: list[Featured], size: int, vocab: int) -> torch.Tensor:
    """The size target ids the target predicts most often over the corpus (ties by id), filled up
    from the lowest ids, sorted: the head's output vocabulary."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for item in featured:
        counts += torch.bincount(item.labels, minlength=vocab)
    size = min(size, vocab)
    order = sorted(range(vocab), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:size]), dtype=torch.int64)


def _batch(items: list[Featured], draft_index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    length = max(item.ids.numel() for item in items)
    width = items[0].features.shape[-1]
    tokens = torch.zeros(len(items), length, dtype=torch.int64)
    features = torch.zeros(len(items), length, width)
    labels = torch.full((len(items), length), IGNORED, dtype=torch.int64)
    for row, item in enumerate(items):
        n = item.ids.numel()
        tokens[row, :n], features[row, :n], labels[row, :n] = item.ids, item.features, draft_index[item.labels]
    return tokens, features, labels


def passes(head: Eagle3Head, tokens: torch.Tensor, features: torch.Tensor, unroll: int):
    """Yield (pass, draft logits, labels slice start) for the first pass and each unrolled one.
    Pass j's pair at position p + j is (t_{p+1+j}, g), predicting t_{p+2+j} = label[p+1+j]."""
    length = tokens.shape[1]
    g = head.encode(features[:, :-1])
    for step in range(unroll + 1):
        pre, logits = head(tokens[:, 1 + step:], g, torch.arange(step, length - 1))
        yield step, logits
        g = pre[:, :-1]


def train_head(head: Eagle3Head, featured: list[Featured], settings: TrainingSettings,
               progress: Optional[Callable[[int, int], None]] = None) -> TrainingReport:
    """Train head in place on featured; progress(step, total) after each optimizer step."""
    torch.manual_seed(settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)
    draft_index = torch.full((head.shape.vocab,), IGNORED, dtype=torch.int64)
    draft_index[head.draft_ids] = torch.arange(head.draft_ids.numel())
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.learning_rate, weight_decay=0.0)
    per_epoch = -(-len(featured) // settings.batch)
    total, step, started = per_epoch * settings.epochs, 0, time.monotonic()
    for epoch in range(settings.epochs):
        last = epoch == settings.epochs - 1
        losses, hits, counted = [], [0] * (settings.unroll + 1), [0] * (settings.unroll + 1)
        by_type: dict[str, list[int]] = {}
        order = torch.randperm(len(featured), generator=generator).tolist()
        for start in range(0, len(order), settings.batch):
            items = [featured[i] for i in order[start:start + settings.batch]]
            tokens, features, labels = _batch(items, draft_index)
            loss = torch.zeros(())
            for j, logits in passes(head, tokens, features, settings.unroll):
                wanted = labels[:, 1 + j:]
                part = functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), wanted.reshape(-1),
                                                ignore_index=IGNORED)
                loss = loss + (0.8 ** j) * part
                if j == 0:
                    losses.append(float(part.detach()))
                if last:
                    right = (logits.argmax(-1) == wanted) & (wanted != IGNORED)
                    hits[j] += int(right.sum())
                    counted[j] += int((wanted != IGNORED).sum())
                    if j == 0:
                        for row, item in enumerate(items):
                            tally = by_type.setdefault(item.category, [0, 0])
                            tally[0] += int(right[row].sum())
                            tally[1] += int((wanted[row] != IGNORED).sum())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if progress is not None:
                progress(step, total)
    return TrainingReport(step, time.monotonic() - started, sum(losses) / max(len(losses), 1),
                          tuple(h / max(c, 1) for h, c in zip(hits, counted)),
                          {kind: h / max(c, 1) for kind, (h, c) in sorted(by_type.items())})
