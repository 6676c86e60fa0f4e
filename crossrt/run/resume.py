"""Resuming a run: the record on disk is continued only when it was made by the same runtime,
parameters, model files and prompts; anything else is refused, naming what differs."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Callable, Sequence

from crossrt.inputs.prompts import Prompt
from crossrt.records.schema import RecordError, RunRecord
from crossrt.records.record_json import load_record


def prompt_sha256(prompt: Prompt) -> str:
    """The digest a result keeps of its prompt's text: ids alone collide across prompt files.
    surrogatepass: a text that is not Unicode (a lone surrogate) still has a digest, and its
    prompt fails with the reason (crossrt.inputs.prompts.refuse_non_unicode); valid text's
    digest is unchanged."""
    return hashlib.sha256(prompt.text.encode("utf-8", "surrogatepass")).hexdigest()


def _differences(before: Any, now: Any) -> str:
    """Only the fields that differ, as `name: recorded -> now`."""
    if not dataclasses.is_dataclass(before):
        return f"{before} in the record, {now} now"
    return "; ".join(f"{f.name}: {getattr(before, f.name)!r} in the record, {getattr(now, f.name)!r} now"
                     for f in dataclasses.fields(before) if getattr(before, f.name) != getattr(now, f.name))


def check_writable(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse an existing out that is neither resumed nor overwritten: checked again before any
    runtime loads (a vLLM engine took 80 s to start before this refusal)."""
    if out.exists() and not resume and not overwrite:
        raise RecordError(f"{out} exists: pass --resume to continue it or --overwrite to replace it")


def starting_record(out: Path, fresh: RunRecord, resume: bool, overwrite: bool) -> RunRecord:
    """The record to continue: the fresh one, or with resume the matching one at out."""
    check_writable(out, resume, overwrite)
    if not out.exists() or overwrite:
        return fresh
    # Read by crossrt run --resume and crossrt reproduce --resume: each starts a record anew its own way.
    previous = load_record(out, remake="start it anew instead of resuming it (crossrt run --overwrite; "
                                       "crossrt reproduce without --resume)")
    if previous.imported:
        raise RecordError(f"cannot resume {out}: it was imported (crossrt import), not run")
    for name, before, now in (("runtime", previous.runtime, fresh.runtime),
                              ("parameters", previous.params, fresh.params),
                              ("target", previous.pair.target.sha256, fresh.pair.target.sha256),
                              ("drafter", previous.pair.drafter.sha256, fresh.pair.drafter.sha256)):
        if before != now:
            raise RecordError(f"cannot resume {out}: its {name} differ ({_differences(before, now)}); "
                              "pass --overwrite to start it anew")
    # Failed prompts are tried again; finished ones are kept.
    return RunRecord(previous.runtime, previous.pair, previous.params,
                     tuple(r for r in previous.results if r.ok), notes=previous.notes, trace=previous.trace)


def check_prompts(out: Path, record: RunRecord, prompts: Sequence[Prompt],
                  tokenize: Callable[[str], list[int]]) -> RunRecord:
    """record, refused unless each prompt it holds is in prompts with the same text, so a
    resumed run never mixes two prompt sources; results written before records kept the
    text's digest are checked by tokenizing the text again, and given the digest."""
    by_id = {prompt.id: prompt for prompt in prompts}
    checked = []
    for result in record.results:
        prompt = by_id.get(result.prompt_id)
        if prompt is None:
            raise RecordError(f"cannot resume {out}: its prompt {result.prompt_id!r} is not in the prompt source; "
                              "resume with the prompts it was run with, or pass --overwrite")
        digest = prompt_sha256(prompt)
        if result.prompt_sha256 is None:
            same = tuple(tokenize(prompt.text)) == (result.own_prompt_ids or result.prompt_ids)
        else:
            same = result.prompt_sha256 == digest
        if not same:
            raise RecordError(f"cannot resume {out}: prompt {prompt.id!r} of the prompt source is not the text "
                              "the record ran under that id; resume with the prompts it was run with, "
                              "or pass --overwrite")
        checked.append(dataclasses.replace(result, prompt_sha256=digest))
    return dataclasses.replace(record, results=tuple(checked))
