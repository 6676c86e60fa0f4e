"""Pairs: a target and a drafter, named per runtime format by a TOML manifest.

A manifest (models/pairs/*.toml) gives, for each role, one path per model format:
`gguf` (llama.cpp), `hf` (a transformers folder), `exl3` (an exllamav3 folder). Relative
paths are relative to the manifest (an installed crossrt's built-in ones: crossrt.inputs.builtin).
An empty string marks a path left for the user to fill.

Before any run, the vocabularies of the two files a runtime will load must be compatible
(crossrt.inputs.vocabulary): pair_info checks them and describes the files for the record.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from crossrt.errors import PairError
from crossrt.inputs.builtin import cache_dir, made_on_first_use, missing_model_hint, model_path, named
from crossrt.inputs.file_facts import file_fact, write_json
from crossrt.inputs.gguf_file import gguf_metadata
from crossrt.inputs.vocabulary import check_files_compatible, vocabulary_facts
from crossrt.records.schema import LoadedFile, ModelInfo, PairInfo

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

FORMATS = ("gguf", "hf", "exl3")
ROLES = ("target", "drafter")
@dataclass(frozen=True)
class Pair:
    name: str
    files: dict[str, dict[str, str]]  # role -> format -> path ("" = not filled in)
    description: str = ""
    defaults: dict[str, object] = field(default_factory=dict)  # e.g. k, spec_type
    source: Optional[Path] = None

    def path(self, role: str, model_format: Union[str, Sequence[str]]) -> Path:
        """The file of role for a runtime loading model_format, checked to exist. Given several
        formats (a runtime's, in its order of preference), the first one filled in for role."""
        where = f"pair {self.name!r}" + (f" ({self.source})" if self.source else "")
        formats = (model_format,) if isinstance(model_format, str) else tuple(model_format)
        named = self.files.get(role, {})
        model_format = next((fmt for fmt in formats if named.get(fmt)), None)
        if model_format is None:
            empty = [fmt for fmt in formats if fmt in named]
            if empty:
                raise PairError(f"{where}: the {role}'s {' and '.join(empty)} path is left empty; "
                                "fill it in with the path of your copy")
            raise PairError(f"{where} names no {' or '.join(formats)} file for the {role}")
        value = named[model_format]
        path = Path(value).expanduser()
        if not path.is_absolute() and self.source is not None:
            path = model_path(self.source, path)
        if not path.exists() and not made_on_first_use(path):
            raise PairError(f"{where}: {role} {model_format} file not found: {path}{missing_model_hint(path)}")
        return path


DEFAULT_K = 4  # draft tokens per step of a run that names no k and whose pair states none


def manifest_path(name: str) -> Path:
    """The manifest a --pair names: a path, else a built-in pair's name (tiny)."""
    return named("pairs", name)


def load_pair(manifest: Path) -> Pair:
    manifest = Path(manifest)
    if not manifest.is_file():
        raise PairError(f"pair manifest not found: {manifest}")
    try:
        data = tomllib.loads(manifest.read_text())
    except tomllib.TOMLDecodeError as error:
        raise PairError(f"{manifest} is not valid TOML: {error}") from None
    files = {}
    for role in ROLES:
        entry = data.get(role)
        if not isinstance(entry, dict):
            raise PairError(f"{manifest} has no [{role}] table")
        unknown = set(entry) - set(FORMATS)
        if unknown:
            raise PairError(f"{manifest} [{role}]: unknown keys {sorted(unknown)}; formats are {FORMATS}")
        files[role] = {fmt: str(path) for fmt, path in entry.items()}
    return Pair(name=str(data.get("name", manifest.stem)), files=files,
                description=str(data.get("description", "")),
                defaults=dict(data.get("defaults", {})), source=manifest.resolve())


def resolve_pair(pair: Optional[str] = None, target: Optional[Path] = None, drafter: Optional[Path] = None) -> Pair:
    """The pair a command names: a manifest (a path, or a name under models/pairs; default: the
    tiny pair), or a target with a drafter. PairError when both kinds, or half a pair, are given."""
    if target or drafter:
        if not (target and drafter) or pair:
            raise PairError("give either --pair, or both --target and --drafter")
        return pair_from_paths(target, drafter)
    return load_pair(manifest_path(pair or "tiny"))


def run_k(pair: Pair, k: Optional[int] = None) -> int:
    """The k of a run: the one given, else the pair's [defaults] k, else DEFAULT_K."""
    if k is not None:
        return k
    stated = pair.defaults.get("k", DEFAULT_K)
    if isinstance(stated, bool) or not isinstance(stated, int) or stated < 1:
        raise PairError(f"pair {pair.name!r} ({pair.source}): [defaults] k = {stated!r}: expected a whole number >= 1")
    return stated


def run_spec_type(pair: Pair, spec_type: Optional[str] = None) -> str:
    """The drafting method of a run: the one given, else the pair's [defaults] spec_type, else a
    drafter model ("draft"); DraftRules checks the name."""
    return spec_type or str(pair.defaults.get("spec_type", "draft"))


def pair_from_paths(target: Path, drafter: Path) -> Pair:
    """An ad-hoc pair from two model paths, their format told by their shape."""
    files = {role: {model_format(Path(path)): str(Path(path).resolve())}
             for role, path in (("target", target), ("drafter", drafter))}
    return Pair(name=f"{Path(target).name}+{Path(drafter).name}", files=files)


def model_format(path: Path) -> str:
    if path.suffix == ".gguf":
        return "gguf"
    if (path / "config.json").is_file():
        config = json.loads((path / "config.json").read_text())
        return "exl3" if config.get("quantization_config", {}).get("quant_method") == "exl3" else "hf"
    raise PairError(f"cannot tell the format of {path}: expected a .gguf file or a folder with config.json")


# ---- fingerprints -------------------------------------------------------------------------

def _digest_key(path: Path) -> str:
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def _file_sha256(path: Path, cache: dict[str, str]) -> str:
    key = _digest_key(path)
    if key not in cache:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        cache[key] = digest.hexdigest()
    return cache[key]


def _digest_cache() -> tuple[Path, dict[str, str]]:
    """sha256_of's cache file and what it holds (nothing where it is missing or damaged)."""
    cache_file = cache_dir() / "sha256.json"
    try:
        return cache_file, json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return cache_file, {}


def sha256_of(path: Path) -> str:
    """sha256 of a file, or of a folder's files (names and contents, in name order).

    Multi-gigabyte models take a while to hash, so digests are cached by path, size and
    modification time in crossrt's cache folder (cache_dir).
    """
    cache_file, cache = _digest_cache()
    known = len(cache)
    if path.is_dir():
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{file.relative_to(path)}\0{_file_sha256(file, cache)}\n".encode())
        result = digest.hexdigest()
    else:
        result = _file_sha256(path, cache)
    if len(cache) > known:  # written only with a new digest (file facts ask for known ones often)
        write_json(cache_file, cache)
    return result


def note_sha256(digests: dict[Path, str]) -> None:
    """Keep in sha256_of's cache the sha256 of files their writer hashed as it wrote them (a
    cached conversion: backends/transformers_conversion.py), so that the first load after
    does not read a gigabyte again only to hash it."""
    cache_file, cache = _digest_cache()
    cache.update({_digest_key(path): digest for path, digest in digests.items()})
    write_json(cache_file, cache)


def model_files(path: Path, what: str = "model") -> tuple[LoadedFile, ...]:
    """A model file, or each file of a model folder, with its sha256, as a record names what a
    runtime loaded (ModelInfo.loaded)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return tuple(LoadedFile(str(file), sha256_of(file), what) for file in files)


def quantization_of(path: Path) -> str:
    if path.suffix == ".gguf":  # kept by digest (file_fact): reading the metadata reads every token
        return file_fact("gguf-quantization-1", [path], lambda: _gguf_quantization(path))
    config = json.loads((path / "config.json").read_text())
    quant = config.get("quantization_config")
    if quant:
        return f"{quant.get('quant_method', 'quantized')} {quant.get('bits', '')}".strip()
    return str(config.get("torch_dtype") or config.get("dtype") or "unknown")


def _gguf_quantization(path: Path) -> str:
    from gguf import LlamaFileType

    file_type = gguf_metadata(path).get("general.file_type")
    if file_type is None:
        return "unknown"
    return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")


def model_info(path: Path, fingerprint: str, n_vocab: int) -> ModelInfo:
    return ModelInfo(path=str(path), sha256=sha256_of(path), format=model_format(path),
                     quantization=quantization_of(path), vocab_fingerprint=fingerprint, n_vocab=n_vocab)


def pair_info(pair: Pair, model_format_name, drafter_format=None) -> PairInfo:
    """Check the pair's files for one format and describe them for the record; drafter_format:
    the drafter's, where it differs (a head's torch weights are its speculators folder). What
    is read of the vocabularies is kept by the files' digests (vocabulary_facts)."""
    paths = {"target": pair.path("target", model_format_name),
             "drafter": pair.path("drafter", drafter_format or model_format_name)}
    vocabularies = {"target": vocabulary_facts(paths["target"])}  # role: (fingerprint, size)
    head = head_folder_vocab_size(paths["drafter"])
    if head is None:
        check_files_compatible(paths["target"], paths["drafter"])
        vocabularies["drafter"] = vocabulary_facts(paths["drafter"])
    elif head != vocabularies["target"][1]:
        raise PairError(f"{paths['drafter']}: the head drafts for a {head}-token vocabulary, the target has "
                        f"{vocabularies['target'][1]}: a head of another target")
    else:  # a head folder reads the target's embeddings and ids: the target's vocabulary is its
        vocabularies["drafter"] = vocabularies["target"]
    return PairInfo(name=pair.name, **{role: model_info(paths[role], *vocabularies[role]) for role in ROLES})


def head_folder_vocab_size(path: Path) -> Optional[int]:
    """The target vocabulary size a drafter head folder (speculators' format: config.json with
    speculators_model_type; z-lab's DFlash: dflash_config; no tokenizer of its own) drafts for;
    None for any other path."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
        if "dflash_config" in data:
            return int(data["vocab_size"])
        if "speculators_model_type" not in data:
            return None
        return int(data["transformer_layer_config"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise PairError(f"{config}: a drafter head's config crossrt cannot read ({error})") from None
