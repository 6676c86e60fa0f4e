"""A model file's vocabulary: its token texts as its format spells them (a GGUF file's metadata,
or an HF folder's tokenizer.json), what each id means (bytes), what a detokenizer prints for it,
and whether a drafter's vocabulary is compatible with a target's.

Before any run, the vocabularies of the two files a runtime will load must be compatible:
speculative decoding compares token ids, so the drafter's id i must mean the target's id i.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from crossrt.errors import PairError
from crossrt.inputs.file_facts import file_fact
from crossrt.inputs.gguf_file import gguf_metadata

# As llama.cpp's own check (common/speculative.cpp): vocabularies may differ in size by a few
# padding tokens, and the first few ids (special tokens in many vocabularies) are not compared.
MAX_VOCAB_SIZE_DIFFERENCE = 128
FIRST_COMPARED_TOKEN = 5

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
    def printed(self) -> tuple[bytes, ...]:
        """Per id, the bytes a detokenizer prints by default: its meaning, and nothing for a special
        token (llama.cpp's token_to_piece without special, as control, unknown and unused tokens;
        transformers' decode(skip_special_tokens=True))."""
        return tuple(b"" if i in self.special else meaning for i, meaning in enumerate(self.meanings))

    @functools.cached_property
    def fingerprint(self) -> str:
        """FINGERPRINT_PREFIX and 16 hex digits of sha256 over each id's meaning and the BOS and
        EOS ids: one vocabulary gives one fingerprint whichever format spells it."""
        digest = hashlib.sha256()
        for meaning in self.meanings:
            digest.update(len(meaning).to_bytes(4, "little") + meaning)
        digest.update(json.dumps([self.bos_id, self.eos_id]).encode())
        return FINGERPRINT_PREFIX + digest.hexdigest()[:16]


def read_vocabulary(path: Path) -> Vocabulary:
    """The vocabulary of a GGUF file or an HF folder, read once per version of its files in a
    process: a run, a parity's every record and a chat template each ask for it, and its
    meanings and fingerprint (~0.15 CPU-s on a 262k vocabulary) are computed once with it."""
    path = Path(path)
    files = (path,) if path.suffix == ".gguf" else (path / "tokenizer.json", path / "config.json")
    try:
        versions = tuple((os.stat(file).st_size, os.stat(file).st_mtime_ns) for file in files)
    except OSError:
        return _read_vocabulary(path)  # raises the reading's own error
    return _cached_vocabulary(str(path), versions)


@functools.lru_cache(maxsize=8)
def _cached_vocabulary(path: str, versions: tuple) -> Vocabulary:
    return _read_vocabulary(Path(path))


def vocabulary_facts(path: Path) -> tuple[str, int]:
    """The fingerprint and size of path's vocabulary, as a record names them: kept by the files'
    digests (file_fact), since deriving them reads every token and its meaning (~0.2 CPU-s on
    Gemma 3's 262,144) in each process that describes the pair."""
    def derive() -> tuple[str, int]:
        vocabulary = read_vocabulary(path)
        return vocabulary.fingerprint, len(vocabulary.tokens)

    fingerprint, size = file_fact("vocabulary-1", [path], derive)
    return fingerprint, size


def check_files_compatible(target: Path, drafter: Path) -> None:
    """check_compatible on the vocabularies of two model files, a pass kept by their digests
    (file_fact); a failure is found again each time, to say how they differ."""
    file_fact("compatible-vocabularies-1", [target, drafter],
              lambda: check_compatible(read_vocabulary(target), read_vocabulary(drafter)) or True)


def _read_vocabulary(path: Path) -> Vocabulary:
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
