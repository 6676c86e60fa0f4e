"""llama.cpp's n-gram spec types under crossrt's settings, for llama-server and
llama-speculative-simple (backends/llama_spec_cli.py): which --drafting runs which type, and the
type's own flags for crossrt's ngram_max, k and n_min (common/arg.cpp, common/common.h at
the vendored commit 0c1e57098). crossrt/speculative/lookup/llama_ngram.py reproduces each type under the
llama-server and llama-spec-simple schedules; docs/ngram.md sets the settings side by side."""

from __future__ import annotations

import dataclasses

from crossrt.errors import SettingsError
from crossrt.speculative.lookup.llama_ngram import check_ngram_cache
from crossrt.run.runtime import DraftRules

# --drafting values llama-server runs as its own n-gram spec types.
NGRAM_DRAFTINGS = {"llama-ngram-simple": "ngram-simple", "llama-ngram-map-k": "ngram-map-k",
                   "llama-ngram-map-k4v": "ngram-map-k4v", "llama-ngram-mod": "ngram-mod",
                   "llama-ngram-cache": "ngram-cache"}
NGRAM_SIMPLE_SIZE_N = 12  # llama.cpp's default lookup length (common/common.h)
MIN_HITS = 1  # the map types' default; crossrt has no counterpart (docs/ngram.md)

# What llama.cpp would use where crossrt did not set it.
DEFAULTS = {
    "ngram-simple": "its defaults size_n 12, size_m 48; size_n is min(12, k) unless --ngram-max sets it, since a "
                    "draft is made only when at least size_n tokens follow the match",
    "ngram-map-k": "its defaults size_n 12, size_m 48; its min_hits (1) is not read by map-k",
    "ngram-map-k4v": "its defaults size_n 12, size_m 48",
    "ngram-mod": "its defaults n_match 24, n_max 64, n_min 48",
    "ngram-cache": "no flags: 1- to 4-grams, 8 tokens a draft, fixed in common/speculative.cpp; no cache files "
                   "(-lcs, -lcd) given",
}
# State a type keeps across one server's requests, which makes its drafts depend on request order.
ACROSS_REQUESTS = {
    "ngram-map-k": "its n-gram map, position hashes and last accepted counts last across requests; positions "
                   "before the previous request's end are found only through hashes stored then",
    "ngram-mod": "its 4 Mi-slot n-gram pool lasts across requests, emptied after five drafts in a row under "
                 "a quarter accepted",
}
ACROSS_REQUESTS["ngram-map-k4v"] = ACROSS_REQUESTS["ngram-map-k"]
ACROSS_REQUESTS["ngram-cache"] = ("its n-gram counts, and how far into the text it has counted, last across "
                                  "requests")


def ngram_rules(rules: DraftRules, drafting: str, ngram_max: int, tool: str) -> DraftRules:
    """The run's rules under --drafting's n-gram type (rules.spec_type set to it); refused in one
    line where --spec-type names another type, or ngram-cache is asked for sizes it does not run."""
    spec_type = NGRAM_DRAFTINGS[drafting]
    if rules.spec_type not in ("draft", spec_type):
        raise SettingsError(f"--drafting {drafting} is {tool}'s {spec_type}, not spec type {rules.spec_type!r}")
    if spec_type == "ngram-cache":
        check_ngram_cache(rules.k, ngram_max)
    return dataclasses.replace(rules, spec_type=spec_type)


def ngram_simple_size_n(k: int) -> int:
    """ngram-simple's lookup length for drafts of at most k: its default, unless k is shorter
    (a draft must be at least as long as the lookup)."""
    return min(NGRAM_SIMPLE_SIZE_N, k)


def ngram_settings(spec_type: str, size_n: int, rules: DraftRules) -> tuple[tuple[str, int], ...]:
    """The type's own flags for crossrt's settings: the lookup length (ngram_max), the longest
    draft (k), and ngram-mod's n_min, which drops a shorter draft as crossrt's n_min does;
    ngram-cache has none."""
    k = rules.k
    if spec_type == "ngram-cache":
        return ()
    if spec_type == "ngram-mod":
        return (("--spec-ngram-mod-n-match", size_n), ("--spec-ngram-mod-n-max", k),
                ("--spec-ngram-mod-n-min", rules.n_min))
    flag = f"--spec-{spec_type}"
    # k4v's min_hits stays llama.cpp's default, given so that a build with another default cannot move it.
    hits = ((f"{flag}-min-hits", MIN_HITS),) if spec_type == "ngram-map-k4v" else ()
    return ((f"{flag}-size-n", size_n), (f"{flag}-size-m", k)) + hits


def ngram_note(spec_type: str, settings: tuple[tuple[str, int], ...], across: bool = True) -> str:
    """The record's note: llama.cpp's own flags and values, what they stand for, and the state
    the type keeps across requests where one process serves them all (across: llama-server, not
    llama-speculative-simple, which runs one prompt per process)."""
    given = " ".join(f"{flag} {value}" for flag, value in settings) or "its fixed sizes"
    crossrt = "ngram_max, k" + (", n_min" if spec_type == "ngram-mod" else "") + \
        (f", and min_hits {MIN_HITS}, its default" if spec_type == "ngram-map-k4v" else "") + \
        (" (4 and 8: the only values it runs at)" if spec_type == "ngram-cache" else "")
    kept = f"; {ACROSS_REQUESTS[spec_type]}" if across and spec_type in ACROSS_REQUESTS else ""
    return f"{spec_type}: {given} (crossrt's {crossrt}; {DEFAULTS[spec_type]}){kept}"
