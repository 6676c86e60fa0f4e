"""Prompts: the built-in suite and user JSONL files.

A prompt file is JSON Lines, one object per line with string fields `id` (unique),
`category` (e.g. code, prose, structured) and `prompt`. Blank lines are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

BUILTIN_SUITES = ("builtin",)
REQUIRED_FIELDS = ("id", "category", "prompt")


class PromptError(ValueError):
    """A prompt source that cannot be read, with the file and line at fault."""


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def parse_jsonl(text: str, origin: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{origin} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptError(f"{where}: not JSON ({error.msg})") from None
        if not isinstance(item, dict):
            raise PromptError(f"{where}: expected an object with fields {', '.join(REQUIRED_FIELDS)}")
        missing = [name for name in REQUIRED_FIELDS if not isinstance(item.get(name), str) or not item[name]]
        if missing:
            raise PromptError(f"{where}: missing or empty string field(s) {', '.join(missing)}")
        if item["id"] in seen:
            raise PromptError(f"{where}: duplicate prompt id {item['id']!r}")
        seen.add(item["id"])
        prompts.append(Prompt(item["id"], item["category"], item["prompt"]))
    if not prompts:
        raise PromptError(f"{origin}: no prompts")
    return prompts


def load_prompts(source: str) -> list[Prompt]:
    """Prompts of a built-in suite (by name) or of a JSONL file (by path)."""
    if source in BUILTIN_SUITES:
        text = resources.files("crossrt").joinpath("data", "prompts", f"{source}.jsonl").read_text()
        return parse_jsonl(text, f"built-in suite {source!r}")
    path = Path(source)
    if not path.is_file():
        raise PromptError(f"prompt file not found: {path} (built-in suites: {', '.join(BUILTIN_SUITES)})")
    return parse_jsonl(path.read_text(encoding="utf-8"), str(path))
