"""A driven run's strategy: how drafts are proposed (a draft model, a lookup: crossrt's own or a
runtime's exactly, crossrt/speculative/lookup/; a static tree), how long each step's draft is (a k policy), and which draft tokens the target accepts
(an acceptance rule). crossrt/speculative/loop.py's one loop composes the pieces: crossrt/speculative/drafters.py,
crossrt/speculative/policies.py and crossrt/speculative/acceptance.py.

The default, a draft model's chain at fixed k with greedy acceptance, is the crossrt schedule
every record before strategies were recorded with. Relaxed acceptance with top_m > 1 and
delta > 0 may leave the target's greedy output: such a run is lossy, labelled so in its record,
and never compared or counted as lossless.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from crossrt.errors import SettingsError
from crossrt.records.tables import k_setting
from crossrt.speculative.draft_rules import K_LIMIT
from crossrt.speculative.lookup import LOOKUPS
from crossrt.speculative.tree import Tree

# Draftings that copy tokens from the context (crossrt/speculative/lookup/): no drafter model is loaded or read.
DRAFTINGS = ("model", *LOOKUPS, "tree")
K_POLICIES = ("fixed", "content", "online", "confidence")
ACCEPTANCES = ("greedy", "relaxed")
NGRAM_LIMIT = 64  # the longest n-gram looked up (llama.cpp's ngram-mod matches 24 by default)
CONTENT_TYPES = ("code", "prose")  # crossrt/speculative/policies.py content_type's verdicts

# Each parameter and the choices it belongs to (part, choices): a parameter means nothing under
# another choice, so the CLI refuses one given alone and a sweep cell drops it. ngram_min belongs
# to the lookups that have a shortest n-gram of their own (transformers' looks down to 1-grams,
# llama.cpp's n-gram types look up one length only).
STRATEGY_PARTS = {"tree": ("drafting", ("tree",)), "ngram_max": ("drafting", tuple(LOOKUPS)),
                  "ngram_min": ("drafting", tuple(name for name, lookup in LOOKUPS.items() if lookup.has_ngram_min)),
                  "content_k": ("k_policy", ("content",)),
                  "k_max": ("k_policy", ("online",)), "min_p1": ("k_policy", ("confidence",)),
                  "top_m": ("acceptance", ("relaxed",)), "delta": ("acceptance", ("relaxed",))}


def _one_of(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SettingsError(f"unknown {what} {value!r}; {what}s: {', '.join(choices)}")


@dataclass(frozen=True)
class Strategy:
    drafting: str = "model"
    tree: Optional[str] = None  # drafting="tree": WxD or a JSON choice-list file (tree_spec)
    # A lookup drafting's longest suffix looked up (transformers' max_matching_ngram_size, whose own
    # default is 2; llama.cpp's types' one length: size_n, default 12, ngram-mod's n_match, default 24);
    # the shortest, crossrt's only.
    ngram_max: int = 3
    ngram_min: int = 1
    k_policy: str = "fixed"
    content_k: Optional[tuple[tuple[str, int], ...]] = None  # k_policy="content": (("code", 7), ("prose", 3))
    k_max: int = 8  # k_policy="online": its ceiling
    # k_policy="confidence": fixed k, stopping before a drafter top-1 probability below min_p1;
    # with the content or online policy, the same stop on top of its k.
    min_p1: float = 0.0
    acceptance: str = "greedy"
    top_m: int = 2  # acceptance="relaxed": a draft token among the target's top_m ...
    delta: float = 1.0  # ... within delta logits of its top-1 is accepted

    def __post_init__(self):
        _one_of("drafting", self.drafting, DRAFTINGS)
        _one_of("k policy", self.k_policy, K_POLICIES)
        _one_of("acceptance", self.acceptance, ACCEPTANCES)
        if self.drafting == "tree" and self.tree is None:
            raise SettingsError("tree drafting needs a tree: WxD or a JSON choice-list file")
        if self.drafting != "tree" and self.tree is not None:
            raise SettingsError(f"a tree goes with tree drafting, not {self.drafting} drafting")
        if self.drafting == "tree":
            tree_spec(self.tree)  # refused now, not at the first prompt
            if self.k_policy != "fixed" or self.min_p1 > 0 or self.acceptance != "greedy":
                raise SettingsError("tree drafting verifies its whole static tree with greedy acceptance: "
                                    "no k policy, no confidence stop, no relaxed acceptance")
        if self.ngram_max > NGRAM_LIMIT or self.k_max > K_LIMIT:
            raise SettingsError(f"n-gram sizes go up to {NGRAM_LIMIT} and k_max up to {K_LIMIT}, got ngram_max "
                                f"{self.ngram_max}, k_max {self.k_max}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SettingsError(f"prompt lookup needs 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                                f"{self.ngram_max}")
        if (self.k_policy == "content") != (self.content_k is not None):
            raise SettingsError("content_k (e.g. code=7,prose=3) goes with the content k policy, and it needs one")
        if self.content_k is not None:
            _check_content_k(self.content_k)
        if self.k_max < 1:
            raise SettingsError(f"the online k policy's k_max must be at least 1, got {self.k_max}")
        if not 0.0 <= self.min_p1 <= 1.0:
            raise SettingsError(f"min_p1 must be between 0 and 1, got {self.min_p1}")
        if self.k_policy == "confidence" and self.min_p1 == 0:
            raise SettingsError("the confidence k policy stops before a drafter top-1 probability below min_p1: "
                                "give min_p1 > 0")
        if self.looks_up and not LOOKUPS[self.drafting].has_ngram_min and self.ngram_min != 1:
            raise SettingsError(f"{self.drafting} has no ngram_min (got {self.ngram_min}): it looks up its own "
                                "lengths from ngram_max (docs/ngram.md)")
        if self.looks_up and self.min_p1 > 0:
            raise SettingsError("prompt lookup proposes tokens without probabilities: it has no confidence "
                                "to stop at")
        if self.top_m < 1 or self.delta < 0:
            raise SettingsError(f"relaxed acceptance needs top-m >= 1 and delta >= 0, got {self.top_m}, "
                                f"{self.delta}")

    @property
    def lossy(self) -> bool:
        """The acceptance rule may leave the target's greedy output."""
        return self.acceptance == "relaxed" and self.top_m > 1 and self.delta > 0

    @property
    def looks_up(self) -> bool:
        """Drafts are copied from the context: no drafter model."""
        return self.drafting in LOOKUPS

    @property
    def is_default(self) -> bool:
        """A draft model's chain at fixed k, greedy: the crossrt schedule's plain run."""
        return self.drafting == "model" and self.k_policy == "fixed" and self.acceptance == "greedy"

    @property
    def reads_k(self) -> bool:
        """The run's k sizes some step: not under a content policy that gives every content type its own."""
        return self.k_policy != "content" or {kind for kind, _ in self.content_k} != set(CONTENT_TYPES)

    def k_setting(self, k: int) -> Union[int, str]:
        """The run's k as its record's tables state it (crossrt/records/tables.py): k, or the k policy."""
        return k_setting(k, self.k_policy, format_content_k(self.content_k or ()), self.k_max, self.min_p1)

    def label(self) -> str:
        """drafting/k policy/acceptance, each with its parameters where it has any."""
        if self.looks_up:
            drafting = LOOKUPS[self.drafting].label.format(ngram_min=self.ngram_min, ngram_max=self.ngram_max)
        else:
            drafting = {"model": "model", "tree": f"tree({self.tree})"}[self.drafting]
        policy = {"fixed": "fixed", "online": f"online(k_max={self.k_max})",
                  "confidence": f"confidence(min_p1={self.min_p1:g})",
                  "content": f"content({format_content_k(self.content_k or ())})"}[self.k_policy]
        acceptance = "greedy" if self.acceptance == "greedy" else f"relaxed(m={self.top_m},delta={self.delta:g})"
        if self.min_p1 > 0 and self.k_policy != "confidence":
            policy += f"+p1>={self.min_p1:g}"
        return f"{drafting}/{policy}/{acceptance}"


def _check_content_k(content_k: tuple[tuple[str, int], ...]) -> None:
    seen = set()
    for kind, k in content_k:
        if kind not in CONTENT_TYPES:
            raise SettingsError(f"content type {kind!r}: content types are {', '.join(CONTENT_TYPES)}")
        if kind in seen:
            raise SettingsError(f"content type {kind!r} is given twice")
        if not isinstance(k, int) or k < 1:
            raise SettingsError(f"content type {kind}: k must be an integer of at least 1, got {k!r}")
        seen.add(kind)


def format_content_k(content_k: tuple[tuple[str, int], ...]) -> str:
    return ",".join(f"{kind}={k}" for kind, k in content_k)


def parse_content_k(text: str) -> tuple[tuple[str, int], ...]:
    """"code=7,prose=3" -> (("code", 7), ("prose", 3))."""
    pairs = []
    for item in text.split(","):
        kind, equals, k = item.strip().partition("=")
        if not equals or not k.strip().isdigit():
            raise SettingsError(f"content k {text!r}: give TYPE=K pairs, e.g. code=7,prose=3")
        pairs.append((kind.strip(), int(k)))
    content_k = tuple(pairs)
    _check_content_k(content_k)
    return content_k


def tree_spec(spec: str) -> Tree:
    """A run's tree: WxD (the full tree of width W and depth D) or a JSON choice-list file.
    best:N is chosen on simulation oracles (crossrt simulate --tree), not at run time."""
    width, x, depth = spec.partition("x")
    if x and width.isdigit() and depth.isdigit():
        return Tree.full(int(width), int(depth))
    if spec.startswith("best:"):
        raise SettingsError(f"tree {spec!r}: best:N is found by `crossrt simulate --tree`; a run takes WxD or "
                            "a JSON choice-list file")
    if not Path(spec).is_file():
        raise SettingsError(f"tree {spec!r}: give WxD or a JSON choice-list file")
    return Tree.from_file(Path(spec))
