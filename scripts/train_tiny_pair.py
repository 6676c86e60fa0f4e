"""Train the trained tiny pair: python scripts/train_tiny_pair.py [--out DIR] [--threads N].
Deterministic (fixed seeds, torch's deterministic algorithms): the same Python, library
versions and CPU give the same files. About 10 minutes on one thread; the loss is logged."""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from crossrt.builders.tinytrain import build_trained_pair  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/trained", help="output folder")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; other thread counts may change the last bits")
    args = parser.parse_args()
    start = time.monotonic()
    files = build_trained_pair(args.out, threads=args.threads,
                               log=lambda line: print(f"[{time.monotonic() - start:6.0f}s] {line}",
                                                      flush=True))
    for path in files:
        print(f"{path.stat().st_size:>10,}  {path}")


if __name__ == "__main__":
    main()
