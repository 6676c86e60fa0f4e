#!/usr/bin/env python3
"""Plant each kind of bug (crossrt/builders/plants.py) into one runtime's copy of a pair's
target, at several sizes, and run plain `crossrt parity` on it: which check fails it, and by
how much. The table in docs/parity.md comes from this script.

    .venv/bin/python scripts/planted_bugs.py --pair tiny
    .venv/bin/python scripts/planted_bugs.py --pair gemma3-270m --plants rope-base,attention-scale
    .venv/bin/python scripts/planted_bugs.py --pair tiny --verification --sizes 1.001,1.01,1.13

--verification plants bugs in the transformers runtime's verification path instead
(backends/transformers_plants.py: calls of more than one token on a non-empty cache), the
model files clean; --sizes then sizes attention-scale (the factor on its queries).

Each row is one real `crossrt parity --runtimes llama-cpp,transformers --modes driven` run (in a
process of its own) on a manifest naming the GGUF beside a transformers folder, one of them
planted; the clean manifest runs first. For a real model's GGUF the folder is the transformers
runtime's own float conversion of it (made by scripts/setup).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from crossrt.builders.plants import PLANTS, PairFiles, plant_named  # noqa: E402

PROMPTS = [{"id": "code", "category": "code", "prompt": "def add(a, b):\n    return"},
           {"id": "prose", "category": "prose", "prompt": "The river ran past the old mill and"}]


def pair_files(pair: str) -> PairFiles:
    from crossrt.inputs.pairs import load_pair, manifest_path

    manifest = load_pair(manifest_path(pair))
    paths = {(role, fmt): manifest.files[role].get(fmt) for role in ("target", "drafter") for fmt in ("gguf", "hf")}
    if paths["target", "hf"] is None:  # a GGUF-only pair: the folder is transformers' conversion of it
        from crossrt.backends.transformers import dequantized_folder

        for role in ("target", "drafter"):
            gguf = manifest.path(role, "gguf")
            folder = dequantized_folder(gguf)
            if not folder.is_dir():
                sys.exit(f"{folder}: the transformers conversion of {gguf} is missing; run scripts/setup")
            paths[role, "hf"] = folder
    return PairFiles(*(manifest.path(role, fmt) if paths[role, fmt] is not None and not isinstance(paths[role, fmt], Path)
                       else paths[role, fmt] for role, fmt in (("target", "gguf"), ("target", "hf"),
                                                               ("drafter", "gguf"), ("drafter", "hf"))))


def parity(manifest: Path, folder: Path, tokens: int, environment: Optional[dict] = None) -> tuple[int, str, float]:
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    started = time.perf_counter()
    done = subprocess.run([str(REPO / ".venv" / "bin" / "crossrt"), "parity", "--pair", str(manifest), "--runtimes",
                           "llama-cpp,transformers", "--modes", "driven", "--prompts", str(prompts),
                           "--max-new-tokens", str(tokens), "--out-dir", str(folder / "runs")],
                          capture_output=True, text=True, env={**os.environ, **(environment or {})})
    return done.returncode, done.stdout, time.perf_counter() - started


def caught_by(output: str) -> str:
    """Which check failed first, in parity's words."""
    fails = [line for line in output.splitlines() if line.startswith("FAIL ")]
    for name, words in (("verification batches", "verification batches compute otherwise"),
                        ("nondeterminism", "nondeterministic: "),
                        ("departures", "look for a bug in its verification path"),
                        ("lossless split", "disagreement inside the runtime"),
                        ("counters", "counters unexplained"),
                        ("weights check", "weights: not the same model"),
                        ("float control", "float control: logits beyond"),
                        ("tokenization", "tokenizes the prompt text differently"),
                        ("as-run logits", ": logits: "), ("ids", "outputs part")):
        if any(words in line for line in fails):
            return name
    return "not caught" if not fails else fails[0][:60]


def control_ratio(output: str) -> str:
    """The float control's max abs diff over its bound, as printed."""
    match = re.search(r"float control: .*? max abs diff ([0-9.e+-]+).*?bounds max abs diff <= ([0-9.e+-]+)", output)
    return f"{float(match.group(1)) / float(match.group(2)):.3g}" if match else "-"


def verification_ratio(output: str) -> str:
    """The transformers scorer's verification batches: measured max abs diff over its bound."""
    match = re.search(r"verification batches: transformers .*? max abs diff ([0-9.e+-]+),.*?bounds max abs diff "
                      r"<= ([0-9.e+-]+)", output)
    return f"{float(match.group(1)) / float(match.group(2)):.3g}" if match else "-"


def _layers(folder: Path) -> int:
    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("text_config", config)["num_hidden_layers"])


def verification_table(files: PairFiles, sizes: list, tokens: int) -> None:
    """Each verification-path plant (and the nondeterministic runtime) on the clean pair."""
    from crossrt.backends.transformers_plants import CALL_NOISE, PATH_PLANTS, PLANT_ENV

    print("| plant | what | size | parity exit | caught by | verification batches max abs / bound | seconds |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="planted-") as scratch:
        for plant in (None, *PATH_PLANTS, CALL_NOISE):
            sized = plant is not None and plant.name == "attention-scale"
            for size in (sizes if sized else [None]):
                folder = Path(scratch) / f"{plant.name if plant else 'clean'}-{size}"
                folder.mkdir()
                value = "" if plant is None else plant.name + (f":{size:g}" if size is not None else "")
                if plant is not None and plant.name == "drafter-rollback":  # the drafter: fewer layers than the target
                    value += f":{_layers(files.target_hf)}"
                code, output, seconds = parity(files.manifest(folder), folder, tokens, {PLANT_ENV: value})
                print(f"| {plant.name if plant else '(none)'} | {plant.what if plant else '-'} | "
                      f"{'default' if size is None else f'{size:g}'} | {code} | "
                      f"{caught_by(output) if code else 'passes'} | {verification_ratio(output)} | {seconds:.0f} |",
                      flush=True)
                shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="tiny")
    parser.add_argument("--plants", default="all", help="comma-separated plant names, or all")
    parser.add_argument("--sizes", default="", help="comma-separated sizes for every plant (default: each plant's own)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--verification", action="store_true",
                        help="plant bugs in transformers' verification path, not in a model file")
    args = parser.parse_args()
    files = pair_files(args.pair)
    if args.verification:
        sizes = [float(size) for size in args.sizes.split(",")] if args.sizes else [None]
        return verification_table(files, sizes, args.max_new_tokens)
    plants = PLANTS if args.plants == "all" else [plant_named(name) for name in args.plants.split(",")]
    sizes = [float(size) for size in args.sizes.split(",")] if args.sizes else [None]
    print("| plant | area | planted in | size | parity exit | caught by | float control max abs / bound | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="planted-") as scratch:
        folder = Path(scratch) / "clean"
        folder.mkdir()
        code, output, seconds = parity(files.manifest(folder), folder, args.max_new_tokens)
        print(f"| (none) | - | - | - | {code} | {caught_by(output) if code else 'passes'} | {control_ratio(output)} | "
              f"{seconds:.0f} |", flush=True)
        for plant in plants:
            for size in sizes:
                folder = Path(scratch) / f"{plant.name}-{size}"
                folder.mkdir()
                manifest = files.planted(plant, folder, size).manifest(folder)
                code, output, seconds = parity(manifest, folder, args.max_new_tokens)
                shown = plant.default_size if size is None else size
                print(f"| {plant.name} | {plant.area} | {plant.fmt} | {shown:g} | {code} | {caught_by(output)} | "
                      f"{control_ratio(output)} | {seconds:.0f} |", flush=True)
                shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
