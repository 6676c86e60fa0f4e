"""The ceiling study as a `crossrt report` section: the table crossrt/simulate/ceiling.py
computes (`crossrt simulate --tree ... --out`), with its taus as bars per category
(docs/ceiling.md)."""

from __future__ import annotations

from typing import Optional, Sequence

from crossrt.errors import SettingsError
from crossrt.report.page import Section, Table
from crossrt.report.svg import Bars, bar_chart, palette_color
from crossrt.simulate.ceiling import Ceiling


def ceiling_section(rows: Sequence[Ceiling], source: str) -> Section:
    """The ceiling table as a `crossrt report` section, with its taus as bars per category."""
    def text(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.2f}"

    if not rows:
        raise SettingsError(f"{source}: the ceiling table is empty")
    first = rows[0]
    groups = ["ALL" if c.category is None else c.category for c in rows]
    series = [(f"chain k={first.k}", [c.chain_tau for c in rows]), ("best chain k", [c.best_k_tau for c in rows]),
              (f"best tree <= {first.tree_budget} (held out)", [c.tree_heldout_tau for c in rows]),
              (f"top-{first.top_b} ceiling", [c.top_b_tau for c in rows])]
    chart = bar_chart("the ceiling per category", groups,
                      [Bars(name, tuple(values), palette_color(i)) for i, (name, values) in enumerate(series)],
                      "tau (tokens per step)")
    table = Table(("category", f"chain k={first.k}", "best k", "best k tau", "best k speedup",
                   f"best tree <= {first.tree_budget}: nodes", "depth", "tau", "speedup", "held out tau",
                   f"top-{first.top_b} tau (depth {first.top_b_depth})"),
                  tuple((g, text(c.chain_tau), str(c.best_k), text(c.best_k_tau), text(c.best_k_speedup),
                         str(c.tree_nodes), str(c.tree_depth), text(c.tree_tau), text(c.tree_speedup),
                         text(c.tree_heldout_tau), text(c.top_b_tau)) for g, c in zip(groups, rows)), 1)
    return Section("ceiling", "The ceiling per category",
                   f"From {source} (crossrt simulate --tree): the chain at k, the best chain k, the best static "
                   "tree within a node budget (fitted on these prompts; held out: fitted on the other half), and "
                   "the tau if the target's token were always among the drafter's top-b. Speedups are the cost "
                   "model's predictions (docs/ceiling.md).", chart, (table,), ())
