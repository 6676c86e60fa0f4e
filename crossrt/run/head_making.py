"""`crossrt drafter eagle3|dflash`: a drafter head for a GGUF target, made once per settings.

Stages: the corpus (the target's greedy outputs on llama.cpp, head_corpus.py), the target's
features over it (transformers on the target's float32 conversion), training (head_training.py),
then the files every runtime reads (head_files.py). The result is cached by a key over the
target's digest, every setting, the seed and the torch version (like the float twins), and copied
to the output folder with crossrt-head.json saying what it is and how well it learned.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from crossrt.builders.dflash import DFlashDrafter, train_dflash
from crossrt.builders.eagle3 import Eagle3Head, TargetShape
from crossrt.builders.head_files import GGUF_NAMES, HeadFilesError, convert_to_gguf, write_speculators, write_zlab
from crossrt.builders.head_settings import DFlashSettings, Eagle3Settings, TrainingSettings
from crossrt.builders.head_training import draft_vocabulary, featured_of, target_states, train_head
from crossrt.inputs.gguf_file import gguf_metadata
from crossrt.inputs.head_targets import why_unfeedable
from crossrt.inputs.pairs import PairError, cache_dir, sha256_of
from crossrt.run.head_corpus import head_corpus

HEAD_VERSION = 3  # bump when the head's training or files change: cached heads are then remade
PROVENANCE = "crossrt-head.json"
# Targets whose shape the head takes from a Llama-style config (TargetShape.of).
FEEDABLE = ("llama",)

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class MadeHead:
    folder: Path
    gguf: Path
    cached: bool  # taken from crossrt's cache, not trained now
    provenance: dict


def check_target(target: Path) -> str:
    """target's architecture when crossrt can make a head for it; HeadFilesError says why not."""
    try:
        architecture = str(gguf_metadata(target).get("general.architecture", ""))
    except PairError as error:
        raise HeadFilesError(str(error)) from None
    reasons = [why for runtime in ("llama.cpp", "vLLM") if (why := why_unfeedable(architecture, runtime))]
    if reasons:
        raise HeadFilesError(f"{target}: {architecture} targets cannot feed a drafter head: {'; '.join(reasons)}")
    if architecture not in FEEDABLE:
        raise HeadFilesError(f"{target}: crossrt makes drafter heads for {', '.join(FEEDABLE)} targets, not "
                             f"{architecture or 'an unnamed architecture'}")
    return architecture


def head_key(kind: str, target: Path, settings, training: TrainingSettings, new_tokens: int) -> str:
    text = json.dumps({"version": HEAD_VERSION, "kind": kind, "target": sha256_of(target),
                       "settings": asdict(settings), "training": asdict(training), "new_tokens": new_tokens,
                       "torch": torch.__version__}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def eagle3_settings(layer_ids: Optional[tuple[int, int, int]], norm_before_residual: bool,
                    draft_vocab: int) -> Callable[[TargetShape], Eagle3Settings]:
    def choose(shape: TargetShape) -> Eagle3Settings:
        settings = Eagle3Settings(layer_ids or Eagle3Settings.default_layers(shape.layers), norm_before_residual,
                                  min(draft_vocab, shape.vocab))
        if any(not 0 <= i < shape.layers for i in settings.layer_ids):
            raise HeadFilesError(f"--layers {','.join(map(str, settings.layer_ids))}: the target has layers 0 to "
                                 f"{shape.layers - 1}")
        return settings
    return choose


def dflash_settings(layer_ids: Optional[tuple[int, ...]], block_size: int, mask_token_id: int, layers: int,
                    draft_vocab: int) -> Callable[[TargetShape], DFlashSettings]:
    def choose(shape: TargetShape) -> DFlashSettings:
        settings = DFlashSettings(layer_ids or DFlashSettings.default_layers(shape.layers), block_size, mask_token_id,
                                  layers, min(draft_vocab, shape.vocab))
        if any(not 0 <= i <= shape.layers - 2 for i in settings.layer_ids):  # output of layer i = input of i + 1
            raise HeadFilesError(f"--layers {','.join(map(str, settings.layer_ids))}: a DFlash drafter reads outputs of "
                                 f"layers 0 to {shape.layers - 2} (llama.cpp exposes no input past the last layer)")
        if not 0 <= mask_token_id < shape.vocab:
            raise HeadFilesError(f"--mask-token {mask_token_id}: the target's ids are 0 to {shape.vocab - 1}")
        return settings
    return choose


def make_head(kind: str, target: Path, output: Path, choose: Callable[[TargetShape], object],
              training: TrainingSettings, new_tokens: int, overwrite: bool, progress: Progress,
              states: Optional[TargetStates] = None) -> MadeHead:
    """kind "eagle3" or "dflash"; choose: its settings for the target's shape (eagle3_settings,
    dflash_settings); states: the target's states kept from an earlier head, and for a later one."""
    check_target(target)
    if output.exists() and not overwrite and not (output / PROVENANCE).is_file():
        raise HeadFilesError(f"{output} exists and holds no crossrt head: pass --overwrite or another OUTPUT")
    from crossrt.backends.transformers import dequantized_folder, load_model
    from crossrt.run.runtime import RuntimeOptions

    # The target's shape from its converted folder's config where there is one: loading the model
    # (1.8 CPU-s on SmolLM2-135M) is needed only to train, not to find a cached head.
    converted, model = dequantized_folder(target), None
    if (converted / "config.json").is_file():
        import transformers

        config = transformers.AutoConfig.from_pretrained(converted)
    else:
        model = load_model(target, RuntimeOptions(threads=training.threads)).model
        config = model.config
    shape = TargetShape.of(config)
    settings = choose(shape)
    key = head_key(kind, target, settings, training, new_tokens)
    cached, gguf = cache_dir() / "heads" / key, GGUF_NAMES[kind]
    if output.is_dir() and _key_of(output) == key:
        return MadeHead(output, output / gguf, True, json.loads((output / PROVENANCE).read_text()))
    was_cached = (cached / PROVENANCE).is_file() and (cached / gguf).is_file()
    if not was_cached:
        model = model or load_model(target, RuntimeOptions(threads=training.threads)).model
        _train_into(kind, cached, target, converted, model, shape, settings, training, new_tokens,
                    key, progress, states or TargetStates())
    _copy_folder(cached, output)
    return MadeHead(output, output / gguf, was_cached, json.loads((output / PROVENANCE).read_text()))


def _train_into(kind: str, cached: Path, target: Path, target_folder: Path, model, shape: TargetShape, settings,
                training: TrainingSettings, new_tokens: int, key: str, progress: Progress,
                states: TargetStates) -> None:
    torch.set_num_threads(training.threads)
    corpus = head_corpus(target, new_tokens, lambda done, total: progress("corpus", done, total))
    # EAGLE3 ids name layer inputs (HF hidden_states[i]); DFlash ids layer outputs (hidden_states[i + 1]).
    tapped = settings.layer_ids if kind == "eagle3" else tuple(i + 1 for i in settings.layer_ids)
    featured = states.features(target, model, corpus, tapped, training.threads,
                               lambda done, total: progress("features", done, total))
    draft_ids = draft_vocabulary(featured, settings.draft_vocab, shape.vocab)
    torch.manual_seed(training.seed)
    embeddings, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    trained = lambda done, total: progress("training", done, total)  # noqa: E731
    if kind == "eagle3":
        head = Eagle3Head(shape, settings, draft_ids, embeddings, lm_head)
        report = train_head(head, featured, training, trained)
        learned = {"training_seconds": round(report.seconds, 1), "steps": report.steps, "loss": round(report.loss, 4),
                   "accuracy_by_pass": [round(a, 4) for a in report.accuracy_by_pass],
                   "accuracy_by_type": {k: round(v, 4) for k, v in report.accuracy_by_type.items()}}
        write = write_speculators
    else:
        head = DFlashDrafter(shape, settings, embeddings, lm_head)
        steps, seconds, loss, first = train_dflash(head, featured, draft_ids, corpus, training, trained)
        learned = {"training_seconds": round(seconds, 1), "steps": steps, "loss": round(loss, 4),
                   "first_token_agreement": round(first, 4)}
        write = write_zlab
    provenance = {
        "kind": kind, "key": key, "target": str(target), "target_sha256": sha256_of(target),
        "settings": asdict(settings), "training": asdict(training), "corpus_new_tokens": new_tokens,
        "corpus_tokens": sum(len(s.ids) for s in corpus), "corpus_sequences": len(corpus), **learned,
        "torch": torch.__version__,
    }
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=f".{key[:12]}.") as work:
        folder = Path(work) / "head"
        write(head, folder)
        progress("gguf", 0, 1)
        convert_to_gguf(folder, target_folder, folder / GGUF_NAMES[kind])
        progress("gguf", 1, 1)
        (folder / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n")
        if cached.exists():
            shutil.rmtree(cached)
        os.rename(folder, cached)


class TargetStates:
    """The target's hidden states over the last corpus it ran on, and the states' ids, for a caller
    that makes several heads of one target in one process (tests/test_heads.py passes one to both
    of its `crossrt drafter` commands, as click's obj): a second head of the same target and corpus
    whose layers are among them reads them instead of running the target over the corpus again
    (SmolLM2-135M, 66 prompts x 8 new tokens: 10 to 20 CPU-s, more than a test head's training).
    One corpus held: the last."""

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._held: tuple[int, ...] = ()
        self._states: Optional[list] = None

    def features(self, target: Path, model, corpus: list, tapped: tuple[int, ...], threads: int,
                 progress: Callable[[int, int], None]) -> list:
        """The target's features at tapped over corpus, from the states held where they hold them."""
        key = (sha256_of(target), threads, tuple(corpus))  # threads: float sums, like the head's own key
        held = self._held if key == self._key else ()
        if key != self._key or not set(tapped) <= set(held):
            held = tuple(sorted(set(tapped) | set(held)))
            self._key, self._held, self._states = key, held, target_states(model, corpus, held, progress)
        return featured_of(corpus, self._states, tapped)


def _key_of(folder: Path) -> Optional[str]:
    try:
        return json.loads((folder / PROVENANCE).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def _copy_folder(source: Path, output: Path) -> None:
    """output becomes a copy of source, whole or not at all."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.") as work:
        copy = Path(work) / "copy"
        shutil.copytree(source, copy)
        if output.exists():
            os.rename(output, Path(work) / "old")
        os.rename(copy, output)
