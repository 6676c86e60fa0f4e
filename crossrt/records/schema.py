"""The run record: one versioned JSON document per (pair, runtime, params) run.

Counters are stored; every rate (tau, alpha, tokens/s, speedup) is derived from them, as
vLLM does, by its formula in crossrt/records/metrics.py, so two records can always be compared
by recomputing from the same numbers.
Convention: tau counts the bonus token (tau = 1 + accepted / steps, which is emitted / steps in
crossrt's own schedule), as community "tokens per step" figures do. docs/schema.md documents each field.

The JSON form, its validation and the record files are crossrt/records/record_json.py.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Iterable, Optional

from crossrt.errors import CrossrtError
from crossrt.records.counts import Counts
from crossrt.records.metrics import Totals


SCHEMA_VERSION = 1
SCHEMA_RESOURCE = "run-record.schema.json"


class RecordError(CrossrtError, ValueError):
    """A record that does not follow the schema, or whose numbers do not add up."""


@dataclass(frozen=True)
class RuntimeInfo:
    name: str
    version: str
    build: Optional[str]
    device: str
    threads: Optional[int]
    gpu_split: Optional[tuple[float, ...]]
    kv_cache: str  # KV cache element type, e.g. "f16": it changes logits, so it is recorded
    flash_attn: Optional[bool] = None  # llama.cpp's flash attention kernels (None: not a choice)
    # llama.cpp's llama_print_system_info() (backends, CPU features): the same commit can still
    # run other kernels. None for other runtimes, and where a tool does not say it.
    system_info: Optional[str] = None
    # The element type a runtime loaded the weights in where it chose one (transformers:
    # float32, bfloat16, float16); None where it runs the file's own types (llama.cpp).
    dtype: Optional[str] = None


@dataclass(frozen=True)
class LoadedFile:
    """A file a runtime read for a model, and its sha256 when read."""

    path: str
    sha256: str
    what: str  # "model": a file the pair names; "conversion": a file of crossrt's cached conversion of it


@dataclass(frozen=True)
class ModelInfo:
    path: str
    sha256: str
    format: str
    quantization: str
    vocab_fingerprint: str
    n_vocab: int
    # What the runtime really read for this model (a GGUF's cached conversion, say), so two
    # records tell whether they ran the same weights; None: not known (records before it, a
    # server crossrt attached to), () where nothing was read (a prompt-lookup run's drafter).
    loaded: Optional[tuple[LoadedFile, ...]] = None


@dataclass(frozen=True)
class PairInfo:
    name: str
    # None only in an imported record whose source names no model files crossrt can digest
    target: Optional[ModelInfo]
    drafter: Optional[ModelInfo]


@dataclass(frozen=True)
class RunParams:
    # greedy, max_new_tokens, n_ctx, draft_n_min, draft_p_min: None only in an imported record
    # whose source does not say them (crossrt/imports/importer.py)
    k: int
    greedy: Optional[bool]
    max_new_tokens: Optional[int]
    mode: str
    spec_type: str
    schedule: str
    n_ctx: Optional[int]
    draft_n_min: Optional[int]
    draft_p_min: Optional[float]
    # The driven loop's strategy (crossrt/speculative/strategies.py); the defaults are what every record
    # before strategies ran: a draft model's chain at fixed k, greedy. Parameters are None where
    # their part of the strategy does not apply.
    drafting: str = "model"  # "model", "prompt-lookup", "hf-prompt-lookup" or "tree"
    tree: Optional[str] = None  # drafting "tree": WxD or a choice-list file
    ngram_max: Optional[int] = None  # drafting "prompt-lookup" or "hf-prompt-lookup" (ngram_min None)
    ngram_min: Optional[int] = None
    k_policy: str = "fixed"  # "fixed", "content", "online" or "confidence"
    content_k: Optional[str] = None  # k_policy "content": e.g. "code=7,prose=3"
    k_max: Optional[int] = None  # k_policy "online"
    min_p1: Optional[float] = None  # k_policy "confidence"
    acceptance: str = "greedy"  # "greedy" or "relaxed"
    top_m: Optional[int] = None  # acceptance "relaxed"
    delta: Optional[float] = None
    lossy: bool = False  # the acceptance rule may leave greedy decoding: never counted as lossless
    repeat: int = 1  # times each prompt ran, baseline then speculative, interleaved (run --repeat)


@dataclass(frozen=True)
class Timings:
    """Seconds. Prefill is the prompt pass of target and drafter; decode is the rest."""

    prefill_s: float
    decode_s: float
    baseline_prefill_s: float
    baseline_decode_s: float


class CountsDoNotAddUp(CrossrtError):
    """Counts that break the counter identities (Counters.identity_violations), each listed."""

    def __init__(self, problems: typing.Sequence[str]):
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True, kw_only=True)
class Counters(Counts):
    """What a speculative run counts; the same fields whatever the runtime: the four Counts
    (crossrt/records/counts.py), then these. accepted_per_pos[i]: steps that accepted at least
    i + 1 tokens. unverified: tokens emitted outside any step (llama-server's first token from the
    prompt pass, plain decodes when no draft fits the budget). cut: tokens steps yielded, counted as
    accepted, but dropped at the token budget or after EOS. Both are 0 in crossrt's schedule.
    step_drafted / step_accepted: the raw per-step lengths, None where a runtime does not
    report them (then accepted_per_pos may be None too).
    """

    accepted_per_pos: Optional[tuple[int, ...]]
    step_drafted: Optional[tuple[int, ...]]
    step_accepted: Optional[tuple[int, ...]]
    unverified: int = 0
    cut: int = 0

    def totals(self, timings: Optional[Timings] = None, baseline_tokens: int = 0) -> Totals:
        """What the metrics read (crossrt/records/metrics.py): these counts, and timings' seconds."""
        return Totals(**self.counted(), decode_s=timings.decode_s if timings else 0.0,
                      baseline_tokens=baseline_tokens,
                      baseline_decode_s=timings.baseline_decode_s if timings else 0.0)

    @classmethod
    def from_steps(cls, step_drafted: typing.Sequence[int], step_accepted: typing.Sequence[int], emitted: int,
                   k: int, unverified: int = 0, cut: int = 0) -> "Counters":
        """The counters of a run whose per-step lengths are known: totals summed from them and
        accepted_per_pos derived, in this one place for every runtime; CountsDoNotAddUp when the
        identities break (the lengths and emitted say different things)."""
        step_drafted, step_accepted = tuple(step_drafted), tuple(step_accepted)
        counters = cls(steps=len(step_accepted), drafted=sum(step_drafted), accepted=sum(step_accepted),
                       emitted=emitted, accepted_per_pos=accepted_per_position(step_accepted, k),
                       step_drafted=step_drafted, step_accepted=step_accepted, unverified=unverified, cut=cut)
        problems = counters.identity_violations(k)
        if problems:
            raise CountsDoNotAddUp(problems)
        return counters

    def identity_violations(self, k: int) -> list[str]:
        """The counter identities every speculative run must satisfy; empty when they hold."""
        problems = []
        if self.emitted != self.steps + self.accepted + self.unverified - self.cut:
            problems.append(f"emitted {self.emitted} != steps {self.steps} + accepted {self.accepted}"
                            f" + unverified {self.unverified} - cut {self.cut}")
        if not self.accepted <= self.drafted <= k * self.steps:
            problems.append(f"not accepted {self.accepted} <= drafted {self.drafted} <= k*steps {k * self.steps}")
        per_pos = self.accepted_per_pos
        if per_pos is not None:
            if any(later > earlier for earlier, later in zip(per_pos, per_pos[1:])):
                problems.append(f"accepted_per_pos {list(per_pos)} increases")
            if per_pos and per_pos[0] > self.steps:
                problems.append(f"accepted_per_pos[0] {per_pos[0]} > steps {self.steps}")
            if sum(per_pos) != self.accepted:
                problems.append(f"sum(accepted_per_pos) {sum(per_pos)} != accepted {self.accepted}")
        if self.step_accepted is not None and self.step_drafted is not None:
            if len(self.step_accepted) != self.steps or len(self.step_drafted) != self.steps:
                problems.append("per-step lists do not have one entry per step")
            elif sum(self.step_accepted) != self.accepted or sum(self.step_drafted) != self.drafted:
                problems.append("per-step lists do not sum to the counters")
        return problems


def accepted_per_position(step_accepted: typing.Sequence[int], k: int) -> tuple[int, ...]:
    """accepted_per_pos[i] = number of steps that accepted at least i + 1 draft tokens."""
    return tuple(sum(1 for n in step_accepted if n > i) for i in range(k))


@dataclass(frozen=True)
class PassView:
    """How the target pass that produced each emitted token saw it, recorded during a driven
    run so a split is explained with the logits the run had, not a later re-score.
    margins[i]: top-1 minus top-2 logit of the row that chose output token i; runner_up[i]: the
    top-2 token; pass_tokens[i]: tokens in that pass (1: a one-token decode; 1 + draft: a
    verification batch; the prompt length: the prompt pass). close_ids[i] / close_gaps[i]: the
    other candidates within crossrt.speculative.numerics.CLOSE_WINDOW logits of that row's choice (at most
    8, nearest first) and how far below it each lay: the near-tie verdict reads the gap to
    whichever token the other side emitted, not only the runner-up's. None in records written
    before they were kept."""

    margins: tuple[float, ...]
    runner_up: tuple[int, ...]
    pass_tokens: tuple[int, ...]
    close_ids: Optional[tuple[tuple[int, ...], ...]] = None
    close_gaps: Optional[tuple[tuple[float, ...], ...]] = None


@dataclass(frozen=True)
class BaselineSource:
    """Where a prompt's plain greedy baseline came from (crossrt/run/baselines.py): decoded in this
    run ("decoded") or taken from the baseline store ("store"), the store key's digest (the
    same digest: the same runtime, build, target file, numerics, machine, prompt and budget),
    and when, where and under what load its timings were measured: a speedup over a stored
    baseline divides by that timing."""

    origin: str  # "decoded" or "store"
    key_sha256: str
    timed_at: str  # ISO 8601, UTC
    host: str
    load_1m: Optional[float]  # the machine's 1-minute load average then (None: not known)


@dataclass(frozen=True)
class UnfitCounts:
    """A native runtime's numbers that did not fit its schedule as crossrt reads it. The prompt
    is kept: its counters take the runtime's steps, drafted and accepted as reported, with
    unverified/cut from the counter identity (derived says how), and raw keeps what it said."""

    problems: tuple[str, ...]
    raw: dict[str, int]
    derived: str

    def describe(self) -> str:
        return f"counts did not fit the runtime's schedule ({'; '.join(self.problems)}); {self.derived}"


@dataclass(frozen=True)
class PromptResult:
    prompt_id: str
    category: str
    status: str  # "ok" or "failed"
    error: Optional[str]
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    baseline_ids: tuple[int, ...]
    stop_reason: Optional[str]  # "eos" or "max_new_tokens"
    counters: Optional[Counters]
    timings: Optional[Timings]
    # The runtime's own tokenization of the prompt text, kept only where it differs from
    # prompt_ids (ids shared by every runtime of a comparison): a tokenizer mismatch.
    own_prompt_ids: Optional[tuple[int, ...]] = None
    output_view: Optional[PassView] = None  # driven runs: the speculative run's passes
    baseline_view: Optional[PassView] = None  # driven runs: the baseline's one-token decodes
    unfit_counts: Optional[UnfitCounts] = None  # native runs whose numbers did not fit
    # sha256 of the prompt's text, so a resumed run can tell a different prompt under the same id
    prompt_sha256: Optional[str] = None
    # The runtime's own chat-template rendering of the prompt, tokenized, kept only where it
    # differs from prompt_ids (crossrt's rendering): a template split (crossrt/inputs/chat_template.py).
    template_ids: Optional[tuple[int, ...]] = None
    baseline_source: Optional[BaselineSource] = None  # None in records written before the store
    lossy: bool = False  # run under a lossy acceptance rule (RunParams.lossy): it makes no lossless claim
    # With run --repeat N: every repetition's timings, the first being `timings` (outputs identical).
    repeats: tuple[Timings, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def lossless(self) -> Optional[bool]:
        # Full-length token-id comparison: a shorter output is a difference, never a prefix match.
        # An imported result holds no token ids (every run emits at least one): nothing to check.
        # A lossy run is never counted lossless, even where its output happens to be greedy's.
        if self.lossy:
            return None
        return list(self.output_ids) == list(self.baseline_ids) if self.ok and self.output_ids else None

    @property
    def totals(self) -> Optional[Totals]:
        """What the metrics read: counters, seconds and baseline length; None unless finished."""
        return self.counters.totals(self.timings, len(self.baseline_ids)) if self.ok else None

    @classmethod
    def failed(cls, prompt_id: str, category: str, error: str, prompt_ids=()) -> "PromptResult":
        return cls(prompt_id, category, "failed", error, tuple(prompt_ids), (), (), None, None, None)


@dataclass(frozen=True, kw_only=True)
class Summary(Totals):
    """A group of prompts: how many, and their finished prompts' counters and seconds summed, so
    every metric (summary.tau, summary.speedup, ...) is a ratio of sums, not a mean of ratios."""

    prompts: int
    failed: int
    lossless: int

    @classmethod
    def of(cls, results: typing.Sequence[PromptResult]) -> "Summary":
        done = [r for r in results if r.ok]
        totals = sum((r.totals for r in done), Totals())
        return cls(**dataclasses.asdict(totals), prompts=len(results), failed=len(results) - len(done),
                   lossless=sum(1 for r in done if r.lossless))


@dataclass(frozen=True)
class ImportInfo:
    """Marks a record crossrt did not run: one aggregate result (or one per request, from AIPerf's
    per-request export) whose counters come from another runtime's own statistics (`crossrt
    import`, docs/import.md)."""

    format: str  # the source format, e.g. "vllm-log"
    source: str  # what was read: the file, or "BEFORE -> AFTER" for the delta of two scrapes
    given: tuple[str, ...]  # the counters the source gives; the others follow crossrt's identities
    missing: tuple[str, ...]  # what the source does not give, in words


@dataclass(frozen=True)
class PromptFormat:
    """How a run's prompts were fed (crossrt/inputs/chat_template.py, docs/prompts.md). A templated
    prompt's prompt_sha256 is the digest of its rendered text."""

    mode: str  # "auto" (chat prompts templated when the model has a template), "chat" or "raw"
    template: Optional[str]  # where the template came from, e.g. "gguf:models/x.gguf"; None: none used
    template_sha256: Optional[str]
    variables: tuple[str, ...]  # --template-var NAME=VALUE, as given
    templated: tuple[str, ...]  # ids of the prompts rendered through the template
    # Which user turn of the questions ran: 2 is MT-Bench's second turn, after the target's own
    # greedy answer to the first (crossrt/run/second_turn.py), from the answers file of this digest.
    turn: int = 1
    first_answers_sha256: Optional[str] = None


@dataclass(frozen=True)
class RunRecord:
    runtime: RuntimeInfo
    pair: PairInfo
    params: RunParams
    results: tuple[PromptResult, ...] = ()
    schema_version: int = SCHEMA_VERSION
    notes: tuple[str, ...] = field(default=())
    # The per-token trace file beside the record (crossrt/records/trace.py), relative to the record's
    # folder; None when no prompt was traced.
    trace: Optional[str] = None
    # Set when crossrt did not run this: counters read from another runtime's text (crossrt import).
    imported: Optional[ImportInfo] = None
    # How prompts were fed: raw text or rendered through a chat template (None: raw, as before).
    prompt_format: Optional[PromptFormat] = None

    def with_result(self, result: PromptResult) -> "RunRecord":
        return self.with_results((result,))

    def with_results(self, results: Iterable[PromptResult]) -> "RunRecord":
        """As with_result for each of results in turn (a result replaces the one with its
        prompt id, and goes last), in one pass: O(n + m), where a loop of with_result is O(n * m)."""
        latest: dict[str, PromptResult] = {}
        for result in results:
            latest.pop(result.prompt_id, None)
            latest[result.prompt_id] = result
        kept = tuple(r for r in self.results if r.prompt_id not in latest)
        return dataclasses.replace(self, results=kept + tuple(latest.values()))

    def categories(self) -> list[str]:
        return sorted({r.category for r in self.results})

    def summary(self, category: Optional[str] = None) -> Summary:
        return Summary.of([r for r in self.results if category is None or r.category == category])
