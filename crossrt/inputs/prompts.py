"""Prompts: the built-in suites and prompt files in crossrt's and in published formats.

crossrt's own format is JSON Lines, one object per line with string fields `id` (unique),
`category` (e.g. code, prose, structured) and `prompt`. Blank lines are skipped, and a file
whose name ends in `.gz` is read through gzip (HumanEval is published as HumanEval.jsonl.gz).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Optional

from crossrt.errors import CrossrtError

# One suite per category, written for crossrt (crossrt/data/prompts/<category>.jsonl).
CATEGORIES = ("code", "prose", "structured", "math", "chat")
# "builtin" is the short suite the tiny pair's tokenizer was trained on and the tests run;
# "categories" is every category suite, in CATEGORIES order.
BUILTIN_SUITES = ("builtin", "categories") + CATEGORIES
REQUIRED_FIELDS = ("id", "category", "prompt")


class PromptError(CrossrtError, ValueError):
    """A prompt source that cannot be read, with the file and line at fault."""



def refuse_non_unicode(text: str) -> None:
    """PromptRefused for a text holding a lone surrogate (JSON's "\\ud800" reads as one): not
    Unicode, so it has no UTF-8 form for any runtime to tokenize or any server to receive."""
    from crossrt.errors import PromptRefused

    surrogate = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
    if surrogate is not None:
        raise PromptRefused(f"the text is not valid Unicode: a lone surrogate {text[surrogate]!r} at character "
                            f"{surrogate}")

@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    # A user's chat turn (benchmark questions, JSONL with "chat": true), rendered through the
    # model's chat template when it has one; completion prompts (code to continue) are not.
    chat: bool = False
    # Set on a prompt rendered through a chat template (crossrt/inputs/chat_template.py): the user turn
    # it was rendered from; text is then the rendering, as fed.
    rendered_from: Optional[str] = None
    # A benchmark question's user turns after the first (MT-Bench's second turn), for
    # crossrt/run/second_turn.py; empty for single-turn prompts.
    later_turns: tuple[str, ...] = ()
    # (role, content) of the conversation before the user turn rendered_from (a second-turn
    # prompt: the first user turn and the target's answer), so a runtime that renders templates
    # itself renders the whole conversation too.
    earlier_turns: tuple[tuple[str, str], ...] = ()


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
    chat = item.get("chat", False)
    if not isinstance(chat, bool):
        raise PromptError(f"{where}: 'chat' must be true or false")
    return Prompt(item["id"], item["category"], item["prompt"], chat=chat)


def _user_turns(turns, where: str, field: str) -> list[str]:
    """A question's user turns: a non-empty list of non-empty strings."""
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise PromptError(f"{where}: {field} must be a non-empty list of non-empty strings")
    return turns


def _question_reader(prefix: str) -> Callable[[dict, str], Prompt]:
    """Spec-Bench and MT-Bench question.jsonl: question_id, category, turns (one string per
    user turn). The first turn is the prompt; the later ones are kept for --turn 2
    (crossrt/run/second_turn.py)."""

    def read(item: dict, where: str) -> Prompt:
        question_id = item.get("question_id")
        if isinstance(question_id, bool) or not isinstance(question_id, (int, str)) or question_id == "":
            raise PromptError(f"{where}: missing question_id (an integer or string)")
        turns = _user_turns(item.get("turns"), where, "'turns'")
        return Prompt(f"{prefix}-{question_id}", _text_field(item, "category", where), turns[0], chat=True,
                      later_turns=tuple(turns[1:]))

    return read


# SPEED-Bench (huggingface.co/datasets/nvidia/SPEED-Bench, its dataset card's features):
# question_id (string), category, sub_category, turns (user turns), source, src_id, difficulty,
# multiturn. Published as parquet, one config per folder: `qualitative/test-00000-of-00001.parquet`
# (11 categories), `throughput_1k/...` to `throughput_32k/...` (an input-length tier each, rows
# filed under entropy tiers as their category). Rows drawn from other datasets are published with
# this placeholder as their turns, to be filled in from the source (NVIDIA's specdec_bench, or
# Nemo-Skills' speed-bench prepare.py, which writes the filled rows as `<config>.jsonl` with
# "messages" in place of "turns").
SPEEDBENCH_PLACEHOLDER = "FULL BENCHMARK DATA SHOULD BE FETCHED FROM THE SOURCE USING SPECDEC_BENCH"
SPEEDBENCH_CONFIG = re.compile(r"(qualitative|throughput_\d+k)")


def speedbench_config(path: Path) -> Optional[str]:
    """The SPEED-Bench config a file holds, from its name or its folder's (`throughput_8k.jsonl`,
    `throughput_8k/test-00000-of-00001.parquet`); None when neither names one."""
    for name in (path.stem, path.parent.name):
        found = SPEEDBENCH_CONFIG.fullmatch(name)
        if found:
            return found.group(1)
    return None


def _speedbench_turns(item: dict, where: str) -> list[str]:
    turns = item.get("turns")
    if turns is None and isinstance(item.get("messages"), list):
        turns = [m.get("content") for m in item["messages"] if isinstance(m, dict) and m.get("role") == "user"]
    return _user_turns(turns, where, "'turns' (or 'messages')")


def _speedbench_reader(config: Optional[str]) -> Callable[[dict, str], Prompt]:
    """SPEED-Bench rows (the published parquet or JSON Lines, or prepare.py's filled ones); the
    first user turn is the prompt, the row's own category kept. A throughput tier's ids carry
    the tier (`speedbench-throughput_8k-<question_id>`), so files of several tiers can be run
    together; qualitative ids are `speedbench-<question_id>`."""
    prefix = "speedbench" if config in (None, "qualitative") else f"speedbench-{config}"

    def read(item: dict, where: str) -> Prompt:
        question_id = _text_field(item, "question_id", where)
        turns = _speedbench_turns(item, where)
        return Prompt(f"{prefix}-{question_id}", _text_field(item, "category", where), turns[0], chat=True,
                      later_turns=tuple(turns[1:]))

    return read


def _refuse_placeholders(items: list[tuple[dict, str]]) -> None:
    """Placeholder rows are refused, all counted in one message, rather than a placeholder
    measured or the published set silently cut to the rows that ship their text."""
    held = [(item, where) for item, where in items
            if isinstance(item.get("turns"), list) and item["turns"] and isinstance(item["turns"][0], str)
            and item["turns"][0].startswith(SPEEDBENCH_PLACEHOLDER)]
    if held:
        item, where = held[0]
        raise PromptError(f"{where}: {len(held)} of {len(items)} rows hold SPEED-Bench's placeholder, not their "
                          f"text (the first: question {item.get('question_id')}): fill the rows in from their "
                          "sources first (NVIDIA specdec_bench, or Nemo-Skills' speed-bench prepare.py)")


def _parquet_rows(path: Path) -> list[dict]:
    """A parquet file's rows as dicts (DuckDB, which `crossrt sweep` uses too)."""
    try:
        import duckdb
    except ImportError:
        raise PromptError(f"{path}: reading parquet needs DuckDB (pip install 'crossrt[sweep]')") from None
    try:
        with duckdb.connect() as connection:
            cursor = connection.execute("SELECT * FROM read_parquet(?)", [str(path)])
            names = [column[0] for column in cursor.description]
            return [dict(zip(names, row)) for row in cursor.fetchall()]
    except duckdb.Error as error:
        raise PromptError(f"{path}: cannot read as parquet ({str(error).splitlines()[0]})") from None


def _humaneval_prompt(item: dict, where: str) -> Prompt:
    """HumanEval: task_id (e.g. HumanEval/0) and prompt (a signature and docstring to complete)."""
    return Prompt(_text_field(item, "task_id", where), "code", _text_field(item, "prompt", where))


@dataclass(frozen=True)
class Reader:
    """How one JSON object of a prompt file becomes a Prompt, and what --help says of it."""

    read: Callable[[dict, str], Prompt]
    help: str


# Scheme of a prompt source -> its reader. A source without a scheme is crossrt's own format.
READERS: dict[str, Reader] = {
    "jsonl": Reader(_crossrt_prompt, "PATH or jsonl:PATH (id, category, prompt; optional chat)"),
    "specbench": Reader(_question_reader("specbench"), "specbench:PATH (Spec-Bench question.jsonl; --turn 2 for the "
                        "second turn)"),
    "mtbench": Reader(_question_reader("mtbench"), "mtbench:PATH (MT-Bench question.jsonl; --turn 2 for the second "
                      "turn)"),
    "humaneval": Reader(_humaneval_prompt, "humaneval:PATH (HumanEval, .jsonl or .jsonl.gz)"),
    "speedbench": Reader(_speedbench_reader(None), "speedbench:PATH (SPEED-Bench, .parquet as published or "
                         ".jsonl, rows filled in)"),
}

# Each benchmark's own category -> crossrt's content type (CATEGORIES), so readers can group by
# either. Spec-Bench's first 80 questions are MT-Bench's (10 per category); its other categories
# and SPEED-Bench's qualitative ones are named for their task. crossrt's judgement, per the kind
# of text a model writes in answer (docs/prompts.md).
CONTENT_TYPES = {
    **{name: name for name in CATEGORIES},
    "coding": "code",
    "math_reasoning": "math",
    "extraction": "structured",
    "writing": "prose", "translation": "prose", "summarization": "prose", "rag": "prose",
    "humanities": "prose", "stem": "prose", "multilingual": "prose",
    "roleplay": "chat", "reasoning": "chat", "qa": "chat",
}


def content_type(category: str) -> Optional[str]:
    """crossrt's content type of a benchmark's category; None for one crossrt does not know."""
    return CONTENT_TYPES.get(category)


def by_content_type(prompts: list[Prompt]) -> list[Prompt]:
    """The prompts filed under their content type (unknown categories keep their own)."""
    return [dataclasses.replace(p, category=content_type(p.category) or p.category) for p in prompts]


def json_lines(text: str, origin: str, error: type[CrossrtError] = PromptError) -> list[tuple[dict, str]]:
    """The JSON objects of a JSON Lines text, each with where it stands ("<origin> line N"):
    the one reader of prompt files, first-answers files and AIPerf exports. A line that is not
    a JSON object raises error, naming the line."""
    items: list[tuple[dict, str]] = []
    # JSON Lines ends lines at \n only: splitlines() would also split at U+2028, \x85... in strings
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{origin} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as problem:
            raise error(f"{where}: not JSON ({problem.msg})") from None
        except (ValueError, RecursionError) as problem:  # a number too long to convert, nesting too deep
            raise error(f"{where}: not JSON crossrt can read ({problem})") from None
        if not isinstance(item, dict):
            raise error(f"{where}: expected a JSON object, got {type(item).__name__}")
        items.append((item, where))
    return items


def read_items(items: list[tuple[dict, str]], origin: str, read: Callable[[dict, str], Prompt]) -> list[Prompt]:
    """Prompts of a file's objects, ids checked unique."""
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for item, where in items:
        prompt = read(item, where)
        if prompt.id in seen:
            raise PromptError(f"{where}: duplicate prompt id {prompt.id!r}")
        seen.add(prompt.id)
        prompts.append(prompt)
    if not prompts:
        raise PromptError(f"{origin}: no prompts")
    return prompts


def parse_prompts(text: str, origin: str, scheme: str = "jsonl") -> list[Prompt]:
    """Prompts of one JSON Lines text in the format scheme names (a key of READERS)."""
    return read_items(json_lines(text, origin), origin, READERS[scheme].read)


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
      - `humaneval:PATH`: HumanEval (task_id, prompt), category `code`, ids the task ids;
      - `speedbench:PATH`: SPEED-Bench, its published parquet or JSON Lines (question_id,
        category, turns or messages), ids `speedbench-<question_id>` (a throughput tier's,
        named by the file or its folder, `speedbench-throughput_8k-<question_id>`); a file
        with placeholder rows is refused, all of them counted.
    Benchmark questions are chat prompts (Prompt.chat); HumanEval's are completions.
    A PATH ending in .gz is decompressed. Errors name the file and line.
    """
    if source in BUILTIN_SUITES:
        names = CATEGORIES if source == "categories" else (source,)
        return [prompt for name in names
                for prompt in parse_prompts(_builtin_text(name), f"built-in suite {name!r}")]
    scheme, raw_path = split_source(source)
    path = Path(raw_path)
    if path.is_dir():  # a benchmark's checkout, say: its question file lies inside
        raise PromptError(f"{path} is a folder, not a prompt file: name the file in it, as "
                          f"{READERS[scheme].help}")
    if not path.exists():  # a pipe (--prompts <(...)) is no regular file, and is read as one
        raise PromptError(f"prompt file not found: {path} (built-in suites: {', '.join(BUILTIN_SUITES)}; "
                          f"file formats: {', '.join(f'{name}:PATH' for name in READERS)})")
    if scheme == "speedbench":
        return _speedbench_prompts(path)
    return parse_prompts(_file_text(path), str(path), scheme)


PROMPT_BYTES = 1 << 30  # the most a prompt file (decompressed) may hold: read up to it, never past


def _capped(path: Path) -> bytes:
    with open(path, "rb") as handle:
        raw = handle.read(PROMPT_BYTES + 1)
    if len(raw) > PROMPT_BYTES:
        raise PromptError(f"{path}: more than {PROMPT_BYTES >> 20} MiB: not a prompt file crossrt reads whole")
    return raw


def _capped_gunzip(raw: bytes, path: Path) -> bytes:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = inflater.decompress(raw, PROMPT_BYTES + 1)
    if len(out) > PROMPT_BYTES:
        raise PromptError(f"{path}: decompresses to more than {PROMPT_BYTES >> 20} MiB: not a prompt file crossrt "
                          "reads whole")
    if not inflater.eof:
        raise EOFError("the compressed stream ends early")
    return out


def _file_text(path: Path) -> str:
    try:
        raw = _capped(path)
        if path.suffix == ".gz":
            raw = _capped_gunzip(raw, path)
    except (OSError, EOFError, zlib.error) as error:
        raise PromptError(f"{path}: cannot read ({error})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:  # named by line, as every other fault of a prompt file is
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise PromptError(f"{path} line {line}: not UTF-8 (byte 0x{raw[error.start]:02x} at column {column}): save "
                          "the file as UTF-8") from None


def _speedbench_prompts(path: Path) -> list[Prompt]:
    """A SPEED-Bench file, parquet as published or JSON Lines; its config from its name."""
    if path.suffix == ".parquet":
        items = [(row, f"{path} row {number}") for number, row in enumerate(_parquet_rows(path), start=1)]
    else:
        items = json_lines(_file_text(path), str(path))
    _refuse_placeholders(items)
    return read_items(items, str(path), _speedbench_reader(speedbench_config(path)))


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


def sources_help() -> str:
    """What a prompt source can be, built from the suites and READERS, for --help."""
    return (f"A built-in suite ({', '.join(BUILTIN_SUITES)}) or a file: "
            + ", ".join(reader.help for reader in READERS.values()) + ".")
