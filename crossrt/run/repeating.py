"""Prompts whose answer repeats earlier text, for drafting by lookup (docs/ngram.md): each prompt,
then its target's own greedy continuation, then the prompt again, so the target's output copies
what the prompt holds and a lookup has something to find. The built-in prompts barely repeat
themselves; scripts/repeating_prompts.py and the n-gram tests build their prompts here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

from crossrt.inputs.prompts import Prompt
from crossrt.speculative.loop import greedy_generate
from crossrt.speculative.session import ModelSession


def repeating(target: ModelSession, prompts: Sequence[Prompt], continuation: int) -> list[Prompt]:
    """Each prompt + the target's first `continuation` greedy tokens after it + "\\n" + the prompt."""
    made = []
    for prompt in prompts:
        seen = greedy_generate(target, target.tokenize(prompt.text), continuation).output_ids
        made.append(dataclasses.replace(prompt, text=prompt.text + target.detokenize(seen) + "\n" + prompt.text))
    return made


def write_jsonl(prompts: Sequence[Prompt], path: Path) -> Path:
    """prompts as a prompts file crossrt reads back (--prompts PATH: id, category, prompt)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": p.id, "category": p.category, "prompt": p.text}) + "\n"
                            for p in prompts), encoding="utf-8")
    return path
