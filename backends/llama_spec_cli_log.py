"""What llama-speculative-simple prints, read (backends/llama_spec_cli.py runs it): its steps
and statistics from its debug log, and the target's vocabulary in-process to tokenize and print
as it does."""

from __future__ import annotations

import ctypes
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from crossrt.run.runtime import RuntimeFailure
# llama_cpp: None where it did not import (reported by check_available)
from crossrt.backends.llama_cpp import llama_cpp, vocab_model

TOOL = "llama-speculative-simple"

_EVENT = re.compile(
    rb"draft candidate\s+(?P<rank>\d+), pos\s+(?P<pos>\d+):\s+(?P<token>\d+) \("
    rb"|accepted (?P<accepted>\d+)/(?P<drafted>\d+) draft tokens, the last target token is: \((?P<last>-?\d+)\)")
_PHASE = re.compile(rb"(?P<name>encoded|decoded)\s+(?P<n>\d+) tokens in\s+(?P<s>[\d.]+) seconds, "
                    rb"speed:\s+(?P<speed>\S+) t/s")
# LLAMA_BATCH_DEBUG's listing of an input batch (src/llama-batch.cpp, init and ubatch_print):
# its start, each token's place and id (then its piece, which may hold any bytes), its end.
_BATCH = re.compile(
    rb"(?P<begin>init: input batch info:)|(?P<end>ubatch_print:\s+\]\n)"
    rb"|ubatch_print:\s+(?P<index>\d+): id =\s+(?P<id>-?\d+) \("
    rb"|accepted (?P<accepted>\d+)/(?P<drafted>\d+) draft tokens, the last target token is: \((?P<last>-?\d+)\)")
_STAT = re.compile(rb"(?P<name>n_predict|n_drafted|n_accept)\s+= (?P<value>\d+)")


@dataclass(frozen=True)
class ToolStep:
    draft: tuple[int, ...]
    accepted: int
    last: int  # the step's last emitted token (an accepted EOS when one ends the step)


@dataclass(frozen=True)
class ToolRun:
    """What one run of the tool printed: its log events and its final statistics."""

    n_prompt: int
    steps: tuple[ToolStep, ...]
    n_predict: int
    n_drafted: int
    n_accept: int
    prefill_s: float
    decode_s: float


def _seconds(match: re.Match) -> float:
    # tokens / speed keeps the precision the printed seconds (3 decimals) lose
    speed = float(match["speed"])
    n = int(match["n"])
    return n / speed if math.isfinite(speed) and speed > 0 else float(match["s"])


def parse_log(log: bytes, batches: bool = False) -> Optional[ToolRun]:
    """The run in the tool's stderr; None when its statistics tail is missing (lost at exit).
    batches: each step's draft is read from the target's verification batch (LLAMA_BATCH_DEBUG),
    for the n-gram types, which log no draft candidates; else from draft-simple's candidate lines."""
    stats = {m["name"].decode(): int(m["value"]) for m in _STAT.finditer(log)}
    phases = {m["name"].decode(): m for m in _PHASE.finditer(log)}
    if len(stats) < 3 or len(phases) < 2:
        return None
    steps = _batch_steps(log) if batches else _candidate_steps(log)
    return ToolRun(int(phases["encoded"]["n"]), tuple(steps), stats["n_predict"],
                   stats["n_drafted"], stats["n_accept"], _seconds(phases["encoded"]), _seconds(phases["decoded"]))


def _candidate_steps(log: bytes) -> list[ToolStep]:
    steps: list[ToolStep] = []
    candidates: dict[int, int] = {}
    for event in _EVENT.finditer(log):
        if event["rank"] is not None:
            if event["rank"] == b"0":
                candidates[int(event["pos"])] = int(event["token"])
            continue
        n_draft = int(event["drafted"])
        if any(pos not in candidates for pos in range(n_draft)):
            raise RuntimeFailure(f"{TOOL} log: a step verified {n_draft} draft tokens but logged "
                                 f"candidates for positions {sorted(candidates)}")
        steps.append(ToolStep(tuple(candidates[pos] for pos in range(n_draft)), int(event["accepted"]),
                              int(event["last"])))
        candidates = {}
    return steps


def _batch_steps(log: bytes) -> list[ToolStep]:
    """Each step's draft: the last input batch the target decoded before the step's line, which
    is [the last token] + the draft (examples/speculative-simple; src/llama-batch.cpp prints every
    input batch's ids under LLAMA_BATCH_DEBUG). Its first id is checked against the step before."""
    steps: list[ToolStep] = []
    batch: Optional[list[int]] = None
    reading = False
    for event in _BATCH.finditer(log):
        if event["begin"] is not None:
            batch, reading = [], True
        elif event["end"] is not None:
            reading = False
        elif event["id"] is not None:
            if reading and batch is not None:
                if int(event["index"]) != len(batch):
                    raise RuntimeFailure(f"{TOOL} log: batch token {int(event['index'])} logged at place {len(batch)}")
                batch.append(int(event["id"]))
        else:
            n_draft = int(event["drafted"])
            if batch is None or len(batch) != n_draft + 1 or (steps and batch[0] != steps[-1].last):
                raise RuntimeFailure(f"{TOOL} log: a step verified {n_draft} draft tokens after the last token, but "
                                     f"its batch held {batch}")
            steps.append(ToolStep(tuple(batch[1:]), int(event["accepted"]), int(event["last"])))
            batch = None
    return steps


def step_tokens(step: ToolStep, eog: frozenset[int]) -> list[int]:
    """The tokens a step emitted. After a fully accepted draft ending in EOS the tool stops at
    that EOS and its bonus token is never shown (but it counts in n_predict)."""
    if step.draft and step.accepted == len(step.draft) and step.draft[-1] in eog:
        return list(step.draft)
    return list(step.draft[:step.accepted]) + [step.last]


class Vocab:
    """The target's vocabulary in-process, at the tool's llama.cpp commit."""

    def __init__(self, path: Path):
        self._model = vocab_model(path)
        vocab = self._model.vocab
        self.eog_ids = frozenset(t for t in range(self._model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))

    def tokenize(self, text: str) -> list[int]:
        # common_tokenize(ctx, prompt, add_special=true, parse_special=true), as the tool calls it
        return self._model.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    def piece(self, token: int) -> bytes:
        """common_token_to_piece(ctx, token): special tokens rendered, as the tool prints them."""
        size = 64
        while True:
            buffer = (ctypes.c_char * size)()
            n = llama_cpp.llama_token_to_piece(self._model.vocab, token, buffer, size, 0, True)
            if n >= 0:
                return bytes(buffer[:n])
            size = -n

    def printed(self, ids: Sequence[int]) -> bytes:
        """ids as the tool prints them: with printf's %s, so each piece ends at a NUL byte."""
        return b"".join(self.piece(t).split(b"\0")[0] for t in ids)

    def close(self) -> None:
        self._model.close()
