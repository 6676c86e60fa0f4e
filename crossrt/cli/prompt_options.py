"""The options that say how prompts are fed (raw text or through a chat template; the first or
second user turn), as `run` and `parity` take them (crossrt/inputs/chat_template.py,
crossrt/run/second_turn.py, docs/prompts.md)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import click

from crossrt.inputs.chat_template import ChatRendering, apply_template
from crossrt.inputs.pairs import Pair
from crossrt.inputs.prompts import Prompt
from crossrt.run.runtime import RuntimeOptions
from crossrt.records.schema import PromptFormat
from crossrt.run.second_turn import FirstAnswerError, FirstAnswers, default_path, second_turn_prompts


def chat_options(command):
    for option in reversed([
        click.option("--chat/--raw", "chat", default=None,
                     help="--chat: render every prompt through the chat template; --raw: feed every prompt as "
                     "raw text. Default: chat prompts (benchmark questions, JSONL with \"chat\": true) are "
                     "rendered when the pair has a template, the rest fed raw."),
        click.option("--chat-template", "chat_template", type=click.Path(path_type=Path, dir_okay=False, exists=True),
                     help="Jinja chat template file, instead of the pair manifest's chat_template or the target "
                     "model's own (GGUF tokenizer.chat_template, HF chat_template.jinja / tokenizer_config.json)."),
        click.option("--template-var", "template_vars", multiple=True, metavar="NAME=VALUE",
                     help="A variable for the chat template, e.g. enable_thinking=false (VALUE read as JSON "
                     "where it parses); repeatable."),
        click.option("--turn", type=click.IntRange(1, 2), default=1, show_default=True,
                     help="Which user turn of the questions to run. 2: MT-Bench's second turn, the conversation "
                     "[turn 1, the target's answer, turn 2] rendered through the chat template (so not "
                     "with --raw). The answer is the target's plain greedy output on turn 1 (--max-new-tokens "
                     "tokens, to EOS), made once by llama-cpp (GGUF target) or transformers (HF folder) and kept "
                     "in --first-answers, so every runtime gets the same ids. Prompt ids end in -turn2; questions "
                     "without a second turn are dropped."),
        click.option("--first-answers", "first_answers_file", type=click.Path(path_type=Path, dir_okay=False),
                     help="With --turn 2: the first-answers file (JSON Lines) to reuse or fill, e.g. one made by "
                     "an earlier command; an answer kept for another turn-1 prompt, target or --max-new-tokens "
                     "is refused. Default: <pair>-first-answers.jsonl beside the records."),
    ]):
        command = option(command)
    return command


def first_answers(turn: int, path: Optional[Path], folder: Path, pair: Pair, options: RuntimeOptions,
                  max_new_tokens: int) -> Optional[FirstAnswers]:
    """Where --turn 2 keeps the first answers (--first-answers, else beside the records in
    folder) and how it makes them; None for turn 1."""
    if turn == 1:
        if path is not None:
            raise FirstAnswerError("--first-answers is for --turn 2")
        return None
    return FirstAnswers(path or default_path(folder, pair), options, max_new_tokens)


def fed_prompts(prompts: Sequence[Prompt], pair: Pair, chat: Optional[bool], chat_template: Optional[Path],
                template_vars: Sequence[str], answers: Optional[FirstAnswers] = None,
                ) -> tuple[list[Prompt], Optional[ChatRendering], PromptFormat]:
    """The prompts as fed, the rendering and the record's account of them; given answers
    (--turn 2), the second-turn prompts, their first answers read or made through answers."""
    if answers is not None and chat is False:
        raise FirstAnswerError("--turn 2 renders a conversation through the chat template: not with --raw")
    mode = "auto" if chat is None else "chat" if chat else "raw"
    fed, rendering, prompt_format = apply_template(prompts, pair, mode, chat_template, template_vars)
    if answers is None:
        return fed, rendering, prompt_format
    second, digest = second_turn_prompts(fed, pair, rendering, answers)
    return second, rendering, dataclasses.replace(prompt_format, templated=tuple(p.id for p in second), turn=2,
                                                  first_answers_sha256=digest)
