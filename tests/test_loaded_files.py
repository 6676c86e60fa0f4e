"""A record names what each runtime really read for each model, with digests (ModelInfo.loaded),
and the transformers runtime's cached conversion of a GGUF file is checked against the digests
written with it before it is loaded: changed, it is refused in one line; written by a crossrt
that kept no digests, it is converted again. Real transformers and llama.cpp loads of the tiny
pair's F32 GGUF files, in a fresh cache folder ($CROSSRT_CACHE), 1 thread."""

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from crossrt.backends.transformers import dequantized_folder, load_model
from crossrt.backends.transformers_conversion import DIGESTS
from crossrt.cli import main
from crossrt.errors import ModelError
from crossrt.inputs.pairs import sha256_of
from crossrt.records.record_json import load_record
from crossrt.run.runtime import RuntimeOptions

from conftest import REPO, assert_clean_error

TINY = REPO / "models" / "tiny"
TARGET, DRAFTER = TINY / "target.f32.gguf", TINY / "drafter.f32.gguf"
OPTIONS = RuntimeOptions(n_ctx=512, threads=1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSRT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(runtime: str, out: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "category": "prose", "prompt": "Once upon a time"}) + "\n")
    return CliRunner().invoke(main, [str(a) for a in (
        "run", "--runtime", runtime, "--target", TARGET, "--drafter", DRAFTER, "--k", 2, "--max-new-tokens", 4,
        "--threads", 1, "--prompts", prompts, "--out", out)])


def test_records_name_the_files_each_runtime_read_with_their_digests(cache, tmp_path):
    runs = {}
    for label, runtime in (("converting", "transformers"), ("converted", "transformers"), ("llama", "llama-cpp")):
        result = _run(runtime, tmp_path / f"{label}.json", tmp_path)
        assert result.exit_code == 0, result.output
        runs[label] = load_record(tmp_path / f"{label}.json").pair
    for role, gguf in (("target", TARGET), ("drafter", DRAFTER)):
        as_named = ((str(gguf.resolve()), sha256_of(gguf), "model"),)
        # llama.cpp reads the file itself; transformers the GGUF while converting it, then its conversion
        for label in ("llama", "converting"):
            model = getattr(runs[label], role)
            assert [(f.path, f.sha256, f.what) for f in model.loaded] == list(as_named)
            assert model.loaded[0].sha256 == model.sha256
        folder = dequantized_folder(gguf)
        converted = getattr(runs["converted"], role).loaded
        assert {Path(f.path) for f in converted} == {p for p in folder.iterdir() if p.name != DIGESTS}
        assert all(f.what == "conversion" and f.sha256 == _digest(Path(f.path)) for f in converted)
        assert any(Path(f.path).name == "model.safetensors" for f in converted)


def test_a_changed_conversion_is_refused_in_one_line(cache, tmp_path):
    load_model(TARGET, OPTIONS)  # converts and caches
    folder = dequantized_folder(TARGET)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=r"^the cached conversion .* is not the one crossrt wrote: model\.safetensors "
                                         r"changed since it was written; delete the folder to convert again$"):
        load_model(TARGET, OPTIONS)
    result = _run("transformers", tmp_path / "run.json", tmp_path)
    assert_clean_error(result, r"model\.safetensors changed since it was written")
    assert result.output.strip().splitlines()[-1].startswith("Error: the cached conversion"), result.output
    assert not (tmp_path / "run.json").exists()
    weights.unlink()
    (folder / "extra.safetensors").write_bytes(bytes(data))  # a file the digests do not name is a change too
    with pytest.raises(ModelError, match=r"extra\.safetensors, model\.safetensors changed"):
        load_model(TARGET, OPTIONS)
    (folder / DIGESTS).write_text("{")
    with pytest.raises(ModelError, match=f"its {DIGESTS} does not read"):
        load_model(TARGET, OPTIONS)


def test_a_conversion_cached_without_digests_is_converted_again(cache, capfd):
    load_model(TARGET, OPTIONS)
    folder = dequantized_folder(TARGET)
    written = {p.name: _digest(p) for p in folder.iterdir()}
    (folder / DIGESTS).unlink()  # as an older crossrt left it
    (folder / "model.safetensors").write_bytes(b"not the weights")
    capfd.readouterr()
    session = load_model(TARGET, OPTIONS)
    said = capfd.readouterr().err.strip().splitlines()
    assert said == [f"crossrt: {folder} has no digests of its files (cached before crossrt checked them): "
                    f"converting {TARGET} again"]
    assert {p.name: _digest(p) for p in folder.iterdir()} == written  # the conversion made afresh, digests back
    assert Path(session.model.name_or_path) == TARGET.parent  # read from the GGUF, not the stale folder
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # nothing left aside
