#!/usr/bin/env python3
"""Prompts whose answer repeats earlier text, for n-gram drafting (docs/ngram.md): each prompt of
a suite, then its target's own greedy continuation, then the prompt again, so the target's output
copies what the prompt holds and a lookup has something to find (tests/test_ngram.py builds the
same on the tiny pair). On llama.cpp in-process, F32 KV cache.

    .venv/bin/python scripts/repeating_prompts.py --pair tiny --out runs/ngram/repeating.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from crossrt.inputs.pairs import resolve_pair  # noqa: E402
from crossrt.inputs.prompts import load_prompts  # noqa: E402
from crossrt.run import loop  # noqa: E402
from crossrt.run.runtime import RuntimeOptions, open_runtime  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pair", default="tiny")
    parser.add_argument("--prompts", default="builtin")
    parser.add_argument("--continuation", type=int, default=24, help="greedy tokens between the two copies")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    runtime = open_runtime("llama-cpp", RuntimeOptions(threads=1, f32_kv_cache=True))
    with runtime.load(resolve_pair(args.pair).path("target", "gguf")) as target:
        lines = []
        for prompt in load_prompts(args.prompts):
            seen = loop.greedy_generate(target, target.tokenize(prompt.text), args.continuation).output_ids
            text = prompt.text + target.detokenize(seen) + "\n" + prompt.text
            lines.append(json.dumps({"id": prompt.id, "category": prompt.category, "prompt": text}) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(lines))
    print(f"{len(lines)} prompts: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
