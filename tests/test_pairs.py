"""Pair manifests, file fingerprints and vocabulary compatibility, on the real tiny pair files
and the real model's GGUF files beside crossrt's own transformers conversion of them."""

import dataclasses

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from crossrt.inputs.pairs import PairError, pair_info, sha256_of
from crossrt.inputs.vocabulary import FIRST_COMPARED_TOKEN, check_compatible, read_vocabulary

from conftest import REPO, assert_clean_error


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
    with pytest.raises(PairError, match=r"incompatible vocabularies.*2 of 512 tokens mean other text, first at id 100"):
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


@pytest.fixture(scope="module")
def real_conversions(real_pair):
    """role -> (the real model's GGUF file, crossrt's float32 transformers conversion of it),
    which scripts/setup writes (scripts/fetch_real_model)."""
    from crossrt.backends.transformers import dequantized_folder

    files = {role: real_pair.path(role, "gguf") for role in ("target", "drafter")}
    found = {role: (path, dequantized_folder(path)) for role, path in files.items()}
    missing = [str(folder) for _, folder in found.values() if not (folder / "tokenizer.json").is_file()]
    if missing:
        pytest.fail(f"no transformers conversion at {', '.join(missing)}; run scripts/setup", pytrace=False)
    return found


def test_one_vocabulary_spelled_by_two_formats_is_one_vocabulary(tiny_pair, real_conversions):
    for gguf_file, folder in [(tiny_pair.path(role, "gguf"), tiny_pair.path(role, "hf")) for role in ("target", "drafter")] \
            + list(real_conversions.values()):
        gguf_vocab, hf_vocab = read_vocabulary(gguf_file), read_vocabulary(folder)
        assert gguf_vocab.fingerprint == hf_vocab.fingerprint, (gguf_file, folder)
        check_compatible(gguf_vocab, hf_vocab)
    gguf_vocab, hf_vocab = (read_vocabulary(path) for path in real_conversions["target"])
    # Gemma 3's GGUF spells its whitespace tokens with spaces, its tokenizer.json with U+2581
    assert gguf_vocab.tokens != hf_vocab.tokens and gguf_vocab.meanings == hf_vocab.meanings


def test_a_token_that_means_other_text_is_another_vocabulary(tiny_pair, real_conversions):
    tiny = read_vocabulary(tiny_pair.path("target", "hf"))
    real = read_vocabulary(real_conversions["target"][0])
    for vocab, token_id in ((tiny, 300), (real, 1000), (real, real.eos_id)):
        tokens = list(vocab.tokens)
        tokens[token_id] += "x"
        changed = dataclasses.replace(vocab, tokens=tuple(tokens))
        assert changed.fingerprint != vocab.fingerprint
        if token_id >= FIRST_COMPARED_TOKEN:  # as llama.cpp, the drafter check skips the first ids
            with pytest.raises(PairError, match=f"1 of {len(tokens)} tokens mean other text, first at id {token_id}"):
                check_compatible(vocab, changed)
    # a format's view of which added tokens are special is no part of what they mean
    assert dataclasses.replace(tiny, special=frozenset(), literal=tiny.special).fingerprint == tiny.fingerprint
    assert dataclasses.replace(tiny, eos_id=tiny.bos_id).fingerprint != tiny.fingerprint


def test_a_missing_model_of_the_checkouts_cache_says_scripts_setup_makes_it(tmp_path):
    """scripts/demo sets up only what it runs (no SmolLM2 drafter heads): a pair whose files are
    still to be fetched or made in the checkout's .cache/models says what makes them; a file
    missing anywhere else is only said missing."""
    from crossrt.inputs.pairs import load_pair

    for where, hinted in ((REPO / ".cache" / "models" / "not-made-yet" / "eagle3.gguf", True),
                          (tmp_path / "elsewhere.gguf", False)):
        manifest = tmp_path / "pair.toml"
        manifest.write_text(f'name = "p"\n[target]\ngguf = "{where}"\n[drafter]\ngguf = "{where}"\n')
        with pytest.raises(PairError, match="file not found") as raised:
            load_pair(manifest).path("target", "gguf")
        assert ("scripts/setup fetches and makes the built-in pairs' models" in str(raised.value)) is hinted
