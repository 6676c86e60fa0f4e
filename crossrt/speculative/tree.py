"""A static draft tree: a set of rank paths, as Medusa's and EAGLE's choice lists are written.
[0] is the drafter's top-1 after the context, [1] its runner-up, [0, 1] the runner-up after the
context plus the top-1, and so on; every prefix of a path is in the set. A step of the one loop
verifies the context's last token plus every node of the tree in one target pass
(crossrt/speculative/loop.py runs it, crossrt/speculative/drafters.py TreeDrafter drafts it); crossrt/simulate/trees.py
simulates it exactly on the rank oracle. docs/ceiling.md gives the rules and measured numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from itertools import product
from pathlib import Path
from typing import Iterable, Sequence

from crossrt.errors import SettingsError

RankPath = tuple[int, ...]
MAX_NODES = 255  # one llama.cpp sequence per leaf, and a context holds at most 256 (LLAMA_MAX_SEQ)


@dataclass(frozen=True)
class Tree:
    """A static draft tree: its nodes' rank paths, prefix-closed, listed breadth first."""

    label: str
    paths: tuple[RankPath, ...]

    def __post_init__(self):
        if not self.paths:
            raise SettingsError(f"tree {self.label}: no nodes")
        known = set()
        for path in self.paths:
            if not path or any(not isinstance(r, int) or r < 0 for r in path):
                raise SettingsError(f"tree {self.label}: {list(path)} is not a path of ranks >= 0")
            if path[:-1] and path[:-1] not in known:
                raise SettingsError(f"tree {self.label}: {list(path)} has no parent {list(path[:-1])}")
            if path in known:
                raise SettingsError(f"tree {self.label}: {list(path)} is listed twice")
            known.add(path)
        if len(self.paths) > MAX_NODES:
            raise SettingsError(f"tree {self.label}: {len(self.paths)} nodes, at most {MAX_NODES}")

    @classmethod
    def of(cls, label: str, paths: Iterable[Sequence[int]]) -> "Tree":
        """The tree of these paths in any order (parents before children after sorting)."""
        return cls(label, tuple(sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))))

    @classmethod
    def full(cls, width: int, depth: int) -> "Tree":
        """Every rank path of ranks below width, up to depth: width 1 is the chain of depth."""
        if width < 1 or depth < 1:
            raise SettingsError(f"a full tree needs width and depth >= 1, got {width}x{depth}")
        return cls.of(f"full {width}x{depth}", (p for d in range(1, depth + 1) for p in product(range(width), repeat=d)))

    @classmethod
    def from_file(cls, path: Path) -> "Tree":
        """A choice list as Medusa and EAGLE write them: a JSON list of rank paths."""
        try:
            paths = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise SettingsError(f"cannot read the choice list {path}: {error}") from None
        if not isinstance(paths, list) or not all(isinstance(p, list) for p in paths):
            raise SettingsError(f"{path}: a choice list is a JSON list of lists of ranks, e.g. [[0], [0, 0], [1]]")
        return cls.of(Path(path).stem, paths)

    @property
    def n_nodes(self) -> int:
        return len(self.paths)

    @cached_property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def cut(self, depth: int) -> "Tree | None":
        """The tree without nodes deeper than depth; None when nothing is left."""
        kept = tuple(p for p in self.paths if len(p) <= depth)
        return Tree(self.label, kept) if kept else None

    @cached_property
    def cuts(self) -> tuple["Tree | None", ...]:
        """cut(depth) at every depth up to the tree's (a step near the budget drafts a cut), made
        once per tree: the simulator drafts the same tree on every oracle."""
        return tuple(self.cut(depth) for depth in range(self.depth + 1))

    @cached_property
    def nodes(self) -> dict[RankPath, int]:
        """Each path's node in a step's Proposal: node 0 is the root, the context's last token."""
        return {path: node for node, path in enumerate(self.paths, start=1)}

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """The Proposal's parents of this tree's nodes, the root's -1 first."""
        return (-1,) + tuple(self.nodes.get(path[:-1], 0) for path in self.paths)

    @cached_property
    def internal(self) -> int:
        """Nodes with children, the root included: the drafter passes that make the tree."""
        return len({p[:-1] for p in self.paths})

    def leaves(self) -> tuple[RankPath, ...]:
        parents = {p[:-1] for p in self.paths}
        return tuple(p for p in self.paths if p not in parents)
