"""Deterministic trainer of a small drafter/target llama pair on an offline code + prose corpus.

    build_trained_pair(out_dir) -> list[pathlib.Path]   # the files written (models/trained)

Unlike the designed tiny pair (crossrt/builders/tinypair.py), these models learn real text, so their
greedy speculative decoding behaves like real models': code (indentation, keywords, repeated
names) is more predictable than prose, and drafts of code are accepted more often. The corpus
is what every CPython install carries: stdlib sources for code; the language reference's
text (pydoc_data.topics), stdlib docstrings, the licence and `this` for prose.

Fixed seeds, torch's deterministic algorithms and one thread: the same Python (its stdlib is
the corpus) and library versions (torch, transformers, tokenizers) on the same CPU give the
same weights. Another CPU may pick other kernels (another vector width, another order of a
floating-point reduction), so its weights can differ in the last bits and, through training,
beyond them.
"""
from __future__ import annotations

import ast
import codecs
import contextlib
import hashlib
import io
import math
import os
import platform
import sysconfig
import textwrap
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tokenizers import Tokenizer

from crossrt.builders.model_files import (BOS_ID, EOS_ID, LlamaShape, hf_config, train_tokenizer,
                                 write_gguf, write_hf)

CATEGORIES = ("code", "prose")
# Code: whole stdlib modules, comments and docstrings included, as code is written.
CODE_FILES = (
    "_collections_abc.py", "_strptime.py", "argparse.py", "ast.py", "base64.py", "bz2.py",
    "calendar.py", "cmd.py", "collections/__init__.py", "colorsys.py", "configparser.py",
    "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "datetime.py", "difflib.py",
    "dis.py", "enum.py", "filecmp.py", "fileinput.py", "fnmatch.py", "fractions.py",
    "functools.py", "getopt.py", "gettext.py", "glob.py", "graphlib.py", "gzip.py",
    "hashlib.py", "heapq.py", "hmac.py", "html/parser.py", "http/cookies.py", "ipaddress.py",
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "linecache.py", "lzma.py",
    "mailbox.py", "mimetypes.py", "netrc.py", "ntpath.py", "numbers.py", "operator.py",
    "pathlib.py", "pickle.py", "pkgutil.py", "plistlib.py", "posixpath.py", "pprint.py",
    "pstats.py", "pyclbr.py", "queue.py", "quopri.py", "random.py", "re/_compiler.py",
    "re/_parser.py", "reprlib.py", "runpy.py", "sched.py", "selectors.py", "shelve.py",
    "shlex.py", "shutil.py", "site.py", "stat.py", "statistics.py", "string.py",
    "symtable.py", "sysconfig.py", "tempfile.py", "textwrap.py", "timeit.py",
    "tokenize.py", "tomllib/_parser.py", "trace.py", "types.py", "uuid.py", "warnings.py",
    "wave.py", "weakref.py", "zipapp.py", "zipfile.py", "zipimport.py",
)
# Prose docstrings come from other modules than the code, so no text is in both categories.
DOCSTRING_FILES = (
    "_pydecimal.py", "_pyio.py", "codecs.py", "doctest.py", "email/message.py", "ftplib.py",
    "http/client.py", "http/cookiejar.py", "http/server.py", "imaplib.py", "inspect.py",
    "logging/__init__.py", "logging/handlers.py", "nntplib.py", "optparse.py", "os.py",
    "pdb.py", "smtplib.py", "socket.py", "socketserver.py", "ssl.py", "subprocess.py",
    "tarfile.py", "threading.py", "tkinter/__init__.py", "traceback.py", "turtle.py",
    "typing.py", "unittest/case.py", "unittest/mock.py", "urllib/parse.py",
    "urllib/request.py",
)
MIN_DOCSTRING = 80  # shorter ones are mostly one-line summaries: little prose


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch: int  # sequences per step
    context: int  # tokens per sequence, BOS included
    lr: float
    warmup: int
    seed: int
    distilled: bool  # learn the target's next-token distribution instead of the corpus' token


# 2048 keeps common English words whole. At 1024, prose splits into word pieces whose
# completions both models get right, and prose is accepted as often as code
# (docs/trained-pair.md); real vocabularies are far larger still.
VOCAB_SIZE = 2048
CONTEXT = 256
TARGET = LlamaShape("target", 128, 4, 4, 2, 256)
DRAFTER = LlamaShape("drafter", 64, 2, 2, 1, 128)
SETTINGS = {"target": TrainSettings(1000, 16, CONTEXT, 3e-3, 50, seed=1, distilled=False),
            "drafter": TrainSettings(700, 16, CONTEXT, 3e-3, 50, seed=2, distilled=True)}
VALIDATION_SHARE = 0.05  # the end of every document, never trained on
LOG_EVERY = 50


# ---------------------------------------------------------------- corpus

def stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def docstrings(source: str) -> str:
    tree = ast.parse(source)
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds))
    return "\n\n".join(d for d in found if d and len(d) >= MIN_DOCSTRING)


def corpus() -> dict[str, list[tuple[str, str]]]:
    """Category -> [(source name, text)], in a fixed order."""
    from pydoc_data.topics import topics
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    root = stdlib()

    def read(name: str) -> str:
        return (root / name).read_text(encoding="utf-8")

    code = [(name, read(name)) for name in CODE_FILES]
    prose = [(f"pydoc_data.topics[{key!r}]", topics[key]) for key in sorted(topics)]
    prose += [(f"docstrings of {name}", docstrings(read(name))) for name in DOCSTRING_FILES]
    prose += [("LICENSE.txt", read("LICENSE.txt")), ("this", codecs.decode(this.s, "rot13"))]
    return {"code": code, "prose": prose}


def corpus_digest(texts: dict[str, list[tuple[str, str]]]) -> str:
    digest = hashlib.sha256()
    for category in CATEGORIES:
        for name, text in texts[category]:
            digest.update(f"{category}\0{name}\0{text}\0".encode())
    return digest.hexdigest()


def streams(tok: Tokenizer, texts: dict[str, list[tuple[str, str]]]
            ) -> dict[str, np.ndarray]:
    """"train": every document's first 95% of tokens, each part followed by EOS, code then
    prose; "code" and "prose": the held-out rest of each of their documents, likewise."""
    parts: dict[str, list[int]] = {"train": []}
    for category in CATEGORIES:
        parts[category] = []
        for _, text in texts[category]:
            ids = tok.encode(text, add_special_tokens=False).ids
            cut = round(len(ids) * (1 - VALIDATION_SHARE))
            parts["train"] += ids[:cut] + [EOS_ID]
            parts[category] += ids[cut:] + [EOS_ID]
    return {name: np.array(ids, dtype=np.int64) for name, ids in parts.items()}


# ---------------------------------------------------------------- training

def sequences(stream: np.ndarray, starts: np.ndarray, context: int) -> np.ndarray:
    """BOS then context - 1 tokens from each start: every sequence begins as a prompt does."""
    body = stream[starts[:, None] + np.arange(context - 1)]
    return np.concatenate([np.full((len(starts), 1), BOS_ID), body], axis=1)


def batches(stream: np.ndarray, settings: TrainSettings,
            rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Sequences from uniform offsets: code and prose in the corpus' own proportions."""
    while True:
        starts = rng.integers(0, len(stream) - settings.context, settings.batch)
        yield sequences(stream, starts, settings.context)


@contextlib.contextmanager
def deterministic_torch(threads: int):
    """One thread and deterministic kernels while training, the caller's settings after."""
    import torch
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield torch
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])


def new_model(shape: LlamaShape, vocab_size: int, context: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)  # transformers initializes weights from torch's global generator
    # The same config write_hf writes: the model trained is the model exported.
    return LlamaForCausalLM(LlamaConfig(**hf_config(shape, vocab_size, context)))


def lr_factor(step: int, settings: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < settings.warmup:
        return (step + 1) / settings.warmup
    done = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * done))


def train(shape: LlamaShape, vocab_size: int, data: dict[str, np.ndarray],
          settings: TrainSettings, log: Callable[[str], None] = print, threads: int = 1,
          teacher=None):
    """Train from scratch (distilled from `teacher`, the target, when settings say so);
    returns the torch model and its metrics: the mean training loss of the last LOG_EVERY
    steps, and per category the held-out loss and, for a distilled model, how often its
    greedy token is the teacher's."""
    with deterministic_torch(threads) as torch:
        model = new_model(shape, vocab_size, settings.context, settings.seed)
        decay = [p for p in model.parameters() if p.ndim >= 2]  # not the norms' gains
        rest = [p for p in model.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                       {"params": rest, "weight_decay": 0.0}],
                                      lr=settings.lr, betas=(0.9, 0.95))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                     lambda s: lr_factor(s, settings))
        source = batches(data["train"], settings, np.random.default_rng(settings.seed))
        model.train()
        recent: list[float] = []
        for step in range(settings.steps):
            ids = torch.from_numpy(next(source))
            if settings.distilled:
                with torch.no_grad():
                    wanted = teacher(input_ids=ids).logits.softmax(-1)
                guess = model(input_ids=ids).logits.log_softmax(-1)
                loss = -(wanted * guess).sum(-1).mean()  # cross-entropy to the teacher
            else:
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            recent = (recent + [loss.item()])[-LOG_EVERY:]
            if (step + 1) % LOG_EVERY == 0 or step + 1 == settings.steps:
                log(f"{shape.name} step {step + 1:>4}/{settings.steps}  "
                    f"loss {np.mean(recent):.3f}")
        model.eval()
        metrics = {"train": float(np.mean(recent))}
        for c in CATEGORIES:
            metrics.update(evaluate(model, data[c], settings.context,
                                    teacher if settings.distilled else None, c))
        log(f"{shape.name} held out  " + "  ".join(f"{k} {v:.3f}" for k, v in metrics.items()
                                                   if k != "train"))
    return model, metrics


def evaluate(model, stream: np.ndarray, context: int, teacher, category: str
             ) -> dict[str, float]:
    """Loss over a held-out stream cut into consecutive sequences, and the share of
    positions where model and teacher pick the same greedy token."""
    import torch
    n = (len(stream) - 1) // (context - 1)
    ids = sequences(stream, np.arange(n) * (context - 1), context)
    losses, same = [], []
    with torch.no_grad():
        for chunk in np.array_split(torch.from_numpy(ids), max(1, n // 16)):
            out = model(input_ids=chunk, labels=chunk)
            losses.append(out.loss.item())
            if teacher is not None:
                picks = teacher(input_ids=chunk).logits.argmax(-1)
                same.append((out.logits.argmax(-1) == picks)[:, :-1].float().mean().item())
    metrics = {category: float(np.mean(losses))}
    if same:
        metrics[f"{category} agreement"] = float(np.mean(same))
    return metrics


def weights_of(model) -> dict[str, np.ndarray]:
    return {name: t.detach().numpy().astype(np.float32).copy()
            for name, t in model.state_dict().items()}


# ---------------------------------------------------------------- files

def write_readme(path: Path, texts: dict[str, list[tuple[str, str]]],
                 data: dict[str, np.ndarray], counts: dict[str, int],
                 metrics: dict[str, dict[str, float]]) -> None:
    versions = ", ".join(f"{d} {version(d)}" for d in ("torch", "transformers", "tokenizers",
                                                       "numpy", "gguf", "safetensors"))

    def agreement(m: dict[str, float], c: str) -> str:
        return f"{m[f'{c} agreement']:.3f}" if f"{c} agreement" in m else "-"

    models = "\n".join(
        f"| {s.name} | {s.n_embd} | {s.n_layer} | {s.n_head} | {s.n_head_kv} | {s.head_dim} "
        f"| {s.n_ff} | {counts[s.name]:,} |" for s in (TARGET, DRAFTER))
    training = "\n".join(
        f"| {s.name} | {'distilled from target' if t.distilled else 'next token'} "
        f"| {t.steps} x {t.batch} x {t.context} | {t.lr:g} | {t.seed} "
        f"| {m['train']:.3f} | {m['code']:.3f} | {m['prose']:.3f} | {agreement(m, 'code')} "
        f"| {agreement(m, 'prose')} |"
        for s, t, m in ((s, SETTINGS[s.name], metrics[s.name]) for s in (TARGET, DRAFTER)))
    sources = "\n".join(
        f"| {c} | {len(texts[c])} | {sum(len(t) for _, t in texts[c]):,} "
        f"| {len(data[c]):,} |" for c in CATEGORIES)
    corpus_text = textwrap.fill(
        f"Corpus (sha256 {corpus_digest(texts)[:16]} over every text), from this interpreter's "
        f"stdlib. Code: {', '.join(CODE_FILES)}. Prose: pydoc_data.topics (the language "
        f"reference's text), docstrings of at least {MIN_DOCSTRING} characters from "
        f"{', '.join(DOCSTRING_FILES)}, LICENSE.txt and `this`. The last "
        f"{VALIDATION_SHARE:.0%} of every document's tokens are held out; training samples "
        f"{CONTEXT - 1}-token windows (after BOS) from uniform offsets in the rest, "
        f"{len(data['train']):,} tokens, so code and prose mix as in the corpus.", 92)
    built = textwrap.fill(
        "Built by `python scripts/train_tiny_pair.py` (`crossrt.builders.tinytrain.build_trained_pair`) "
        f"on one CPU thread with Python {platform.python_version()}, {versions}. Do not edit "
        "by hand; docs/trained-pair.md says what the pair is for and what speculative "
        "decoding measures on it.", 92)
    path.write_text(f"""# crossrt trained pair

{built}

{corpus_text}

| category | documents | characters | held-out tokens |
|---|---|---|---|
{sources}

Tokenizer: byte-level BPE trained on the whole corpus, {VOCAB_SIZE} tokens, `<|bos|>` = 0
(added at the start), `<|eos|>` = 1. Models: llama, untied output, trained context {CONTEXT};
the GGUFs are F32 and the HF folders hold the same F32 weights.

| model | n_embd | layers | heads | kv heads | head_dim | ff | parameters |
|---|---|---|---|---|---|---|---|
{models}

AdamW (betas 0.9, 0.95; weight decay 0.1 on matrices), linear warm-up then cosine decay to a
tenth, gradients clipped at 1. The drafter learns the target's whole next-token distribution
(cross-entropy to its softmax). Losses in nats per token: train is the mean of the last
{LOG_EVERY} steps' training loss (the drafter's against the target's distribution;
train-log.txt has the curve), code and prose the held-out next-token loss; agreement is the
share of held-out positions where the drafter's greedy token is the target's.

| model | objective | steps x batch x context | lr | seed | train | code | prose | code agreement | prose agreement |
|---|---|---|---|---|---|---|---|---|---|
{training}

Same Python and library versions on the same CPU give the same files; another CPU may order
floating-point reductions differently and give slightly different weights.
""")


# ---------------------------------------------------------------- entry point

def build_trained_pair(out_dir: str | Path, threads: int = 1,
                       log: Callable[[str], None] = print) -> list[Path]:
    """Corpus, tokenizer, both models, then F32 GGUF files, HF folders, README and the log."""
    # tokenizers trains and encodes on a thread pool; one thread keeps to the machine's share.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    tok = train_tokenizer([t for c in CATEGORIES for _, t in texts[c]], VOCAB_SIZE)
    data = streams(tok, texts)
    lines: list[str] = []

    def record(line: str) -> None:
        lines.append(line)
        log(line)

    files, metrics, counts, teacher = [], {}, {}, None
    for shape in (TARGET, DRAFTER):
        model, metrics[shape.name] = train(shape, VOCAB_SIZE, data, SETTINGS[shape.name],
                                           record, threads, teacher)
        weights = weights_of(model)
        counts[shape.name] = sum(a.size for a in weights.values())
        files.append(out / f"{shape.name}.f32.gguf")
        write_gguf(files[-1], weights, shape, tok, f16=False, context_length=CONTEXT)
        files += write_hf(out / f"{shape.name}-hf", weights, shape, tok, context_length=CONTEXT)
        teacher = model
    files.append(out / "train-log.txt")
    files[-1].write_text("\n".join(lines) + "\n")
    files.append(out / "README.md")
    write_readme(files[-1], texts, data, counts, metrics)
    return files
