"""Splits made on purpose: a pair run over generated prompts under several numerics variants,
every split found counted by where it happened and by the cause crossrt gave it.

Which prompt splits at which token depends on the machine (instruction set, threads, kernels),
so the verdicts are checked on splits generated in numbers rather than on hand-picked prompts:
prompts are drawn from a seeded word list, and each batch of them runs under every variant
(KV cache type, flash attention, threads) through crossrt's driven loop and, where given, the
native runtimes, until every kind of split has been seen often enough or the cap is reached.
Kinds: batch-shape (a driven run leaving its own baseline), native (a native run leaving its
own), cross-run (two runs' outputs parting) and counters-only (identical outputs, other counts).
`scripts/split_census` prints a census; tests/test_splits.py asserts every split has a cause.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

from crossrt.compare.splits import NUMERICS
from crossrt.compare.parity import OWN_BASELINE, PromptParity, labelled
from crossrt.compare.parity_run import Checks, compare_safely
from crossrt.records.schema import RunRecord

WORDS = ("river value code light storm import the night house a list return market class day def "
         "water print plant sun number table city green for while open read").split()
KINDS = ("batch-shape", "native", "cross-run", "counters-only")


@dataclass(frozen=True)
class Variant:
    name: str
    runtime: str
    mode: str
    options: tuple[str, ...] = ()  # `crossrt run` options: --f32-kv-cache, --no-flash-attn, --threads N
    models: tuple[str, ...] = ()  # `crossrt run` model options, e.g. the same pair in F16; () the census's own


# The numerics that move near-ties on a CPU: the KV cache type, flash attention and threads
# (2 threads only on an idle machine: ggml's threads busy-wait), and llama-server natively.
NUMERICS_VARIANTS = (
    Variant("f16-kv", "llama-cpp", "driven"),
    Variant("f32-kv", "llama-cpp", "driven", ("--f32-kv-cache",)),
    Variant("no-flash", "llama-cpp", "driven", ("--no-flash-attn",)),
    Variant("server", "llama-server", "native"),
)
TWO_THREADS = Variant("2-threads", "llama-cpp", "driven", ("--threads", "2"))
# llama-server's schedule driven in-process: the twin whose pass views explain the native run's splits.
SERVER_TWIN = Variant("server-schedule", "llama-cpp", "driven", ("--schedule", "llama-server"))
# llama.cpp's own tools under the other numerics: each a native run with its own baseline.
MORE_NATIVE = (
    Variant("server-f32-kv", "llama-server", "native", ("--f32-kv-cache",)),
    Variant("server-no-flash", "llama-server", "native", ("--no-flash-attn",)),
    Variant("spec-cli", "llama-spec-cli", "native"),
)


def generated_prompts(seed: int, count: int, words: Sequence[str] = WORDS) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"gen-{seed}-{i}", "category": "prose",
             "prompt": " ".join(rng.choice(list(words), int(rng.integers(2, 12))))} for i in range(count)]


def kind_of(comparison: PromptParity, native: set[str]) -> Optional[str]:
    """Which kind of split a comparison holds (KINDS), None when nothing parted."""
    if not comparison.causes:
        return None
    if comparison.run_b == OWN_BASELINE:
        return "native" if comparison.run_a in native else "batch-shape"
    return "cross-run" if comparison.divergence is not None else "counters-only"


@dataclass
class Census:
    """Splits seen, by kind and by cause, and the comparisons that failed (their lines)."""

    kinds: Counter = field(default_factory=Counter)
    causes: Counter = field(default_factory=Counter)  # (kind, cause) -> splits
    failures: list[str] = field(default_factory=list)
    compared: int = 0  # comparisons whose token ids were compared: a census of none counts nothing
    prompts: int = 0
    run_s: float = 0.0
    explain_s: float = 0.0

    def add(self, comparisons: Sequence[PromptParity], native: set[str], batch: str = "") -> None:
        """Count a batch's comparisons; a batch that compared no token ids at all (every prompt
        failed, say) is a failure, not a batch without splits."""
        compared = sum(c.comparable for c in comparisons)
        self.compared += compared
        if not compared:
            why = "; ".join(dict.fromkeys(c.no_ids for c in comparisons if c.no_ids)) or "no comparisons"
            self.failures.append(f"{batch or 'a batch'}: nothing compared ({why})")
        for comparison in comparisons:
            kind = kind_of(comparison, native)
            if kind is not None:
                self.kinds[kind] += 1
                for cause in comparison.causes:
                    self.causes[(kind, cause)] += 1
            if not comparison.ok:
                self.failures.append(f"{comparison.run_a} vs {comparison.run_b}, {comparison.prompt_id}: "
                                     + "; ".join(comparison.problems))

    def unexplained(self) -> int:
        return sum(n for (_, cause), n in self.causes.items() if cause not in NUMERICS)

    def render(self) -> str:
        lines = [f"{self.prompts} prompts, {self.compared} comparisons of token ids; runs {self.run_s:.1f} s, "
                 f"explaining {self.explain_s:.1f} s",
                 "| kind | splits | causes |", "|---|---|---|"]
        for kind in KINDS:
            causes = ", ".join(f"{cause} {n}" for (k, cause), n in sorted(self.causes.items()) if k == kind)
            lines.append(f"| {kind} | {self.kinds[kind]} | {causes or '-'} |")
        lines += [f"FAIL {line}" for line in self.failures]
        return "\n".join(lines)


RunOne = Callable[[Variant, Path, Path], Union[RunRecord, str]]  # a record, or why the variant has none (it crashed)


def take_census(run_one: RunOne, folder: Path, variants: Sequence[Variant] = NUMERICS_VARIANTS,
                batch: int = 20, max_batches: int = 10, enough: int = 20,
                kinds: Sequence[str] = KINDS, on_batch: Optional[Callable[[Census], None]] = None,
                prompts_of: Optional[Callable[[int], Sequence[dict]]] = None) -> Census:
    """Batches of generated prompts through every variant (run_one(variant, prompts file, record
    path) runs one and returns its record) until each of kinds has `enough` splits or
    max_batches ran; each batch's records compared together, every split explained (re-scored
    where a native run recorded no passes, as parity re-scores: a crash there is a failure, and
    the batch is compared from what its runs recorded). prompts_of(number), where given, is
    batch number's prompts instead: a census of runs some variants already made of them."""
    census = Census()
    for number in range(max_batches):
        given = list(prompts_of(number)) if prompts_of is not None else generated_prompts(number, batch)
        prompts = folder / f"prompts-{number}.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in given))
        started = time.perf_counter()
        outcomes = [run_one(variant, prompts, folder / f"{variant.name}-{number}.json") for variant in variants]
        census.run_s += time.perf_counter() - started
        # A variant whose runtime crashed is a failure; the others are still compared.
        census.failures += [f"{v.name}: {outcome}" for v, outcome in zip(variants, outcomes) if isinstance(outcome, str)]
        ran = [(v, outcome) for v, outcome in zip(variants, outcomes) if not isinstance(outcome, str)]
        runs = labelled([record for _, record in ran], [v.name for v, _ in ran])
        native = {label for (label, _), (v, _) in zip(runs, ran) if v.mode == "native"}
        started = time.perf_counter()
        name = f"batch {number} ({prompts.name})"
        verdicts, crashed = compare_safely(runs, [], Checks(logits=False))
        census.add(verdicts.comparisons, native, batch=name)
        census.failures += [f"{name}: {n.run} {n.what}: {n.reason}" for n in crashed]
        census.explain_s += time.perf_counter() - started
        census.prompts += len(given)
        if on_batch is not None:
            on_batch(census)
        if all(census.kinds[kind] >= enough for kind in kinds):
            break
    return census
