"""Which prompt each request of AIPerf's per-request export ran (`crossrt import --from aiperf
--prompts FILE`): by its text, where AIPerf's inputs.json gives it, else by position.

profile_export.jsonl carries no input text: a record's `metadata` names the request's
`conversation_id` and `turn_index`, which look up its payload in `inputs.json`, written beside it
(ai-dynamo/aiperf: `MetricRecordMetadata` in src/aiperf/common/models/record_models.py at
017c63d230ac; `DatasetManager._generate_input_payloads` in src/aiperf/dataset/dataset_manager.py at
6f2353ce4bb0): {"data": [{"session_id", "payloads": [one payload per turn]}]}. A completions payload
holds the turn's texts as `prompt`, a list of strings (src/aiperf/endpoints/openai_completions.py at
087322484593); a chat payload holds `messages`, each `content` a string or a list of
{"type": "text", "text"} parts (openai_chat.py and base_endpoint.py at 00a8e858f64a).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from crossrt.imports.exllamav3 import json_body
from crossrt.imports.imported import ImportFailure, json_count
from crossrt.inputs.prompts import Prompt

QUOTED = 40  # characters of a text quoted in a message


class PromptMismatch(ImportFailure):
    """Requests that do not pair with --prompts, or an inputs.json that does not say what they
    sent: the export itself reads."""


@dataclass(frozen=True)
class Sent:
    """What a request's metadata says it sent: its line, conversation and turn."""

    where: str
    conversation: Optional[str]
    turn: int


def sent_by(line: dict, where: str) -> tuple[Sent, Optional[int]]:
    """What a request sent (its metadata's conversation_id and turn_index) and its session_num,
    the order AIPerf issued it in; None where the metadata does not say them."""
    metadata = line.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    conversation, turn, session = (metadata.get(name) for name in ("conversation_id", "turn_index", "session_num"))
    if conversation is not None and not (isinstance(conversation, str) and 0 < len(conversation) <= 1024):
        raise ImportFailure(f"{where}: metadata.conversation_id is not an id (a string of 1 to 1024 characters)")
    turn = 0 if turn is None else json_count(turn, f"{where}, metadata.turn_index")
    session = None if session is None else json_count(session, f"{where}, metadata.session_num")
    return Sent(where, conversation, turn), session


def _payloads(text: str) -> dict[tuple[str, int], object]:
    """inputs.json's payloads by (session_id, turn index)."""
    try:
        data = json_body(text)
    except ImportFailure as error:
        raise PromptMismatch(f"inputs.json is {error}") from None
    sessions = data.get("data") if isinstance(data, dict) else None
    if not isinstance(sessions, list):
        raise PromptMismatch("inputs.json is not AIPerf's inputs file: no 'data' list of sessions")
    payloads: dict[tuple[str, int], object] = {}
    for at, session in enumerate(sessions):
        if not (isinstance(session, dict) and isinstance(session.get("session_id"), str)
                and isinstance(session.get("payloads"), list)):
            raise PromptMismatch(f"inputs.json data[{at}] is not a session (a string session_id and a list of "
                                 "payloads)")
        for turn, payload in enumerate(session["payloads"]):
            payloads[session["session_id"], turn] = payload
    return payloads


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        texts = [part.get("text") for part in content if part.get("type") == "text"]
        if texts and all(isinstance(text, str) for text in texts):
            return "".join(texts)
    raise PromptMismatch(f"{where}: the user message's content is neither a string nor text parts")


def payload_text(payload, where: str) -> str:
    """The text a payload sent: a completions payload's one prompt, or a chat payload's last user
    message (the turn itself; earlier messages are its history)."""
    if not isinstance(payload, dict):
        raise PromptMismatch(f"{where} is not a JSON object")
    if "prompt" in payload:
        prompt = payload["prompt"]
        prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
        if not isinstance(prompt, str):
            raise PromptMismatch(f"{where}: 'prompt' is not one text (a string, or a list of one)")
        return prompt
    messages = payload.get("messages")
    if isinstance(messages, list):
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            return _content(users[-1].get("content"), where)
    raise PromptMismatch(f"{where} has neither a 'prompt' (completions) nor a user message (chat)")


def _by_text(sent: Sequence[Sent], prompts: Sequence[Prompt], inputs: str) -> list[Prompt]:
    payloads = _payloads(inputs)
    by_text: dict[str, Prompt] = {}
    for prompt in prompts:
        by_text.setdefault(prompt.text, prompt)
    matched = []
    for request in sent:
        if request.conversation is None:
            raise PromptMismatch(f"{request.where}: no metadata.conversation_id to look its text up in inputs.json")
        key = (request.conversation, request.turn)
        if key not in payloads:
            raise PromptMismatch(f"{request.where}: conversation {request.conversation[:QUOTED]!r} turn {request.turn} "
                                "is not in inputs.json (an inputs.json of another run?)")
        text = payload_text(payloads[key], f"inputs.json {request.conversation[:QUOTED]!r} turn {request.turn}")
        if text not in by_text:
            raise PromptMismatch(f"{request.where}: its text {text[:QUOTED]!r} is no prompt's of --prompts")
        matched.append(by_text[text])
    return matched


def prompts_of(sent: Sequence[Sent], prompts: Sequence[Prompt], inputs: Optional[str]) -> tuple[list[Prompt], str,
                                                                                             tuple[str, ...]]:
    """The prompt each request ran, how they were matched (a note), and the prompts no request
    ran (in words, for the record's `missing`). Requests that ran one prompt twice, a request of
    no prompt, and (by position) other counts are refused."""
    if inputs is not None:
        matched = _by_text(sent, prompts, inputs)
        how = "matched to --prompts by text: each request's payload in AIPerf's inputs.json (by conversation_id " \
              "and turn_index; a chat payload's last user message)"
    elif len(sent) != len(prompts):
        raise PromptMismatch(f"{len(sent)} requests and {len(prompts)} prompts in --prompts: without AIPerf's "
                            "inputs.json (--inputs) requests are matched by position, which needs as many of each")
    else:
        matched = list(prompts)
        how = "matched to --prompts by position (no inputs.json: AIPerf's export carries no input text)"
    first: dict[str, Sent] = {}
    for request, prompt in zip(sent, matched):
        if prompt.id in first:
            raise PromptMismatch(f"{first[prompt.id].where} and {request.where} both ran prompt "
                                 f"{prompt.id[:QUOTED]!r}: one result per prompt (profile as many requests as the "
                                 "dataset has prompts)")
        first[prompt.id] = request
    unran = [prompt.id for prompt in prompts if prompt.id not in first]
    missing = (f"{len(unran)} of the {len(prompts)} prompts of --prompts: no request ran them "
               f"({', '.join(unran[:5])}{', ...' if len(unran) > 5 else ''})",) if unran else ()
    return matched, how, missing
