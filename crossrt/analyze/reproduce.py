"""Reproducing published claims here: each claim planned (the run that reproduces it, or every
reason it cannot run on this machine), run, and checked against what it claims. `crossrt
reproduce` (crossrt/cli/reproduce.py) parses, calls this and prints.

Planning a claim collects every reason it cannot run here (sampling, drafting method, runtime,
pair files, prompts) rather than stopping at the first, so one pass shows all that is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

from crossrt import progress
from crossrt.analyze.claims import Claim, Outcome, check_record
from crossrt.errors import USER_ERRORS
from crossrt.inputs.chat_template import ChatTemplateError, apply_template
from crossrt.inputs.pairs import ROLES, Pair, PairError, resolve_pair, run_spec_type
from crossrt.inputs.prompts import Prompt, PromptError, load_prompts, relabel, source_relative_to
from crossrt.run.attach import attach
from crossrt.run.baselines import BaselineStore
from crossrt.run.driver import RunRequest
from crossrt.run.isolation import run_pair_safely
from crossrt.speculative.loop import SCHEDULE
from crossrt.run.rules import run_rules
from crossrt.run.runtime import HEAD_SPEC_TYPES, RuntimeOptions, RuntimeUnavailable, Server, availability, runtime_class


@dataclass(frozen=True)
class Settings:
    """What the command line adds to every claim."""

    options: RuntimeOptions
    max_new_tokens: int  # for claims that state none
    prompts: str  # suite for claims that name none
    out_dir: Path
    hardware: Optional[str]
    resume: bool
    # The servers attaching runtimes found at --url, or why none: asked once per command.
    servers: dict[tuple[str, str], Union[Server, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """The run that reproduces a claim, and its prompts as the claim's template renders them."""

    request: RunRequest
    prompts: tuple[Prompt, ...]
    warnings: tuple[str, ...] = ()  # its drafting rules' (crossrt/run/rules.py)


def claim_prompts(claim: Claim, default_source: str) -> list[Prompt]:
    """The claim's prompts: one suite per category, relabelled to it, or one suite (the
    claim's or the default) kept to the claimed categories (all of it for overall-only claims)."""
    base = claim.origin.parent
    if isinstance(claim.prompts, tuple):
        prompts = [p for category, source in claim.prompts
                   for p in relabel(load_prompts(source_relative_to(source, base)), category)]
        ids = [p.id for p in prompts]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise PromptError(f"prompt id(s) {', '.join(repeated)} appear in more than one of the claim's suites")
        return prompts
    source = source_relative_to(claim.prompts, base) if claim.prompts else default_source
    wanted = set(claim.categories)
    return [p for p in load_prompts(source) if not wanted or p.category in wanted]


def claim_pair(claim: Claim) -> Pair:
    """The claim's manifest: a path relative to the claims file, else one crossrt resolves
    (a path from the working folder, or a name under models/pairs)."""
    candidate = claim.origin.parent / claim.pair
    return resolve_pair(str(candidate) if candidate.is_file() else claim.pair)


def _pair_reasons(claim: Claim, model_format: Optional[str]) -> list[str]:
    if claim.pair is None:
        return ["the claim names no pair manifest (pair)"]
    try:
        pair = claim_pair(claim)
        if model_format is not None:
            for role in ROLES:
                pair.path(role, model_format)
        elif not all(any(pair.files[role].values()) for role in ROLES):
            return [f"pair {pair.name!r} ({pair.source}): its model paths are left empty; fill them in"]
    except PairError as error:
        return [str(error)]
    return []


def _attached(runtime: str, url: str) -> Union[Server, str]:
    """The server at url as runtime attaches to it; else why not."""
    try:
        return attach(runtime, url)
    except USER_ERRORS as error:
        return str(error)


def _server_reasons(runtime: str, claim: Claim, settings: Settings) -> list[str]:
    """Why claim cannot run on the server the runtime attaches to (--url): none given, nothing
    fit there, or a draft length (the server's own setting) other than the claim's k."""
    url = settings.options.url
    if url is None:
        return [f"runtime {runtime!r} attaches to a server you run: give --url URL (and --baseline-url URL)"]
    if (runtime, url) not in settings.servers:  # asked once per command
        settings.servers[runtime, url] = _attached(runtime, url)
    server = settings.servers[runtime, url]
    if isinstance(server, str):
        return [server]
    if server.k is not None and server.k != claim.k:
        return [f"the server at {server.url} drafts up to {server.k} tokens (its own setting), the claim's k is "
                f"{claim.k}: attach a server started with k {claim.k}"]
    return []  # a server that does not report its draft length yet: the run checks it once it has drafted


def plan_claim(claim: Claim, settings: Settings) -> tuple[Optional[Plan], list[str]]:
    """The run reproducing claim, or every reason it cannot run on this machine."""
    reasons = []
    if claim.sampling != "greedy":
        reasons.append(f"sampling {claim.sampling!r}: crossrt decodes greedily only")
    runtime = None
    if claim.crossrt_runtime is None:
        reasons.append(f"no crossrt runtime reproduces {claim.runtime!r} (crossrt_runtime)")
    else:
        try:
            runtime = runtime_class(claim.crossrt_runtime)
        except RuntimeUnavailable:
            pass  # unknown or not importable here: the availability reason says so
        if runtime is not None and runtime.attaches:  # usable wherever its server answers
            reasons += _server_reasons(claim.crossrt_runtime, claim, settings)
        else:
            unavailable = availability(claim.crossrt_runtime)
            if unavailable:
                reasons.append(unavailable)
    mode = claim.mode or ("native" if runtime is not None and "native" in runtime.modes else "driven")
    if runtime is not None and mode not in runtime.modes:
        reasons.append(f"runtime {runtime.name!r} has no {mode} mode (it has: {', '.join(runtime.modes)})")
    reasons += _pair_reasons(claim, runtime.model_format if runtime is not None else None)
    prompts: list[Prompt] = []
    try:
        prompts = claim_prompts(claim, settings.prompts)
        present = {p.category for p in prompts}
        if not prompts or (claim.categories and not present & set(claim.categories)):
            reasons.append(f"none of the claimed categories ({', '.join(claim.categories)}) is in the prompt suite "
                           f"{claim.prompts or settings.prompts!r}")
    except PromptError as error:
        reasons.append(f"prompts: {error}")
    if reasons:
        return None, reasons
    pair = claim_pair(claim)
    spec_type = run_spec_type(pair, claim.spec_type)
    # MTP heads and n-gram drafting are a runtime's own: whether a native runtime has the claim's
    # method is known only when it starts, and a refusal then is a failed run.
    if mode == "driven" and spec_type not in ("draft", *HEAD_SPEC_TYPES):
        return None, [f"spec_type {spec_type!r}: crossrt's driven loop drafts with a drafter model or a head; "
                      "it needs a runtime's native mode"]
    try:  # the claim's template use, exactly: "chat" on a pair without a template cannot run
        prompts, rendering, prompt_format = apply_template(prompts, pair, claim.template)
    except ChatTemplateError as error:
        return None, [str(error)]
    max_new_tokens = claim.max_new_tokens or settings.max_new_tokens
    rules, warnings = run_rules(claim.crossrt_runtime, mode, claim.schedule or SCHEDULE, max_new_tokens, claim.k,
                                spec_type=spec_type)
    request = RunRequest(pair=pair, runtime=claim.crossrt_runtime, options=settings.options, rules=rules,
                         max_new_tokens=max_new_tokens, out=settings.out_dir / f"{claim.id}.json", mode=mode,
                         schedule=claim.schedule or SCHEDULE, resume=settings.resume, overwrite=not settings.resume,
                         chat=rendering, prompt_format=prompt_format, baselines=BaselineStore.default())
    return Plan(request, tuple(prompts), warnings), []


def reproduce_claim(claim: Claim, settings: Settings, say: Callable[[str], None]) -> Outcome:
    """The claim run here and checked, or skipped with every reason; say: where the command shows
    which run starts (the runs take minutes)."""
    plan, reasons = plan_claim(claim, settings)
    if plan is None:
        return Outcome(claim, skipped=tuple(reasons))
    request = plan.request
    say(f"running {claim.id}: {request.runtime} {request.mode} k={claim.k}, {len(plan.prompts)} prompts "
        f"({claim.describe_prompts()}, template {claim.template}), {request.max_new_tokens} tokens each")
    for warning in plan.warnings:
        say(f"warning: {warning}")
    try:
        with progress.bar(claim.id, len(plan.prompts)) as shown:
            record = run_pair_safely(request, plan.prompts, on_prompt=lambda prompt, result: shown.update(1))
    except USER_ERRORS as error:
        return Outcome(claim, error=str(error), record=request.out)
    return Outcome(claim, check_record(claim, record, settings.hardware), record=request.out)
