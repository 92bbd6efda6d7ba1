"""What the machine's static tree says, as policy inputs: the depth of the best static tree and the best V at each
depth, measured by the machine setup (``static_gs.json``: :func:`adaptree.adapt.setup.static_tree`).

The cost features (:func:`adaptree.offline.family.cost_features`) tell a policy what a draft step and a
verification cost here; what a tree of depth d and V nodes *earns* on this machine depends on the head's acceptance
as well. The best static tree folds both together, and a policy trained over a family of machines learns from it in
a few thousand cycles what it cannot learn from the raw costs in a CPU's budget of PPO steps (the cost-only LTD pair
collapsed to one tree for every machine: the step between the costs and the right tree is the whole problem).
So a learned method may observe it (:meth:`MachineTree.features`: how many levels below the best static depth the
tree is, and the log of the best V at the current depth) and choose V relative to it
(:meth:`MachineTree.relative_size`).
Such a policy still decides per cycle from the draft's scores and the context match; the static tree is where it
starts, not what it does.

In training every member of a family gets its tree from the training traces (:meth:`MachineTree.fit`, attached to
the member's ``meta`` under :data:`META_KEY`, where the environments and the controllers read it); at inference it
comes from the machine setup's ``static_gs.json`` (the learned methods' ``tuned`` option).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

META_KEY = "machine_tree"
"""Where a latency model's ``meta`` holds its machine tree (``{"depth", "size", "size_by_depth"}``)."""

FEATURES = ("(D* - D) / max_depth", "log2 V*(D) / 8")
"""What :meth:`MachineTree.features` returns, in order."""

SIZE_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
"""Relative size actions: V = the best V at the tree's depth times a factor (rounded, at least 1)."""


@dataclass(frozen=True)
class MachineTree:
    """The best static tree of a machine: its depth, its V, and the best V at every depth."""

    depth: int
    size: int
    size_by_depth: dict[int, int]

    def __post_init__(self) -> None:
        by = {int(d): int(v) for d, v in dict(self.size_by_depth).items()}
        if self.depth < 1 or self.size < 1 or not by or min(by) < 1 or min(by.values()) < 1:
            raise ValueError(f"a machine tree needs depth, size and every size_by_depth entry >= 1, got depth="
                             f"{self.depth}, size={self.size}, size_by_depth={self.size_by_depth}")
        object.__setattr__(self, "size_by_depth", dict(sorted(by.items())))

    def size_at(self, depth: int) -> int:
        """The best V of a tree of ``depth`` levels (the deepest entry's beyond the table)."""
        by = self.size_by_depth
        return by.get(int(depth), by[max(by)] if depth > max(by) else by[min(by)])

    def relative_size(self, depth: int, factor: float) -> int:
        """V of the relative size action ``factor`` at ``depth``: the best V there times ``factor``, at least 1."""
        return max(1, int(round(self.size_at(depth) * factor)))

    def features(self, depth: int, max_depth: int) -> list[float]:
        """:data:`FEATURES` at a tree of ``depth`` levels."""
        return [(self.depth - depth) / max_depth, math.log2(self.size_at(depth)) / 8.0]

    def summary(self, max_depth: int) -> list[float]:
        """The tree as two numbers for a decision taken before drafting (:func:`static_features`)."""
        return static_features(self.depth, self.size, max_depth)

    def to_dict(self) -> dict:
        return {"depth": self.depth, "size": self.size,
                "size_by_depth": {str(d): v for d, v in self.size_by_depth.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "MachineTree":
        by = d.get("size_by_depth") or {d["depth"]: d["size"]}  # a setup made before: its one tree at every depth
        return cls(int(d["depth"]), int(d["size"]), {int(k): int(v) for k, v in by.items()})

    @classmethod
    def load(cls, path: str | os.PathLike) -> "MachineTree":
        """From a machine setup's ``static_gs.json`` (or ``tune-static``'s: depth and size only)."""
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a static tree file with depth, size (and size_by_depth): {e}") from None

    @classmethod
    def fit(cls, traces, latency, width: int = 10, max_depth: int = 12) -> "MachineTree":
        """The tree the machine setup would choose on ``traces`` under ``latency``
        (:func:`~adaptree.offline.oracle.best_static` and its grid's best V per depth)."""
        from adaptree.offline.oracle import best_static

        best = best_static(traces, latency, widths=(width,), depths=range(1, max_depth + 1))
        return cls(best.depth, best.size, best.size_by_depth())

    @classmethod
    def of(cls, latency) -> "MachineTree | None":
        """The tree attached to a latency model's ``meta`` (:data:`META_KEY`), or None."""
        d = (getattr(latency, "meta", None) or {}).get(META_KEY)
        return cls.from_dict(d) if d else None


def static_features(depth: int, size: int, max_depth: int) -> list[float]:
    """A machine's best static tree as policy inputs that do not depend on the current depth: its depth / max_depth
    and log2 of its V / 8 (Re-SpS's state, RADAR's inputs next to the costs)."""
    return [depth / max_depth, math.log2(max(1, size)) / 8.0]


def attach(models, traces, width: int = 10, max_depth: int = 12, progress: bool = False) -> None:
    """Fit every latency model's :class:`MachineTree` on ``traces`` and attach it to its ``meta`` (those that have one
    keep it)."""
    from tqdm import tqdm

    for m in tqdm(list(models), desc="machine trees", unit="machine", disable=not progress):
        if META_KEY not in (m.meta or {}):
            m.meta = {**(m.meta or {}), META_KEY: MachineTree.fit(traces, m, width, max_depth).to_dict()}
