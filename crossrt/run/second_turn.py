"""MT-Bench's second turn: each question's conversation [user turn 1, the target's answer,
user turn 2] rendered once through the chat template, the answer being the target's own plain
greedy output on turn 1.

The answer is made once, by the in-process runtime that loads the pair's target (llama-cpp for
a GGUF target, transformers for an HF folder, the same file the chat template is read from),
and kept in a first-answers file (JSON Lines, one answer per question), so every runtime of a
comparison, and every later command given the same file, is fed the same second-turn prompt:
an answer made again by each runtime would differ wherever the runtimes' greedy outputs part.
A kept answer is reused only when it was made for the same turn-1 prompt (the digest of its
text as fed, as a run record's prompt_sha256), by the same target file and with the same token
budget; any other is refused, never silently made again. Answers for questions the file does
not hold yet are made and added to it. The runtime answers where crossrt/run/isolation.py places
it (a process of its own: a crash is one line, and the file keeps only what it held).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from crossrt.inputs.chat_template import ChatRendering, user_turn
from crossrt.errors import PromptRefused
from crossrt.records.journal import storage_error, write_atomically
from crossrt.run.crashes import RuntimeCrashed
from crossrt.run.isolation import call_safely
from crossrt.speculative.loop import greedy_generate
from crossrt.inputs.pairs import Pair, PairError, sha256_of
from crossrt.inputs.prompts import Prompt, PromptError, json_lines
from crossrt.run.resume import prompt_sha256
from crossrt.run.runtime import RuntimeOptions, open_runtime

ANSWERS_NAME = "first-answers.jsonl"


class FirstAnswerError(PromptError):
    """A first-answers file that cannot be read or does not fit the run, or a second turn that
    cannot be made; the message names the file or the question."""


@dataclass(frozen=True)
class FirstAnswer:
    """The target's greedy answer to one question's first turn, as the answers file keeps it."""

    id: str  # the question's prompt id (turn 1)
    prompt_sha256: str  # of the turn-1 text as fed: the record's prompt_sha256 of a turn-1 run
    target_sha256: str  # of the target file that answered, as the record's pair.target.sha256
    max_new_tokens: int
    runtime: str  # the runtime that made it, with its version
    answer_ids: tuple[int, ...]  # as generated, a final EOS included
    text: str  # answer_ids without the final EOS, decoded: the assistant turn rendered


@dataclass(frozen=True)
class FirstAnswers:
    """Where the answers are kept, and how a missing one is made."""

    path: Path
    options: RuntimeOptions
    max_new_tokens: int


def default_path(folder: Path, pair: Pair) -> Path:
    """The answers file of a pair's runs in folder (runs of other pairs there keep their own)."""
    return Path(folder) / f"{pair.name}-{ANSWERS_NAME}"


def _read(path: Path) -> dict[str, FirstAnswer]:
    if not path.exists():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise storage_error(path, error, doing="read", option="--first-answers") from None
    except UnicodeDecodeError as error:
        raise FirstAnswerError(f"{path}: not a first-answers file ({error})") from None
    names = {f.name for f in dataclasses.fields(FirstAnswer)}
    answers: dict[str, FirstAnswer] = {}
    for item, where in json_lines(text, str(path), FirstAnswerError):
        if set(item) != names or not isinstance(item["text"], str) \
                or not isinstance(item["answer_ids"], list) or not all(type(i) is int for i in item["answer_ids"]):
            raise FirstAnswerError(f"{where}: not a first answer (expected the fields "
                                   f"{', '.join(sorted(names))})")
        answer = FirstAnswer(**{**item, "answer_ids": tuple(item["answer_ids"])})
        answers[answer.id] = answer
    return answers


def _write(path: Path, answers: Sequence[FirstAnswer]) -> None:
    lines = [json.dumps(dataclasses.asdict(answer), ensure_ascii=False) + "\n" for answer in answers]
    write_atomically(path, "".join(lines).encode(), option="--first-answers")


def _check(answer: FirstAnswer, wanted: FirstAnswer, path: Path) -> None:
    """Refuse a kept answer made for another turn-1 prompt, target or budget."""
    for name, what in (("prompt_sha256", "another turn-1 prompt (its text or rendering changed)"),
                       ("target_sha256", "another target model"), ("max_new_tokens", "another --max-new-tokens")):
        kept, now = getattr(answer, name), getattr(wanted, name)
        if kept != now:
            raise FirstAnswerError(f"{path}: the answer to {answer.id} was made for {what} ({name} {kept}, this run "
                                   f"{now}); give another --first-answers file, or delete this one to make them again")


def _target(pair: Pair) -> tuple[str, Path]:
    """The runtime that answers and the target file it loads: the file the template is read from."""
    try:
        path = pair.path("target", ("gguf", "hf"))
    except PairError as error:
        raise FirstAnswerError(f"--turn 2: {error}") from None
    return ("llama-cpp" if path.suffix == ".gguf" else "transformers"), path


def _answer(prompts: Sequence[Prompt], pair: Pair, source: FirstAnswers,
            wanted: dict[str, FirstAnswer]) -> list[FirstAnswer]:
    """The target's greedy answers to prompts' first turns, in one model load."""
    name, path = _target(pair)
    try:
        return call_safely(name, _answered, name, path, list(prompts), source, wanted)
    except RuntimeCrashed as crash:
        raise crash.with_detail(f"while making --turn 2's first answers, none of them kept in {source.path}") from None


def _answered(name: str, path: Path, prompts: Sequence[Prompt], source: FirstAnswers,
              wanted: dict[str, FirstAnswer]) -> list[FirstAnswer]:
    runtime = open_runtime(name, dataclasses.replace(source.options, executable=None))
    info = runtime.info()
    made_by = f"{info.name} {info.version}, {info.kv_cache} KV cache, flash_attn {info.flash_attn}"
    made = []
    with runtime.load(path) as target:
        for prompt in prompts:
            try:
                ids = greedy_generate(target, target.tokenize(prompt.text), source.max_new_tokens).output_ids
            except PromptRefused as error:
                raise FirstAnswerError(f"--turn 2: {prompt.id}: the target cannot answer its first turn: "
                                       f"{error}") from None
            text_ids = ids[:-1] if ids and ids[-1] in target.eog_ids else ids
            made.append(dataclasses.replace(wanted[prompt.id], runtime=made_by, answer_ids=tuple(ids),
                                            text=target.detokenize(text_ids)))
    return made


def _second_turn(prompt: Prompt, answer: FirstAnswer, rendering: ChatRendering) -> Prompt:
    first, second = prompt.rendered_from, prompt.later_turns[0]
    earlier = (("user", first), ("assistant", answer.text))
    messages = [{"role": role, "content": content} for role, content in earlier] + user_turn(second)
    return Prompt(f"{prompt.id}-turn2", prompt.category, rendering.fed_text(rendering.render(messages)), chat=True,
                  rendered_from=second, earlier_turns=earlier)


def second_turn_prompts(fed: Sequence[Prompt], pair: Pair, rendering: Optional[ChatRendering],
                        source: FirstAnswers) -> tuple[list[Prompt], str]:
    """The second-turn prompts of the templated turn-1 prompts fed (those without a second
    turn dropped), and the sha256 of the answers file they were made from."""
    if rendering is None:
        raise FirstAnswerError(f"--turn 2 needs a chat template (pair {pair.name!r} has none, or --raw was given): "
                               "a second turn is a conversation, and raw text of one would be arbitrary; give "
                               "--chat-template FILE")
    asked = [p for p in fed if p.later_turns and p.rendered_from is not None]
    if not asked:
        raise FirstAnswerError("--turn 2: none of the prompts has a second turn (MT-Bench's questions do, and "
                               "Spec-Bench's first 80)")
    target_sha256 = sha256_of(_target(pair)[1])
    wanted = {p.id: FirstAnswer(p.id, prompt_sha256(p), target_sha256, source.max_new_tokens, "", (), "")
              for p in asked}
    kept = _read(source.path)
    for prompt in asked:
        if prompt.id in kept:
            _check(kept[prompt.id], wanted[prompt.id], source.path)
    missing = [p for p in asked if p.id not in kept]
    if missing:
        kept.update((answer.id, answer) for answer in _answer(missing, pair, source, wanted))
        _write(source.path, list(kept.values()))
    try:
        digest = hashlib.sha256(source.path.read_bytes()).hexdigest()
    except OSError as error:
        raise storage_error(source.path, error, doing="read", option="--first-answers") from None
    return [_second_turn(p, kept[p.id], rendering) for p in asked], digest
