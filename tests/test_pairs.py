"""Pair manifests, file fingerprints and vocabulary compatibility, on the real tiny pair files."""

import dataclasses

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from crossrt.inputs.pairs import PairError, check_compatible, pair_info, read_vocabulary, sha256_of

from conftest import assert_clean_error


def copy_gguf_with_tokens(source, destination, change_tokens):
    """A copy of a GGUF file whose token texts are change_tokens(tokens): same weights,
    different vocabulary, as a drafter trained with another tokenizer would have."""
    reader = gguf.GGUFReader(source)
    tokens = list(reader.get_field("tokenizer.ggml.tokens").contents())
    writer = gguf.GGUFWriter(destination, "llama")
    new = {"tokenizer.ggml.tokens": MetadataDetails(gguf.GGUFValueType.ARRAY, change_tokens(tokens),
                                                    sub_type=gguf.GGUFValueType.STRING)}
    copy_with_new_metadata(reader, writer, new, [])
    return destination


def test_tiny_pair_is_compatible_and_fingerprinted(tiny_pair):
    info = pair_info(tiny_pair, "gguf")
    assert info.target.vocab_fingerprint == info.drafter.vocab_fingerprint
    assert info.target.n_vocab == 512 and info.target.quantization == "F32"
    assert len(info.target.sha256) == 64 and info.target.sha256 != info.drafter.sha256
    hf = pair_info(tiny_pair, "hf")
    assert hf.target.format == "hf" and hf.target.vocab_fingerprint == info.target.vocab_fingerprint


def test_folder_digest_covers_names_and_contents(tmp_path):
    (tmp_path / "a").write_text("1")
    first = sha256_of(tmp_path)
    (tmp_path / "a").write_text("2")
    assert sha256_of(tmp_path) != first


def test_swapped_tokens_are_named_in_the_error(tiny_pair, tmp_path):
    def swap(tokens):
        tokens[100], tokens[101] = tokens[101], tokens[100]
        return tokens

    drafter = copy_gguf_with_tokens(tiny_pair.path("drafter", "gguf"), tmp_path / "other.gguf", swap)
    target_vocab = read_vocabulary(tiny_pair.path("target", "gguf"))
    with pytest.raises(PairError, match=r"incompatible vocabularies.*2 of 512 token texts differ, first at id 100"):
        check_compatible(target_vocab, read_vocabulary(drafter))


def test_special_ids_and_sizes_are_checked(tiny_pair):
    vocab = read_vocabulary(tiny_pair.path("target", "gguf"))
    with pytest.raises(PairError, match="special ids differ"):
        check_compatible(vocab, dataclasses.replace(vocab, eos_id=2))
    with pytest.raises(PairError, match="vocabulary sizes differ by 200"):
        check_compatible(vocab, dataclasses.replace(vocab, tokens=vocab.tokens + ("x",) * 200))
    check_compatible(vocab, dataclasses.replace(vocab, tokens=vocab.tokens + ("<pad>",) * 64))


def test_run_refuses_an_incompatible_drafter(tiny_pair, tmp_path):
    from click.testing import CliRunner

    from crossrt.cli import main

    drafter = copy_gguf_with_tokens(tiny_pair.path("drafter", "gguf"), tmp_path / "other.gguf",
                                    lambda tokens: tokens[:5] + [t + "x" for t in tokens[5:]])
    result = CliRunner().invoke(main, ["run", "--target", str(tiny_pair.path("target", "gguf")),
                                       "--drafter", str(drafter), "--out", str(tmp_path / "run.json")])
    assert_clean_error(result, "incompatible vocabularies", exit_codes=(1,))
    assert not (tmp_path / "run.json").exists()
