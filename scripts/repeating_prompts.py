#!/usr/bin/env python3
"""Prompts whose answer repeats earlier text, for n-gram drafting (docs/ngram.md): each prompt of
a suite, then its target's own greedy continuation, then the prompt again, so the target's output
copies what the prompt holds and a lookup has something to find (crossrt/run/repeating.py, as the
n-gram tests build theirs on the tiny pair). On llama.cpp in-process, F32 KV cache.

    .venv/bin/python scripts/repeating_prompts.py --pair tiny --out runs/ngram/repeating.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from crossrt.inputs.pairs import resolve_pair  # noqa: E402
from crossrt.inputs.prompts import load_prompts  # noqa: E402
from crossrt.run.repeating import repeating, write_jsonl  # noqa: E402
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
        prompts = repeating(target, load_prompts(args.prompts), args.continuation)
    write_jsonl(prompts, args.out)
    print(f"{len(prompts)} prompts: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
