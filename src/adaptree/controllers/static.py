"""The autoregressive baseline and the static EAGLE-3 tree (W=10, depth 8, V=60 by default)."""

from __future__ import annotations

from dataclasses import dataclass

from .base import MAX_DEPTH, MAX_WIDTH, Controller, CycleContext, TreePlan


class AutoregressiveController(Controller):
    """One token per target forward; the draft head is never run."""

    name = "ar"
    uses_draft = False

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        return TreePlan(width=1, max_depth=0, size=0)


@dataclass
class StaticConfig:
    """EAGLE-3's static tree hyperparameters (SPEC.md §1; LTD's baseline uses depth 8)."""

    width: int = 10
    """Beam width W: top-k per expansion and beam size."""
    depth: int = 8
    """Draft depth D: draft forwards per cycle = levels of the tree."""
    size: int = 60
    """Verification size V: draft nodes sent to the target (the root is extra)."""

    def __post_init__(self) -> None:
        if not 1 <= self.width <= MAX_WIDTH:
            raise ValueError(f"width (W) must be in 1..{MAX_WIDTH}, got {self.width}")
        if not 1 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"depth (D) must be in 1..{MAX_DEPTH}, got {self.depth}")
        if self.size < 1:
            raise ValueError(f"size (V) must be >= 1, got {self.size}")


class StaticController(Controller):
    """EAGLE-3's dynamic tree with static hyperparameters: the same (W, D, V) every cycle."""

    name = "static"

    def __init__(self, config: StaticConfig | None = None) -> None:
        self.config = config or StaticConfig()
        self.plan = TreePlan(self.config.width, self.config.depth, self.config.size)

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        return self.plan
