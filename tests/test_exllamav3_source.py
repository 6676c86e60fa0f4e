"""The exllamav3 backend against exllamav3 1.6.5's own source, without a GPU.

Two kinds of test: some read the unpacked 1.6.5 wheel (fetched once into .cache/exllamav3-src;
skipped, with the reason, where pip cannot reach it) to pin down what crossrt relies on; others
run crossrt's loading, evaluation and Generator code over a stand-in of exllamav3's Python API
that records every call, and check the keyword arguments against 1.6.5's signatures: Model.load,
Generator and Job take **kwargs, so a misspelled or missing parameter would pass unnoticed there.
"""

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from crossrt.errors import SettingsError
from crossrt.backends import exllamav3 as backend
from crossrt.backends import exllamav3_native as native
from crossrt.run.runtime import DraftRules, RuntimeOptions, Rows

from conftest import REPO

pytest.importorskip("torch", reason="the stand-in hands out torch tensors, as exllamav3 does")
from exllamav3_stand_in import StandIn  # noqa: E402 (it needs torch)

SOURCE = REPO / ".cache" / "exllamav3-src" / backend.PINNED_VERSION
GPU_CHECK = REPO / "scripts" / "gpu_check"
TINY_TARGET = REPO / "models" / "tiny" / "target-hf"
# Where crossrt's calls land in 1.6.5: (file, class, function); Model.load forwards to load_gen.
SIGNATURES = {
    "Config.from_directory": ("model/config.py", "Config", "from_directory"),
    "Model.from_config": ("model/model.py", "Model", "from_config"),
    "Model.load": ("model/model.py", "Model", "load_gen"),
    "Model.warmup": ("model/model.py", "Model", "warmup"),
    "Cache": ("cache/cache.py", "Cache", "__init__"),
    "Tokenizer.encode": ("tokenizer/tokenizer.py", "Tokenizer", "encode"),
    "Generator": ("generator/generator.py", "Generator", "__init__"),
    "Job": ("generator/job.py", "Job", "__init__"),
}


@pytest.fixture(scope="session")
def source() -> Path:
    """The unpacked exllamav3 package of the 1.6.5 wheel."""
    package = SOURCE / "exllamav3"
    if not (package / "version.py").is_file():
        download = SOURCE.parent / "wheel"
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                  f"exllamav3=={backend.PINNED_VERSION}", "-d", str(download)],
                                 capture_output=True, text=True, timeout=300)
        if fetched.returncode != 0:
            pytest.skip(f"exllamav3 {backend.PINNED_VERSION}'s source is not in {SOURCE} and pip could not fetch "
                        f"it: {fetched.stderr.strip()[-300:]}")
        partial = SOURCE.with_name(SOURCE.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(next(download.glob(f"exllamav3-{backend.PINNED_VERSION}-*.whl"))) as wheel:
            wheel.extractall(partial)
        shutil.rmtree(SOURCE, ignore_errors=True)
        os.replace(partial, SOURCE)
    return package


def function_node(source: Path, path: str, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((source / path).read_text())
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls).body
    return next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == name)


def keyword_defaults(node: ast.FunctionDef) -> dict[str, object]:
    """Named parameters that can be passed by keyword, with their literal defaults (None if none)."""
    arguments = node.args
    named = arguments.posonlyargs + arguments.args
    defaults = [None] * (len(named) - len(arguments.defaults)) + list(arguments.defaults)
    pairs = list(zip(named, defaults)) + list(zip(arguments.kwonlyargs, arguments.kw_defaults))
    return {arg.arg: ast.literal_eval(default) if isinstance(default, ast.Constant) else None
            for arg, default in pairs}


def shell_array(name: str) -> list[str]:
    """The words of a bash array NAME=(...) in scripts/gpu_check, comments dropped."""
    body = re.search(rf"^{name}=\((.*?)^\)", GPU_CHECK.read_text(), re.S | re.M).group(1)
    return " ".join(line.split("#")[0] for line in body.splitlines()).split()


@pytest.fixture
def exl(monkeypatch) -> StandIn:
    stand_in = StandIn()
    monkeypatch.setitem(sys.modules, "exllamav3", stand_in.module)
    monkeypatch.setitem(sys.modules, "exllamav3.util", stand_in.util)
    monkeypatch.setattr(backend, "gpu_memory_gib", lambda: [80.0, 80.0])
    return stand_in


def model_folder(root: Path, name: str, architecture: str = "LlamaForCausalLM", **stand_in) -> Path:
    """The tiny target's config (and weights) under another name, with stand-in fields."""
    folder = root / name
    folder.mkdir()
    config = json.loads((TINY_TARGET / "config.json").read_text())
    config.update(architectures=[architecture], stand_in=stand_in)
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(TINY_TARGET / "model.safetensors", folder)
    return folder


def assert_names_exist_in_1_6_5(source: Path, stand_in: StandIn) -> None:
    for called, kwargs in stand_in.calls:
        if called in SIGNATURES:
            known = keyword_defaults(function_node(source, *SIGNATURES[called]))
            assert set(kwargs) <= set(known), f"{called}: {sorted(set(kwargs) - set(known))} not in 1.6.5"


# ---- 1: the version ------------------------------------------------------------------------------

def test_version_is_read_from_the_distribution_not_the_package(source):
    assert "__version__" not in (source / "__init__.py").read_text()
    assert (source / "version.py").read_text().strip() == f'__version__ = "{backend.PINNED_VERSION}"'
    script = GPU_CHECK.read_text()
    assert "exllamav3.__version__" not in script and "importlib.metadata.version('exllamav3')" in script


# ---- 2 and 6: chunk size, chunked evaluation -------------------------------------------------------

def test_loading_prepares_one_chunk_on_the_cache_in_1_6_5(source):
    assert keyword_defaults(function_node(source, "model/model.py", "Model", "load_gen"))["max_chunk_size"] == 2048
    autosplit = (source / "model" / "model_ls.py").read_text()
    assert '"batch_shape": (1, max_chunk_size),' in autosplit
    assert "prepare_for_attn(torch.zeros((1, max_chunk_size)" in autosplit
    assert 'assert bsz * cache_max_seq_len <= cache.max_num_tokens, "Cache too small for batch shape"' in \
        (source / "modules" / "attn.py").read_text()
    # The Generator prefills a chunk of max_chunk_size at a time.
    job = (source / "generator" / "job.py").read_text()
    assert "prefill_end = seq.kv_position + self.generator.max_chunk_size" in job


@pytest.mark.parametrize("n_ctx, capacity, chunk", [(512, 512, 512), (300, 512, 512), (5000, 5120, 2048)])
def test_driven_load_fits_the_chunk_to_the_cache(source, exl, n_ctx, capacity, chunk):
    session = backend.ExllamaV3Runtime(RuntimeOptions(n_ctx=n_ctx)).load(TINY_TARGET)
    assert exl.kwargs("Cache")[0]["max_num_tokens"] == capacity
    assert exl.kwargs("Model.load")[0]["max_chunk_size"] == exl.kwargs("Model.warmup")[0]["max_chunk_size"] == chunk
    assert "use_per_device" not in exl.kwargs("Model.load")[0]
    assert (session.n_vocab, session.eog_ids) == (512, frozenset({1}))
    assert_names_exist_in_1_6_5(source, exl)


def test_chunk_plan():
    assert backend.chunk_plan(5, 2, Rows.ALL) == [(0, 2, Rows.ALL), (2, 4, Rows.ALL), (4, 5, Rows.ALL)]
    assert backend.chunk_plan(5, 2, Rows.LAST) == [(0, 2, Rows.NONE), (2, 4, Rows.NONE), (4, 5, Rows.LAST)]
    assert backend.chunk_plan(4, 2, Rows.NONE) == [(0, 2, Rows.NONE), (2, 4, Rows.NONE)]
    assert backend.chunk_plan(3, 2048, Rows.LAST) == [(0, 3, Rows.LAST)]


def test_driven_evaluations_run_chunk_by_chunk(exl):
    session = backend.ExllamaV3Runtime(RuntimeOptions(n_ctx=512)).load(TINY_TARGET)
    session.eval([3] * 200, Rows.NONE)
    every = session.eval([3] * 40, Rows.ALL)
    passes = exl.kwargs("Model.prefill") + exl.kwargs("Model.forward")
    assert [(p["tokens"], p["past_len"], p["batch_shape"]) for p in passes] == [(200, 0, (1, 512)), (40, 200, (1, 512))]
    session._chunk = 16
    last = session.eval([3] * 40, Rows.LAST)
    chunks = exl.kwargs("Model.prefill")[1:] + exl.kwargs("Model.forward")[1:]
    assert [(p["tokens"], p["past_len"], p.get("last_tokens_only")) for p in chunks] == \
        [(16, 240, None), (16, 256, None), (8, 272, 1)]
    assert every.shape == (40, 512) and last.shape == (1, 512)  # sliced to the vocabulary
    assert session.n_past == 280


# ---- 3 and 4: the compile carries over between calls; its progress is measured ---------------------

def test_extension_sources_are_counted_as_1_6_5_builds_them(source):
    """scripts/gpu_check counts compiled objects against exllamav3's own source list, loaded by
    path (util/cuda_flags.py uses the standard library only, so nothing triggers the build)."""
    script = GPU_CHECK.read_text()
    assert "spec_from_file_location" in script and "extension_sources" in script
    spec = importlib.util.spec_from_file_location("cuda_flags", source / "util" / "cuda_flags.py")
    cuda_flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cuda_flags)
    assert len(cuda_flags.extension_sources(str(source / "exllamav3_ext"))) == 194


def test_gpu_check_keeps_the_build_inputs_stable_between_calls():
    script = GPU_CHECK.read_text()
    install = next(line for line in script.splitlines() if "--target /tmp/site .whl/" in line)
    assert "--upgrade" not in install
    assert "touch" in script and "TRITON_CACHE_DIR=" in script and "TORCH_EXTENSIONS_DIR=" in script


# ---- 5: --gpu-split --------------------------------------------------------------------------------

def test_1_6_5_fills_gpus_in_order(source):
    autosplit = (source / "model" / "model_ls.py").read_text()
    assert "current_device_i += 1" in autosplit
    assert 'raise RuntimeError("Insufficient VRAM in split for model and cache")' in autosplit
    assert "use_per_device = [int(x * 1024**3) for x in use_per_device]" in (source / "model" / "model.py").read_text()


def test_gpu_split_shares_become_per_model_limits():
    assert backend.use_per_device(10.0, (1, 1), (14.6, 14.6)) == [5.0, 14.6]
    assert backend.use_per_device(8.0, (1, 3), (24.0, 24.0)) == [2.0, 24.0]
    assert backend.use_per_device(8.0, (2, 0), (80.0, 80.0)) == [80.0, 0.0]
    assert backend.use_per_device(8.0, (0, 1), (80.0, 80.0)) == [0.0, 80.0]
    assert backend.use_per_device(1e-6, (1, 1), (80.0, 80.0)) == [1 / 1024, 80.0]  # never 0 (= unused)
    assert backend.use_per_device(100.0, (1, 1), (16.0, 16.0)) == [16.0, 16.0]
    with pytest.raises(SettingsError, match="3 shares but torch sees 2"):
        backend.use_per_device(1.0, (1, 1, 1), (16.0, 16.0))


def test_model_size_counts_weights_as_loaded():
    tensor_bytes = backend.loaded_tensor_bytes(TINY_TARGET)
    assert tensor_bytes["model.embed_tokens.weight"] == 512 * 64 * 2  # F32 on disk, FP16 once loaded
    assert backend.module_bytes(tensor_bytes, ["model.layers.1"]) == 36992 * 2
    assert backend.module_bytes(tensor_bytes, ["model.layers.1."]) == 0
    assert backend.module_bytes(tensor_bytes, ["missing", "model.norm"]) == 64 * 2


def test_gpu_split_is_sized_per_model_and_recorded(exl, monkeypatch):
    runtime = backend.ExllamaV3Runtime(RuntimeOptions(n_ctx=512, gpu_split=(1, 1)))
    runtime.load(TINY_TARGET)
    # Embedding in system memory; 4 layers, norm and head in FP16; K/V of 4 layers at 512 tokens.
    size = (4 * 36992 + 64 + 512 * 64) * 2 + 4 * 2 * 512 * 2 * 16 * 2
    placement = runtime._placements[0]
    assert placement.size_gib == pytest.approx(size / 1024**3)
    assert exl.kwargs("Model.load")[0]["use_per_device"] == [1 / 1024, 80.0] == list(placement.use_per_device)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: backend.PINNED_VERSION)
    assert runtime.info().build.endswith("; target-hf (0.001 GiB) use_per_device 0.001/80.000 GiB")


# ---- 7: nvcc as exllamav3 finds it -----------------------------------------------------------------

def test_nvcc_is_found_through_torchs_cuda_home(source, monkeypatch, tmp_path):
    assert "cuda_home = torch.utils.cpp_extension.CUDA_HOME" in (source / "ext.py").read_text()
    for variable in ("CUDA_HOME", "CUDA_PATH", "PYTORCH_NVCC"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(backend, "DEFAULT_CUDA_HOME", str(tmp_path / "cuda"))
    assert backend.nvcc_path() is None
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    (tmp_path / "cuda" / "bin" / "nvcc").write_text("")
    assert backend.nvcc_path() == str(tmp_path / "cuda" / "bin" / "nvcc")
    monkeypatch.setenv("PYTORCH_NVCC", "/opt/nvcc-wrapper")
    assert backend.nvcc_path() == "/opt/nvcc-wrapper"


def test_gpu_check_preflight_finds_nvcc_under_cuda_home(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "nvcc").chmod(0o755)
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(["bash", str(GPU_CHECK), "preflight"], capture_output=True, text=True, env=env, timeout=60)
    assert f"nvcc: {tmp_path}/bin/nvcc" in result.stdout, result.stdout + result.stderr


# ---- 8: what the GPU image lacks travels as wheels ---------------------------------------------------

def test_every_dependency_of_1_6_5_is_carried_or_in_the_image(source):
    metadata = (source.parent / f"exllamav3-{backend.PINNED_VERSION}.dist-info" / "METADATA").read_text()
    required = {re.split(r"[<>=;\s]", line.split(":", 1)[1].strip())[0].lower().replace("_", "-")
                for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra ==" not in line
                and "Windows" not in line}
    carried = {word.split("==")[0].lower() for word in shell_array("BINARY_WHEELS")}
    present = {word.lower() for word in shell_array("IMAGE_PACKAGES")} | {"llguidance"}
    assert "marisa-trie" in carried
    assert required - carried - present == set()
    # llguidance is declared but optional: its import is guarded (generator/filter/llguidance.py:9-13).
    assert "except (ModuleNotFoundError, ImportError):\n    llguidance_available = False" in \
        (source / "generator" / "filter" / "llguidance.py").read_text()
    assert "import marisa_trie" in (source / "loader" / "safetensors.py").read_text()


# ---- 9: MTP drafters of their own folder -----------------------------------------------------------

def test_1_6_5_has_mtp_drafters_with_a_folder_of_their_own(source):
    assistant = (source / "architecture" / "gemma4_assistant.py").read_text()
    assert '"mtp_draft": True,' in assistant and 'return {"text": Gemma4AssistantModel}' in assistant
    assert '"dflash_draft": True,' in (source / "architecture" / "deepseek_v4_mtp.py").read_text()


def test_native_loads_an_mtp_drafter_from_its_own_folder(source, exl, tmp_path):
    target = model_folder(tmp_path, "target")
    drafter = model_folder(tmp_path, "assistant", "Gemma4AssistantForCausalLM", caps={"text": {"mtp_draft": True}})
    session = native.open_generator_session(target, drafter, DraftRules(4, spec_type="mtp"), RuntimeOptions(n_ctx=256))
    assert [kwargs.get("component", "text") for kwargs in exl.kwargs("Model.from_config")] == ["text", "text"]
    assert exl.kwargs("Model.load")[1]["draft_model"] is session._drafter  # drafter loaded first, then the target
    generated = session.generate([5, 6], 16, speculative=True)
    assert generated.output_ids == (7, 8, 1) and generated.counters.accepted == 2
    assert exl.kwargs("Generator")[0]["max_chunk_size"] == 512 == exl.kwargs("Model.load")[0]["max_chunk_size"]
    assert_names_exist_in_1_6_5(source, exl)


def test_native_loads_component_and_block_drafters(exl, tmp_path):
    mtp = model_folder(tmp_path, "qwen", components=["text", "mtp"], caps={"mtp": {"mtp_draft": True}})
    native.open_generator_session(mtp, mtp, DraftRules(3, spec_type="mtp"), RuntimeOptions(n_ctx=256))
    assert [kwargs.get("component", "text") for kwargs in exl.kwargs("Model.from_config")] == ["text", "mtp"]
    dspark = model_folder(tmp_path, "deepseek", components=["text", "mtp"], caps={"mtp": {"dflash_draft": True}})
    session = native.open_generator_session(dspark, dspark, DraftRules(3, spec_type="dspark"),
                                            RuntimeOptions(n_ctx=256))
    assert native.DSPARK_NOTE in session.notes
    with pytest.raises(SettingsError, match="spec_type mtp but .* \\(dspark drafting\\)"):
        native.open_generator_session(dspark, dspark, DraftRules(3, spec_type="mtp"), RuntimeOptions(n_ctx=256))
    with pytest.raises(SettingsError, match="name the target's folder as the drafter"):
        native.open_generator_session(dspark, mtp, DraftRules(3, spec_type="dspark"), RuntimeOptions(n_ctx=256))
    dflash2 = model_folder(tmp_path, "dflash2", "DFlash2DraftModel", caps={"text": {"dflash_draft": True}}, block_size=8)
    native.open_generator_session(mtp, dflash2, DraftRules(7, spec_type="dflash2"), RuntimeOptions(n_ctx=256))
    with pytest.raises(SettingsError, match="drafts blocks of 8: k is at most 7"):
        native.open_generator_session(mtp, dflash2, DraftRules(8, spec_type="dflash2"), RuntimeOptions(n_ctx=256))


# ---- 10: recurrent targets -------------------------------------------------------------------------

def test_1_6_5_rejects_a_matching_draft_at_a_checkpoint_boundary(source):
    generator = (source / "generator" / "generator.py").read_text()
    assert "cp_boundary = batch_states is not None and job.is_checkpoint_boundary()" in generator
    assert "if draft_tokens[j, i].item() != sampled_token.item() or cp_boundary:" in generator
    assert "batch_states = [job.recurrent_state.target for job in batch_jobs]" in generator


def test_records_of_recurrent_targets_say_so(exl, tmp_path):
    hybrid = model_folder(tmp_path, "hybrid", caps={"text": {"recurrent_states": True}})
    plain = model_folder(tmp_path, "plain")
    noted = native.open_generator_session(hybrid, plain, DraftRules(4), RuntimeOptions(n_ctx=256)).notes
    assert any("checkpoint boundary" in note and "interval=2048" in note for note in noted)
    assert [kwargs["max_history"] for kwargs in exl.kwargs("Cache")] == [4, 4]
    unnoted = native.open_generator_session(plain, plain, DraftRules(4), RuntimeOptions(n_ctx=256)).notes
    assert not any("checkpoint boundary" in note for note in unnoted)
