"""Each prompt's output as the speculative decoding papers draw it: the text cut into the
verification steps that emitted it, each step coloured by how many draft tokens it accepted
(`crossrt report`, docs/report.md).

Token text comes from the pair's own vocabulary, read from the target file the record names
(GGUF metadata, or an HF folder's tokenizer.json), so no runtime is loaded: each id prints the
bytes crossrt.inputs.vocabulary says a detokenizer prints for it (`Vocabulary.printed`: special
tokens nothing). The bytes are decoded incrementally, so a character split across tokens is
shown with the token that completes it.
A file that is missing, or whose vocabulary is not the one the run recorded (its fingerprint),
gives no text, and the section says so.
"""

from __future__ import annotations

import codecs
import functools
import re
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Optional, Sequence

from crossrt.inputs.pairs import PairError
from crossrt.inputs.vocabulary import read_vocabulary
from crossrt.report.page import Section, Table
from crossrt.report.runs import ReportRun
from crossrt.speculative.schedules import first_from_prompt
from crossrt.records.schema import PromptResult, RunRecord

# Characters XML 1.0 forbids (the page is also well-formed XML): shown as \xNN instead.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


@dataclass(frozen=True)
class Vocab:
    pieces: tuple[bytes, ...]  # per token id, the bytes a detokenizer prints for it


@functools.lru_cache(maxsize=8)
def vocab_at(path: str, fingerprint: str) -> tuple[Optional[Vocab], Optional[str]]:
    """The vocabulary of the model file at path if its fingerprint is the one given, or None
    and why not."""
    try:
        vocabulary = read_vocabulary(Path(path))
        if vocabulary.fingerprint != fingerprint:
            return None, f"{path} holds another vocabulary than the run's (fingerprint {vocabulary.fingerprint})"
        return Vocab(vocabulary.printed), None
    except (PairError, OSError, ValueError, KeyError, TypeError) as error:
        return None, f"cannot read the vocabulary of {path} ({error})"


def load_vocab(record: RunRecord) -> tuple[Optional[Vocab], Optional[str]]:
    """The record's target vocabulary, or None and why not."""
    target = record.pair.target
    if target is None:
        return None, "the record names no model files"
    return vocab_at(target.path, target.vocab_fingerprint)


def token_texts(vocab: Vocab, ids: Sequence[int]) -> list[str]:
    """The text each token adds, decoded as one UTF-8 stream (invalid bytes as U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    texts = [decoder.decode(vocab.pieces[i] if 0 <= i < len(vocab.pieces) else f"[{i}]".encode()) for i in ids]
    if texts:
        texts[-1] += decoder.decode(b"", final=True)
    return texts


@dataclass(frozen=True)
class Span:
    """Output tokens start .. stop - 1, and the step that emitted them (None: outside steps)."""

    start: int
    stop: int
    step: Optional[int]
    accepted: int
    drafted: int


def _by_passes(result: PromptResult, schedule: str) -> Optional[list[Span]]:
    """The spans as the run's passes place them (driven runs record, per output token, the size
    of the pass that chose it): a step's tokens come from one pass of 1 + its draft tokens; any
    other token is unverified (llama-server's prompt-pass token, a plain decode, mid-run too where
    llama.cpp threw a short draft away). None where that does not account for every step and
    every unverified token (a pass of another kind that happens to have a step's size)."""
    counters, passes = result.counters, result.output_view.pass_tokens
    end, at, step, plain, spans = len(result.output_ids), 0, 0, 0, []
    while at < end:
        fits = step < counters.steps and passes[at] == 1 + counters.step_drafted[step]
        if fits and not (at == 0 and first_from_prompt(schedule)):  # llama-server's, vLLM's: the prompt pass
            stop = min(at + counters.step_accepted[step] + 1, end)
            spans.append(Span(at, stop, step, counters.step_accepted[step], counters.step_drafted[step]))
            at, step = stop, step + 1
            continue
        if spans and spans[-1].step is None:
            spans[-1] = Span(spans[-1].start, at + 1, None, 0, 0)
        else:
            spans.append(Span(at, at + 1, None, 0, 0))
        at, plain = at + 1, plain + 1
    return spans if step == counters.steps and plain == counters.unverified else None


def _in_order(result: PromptResult, schedule: str) -> list[Span]:
    """The spans without pass sizes (native runs): the steps in order, llama-server's first token
    from the prompt pass, any other unverified tokens after the last step."""
    counters = result.counters
    end, at, spans = len(result.output_ids), 0, []
    if first_from_prompt(schedule) and counters.unverified:
        spans.append(Span(0, 1, None, 0, 0))
        at = 1
    for step, (accepted, drafted) in enumerate(zip(counters.step_accepted, counters.step_drafted)):
        if at >= end:
            break
        stop = min(at + accepted + 1, end)
        spans.append(Span(at, stop, step, accepted, drafted))
        at = stop
    if at < end:
        spans.append(Span(at, end, None, 0, 0))
    return spans


def step_spans(result: PromptResult, schedule: str) -> Optional[list[Span]]:
    """The output cut into its steps, each accepted + 1 tokens, and the unverified tokens between
    them; None without per-step lists or token ids. Tokens a step yielded past the budget or an
    EOS (cut) are not in the output, so such a step is shown cut short."""
    counters = result.counters
    if counters is None or counters.step_accepted is None or counters.step_drafted is None or not result.output_ids:
        return None
    view = result.output_view
    placed = _by_passes(result, schedule) if view is not None and len(view.pass_tokens) == len(result.output_ids) \
        else None
    return placed if placed is not None else _in_order(result, schedule)


def accept_color(accepted: int, k: int) -> str:
    """Light red for a step that accepted nothing, through yellow, to light green for one that
    accepted its whole draft of k: light enough for dark text on it."""
    return f"hsl({120 * accepted / k if k else 0:.0f}, 80%, 80%)"


def _shown(text: str) -> str:
    return escape(_NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text))


def steps_figure(caption: str, spans: Sequence[Span], texts: Sequence[str], k: int) -> str:
    parts = []
    for span in spans:
        text = _shown("".join(texts[span.start:span.stop]))
        if span.step is None:
            parts.append(f'<span class="plain" title="emitted outside a verification step">{text}</span>')
            continue
        tip = (f"step {span.step + 1}: {span.accepted} of {span.drafted} draft tokens accepted, "
               f"{span.stop - span.start} emitted")
        parts.append(f'<span class="step" data-accepted="{span.accepted}" '
                     f'style="background:{accept_color(span.accepted, k)}" title="{escape(tip)}">{text}</span>')
    return f'<figure class="steps"><figcaption>{escape(caption)}</figcaption><p>{"".join(parts)}</p></figure>'


def swatches(k: int) -> str:
    cells = "".join(f'<span class="swatch" style="background:{accept_color(j, k)}">{j}</span>' for j in range(k + 1))
    return f'<p class="swatches">draft tokens accepted per step: {cells}</p>'


def steps_section(runs: Sequence[ReportRun]) -> Section:
    k_max = max(run.record.params.k for run in runs)
    rows, figures, notes, without = [], [], [], []
    for run in runs:
        vocab, problem = load_vocab(run.record)
        shown = [(result, spans) for result in run.record.results if result.ok
                 for spans in [step_spans(result, run.record.params.schedule)] if spans is not None]
        if not shown:
            without.append(run.label)
            continue
        if vocab is None:
            notes.append(f"{run.label}: no token text, {problem}; token ids are shown instead")
        for result, spans in shown:
            counters, k = result.counters, run.record.params.k
            counts = [sum(1 for n in counters.step_accepted if n == j) for j in range(k_max + 1)]
            rows.append((run.label, result.prompt_id, result.category, str(counters.steps), str(len(result.output_ids)),
                         f"{counters.tau:.2f}" if counters.tau is not None else "-",
                         *(str(n) if j <= k else "" for j, n in enumerate(counts))))
            texts = (token_texts(vocab, result.output_ids) if vocab is not None
                     else [f"[{i}]" for i in result.output_ids])
            # One colour scale for every run (k_max), so a colour means the same accepted length anywhere.
            figures.append(steps_figure(f"{run.label}: {result.prompt_id} ({result.category}), k={k}", spans, texts,
                                        k_max))
    if without:
        notes.append(f"no per-step lengths or token ids (imported, or a native run that does not report steps): "
                     f"{', '.join(without)}")
    table = Table(("run", "prompt", "category", "steps", "tokens", "tau",
                   *(f"accepting {j}" for j in range(k_max + 1))), tuple(rows), 3)
    legend = (swatches(k_max),) if figures else ()
    return Section("steps", "Accepted length per step, in the output text",
                   "Each finished prompt's output, cut into the verification steps that emitted it: a step's "
                   "tokens are its accepted draft tokens and the target's own token after them, on a colour for "
                   "the number of draft tokens it accepted (hover a step for its numbers; unshaded text came "
                   "from outside any step). The table counts each prompt's steps by the draft tokens they "
                   "accepted.", None, (table,) if rows else (), tuple(notes), legend + tuple(figures))
