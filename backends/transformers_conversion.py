"""The transformers runtime's conversions of GGUF files, cached (backends/transformers.py): where
each is kept, written with the sha256 of each of its files (DIGESTS), and checked against them
on every load, so a cache that changed since it was written is refused, never run in the GGUF's
name; the files checked are what the record names as loaded (ModelInfo.loaded).

Digests are read through crossrt's digest cache (crossrt.inputs.pairs.sha256_of: by path, size
and modification time), so a load re-reads a file only when it changed on disk; an edit that
keeps a file's size and restores its modification time to the nanosecond is not seen.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from crossrt.errors import ModelError
from crossrt.inputs.pairs import cache_dir, note_sha256, sha256_of
from crossrt.records.schema import LoadedFile

if TYPE_CHECKING:
    import torch

# A conversion's manifest: its source's sha256 and each of its files' (save_dequantized).
DIGESTS = "crossrt-digests.json"


@contextlib.contextmanager
def each_gguf_read_once():
    """While converting a GGUF file, gguf-py reads it once, not three times, and through a plain
    NumPy view of its mapping.

    transformers' GGUF loader opens the file with a new gguf.GGUFReader for the config, for the
    weights and for the tokenizer in turn (load_gguf_checkpoint imports the class at each call),
    and each reader builds NumPy views of every vocabulary entry. A reader is a read-only view of
    the file, so one per file serves all three. Views sliced from gguf-py's np.memmap are
    memmaps, each made by memmap's own Python code (__getitem__, __array_finalize__): ~14 CPU-s
    per reader on a 262,144-token vocabulary, ~3.6 through a plain ndarray view of the same
    mapping (_PlainViews), whose views are made in C. The bytes read are the same: conversions
    are byte for byte those of gguf-py's own reader.

    transformers' weight-name mapping also builds gguf-py's TensorNameMap once per submodule of
    the model (313 for Gemma 3 270M, 4 ms each), always for the same architecture and block
    count: it is built once (~1.2 CPU-s less), and no caller changes it. (Its three parses of
    every field value, ~0.9 CPU-s each, are left: a cache of the parsed parts cost more to fill
    than the two parses it saved.)
    """
    import gguf

    make_reader, name_map, readers = gguf.GGUFReader, gguf.get_tensor_name_map, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = _plain_views(make_reader)(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, name_map


@functools.cache
def _plain_views(reader_class: type) -> type:
    """reader_class (gguf-py's GGUFReader) reading through a plain ndarray view of the np.memmap
    it maps the file with: its __init__ sets self.data to the memmap before reading anything, and
    every field and tensor it builds is a slice of self.data. The view keeps the memmap (its base)
    and so the mapping open."""

    class _PlainViews(reader_class):
        @property
        def data(self):
            return self._mapped

        @data.setter
        def data(self, value):
            self._mapped = value.view(np.ndarray)

    return _PlainViews


def dequantized_folder(path: Path, dtype: str = "float32") -> Path:
    """Where the GGUF file path, dequantized by this transformers version into dtype, is cached
    as a transformers folder: keyed by the file's content, so a changed file is converted again.
    A float32 conversion keeps the name conversions had before dtypes (the sha256 alone)."""
    import transformers  # the runtime's own, imported before any model loads
    name = sha256_of(path) if dtype == "float32" else f"{sha256_of(path)}-{dtype}"
    return cache_dir() / "hf-from-gguf" / f"transformers-{transformers.__version__}" / name


def conversion_files(folder: Path, source: Path) -> Optional[tuple[LoadedFile, ...]]:
    """The files of folder, the cached conversion of the GGUF file source, each checked against
    the digests written with it; None where there is none to load: no folder, or one an older
    crossrt wrote without digests (converted again, said in one line). A conversion whose files
    are not the ones written is refused (ModelError): it would run in the GGUF's name."""
    if not folder.is_dir():
        return None
    manifest = folder / DIGESTS
    if not manifest.is_file():
        print(f"crossrt: {folder} has no digests of its files (cached before crossrt checked them): "
              f"converting {source} again", file=sys.stderr)
        return None
    refuse = f"the cached conversion {folder} of {source.name} is not the one crossrt wrote"
    try:
        written = json.loads(manifest.read_text())
        expected, source_sha256 = dict(written["files"]), written["source_sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelError(f"{refuse}: its {DIGESTS} does not read ({error}); delete the folder to convert again") from None
    present = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {DIGESTS}
    changed = sorted(present ^ set(expected)) + sorted(
        name for name in present & set(expected) if sha256_of(folder / name) != expected[name])
    if source_sha256 != sha256_of(source):
        changed.insert(0, f"its source (sha256 {source_sha256[:12]}...)")
    if changed:
        raise ModelError(f"{refuse}: {', '.join(changed)} changed since it was written; delete the folder to "
                         "convert again")
    return tuple(LoadedFile(str(folder / name), expected[name], "conversion") for name in sorted(expected))


def write_digests(folder: Path, source: Path) -> dict[str, str]:
    """Write DIGESTS into folder, a conversion of the GGUF file source not yet in its place (a
    digests file copied from another conversion is replaced); the digests, by file name."""
    files = {str(p.relative_to(folder)): _file_digest(p) for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != DIGESTS}
    (folder / DIGESTS).write_text(json.dumps({"source_sha256": sha256_of(source), "files": files}, indent=1) + "\n")
    return files


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_dequantized(model, tokenizer, folder: Path, source: Path) -> None:
    """Cache a model and tokenizer loaded from the GGUF file source (or cast from its float32
    conversion) as the transformers folder folder, with the digests of its files (DIGESTS),
    which conversion_files checks on every load.

    save_pretrained refuses models loaded from GGUF, so the weights go to safetensors directly
    (stored_weights) and the config loses its GGUF quantization_config, which would send the
    next load back to the GGUF file. The folder is written under a temporary name, digests
    last, and renamed into place (over a conversion an older crossrt left without digests), so
    an interrupted write is never read as a cache. A cache that cannot be written only costs
    converting again next time.
    """
    from safetensors.torch import save_file

    temporary = stale = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):  # a cast float32 conversion has none
            del config.quantization_config
        config.save_pretrained(temporary)
        model.generation_config.save_pretrained(temporary)
        save_file(stored_weights(model), temporary / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(temporary)
        digests = write_digests(temporary, source)
        if folder.is_dir() and not (folder / DIGESTS).is_file():
            stale = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.stale."))
            os.rename(folder, stale / folder.name)
        os.rename(temporary, folder)
        # The files keep their modification times: the first load's check need not read them.
        note_sha256({folder / name: digest for name, digest in digests.items()})
    except OSError as error:
        if not (folder / DIGESTS).is_file():  # another process renaming its copy first is no failure
            warnings.warn(f"could not cache the dequantized model in {folder}: {error}", stacklevel=2)
    finally:
        for leftover in (temporary, stale):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


def stored_weights(model) -> dict[str, "torch.Tensor"]:
    """The model's weights with each tied tensor once, under the first name the model gives it:
    the input embeddings (model.embed_tokens) before the output head tied to them. transformers
    loads that as it is; under the head's name, which safetensors' save_model picks, a load of
    Gemma 3 270M first fills the 262,144 x 640 embeddings with random values and ties them
    after: a process's first load took 4.5-5.4 s instead of 2.5-3.1 (the logits are the same)."""
    weights, seen = {}, set()
    for name, tensor in model.state_dict().items():
        storage = (tensor.data_ptr(), tuple(tensor.shape))
        if storage not in seen:
            seen.add(storage)
            weights[name] = tensor.contiguous()
    return weights
