"""The options that say how prompts are fed (raw text or through a chat template), as `run` and
`parity` take them (crossrt/chat_template.py, docs/prompts.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import click

from crossrt.chat_template import ChatRendering, apply_template
from crossrt.pairs import Pair
from crossrt.prompts import Prompt
from crossrt.schema import PromptFormat


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
    ]):
        command = option(command)
    return command


def fed_prompts(prompts: Sequence[Prompt], pair: Pair, chat: Optional[bool], chat_template: Optional[Path],
                template_vars: Sequence[str]) -> tuple[list[Prompt], Optional[ChatRendering], PromptFormat]:
    mode = "auto" if chat is None else "chat" if chat else "raw"
    return apply_template(prompts, pair, mode, chat_template, template_vars)
