"""Pairs: a target and a drafter, named per runtime format by a TOML manifest.

A manifest (models/pairs/*.toml) gives, for each role, one path per model format:
`gguf` (llama.cpp), `hf` (a transformers folder), `exl3` (an exllamav3 folder). Relative
paths are relative to the manifest. An empty string marks a path left for the user to fill.

Before any run, the vocabularies of the two files a runtime will load must be compatible:
speculative decoding compares token ids, so the drafter's id i must mean the target's id i.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union


from crossrt.errors import CrossrtError
from crossrt.inputs.gguf_file import read_layout
from crossrt.records.schema import LoadedFile, ModelInfo, PairInfo

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

FORMATS = ("gguf", "hf", "exl3")
ROLES = ("target", "drafter")
# As llama.cpp's own check (common/speculative.cpp): vocabularies may differ in size by a few
# padding tokens, and the first few ids (special tokens in many vocabularies) are not compared.
MAX_VOCAB_SIZE_DIFFERENCE = 128
FIRST_COMPARED_TOKEN = 5


class PairError(CrossrtError, ValueError):
    """A manifest, model file or vocabulary problem, with a message meant for the user."""


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
            path = self.source.parent / path
        if not path.exists():
            raise PairError(f"{where}: {role} {model_format} file not found: {path}")
        return path


REPO_PAIRS = Path(__file__).resolve().parents[2] / "models" / "pairs"
DEFAULT_K = 4  # draft tokens per step of a run that names no k and whose pair states none


def manifest_path(name: str) -> Path:
    """The manifest a --pair names: a path, else a name under models/pairs (tiny)."""
    path = Path(name)
    if not path.exists() and (REPO_PAIRS / f"{name}.toml").is_file():
        return REPO_PAIRS / f"{name}.toml"
    return path


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


# ---- vocabularies -------------------------------------------------------------------------

# How a file spells the bytes of its ordinary tokens: GPT-2's byte-level alphabet (a printable
# character per byte), SentencePiece's U+2581 for a space, or the text itself.
BYTE_LEVEL, SENTENCEPIECE, PLAIN = "byte-level", "sentencepiece", "plain"
_GGUF_SPELLING = {"gpt2": BYTE_LEVEL, "llama": SENTENCEPIECE, "t5": SENTENCEPIECE}
# GGUF tokenizer.ggml.token_type values (llama.cpp's LLAMA_TOKEN_TYPE_*)
GGUF_UNKNOWN, GGUF_CONTROL, GGUF_USER_DEFINED, GGUF_UNUSED, GGUF_BYTE = 2, 3, 4, 5, 6
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
FINGERPRINT_PREFIX = "bytes:"  # what the fingerprint hashes; records before it hashed token texts


@functools.lru_cache(maxsize=1)
def _gpt2_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (its bytes_to_unicode), inverted."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


@dataclass(frozen=True)
class Vocabulary:
    """A model file's vocabulary as its format spells it, and what each id means.

    The same vocabulary is spelled differently by a GGUF file and a transformers folder (Gemma 3's
    GGUF writes its whitespace tokens as spaces, its tokenizer.json as U+2581), so two files are
    compared, and fingerprinted, by meaning (`meanings`): a special token by its text, a byte
    token by its byte, any other token by the bytes its text stands for in its file's spelling.
    Whether an added token is special is not part of its meaning: formats disagree on it
    (llama.cpp's converter makes an added token that looks special a control token).
    """

    model: str  # tokenizer model as GGUF names it, e.g. "gpt2" (byte-level BPE), "llama" (SentencePiece)
    tokens: tuple[str, ...]
    bos_id: Optional[int]
    eos_id: Optional[int]
    spelling: str = PLAIN  # BYTE_LEVEL, SENTENCEPIECE or PLAIN: how ordinary tokens spell bytes
    special: frozenset[int] = frozenset()  # control tokens: they mean their text, not bytes
    literal: frozenset[int] = frozenset()  # user-defined (added) tokens: their text as it is
    byte_tokens: frozenset[int] = frozenset()  # SentencePiece's <0xNN> fallback tokens

    @functools.cached_property
    def meanings(self) -> tuple[bytes, ...]:
        """Per id, the bytes the token stands for."""
        return tuple(self._meaning(i, text) for i, text in enumerate(self.tokens))

    def _meaning(self, token_id: int, text: str) -> bytes:
        if token_id in self.special:
            return text.encode()
        if token_id in self.byte_tokens:
            return bytes([int(text[3:5], 16)])
        if self.spelling == SENTENCEPIECE:
            # llama.cpp's converter writes user-defined spaces as spaces, tokenizer.json as U+2581
            return text.replace("\u2581", " ").encode()
        if self.spelling == BYTE_LEVEL and token_id not in self.literal:
            alphabet = _gpt2_alphabet()
            if all(c in alphabet for c in text):
                return bytes(alphabet[c] for c in text)
        return text.encode()  # as tokenizers' ByteLevel decoder does with a character outside it

    @functools.cached_property
    def fingerprint(self) -> str:
        """FINGERPRINT_PREFIX and 16 hex digits of sha256 over each id's meaning and the BOS and
        EOS ids: one vocabulary gives one fingerprint whichever format spells it."""
        digest = hashlib.sha256()
        for meaning in self.meanings:
            digest.update(len(meaning).to_bytes(4, "little") + meaning)
        digest.update(json.dumps([self.bos_id, self.eos_id]).encode())
        return FINGERPRINT_PREFIX + digest.hexdigest()[:16]


def gguf_metadata(path: Path) -> dict[str, object]:
    """The GGUF key/value metadata of path (scalars, strings and arrays as lists), without tensors
    (crossrt.inputs.gguf_file: ~0.3 s for a 262,144-token vocabulary, where gguf-py's reader takes ~20).
    Read once per version of the file in a process: a run asks for the vocabulary, the
    quantization and the chat template in turn."""
    try:
        stat = os.stat(path)
    except OSError as error:
        raise PairError(f"{path} is not a readable GGUF file ({error.strerror or error})") from None
    return dict(_gguf_metadata(str(path), stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _gguf_metadata(path: str, size: int, mtime_ns: int) -> dict[str, object]:
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return {key: field.value for key, field in read_layout(data, tensors=False).fields.items()}
    except (OSError, ValueError, struct.error) as error:  # UnicodeDecodeError is a ValueError
        raise PairError(f"{path} is not a readable GGUF file ({error}): it is damaged or truncated; "
                        "copy or convert it again") from None


def read_vocabulary(path: Path) -> Vocabulary:
    if path.suffix == ".gguf":
        return _gguf_vocabulary(path)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise PairError(f"{path} has no tokenizer.json to read the vocabulary from")
    try:
        tokenizer = json.loads(tokenizer_file.read_text())
        model = tokenizer["model"]
        # BPE and WordPiece map texts to ids; Unigram lists [text, score] in id order
        vocab = {entry[0]: i for i, entry in enumerate(model["vocab"])} if isinstance(model["vocab"], list) \
            else dict(model["vocab"])
        added = {t["id"]: t for t in tokenizer.get("added_tokens", [])}
    except (ValueError, KeyError, TypeError) as error:
        raise PairError(f"{tokenizer_file} is not a tokenizer.json crossrt reads ({error})") from None
    vocab.update({t["content"]: token_id for token_id, t in added.items()})
    tokens = [""] * (max(vocab.values()) + 1)
    for text, token_id in vocab.items():
        tokens[token_id] = text
    config = json.loads((path / "config.json").read_text())
    spelling = _hf_spelling(tokenizer.get("decoder"))
    byte_tokens = frozenset(i for i, text in enumerate(tokens) if model.get("byte_fallback") and i not in added
                            and _BYTE_PIECE.fullmatch(text))
    return Vocabulary({BYTE_LEVEL: "gpt2", SENTENCEPIECE: "llama"}.get(spelling, model["type"]), tuple(tokens),
                      config.get("bos_token_id"), config.get("eos_token_id"), spelling,
                      special=frozenset(i for i, t in added.items() if t.get("special")),
                      literal=frozenset(i for i, t in added.items() if not t.get("special")), byte_tokens=byte_tokens)


def _gguf_vocabulary(path: Path) -> Vocabulary:
    meta = gguf_metadata(path)
    model, tokens = str(meta.get("tokenizer.ggml.model", "")), tuple(meta.get("tokenizer.ggml.tokens", ()))
    types = meta.get("tokenizer.ggml.token_type") or ()

    def of_type(*kinds: int) -> frozenset[int]:
        return frozenset(i for i, kind in enumerate(types) if kind in kinds)

    # llama.cpp prints unknown and unused tokens by their text as it does control tokens
    return Vocabulary(model, tokens, meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id"),
                      _GGUF_SPELLING.get(model, PLAIN), special=of_type(GGUF_CONTROL, GGUF_UNKNOWN, GGUF_UNUSED),
                      literal=of_type(GGUF_USER_DEFINED),
                      byte_tokens=frozenset(i for i in of_type(GGUF_BYTE) if _BYTE_PIECE.fullmatch(tokens[i])))


def _hf_spelling(decoder: Optional[dict]) -> str:
    """How a tokenizer.json's decoder reads token texts: ByteLevel is GPT-2's alphabet;
    Metaspace, ByteFallback or a Replace of U+2581 are SentencePiece's spelling."""
    steps = (decoder or {}).get("decoders", [decoder or {}])
    kinds = {step.get("type") for step in steps}
    if "ByteLevel" in kinds:
        return BYTE_LEVEL
    if kinds & {"Metaspace", "ByteFallback"} or any(
            step.get("type") == "Replace" and (step.get("pattern") or {}).get("String") == "\u2581" for step in steps):
        return SENTENCEPIECE
    return PLAIN


def check_compatible(target: Vocabulary, drafter: Vocabulary) -> None:
    """Raise PairError saying how the vocabularies differ, when a drafter's token ids would
    not mean what the target's mean (the same bytes, or the same special token); the files may
    spell them differently, and their tokenizer models may differ, as only ids pass between them."""
    problems = []
    if (target.bos_id, target.eos_id) != (drafter.bos_id, drafter.eos_id):
        problems.append(f"special ids differ: target bos/eos {target.bos_id}/{target.eos_id}, "
                        f"drafter {drafter.bos_id}/{drafter.eos_id}")
    size_gap = abs(len(target.tokens) - len(drafter.tokens))
    if size_gap > MAX_VOCAB_SIZE_DIFFERENCE:
        problems.append(f"vocabulary sizes differ by {size_gap} (target {len(target.tokens)}, "
                        f"drafter {len(drafter.tokens)}; at most {MAX_VOCAB_SIZE_DIFFERENCE} allowed)")
    common = min(len(target.tokens), len(drafter.tokens))
    ours, theirs = target.meanings, drafter.meanings
    mismatched = [i for i in range(FIRST_COMPARED_TOKEN, common) if ours[i] != theirs[i]]
    if mismatched:
        first = mismatched[0]
        problems.append(f"{len(mismatched)} of {common} tokens mean other text, first at id {first}: "
                        f"target {_shown(target, first)}, drafter {_shown(drafter, first)}")
    if problems:
        raise PairError("incompatible vocabularies, the drafter cannot draft for this target: "
                        + "; ".join(problems))


def _shown(vocabulary: Vocabulary, token_id: int) -> str:
    return f"{vocabulary.tokens[token_id]!r} ({vocabulary.meanings[token_id]!r})"


# ---- fingerprints -------------------------------------------------------------------------

def cache_dir() -> Path:
    """crossrt's cache folder (file digests, models converted for a runtime): $CROSSRT_CACHE,
    else crossrt/ in the user's cache folder."""
    if os.environ.get("CROSSRT_CACHE"):
        return Path(os.environ["CROSSRT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "crossrt"


def _file_sha256(path: Path, cache: dict[str, str]) -> str:
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    if key not in cache:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        cache[key] = digest.hexdigest()
    return cache[key]


def sha256_of(path: Path) -> str:
    """sha256 of a file, or of a folder's files (names and contents, in name order).

    Multi-gigabyte models take a while to hash, so digests are cached by path, size and
    modification time in crossrt's cache folder (cache_dir).
    """
    cache_file = cache_dir() / "sha256.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if path.is_dir():
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{file.relative_to(path)}\0{_file_sha256(file, cache)}\n".encode())
        result = digest.hexdigest()
    else:
        result = _file_sha256(path, cache)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(json.dumps(cache))
    except OSError:
        pass  # a read-only home only costs re-hashing next time
    return result


def model_files(path: Path, what: str = "model") -> tuple[LoadedFile, ...]:
    """A model file, or each file of a model folder, with its sha256, as a record names what a
    runtime loaded (ModelInfo.loaded)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return tuple(LoadedFile(str(file), sha256_of(file), what) for file in files)


def quantization_of(path: Path) -> str:
    if path.suffix == ".gguf":
        from gguf import LlamaFileType

        file_type = gguf_metadata(path).get("general.file_type")
        if file_type is None:
            return "unknown"
        return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    config = json.loads((path / "config.json").read_text())
    quant = config.get("quantization_config")
    if quant:
        return f"{quant.get('quant_method', 'quantized')} {quant.get('bits', '')}".strip()
    return str(config.get("torch_dtype") or config.get("dtype") or "unknown")


def model_info(path: Path, vocabulary: Vocabulary) -> ModelInfo:
    return ModelInfo(path=str(path), sha256=sha256_of(path), format=model_format(path),
                     quantization=quantization_of(path), vocab_fingerprint=vocabulary.fingerprint,
                     n_vocab=len(vocabulary.tokens))


def pair_info(pair: Pair, model_format_name: str) -> PairInfo:
    """Check the pair's files for one format and describe them for the record."""
    paths = {role: pair.path(role, model_format_name) for role in ROLES}
    vocabularies = {role: read_vocabulary(paths[role]) for role in ROLES}
    check_compatible(vocabularies["target"], vocabularies["drafter"])
    return PairInfo(name=pair.name, **{role: model_info(paths[role], vocabularies[role]) for role in ROLES})
