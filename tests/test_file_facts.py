"""crossrt.inputs.file_facts: what is derived from model files' contents, kept on disk by their
digests: read back by a later call, never for a file that changed, derived again where an entry
is damaged; a cache that cannot be written costs only the deriving, and an error is never kept.
Then on the tiny pair's files, what a run's record says of a pair, from the cache and after its
drafter is rewritten in place."""

import json
import os
import shutil

import pytest

from crossrt.errors import PairError
from crossrt.inputs.file_facts import FOLDER, file_fact
from crossrt.inputs.pairs import pair_from_paths, pair_info
from crossrt.inputs.vocabulary import read_vocabulary

from test_pairs import copy_gguf_with_tokens


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("CROSSRT_CACHE", str(folder))
    return folder


class Counted:
    """A derivation that counts its calls."""

    def __init__(self, derive):
        self.derive, self.calls = derive, 0

    def __call__(self):
        self.calls += 1
        return self.derive()


def test_a_fact_is_derived_once_then_read_back(tmp_path, cache):
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    derive = Counted(lambda: {"counts": (1, 2)})
    assert file_fact("counts-1", [model], derive) == {"counts": [1, 2]}  # as JSON gives it back, either way
    assert file_fact("counts-1", [model], derive) == {"counts": [1, 2]} and derive.calls == 1
    assert file_fact("counts-2", [model], lambda: 3) == 3  # another kind (or version) is its own fact
    assert len(list((cache / FOLDER).glob("*.json"))) == 2


def test_a_changed_file_is_not_served_stale(tmp_path, cache):
    model = tmp_path / "model.bin"
    model.write_bytes(b"four")
    assert file_fact("text-1", [model], model.read_text) == "four"
    model.write_bytes(b"five")  # the same size: only the modification time tells
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert file_fact("text-1", [model], model.read_text) == "five"
    model.write_bytes(b"longer")
    assert file_fact("text-1", [model], model.read_text) == "longer"


def test_a_damaged_entry_is_derived_again_and_replaced(tmp_path, cache):
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    assert file_fact("answer-1", [model], lambda: 7) == 7
    (entry,) = (cache / FOLDER).glob("answer-1-*.json")
    kept = json.loads(entry.read_text())
    damages = ["", "{cut sho", json.dumps([7]), json.dumps({**kept, "value": 8}),  # a value its checksum denies
               json.dumps({**kept, "digests": ["0" * 64]}), json.dumps({**kept, "kind": "answer-2"}),
               json.dumps({key: value for key, value in kept.items() if key != "check"})]
    for damage in damages:
        entry.write_text(damage)
        derive = Counted(lambda: 7)
        assert file_fact("answer-1", [model], derive) == 7 and derive.calls == 1, damage
        assert json.loads(entry.read_text()) == kept, damage


def test_a_cache_that_cannot_be_written_costs_only_the_deriving(tmp_path, monkeypatch):
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("CROSSRT_CACHE", str(blocker / "cache"))  # under a file: no folder can be made
    derive = Counted(lambda: 7)
    assert file_fact("answer-1", [model], derive) == 7
    assert file_fact("answer-1", [model], derive) == 7 and derive.calls == 2


def test_an_error_is_raised_each_time_never_kept(tmp_path, cache):
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")

    def broken():
        raise PairError(f"{model} is not a readable GGUF file")

    for _ in range(2):
        with pytest.raises(PairError, match="not a readable GGUF file"):
            file_fact("answer-1", [model], broken)
    # a file that cannot be hashed: its derivation says what is wrong with it
    with pytest.raises(PairError, match="not a readable GGUF file"):
        file_fact("answer-1", [tmp_path / "absent.gguf"], broken)


def swap(tokens):
    tokens[100], tokens[101] = tokens[101], tokens[100]
    return tokens


def test_a_pairs_facts_come_from_the_cache_and_follow_a_rewritten_drafter(tiny_pair, tmp_path, cache):
    target, drafter = tiny_pair.path("target", "gguf"), tmp_path / "drafter.gguf"
    shutil.copyfile(tiny_pair.path("drafter", "gguf"), drafter)
    pair = pair_from_paths(target, drafter)
    info = pair_info(pair, "gguf")
    vocabulary = read_vocabulary(drafter)
    assert (info.drafter.vocab_fingerprint, info.drafter.n_vocab) == (vocabulary.fingerprint, len(vocabulary.tokens))
    assert info.drafter.quantization == "F32"
    kinds = sorted(entry.name.rsplit("-", 1)[0] for entry in (cache / FOLDER).iterdir())
    assert kinds == ["compatible-vocabularies-1", "gguf-quantization-1", "gguf-quantization-1",
                     "vocabulary-1", "vocabulary-1"]
    assert pair_info(pair, "gguf") == info  # every fact read back
    # The drafter rewritten in place with two tokens swapped (its size the same): refused, each time.
    copy_gguf_with_tokens(tiny_pair.path("drafter", "gguf"), drafter, swap)
    for _ in range(2):
        with pytest.raises(PairError, match="incompatible vocabularies"):
            pair_info(pair, "gguf")
