"""`crossrt drafter layer-skip` on the real model (Gemma 3 270M Q4_K_M, 18 blocks, fetched by
scripts/setup): the cut keeps the metadata, vocabulary and quantized tensors byte for byte,
loads in llama.cpp with 17 layers and drafts for the target; bad arguments and damaged inputs
get one-line errors before any work."""

import json
import re
import shutil
from collections import Counter

import llama_cpp
import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from crossrt.backends.transformers_conversion import _plain_views
from crossrt.speculative import loop
from crossrt.cli import main
from crossrt.inputs.gguf_file import gguf_metadata
from crossrt.inputs.pairs import pair_from_paths, pair_info
from crossrt.run.runtime import DraftRules, Rows

from conftest import REPO, assert_clean_error

BLOCKS = 17
TINY = REPO / "models" / "tiny" / "target.f32.gguf"  # 4 blocks


def layer_skip(*args):
    return CliRunner().invoke(main, ["drafter", "layer-skip", *map(str, args)])


@pytest.fixture(scope="module")
def target(real_pair):
    return real_pair.path("target", "gguf")


@pytest.fixture(scope="module")
def cut(target, tmp_path_factory):
    output = tmp_path_factory.mktemp("layer-skip") / "blocks17.gguf"
    result = layer_skip(target, output, "--blocks", BLOCKS)
    assert result.exit_code == 0, result.output
    assert result.output == f"wrote {output}: 17 of 18 blocks, 223 tensors (13 dropped), 249.1 MB\n"
    return output


def test_metadata_is_copied_with_the_new_block_count(target, cut):
    theirs, ours = gguf_metadata(target), gguf_metadata(cut)
    assert (theirs.pop("gemma3.block_count"), ours.pop("gemma3.block_count")) == (18, BLOCKS)
    assert ours == theirs  # tokenizer, special ids, file type and every other field
    info = pair_info(pair_from_paths(target, cut), "gguf")  # the check every run makes
    assert info.target.vocab_fingerprint == info.drafter.vocab_fingerprint
    assert info.drafter.n_vocab == 262144 and info.drafter.quantization == "Q4_K_M"


def test_tensors_keep_their_types_and_bytes(target, cut):
    # gguf's own reader, not crossrt's, on a plain view of its mapping as the transformers
    # runtime reads GGUFs (_plain_views: the same bytes, ~10 CPU-s less than memmap slices).
    ours = _plain_views(GGUFReader)(cut).tensors
    blocks = {int(match.group(1)) for t in ours if (match := re.match(r"blk\.(\d+)\.", t.name))}
    assert blocks == set(range(BLOCKS)) and len(ours) == 2 + 13 * BLOCKS  # + token_embd, output_norm
    # The target's types, less its last block's 13 tensors (6 F32, 4 Q5_0, Q4_K, Q8_0, Q6_K).
    assert Counter(t.tensor_type.name for t in ours) == {"F32": 103, "Q5_0": 77, "Q4_K": 26, "Q8_0": 9, "Q6_K": 8}
    # The target stores blk.17 last, so the cut's tensor data is the start of the target's.
    start = min(t.data_offset for t in ours)
    data, theirs = np.memmap(cut, mode="r")[start:], np.memmap(target, mode="r")
    offset = bytes(theirs[:start + 65536]).find(bytes(data[:4096]))
    assert offset > 0 and np.array_equal(theirs[offset:offset + len(data)], data)


def test_cut_loads_in_llama_cpp_and_drafts_for_the_target(real_pair, cut, llama_runtime):
    target = llama_runtime.load(real_pair.path("target", "gguf"))
    drafter = llama_runtime.load(cut)
    assert llama_cpp.llama_model_n_layer(drafter._model.model) == BLOCKS
    assert drafter.n_vocab == target.n_vocab == 262144
    ids = target.tokenize("The capital of France is")
    assert drafter.tokenize("The capital of France is") == ids == [2, 818, 5279, 529, 7001, 563]
    # A different model (logits move by several units) that still knows the answer.
    assert np.abs(target.eval(ids, Rows.LAST).copy() - drafter.eval(ids, Rows.LAST)).max() > 1
    # " Paris" and " France" lie within ~0.03 logits in the cut model: which one its argmax
    # picks depends on the CPU's kernels, so the property is that the answer is a top candidate.
    drafter.truncate(0)
    row = np.asarray(drafter.eval(ids, Rows.LAST)[0])
    assert "Paris" in {drafter.detokenize([int(t)]).strip() for t in np.argsort(-row)[:2]}
    code = target.tokenize("def fibonacci(n):\n")
    generation = loop.speculative_generate(target, drafter, code, DraftRules(7), 16)
    assert len(generation.output_ids) == 16 and sum(generation.step_accepted) > 0


@pytest.mark.parametrize("blocks, message", [(18, "cannot keep 18 blocks: .* has 18; keep 1 to 17"),
                                             (0, "0 is not in the range x>=1")])
def test_blocks_out_of_range_are_refused(target, tmp_path, blocks, message):
    result = layer_skip(target, tmp_path / "out.gguf", "--blocks", blocks)
    assert_clean_error(result, message)
    assert not list(tmp_path.iterdir())


def test_missing_and_damaged_inputs_are_refused(target, tmp_path):
    header_only = tmp_path / "header-only.gguf"
    with target.open("rb") as source:
        header_only.write_bytes(source.read(1 << 20))  # cut inside the 262,144-token vocabulary
    no_data = tmp_path / "no-data.gguf"
    no_data.write_bytes(TINY.read_bytes()[:-4096])  # header intact, tensors cut short
    for source, message in [(tmp_path / "missing.gguf", "no such GGUF file"),
                            (header_only, "runs past the end of the file): it is damaged or truncated"),
                            (no_data, "is not a readable GGUF file (damaged or truncated?)")]:
        result = layer_skip(source, tmp_path / "out.gguf", "--blocks", 2)
        assert_clean_error(result, re.escape(message), exit_codes=(1,))
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out.gguf").exists()


def test_outputs_that_cannot_be_written_are_refused(tmp_path):
    source = tmp_path / "tiny.gguf"
    shutil.copy(TINY, source)
    existing = tmp_path / "existing.gguf"
    existing.write_bytes(b"keep me")
    for output, message in [(tmp_path / "no" / "such" / "folder.gguf", "folder .* does not exist"),
                            (source, "is the input file"), (existing, "exists; pass --overwrite")]:
        result = layer_skip(source, output, "--blocks", 2)
        assert result.exit_code == 1 and re.search(message, result.output), result.output
    assert existing.read_bytes() == b"keep me"
    result = layer_skip(source, existing, "--blocks", 2, "--overwrite")
    assert result.exit_code == 0 and gguf_metadata(existing)["llama.block_count"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.gguf", "tiny.gguf"]  # no temporary left


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRT_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_cutting_a_transformers_conversion_gives_the_conversion_of_the_cut(hf_cache):
    """The tiny target's transformers conversion cut to 2 blocks equals transformers' own
    conversion of the GGUF cut to 2 blocks, file by file and tensor by tensor."""
    from safetensors.torch import load_file

    from crossrt.backends.transformers import dequantized_folder, load_model
    from crossrt.builders.layer_skip import layer_skip_folder as cut_folder
    from crossrt.run.runtime import RuntimeOptions

    cut = hf_cache / "blocks2.gguf"
    layer_skip(TINY, cut, "--blocks", 2)
    for model in (TINY, cut):
        load_model(model, RuntimeOptions(threads=1))
    ours, theirs = hf_cache / "ours", dequantized_folder(cut)
    assert cut_folder(dequantized_folder(TINY), ours, 2) == 2 * 9  # a llama block's 9 tensors
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    config = json.loads((ours / "config.json").read_text())
    assert config == json.loads((theirs / "config.json").read_text()) and config["num_hidden_layers"] == 2
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    mine, transformers = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert mine.keys() == transformers.keys() and all(mine[k].equal(transformers[k]) for k in mine)


def test_cutting_a_transformers_folder_refuses_bad_arguments(hf_cache):
    from crossrt.backends.transformers import dequantized_folder, load_model
    from crossrt.builders.layer_skip import LayerSkipError, layer_skip_folder as cut_folder
    from crossrt.run.runtime import RuntimeOptions

    load_model(TINY, RuntimeOptions(threads=1))
    source = dequantized_folder(TINY)
    (hf_cache / "taken").mkdir()
    for folder, output, blocks, message in [(source, hf_cache / "out", 4, "cannot keep 4 blocks: .* has 4; keep 1 to 3"),
                                            (hf_cache, hf_cache / "out", 2, "expected a transformers folder"),
                                            (source, hf_cache / "taken", 2, "exists; remove it to cut again")]:
        with pytest.raises(LayerSkipError, match=message):
            cut_folder(folder, output, blocks)
    assert not (hf_cache / "out").exists() and not list((hf_cache / "taken").iterdir())
