"""The corpus a drafter head learns from: the target's own greedy outputs.

A head drafts well when it predicts what the target would say, so it learns from the target's
greedy continuations of crossrt's built-in prompts of three content types (code, prose,
structured: crossrt/data/prompts/{code,prose,structured}.jsonl, 22 prompts each). These are not
the prompts runs default to (builtin.jsonl), so acceptance measured on those is held out. The
continuations come from llama.cpp on the target's GGUF (in-process, one thread: ~50 tokens/s for
a 135M model), the runtime whose drafting the head serves; greedy, so reproducible. Cached by the
target's digest in crossrt's cache folder: every head of one target shares it, a shorter corpus
cut from a longer one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Optional

from crossrt.builders.head_training import CorpusSequence
from crossrt.errors import CrossrtError
from crossrt.inputs.pairs import cache_dir, sha256_of
from crossrt.inputs.prompts import load_prompts
from crossrt.records.journal import write_atomically

CONTENT_TYPES = ("code", "prose", "structured")
CORPUS_VERSION = 2  # bump when what a corpus holds changes: cached corpora are then remade


class HeadCorpusError(CrossrtError, ValueError):
    """The target cannot write the corpus, said for the user."""


def corpus_path(target: Path) -> Path:
    """One corpus per target, the longest asked for: greedy decoding one token at a time is
    prefix-consistent, so a corpus of n new tokens is every longer one's continuations cut at n."""
    text = json.dumps({"version": CORPUS_VERSION, "target": sha256_of(target), "types": CONTENT_TYPES},
                      sort_keys=True)
    return cache_dir() / "head-corpora" / f"{hashlib.sha256(text.encode()).hexdigest()}.json"


def head_corpus(target: Path, new_tokens: int,
                progress: Optional[Callable[[int, int], None]] = None) -> list[CorpusSequence]:
    """The corpus for target's heads: cut from the cached one where it is as long, else written
    (progress(done, total) per prompt) and cached in its place."""
    path = corpus_path(target)
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
            if cached["new_tokens"] >= new_tokens:
                return [CorpusSequence(item["category"], tuple(item["ids"][:item["n_prompt"] + new_tokens]),
                                       item["n_prompt"]) for item in cached["sequences"]]
        except (ValueError, KeyError, TypeError):
            pass  # damaged: written again below
    sequences = _greedy_continuations(target, new_tokens, progress)
    data = {"new_tokens": new_tokens,
            "sequences": [{"category": s.category, "ids": list(s.ids), "n_prompt": s.n_prompt} for s in sequences]}
    write_atomically(path, json.dumps(data).encode(), "$CROSSRT_CACHE")
    return sequences


def _greedy_continuations(target: Path, new_tokens: int,
                          progress: Optional[Callable[[int, int], None]]) -> list[CorpusSequence]:
    from crossrt.run.runtime import Rows, RuntimeOptions, open_runtime

    prompts = [p for kind in CONTENT_TYPES for p in load_prompts(kind)]
    try:
        session = open_runtime("llama-cpp", RuntimeOptions(threads=1, n_ctx=1024)).load(target)
    except (OSError, ValueError) as error:
        raise HeadCorpusError(f"{target}: llama.cpp cannot load the target to write the head's corpus: {error}") \
            from None
    sequences = []
    try:
        ends = set(session.eog_ids)
        for done, prompt in enumerate(prompts):
            ids = session.tokenize(prompt.text)
            session.truncate(0)
            row = session.eval(ids, Rows.LAST)[0]
            continuation: list[int] = []
            while len(continuation) < new_tokens:
                token = int(row.argmax())
                continuation.append(token)
                if token in ends:
                    break
                row = session.eval([token], Rows.LAST)[0]
            sequences.append(CorpusSequence(prompt.category, tuple(ids) + tuple(continuation), len(ids)))
            if progress is not None:
                progress(done + 1, len(prompts))
    finally:
        session.close()
    return sequences
