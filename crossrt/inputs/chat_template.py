"""Chat templates: each chat prompt rendered once, by crossrt, and fed as the same ids to every
runtime; where a runtime renders templates itself, its rendering is kept for comparison.

The template is the first found of --chat-template, the manifest's, the GGUF's and the HF
folder's; it renders as transformers 5.24 renders (a sandboxed jinja2, --template-var
overriding), and a leading bos_token is dropped where the model adds a BOS itself (llama.cpp's
rule). Sources, rules, and what each runtime does: docs/prompts.md, "Where the template comes
from" and "Rendering rules".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from crossrt.inputs.file_facts import file_fact
from crossrt.inputs.gguf_file import gguf_metadata
from crossrt.inputs.pairs import Pair, PairError
from crossrt.inputs.vocabulary import Vocabulary, read_vocabulary
from crossrt.inputs.prompts import Prompt, PromptError
from crossrt.records.schema import PromptFormat, PromptResult

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

MODES = ("auto", "chat", "raw")


class ChatTemplateError(PromptError):
    """A chat template that cannot be found, read or rendered, naming the template."""


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    source: str  # e.g. "file:models/tiny/chat_template.jinja", "gguf:model.gguf"
    bos_token: str
    eos_token: str
    add_bos: bool  # the model's tokenizer adds a BOS to every text it tokenizes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class ChatRendering:
    """A template with the variables of a run: what crossrt renders, and what a runtime that
    renders templates itself is asked to render too."""

    template: ChatTemplate
    variables: tuple[tuple[str, Any], ...] = ()

    def render(self, messages: Sequence[dict]) -> str:
        values = {"bos_token": self.template.bos_token, "eos_token": self.template.eos_token,
                  **dict(self.variables)}
        try:
            return _compile(self.template.text).render(messages=list(messages), add_generation_prompt=True, **values)
        except Exception as error:  # jinja2's TemplateError, SecurityError and what a template raises
            raise ChatTemplateError(f"chat template {self.template.source}: {type(error).__name__}: {error}") from None

    def fed_text(self, rendered: str) -> str:
        """The rendering as fed: without a leading bos_token when the model adds its own."""
        bos = self.template.bos_token
        if self.template.add_bos and bos and rendered.startswith(bos):
            return rendered[len(bos):]
        return rendered


def user_turn(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def prompt_messages(prompt: Prompt) -> list[dict]:
    """The conversation a templated prompt was rendered from: its earlier turns (a second
    turn's question and answer), then its user turn."""
    earlier = [{"role": role, "content": content} for role, content in prompt.earlier_turns]
    return earlier + user_turn(prompt.rendered_from)


def _compile(text: str):
    """transformers' template environment (see the module docstring), built the same way."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=dict,
                       namespace=jinja2.utils.Namespace)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ChatTemplateError(f"chat template line {error.lineno}: {error.message}") from None


def template_variables(pairs: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    """`--template-var NAME=VALUE` options: VALUE as JSON where it parses (true, 3, "x"), else text."""
    parsed = []
    for item in pairs:
        name, equals, value = item.partition("=")
        if not equals or not name.strip():
            raise ChatTemplateError(f"--template-var {item!r}: expected NAME=VALUE, e.g. enable_thinking=false")
        try:
            parsed.append((name.strip(), json.loads(value)))
        except json.JSONDecodeError:
            parsed.append((name.strip(), value))
    return tuple(parsed)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ChatTemplateError(f"{what} {path}: cannot read ({error})") from None


def _manifest_template(pair: Pair) -> Optional[tuple[str, str]]:
    if pair.source is None:
        return None
    named = tomllib.loads(pair.source.read_text()).get("chat_template")
    if not named:
        return None
    path = Path(named).expanduser()
    path = (path if path.is_absolute() else pair.source.parent / path).resolve()
    return _read(path, f"pair {pair.name!r} chat_template"), f"file:{path}"


def _gguf_facts(model: Path) -> dict[str, Any]:
    """What a template reads of a GGUF: its template, its BOS and EOS tokens' texts and whether it
    adds a BOS; kept by the file's digest (file_fact), since reading them reads every
    vocabulary string (~0.15 CPU-s on Gemma 3's 262,144) in each process that feeds prompts."""
    def derive() -> dict[str, Any]:
        metadata, vocabulary = gguf_metadata(model), read_vocabulary(model)
        return {"template": metadata.get("tokenizer.chat_template"), "bos": _token(vocabulary, vocabulary.bos_id),
                "eos": _token(vocabulary, vocabulary.eos_id),
                "add_bos": bool(metadata.get("tokenizer.ggml.add_bos_token", False))}

    return file_fact("gguf-chat-1", [model], derive)


def _token(vocabulary: Vocabulary, token_id: Optional[int]) -> str:
    return vocabulary.tokens[token_id] if token_id is not None and token_id < len(vocabulary.tokens) else ""


def _model_template(model: Path) -> Optional[tuple[str, str]]:
    if model.suffix == ".gguf":
        text = _gguf_facts(model)["template"]
        return (str(text), f"gguf:{model}") if text else None
    if (model / "chat_template.jinja").is_file():
        return _read(model / "chat_template.jinja", "chat template"), f"hf:{model / 'chat_template.jinja'}"
    config = model / "tokenizer_config.json"
    text = json.loads(_read(config, "tokenizer config")).get("chat_template") if config.is_file() else None
    if isinstance(text, list):  # several named templates: transformers' default is the one named "default"
        text = next((t.get("template") for t in text if t.get("name") == "default"), None)
    return (text, f"hf:{config}") if isinstance(text, str) and text else None


def _adds_bos(model: Path) -> bool:
    """Whether an HF folder's tokenizer puts a BOS before every text, as the runtimes read it."""
    config_file = model / "tokenizer_config.json"
    config = json.loads(_read(config_file, "tokenizer config")) if config_file.is_file() else {}
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    processor = json.loads(_read(model / "tokenizer.json", "tokenizer")).get("post_processor") or {}
    steps = processor.get("processors", []) if processor.get("type") == "Sequence" else [processor]
    return any(step.get("type") == "TemplateProcessing" and "SpecialToken" in (step.get("single") or [{}])[0]
               for step in steps)


def find_template(pair: Pair, template_file: Optional[Path] = None) -> Optional[ChatTemplate]:
    """The pair's chat template (module docstring for the order), None when it has none."""
    model = pair.path("target", ("gguf", "hf"))
    if template_file is not None:
        found = (_read(Path(template_file), "--chat-template"), f"file:{template_file}")
    else:
        found = _manifest_template(pair) or _model_template(model)
    if found is None:
        return None
    if model.suffix == ".gguf":
        facts = _gguf_facts(model)
        return ChatTemplate(found[0], found[1], facts["bos"], facts["eos"], facts["add_bos"])
    vocabulary = read_vocabulary(model)
    return ChatTemplate(found[0], found[1], _token(vocabulary, vocabulary.bos_id), _token(vocabulary, vocabulary.eos_id),
                        _adds_bos(model))


def apply_template(prompts: Sequence[Prompt], pair: Pair, mode: str = "auto", template_file: Optional[Path] = None,
                   variables: Sequence[str] = ()) -> tuple[list[Prompt], Optional[ChatRendering], PromptFormat]:
    """The prompts as fed, the rendering used (None: all raw) and the record's account of it.
    mode auto: chat prompts (Prompt.chat) are templated when the pair has a template; chat:
    every prompt is, and a pair without a template is an error; raw: none is."""
    if mode not in MODES:
        raise ChatTemplateError(f"prompt mode {mode!r}: expected one of {', '.join(MODES)}")
    parsed = template_variables(variables)
    template = None
    if mode != "raw":
        try:
            template = find_template(pair, template_file)
        except PairError as error:
            raise ChatTemplateError(str(error)) from None
    if template is None:
        if mode == "chat":
            raise ChatTemplateError(f"--chat: pair {pair.name!r} has no chat template (give --chat-template FILE)")
        return list(prompts), None, PromptFormat(mode, None, None, tuple(variables), ())
    rendering = ChatRendering(template, parsed)
    fed = [dataclasses.replace(p, text=rendering.fed_text(rendering.render(user_turn(p.text))), rendered_from=p.text)
           if mode == "chat" or p.chat else p for p in prompts]
    templated = tuple(p.id for p in fed if p.rendered_from is not None)
    return fed, rendering, PromptFormat(mode, template.source, template.sha256, tuple(variables), templated)


def runtime_template_ids(session: Any, prompt: Prompt, rendering: Optional[ChatRendering]) -> Optional[tuple[int, ...]]:
    """The runtime's own rendering of a templated prompt, tokenized as it feeds a chat turn, from
    a session that renders templates itself (`chat_template_ids`); None where it does not."""
    render = getattr(session, "chat_template_ids", None)
    if rendering is None or prompt.rendered_from is None or render is None:
        return None
    return tuple(render(prompt_messages(prompt), rendering.template.text, dict(rendering.variables)))


def with_template_ids(result: PromptResult, session: Any, prompt: Prompt,
                      rendering: Optional[ChatRendering]) -> PromptResult:
    """result with the runtime's own rendering (runtime_template_ids) where it differs from the
    ids that ran: a template split, which parity and diff report (crossrt/compare/diagnosis.py)."""
    if not result.prompt_ids:
        return result
    own = runtime_template_ids(session, prompt, rendering)
    return result if own is None or own == result.prompt_ids else dataclasses.replace(result, template_ids=own)
