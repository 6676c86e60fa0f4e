"""Prompts: the built-in suites and prompt files in crossrt's and in published formats.

crossrt's own format is JSON Lines, one object per line with string fields `id` (unique),
`category` (e.g. code, prose, structured) and `prompt`. Blank lines are skipped, and a file
whose name ends in `.gz` is read through gzip (HumanEval is published as HumanEval.jsonl.gz).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

# One suite per category, written for crossrt (crossrt/data/prompts/<category>.jsonl).
CATEGORIES = ("code", "prose", "structured", "math", "chat")
# "builtin" is the short suite the tiny pair's tokenizer was trained on and the tests run;
# "categories" is every category suite, in CATEGORIES order.
BUILTIN_SUITES = ("builtin", "categories") + CATEGORIES
REQUIRED_FIELDS = ("id", "category", "prompt")


class PromptError(ValueError):
    """A prompt source that cannot be read, with the file and line at fault."""


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def _text_field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise PromptError(f"{where}: missing or empty string field {name!r}")
    return value


def _crossrt_prompt(item: dict, where: str) -> Prompt:
    missing = [name for name in REQUIRED_FIELDS if not isinstance(item.get(name), str) or not item[name]]
    if missing:
        # A published file given as a plain path: say which scheme would read it.
        hint = ""
        if "turns" in item and "question_id" in item:
            hint = " (this looks like a Spec-Bench or MT-Bench question.jsonl: use specbench:PATH or mtbench:PATH)"
        elif "task_id" in item:
            hint = " (this looks like HumanEval: use humaneval:PATH)"
        raise PromptError(f"{where}: missing or empty string field(s) {', '.join(missing)}{hint}")
    return Prompt(item["id"], item["category"], item["prompt"])


def _question_reader(prefix: str) -> Callable[[dict, str], Prompt]:
    """Spec-Bench and MT-Bench question.jsonl: question_id, category, turns (one string per
    user turn). crossrt runs single prompts, so the first turn is the prompt."""

    def read(item: dict, where: str) -> Prompt:
        question_id = item.get("question_id")
        if isinstance(question_id, bool) or not isinstance(question_id, (int, str)) or question_id == "":
            raise PromptError(f"{where}: missing question_id (an integer or string)")
        turns = item.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise PromptError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return Prompt(f"{prefix}-{question_id}", _text_field(item, "category", where), turns[0])

    return read


def _humaneval_prompt(item: dict, where: str) -> Prompt:
    """HumanEval: task_id (e.g. HumanEval/0) and prompt (a signature and docstring to complete)."""
    return Prompt(_text_field(item, "task_id", where), "code", _text_field(item, "prompt", where))


# Scheme of a prompt source -> reader of one JSON object. A source without a scheme is crossrt's.
READERS: dict[str, Callable[[dict, str], Prompt]] = {
    "jsonl": _crossrt_prompt,
    "specbench": _question_reader("specbench"),
    "mtbench": _question_reader("mtbench"),
    "humaneval": _humaneval_prompt,
}


def parse_prompts(text: str, origin: str, scheme: str = "jsonl") -> list[Prompt]:
    """Prompts of one JSON Lines text in the format scheme names (a key of READERS)."""
    read = READERS[scheme]
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
            raise PromptError(f"{where}: expected a JSON object, got {type(item).__name__}")
        prompt = read(item, where)
        if prompt.id in seen:
            raise PromptError(f"{where}: duplicate prompt id {prompt.id!r}")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise PromptError(f"{origin}: no prompts")
    return prompts


def split_source(source: str) -> tuple[str, str]:
    """(scheme, path) of a file source: `specbench:q.jsonl` -> ("specbench", "q.jsonl");
    a bare path is crossrt's own format. Only known schemes are split off, so a Windows
    drive letter stays part of the path."""
    scheme, colon, rest = source.partition(":")
    if colon and scheme in READERS:
        return scheme, rest
    return "jsonl", source


def _builtin_text(name: str) -> str:
    return resources.files("crossrt").joinpath("data", "prompts", f"{name}.jsonl").read_text(encoding="utf-8")


def load_prompts(source: str) -> list[Prompt]:
    """Prompts of a built-in suite or of a file.

    source is one of:
      - a built-in suite: `builtin` (10 short prompts: code, prose, structured),
        `categories` (every category suite below, 20+ prompts each), or one category:
        `code`, `prose`, `structured` (JSON, YAML, tables), `math`, `chat`;
      - `PATH` or `jsonl:PATH`: crossrt's JSON Lines (id, category, prompt);
      - `specbench:PATH`: Spec-Bench's data/spec_bench/question.jsonl (question_id, category,
        turns); the first turn is the prompt, its id `specbench-<question_id>`;
      - `mtbench:PATH`: MT-Bench's question.jsonl, the same fields; ids `mtbench-<question_id>`;
      - `humaneval:PATH`: HumanEval (task_id, prompt), category `code`, ids the task ids.
    A PATH ending in .gz is decompressed. Errors name the file and line.
    """
    if source in BUILTIN_SUITES:
        names = CATEGORIES if source == "categories" else (source,)
        return [prompt for name in names
                for prompt in parse_prompts(_builtin_text(name), f"built-in suite {name!r}")]
    scheme, raw_path = split_source(source)
    path = Path(raw_path)
    if not path.is_file():
        raise PromptError(f"prompt file not found: {path} (built-in suites: {', '.join(BUILTIN_SUITES)}; "
                          f"file formats: {', '.join(f'{name}:PATH' for name in READERS)})")
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as error:
        raise PromptError(f"{path}: cannot read ({error})") from None
    return parse_prompts(text, str(path), scheme)


def source_relative_to(source: str, base: Path) -> str:
    """source with a relative file path taken from folder base (a claims file's folder)
    instead of the working directory; built-in suite names are kept as they are."""
    if source in BUILTIN_SUITES:
        return source
    scheme, raw_path = split_source(source)
    path = Path(raw_path).expanduser()
    if path.is_absolute():
        return source
    return f"{scheme}:{base / path}"


def relabel(prompts: list[Prompt], category: str) -> list[Prompt]:
    """The prompts filed under category: a claim's per-category suite is that category's
    prompts whatever the source calls them (HumanEval's are code, Spec-Bench's coding...)."""
    return [dataclasses.replace(prompt, category=category) for prompt in prompts]
