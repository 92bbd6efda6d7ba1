"""The controller seam: the four decision points of the draft-and-verify cycle (DESIGN.md).

A controller shapes each cycle's draft tree; the engine owns the loop. Every method is optional to
override: the defaults give a static tree of the plan's depth and size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from adaptree.core.records import CycleRecord
from adaptree.core.tree import DraftStep, DraftTree

MAX_WIDTH = 64
MAX_DEPTH = 64


@dataclass(frozen=True)
class TreePlan:
    """The shape a cycle starts with: beam width W, maximum depth D (draft forwards) and default V."""

    width: int
    max_depth: int
    size: int

    def __post_init__(self) -> None:
        if not 1 <= self.width <= MAX_WIDTH:
            raise ValueError(f"tree width W must be in 1..{MAX_WIDTH}, got {self.width}")
        if not 0 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"tree depth D must be in 0..{MAX_DEPTH}, got {self.max_depth}")
        if self.size < 0:
            raise ValueError(f"verification size V must be >= 0, got {self.size}")


@dataclass
class CycleContext:
    """What a controller knows when a cycle begins."""

    cycle: int
    """Index of the cycle within this generation (0-based)."""
    context_len: int
    """Tokens committed in the target's KV cache (prompt + generated, before the root)."""
    generated: int
    """New tokens produced so far (the root included)."""
    features: torch.Tensor | None
    """Target low/mid/high features ``[3*hidden]`` of the last accepted position (None without a head)."""
    prompt_ids: Sequence[int] = ()
    """The prompt's token ids (a reference, not a copy)."""
    generated_ids: Sequence[int] = ()
    """Token ids generated so far, the root included (a reference to the engine's growing list: read it in
    ``begin_cycle``, copy it to keep it)."""


class Controller:
    """Base controller: a static plan, draft to the plan's depth, verify the plan's size."""

    name = "base"
    uses_draft = True
    """False for the autoregressive baseline: the engine then never runs the draft head."""

    def reset(self) -> None:
        """Called at the start of every generation."""

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        raise NotImplementedError

    def continue_drafting(self, step: DraftStep) -> bool:
        """After every draft forward (depth < plan.max_depth): draft one more level?"""
        return True

    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        """Once drafting stopped: how many draft nodes V to verify."""
        return plan.size

    def end_cycle(self, record: CycleRecord) -> None:
        """After verification, with the accepted length and the cycle's timings."""


def check_shape(width: int, depth: int, size: int, depth_name: str = "depth") -> None:
    """Raise ValueError naming the bad value when W, the depth or V is out of range."""
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width (W) must be in 1..{MAX_WIDTH}, got {width}")
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"{depth_name} must be in 1..{MAX_DEPTH}, got {depth}")
    if size < 1:
        raise ValueError(f"size (V) must be >= 1, got {size}")


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
        check_shape(self.width, self.depth, self.size, depth_name="depth (D)")


class StaticController(Controller):
    """EAGLE-3's dynamic tree with static hyperparameters: the same (W, D, V) every cycle."""

    name = "static"

    def __init__(self, config: StaticConfig | None = None) -> None:
        self.config = config or StaticConfig()
        self.plan = TreePlan(self.config.width, self.config.depth, self.config.size)

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        return self.plan
