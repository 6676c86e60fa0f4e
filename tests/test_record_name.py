"""Default record names (crossrt/run/record_name.py): runs of other settings never share a file."""

import re
from pathlib import Path

from crossrt.run.record_name import default_record_path
from crossrt.run.runtime import DraftRules
from crossrt.speculative.strategies import Strategy


def name(**changes) -> Path:
    settings = dict(pair="tiny", runtime="llama-cpp", mode="driven", default_mode="driven", k=4, schedule="crossrt",
                    strategy=Strategy(), rules=DraftRules(4))
    settings.update(changes)
    return default_record_path(**settings)


def test_the_plain_run_keeps_its_name():
    assert name() == Path("runs/tiny-llama-cpp-k4.json")


def test_every_distinct_setting_gives_a_distinct_name():
    variants = [name(), name(mode="native"), name(schedule="llama-server"), name(k=7),
                name(strategy=Strategy(drafting="prompt-lookup")),
                name(strategy=Strategy(drafting="prompt-lookup", ngram_max=4)),
                name(strategy=Strategy(acceptance="relaxed")),
                name(strategy=Strategy(acceptance="relaxed", top_m=3)),
                name(strategy=Strategy(k_policy="content", content_k=(("code", 7), ("prose", 3)))),
                name(rules=DraftRules(4, n_min=2)), name(rules=DraftRules(4, p_min=0.5))]
    assert len(set(variants)) == len(variants), variants
    assert "relaxed" in name(strategy=Strategy(acceptance="relaxed")).name  # lossy runs say so


def test_a_content_policy_is_named_by_its_ks_and_not_by_an_unread_k():
    """code=7,prose=3 gives every content type its k: the run's k sizes no step (it is not named,
    and it stays in the digest); with a type left out, that type drafts k, which is named."""
    both = Strategy(k_policy="content", content_k=(("code", 7), ("prose", 3)))
    path = name(strategy=both)
    assert path.parent == Path("runs") and path.name.startswith("tiny-llama-cpp-model-content-code-7-prose-3-greedy-")
    assert not re.search(r"-k\d+", path.name) and name(strategy=both, k=5) != path
    assert name(strategy=Strategy(k_policy="content", content_k=(("code", 7),))).name.endswith("-k4.json")
