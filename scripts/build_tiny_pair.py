"""Build a deterministic drafter/target pair: python scripts/build_tiny_pair.py [--out DIR]
[--seed N] [--shape tiny|bench]. The tiny pair in models/tiny is committed; rebuilding it with
the same seed and library versions gives the same bytes."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from crossrt.builders.tinypair import PRESETS, build_pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="output folder (default: models/tiny, or .cache/bench-pair)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(PRESETS), default="tiny")
    args = parser.parse_args()
    out = args.out or ("models/tiny" if args.shape == "tiny" else ".cache/bench-pair")
    for path in build_pair(out, preset=args.shape, seed=args.seed):
        print(f"{path.stat().st_size:>10,}  {path}")


if __name__ == "__main__":
    main()
