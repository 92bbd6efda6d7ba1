"""The controller seam: the five decision points of the draft-and-verify cycle (DESIGN.md).

A controller shapes each cycle's draft tree; the engine owns the loop. Every method is optional to
override: the defaults give a static tree of the plan's depth and size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from adaptree.core.config import check_fields
from adaptree.core.context import ContextIndex
from adaptree.core.records import CycleRecord
from adaptree.core.tree import DraftStep, DraftTree

MAX_WIDTH = 64
MAX_DEPTH = 64


@dataclass(frozen=True)
class TreePlan:
    """The shape a cycle starts with: beam width W, maximum depth D (draft forwards) and default V, and
    a chain of tokens from another source (a context match's continuation: :mod:`adaptree.core.context`)
    verified under the same root, its prefix shared with the head's tree where the tokens agree."""

    width: int
    max_depth: int
    size: int
    chain: tuple[int, ...] = ()
    """Tokens to verify as one more root-to-leaf path (cut to the context room left after the head's V)."""

    def __post_init__(self) -> None:
        if not 1 <= self.width <= MAX_WIDTH:
            raise ValueError(f"tree width W must be in 1..{MAX_WIDTH}, got {self.width}")
        if not 0 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"tree depth D must be in 0..{MAX_DEPTH}, got {self.max_depth}")
        if self.size < 0:
            raise ValueError(f"verification size V must be >= 0, got {self.size}")

    def with_chain(self, chain: Sequence[int]) -> TreePlan:
        """This plan with ``chain`` as its chain (this plan itself when ``chain`` is empty)."""
        return TreePlan(self.width, self.max_depth, self.size, tuple(chain)) if chain else self


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
    index: ContextIndex | None = None
    """The prompt and the generated tokens (root last) as a :class:`~adaptree.core.context.ContextIndex`,
    for controllers that ask for one (:meth:`Controller.context_index`; None for the others)."""
    temperature: float = 0.0
    """The sampling temperature verification accepts with (0: greedy; replay is greedy): how often a drafted token
    is accepted depends on it (a chain's calibrated rates: :class:`~adaptree.methods.common.ChainCalibration`)."""


AR_PLAN = TreePlan(1, 0, 0)
"""An autoregressive step inside a tree method's run: no drafting, the root alone is verified."""


class Controller:
    """Base controller: a static plan, draft to the plan's depth, verify the plan's size."""

    name = "base"
    uses_draft = True
    """False for the autoregressive baseline: the engine then never runs the draft head."""
    reads_features = True
    """False for a controller that never reads :attr:`CycleContext.features`: the loop then passes None and the engine
    makes no tensor of them (on llama.cpp's kernels a torch object per AR step cost about 1% of the step)."""

    def reset(self) -> None:
        """Called at the start of every generation."""

    def context_index(self) -> ContextIndex | None:
        """A fresh :class:`~adaptree.core.context.ContextIndex` for a generation when the controller reads
        :attr:`CycleContext.index` (the loop keeps it up to date), None otherwise (the default: no upkeep)."""
        return None

    def use_latency(self, latency) -> None:
        """This machine's :class:`~adaptree.offline.latency.LatencyModel` (in replay and training: the simulated
        machine's, called before every generation). Controllers that see what the hardware costs read it here;
        the others ignore it."""

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        raise NotImplementedError

    def continue_drafting(self, step: DraftStep) -> bool:
        """After every draft forward (depth < plan.max_depth): draft one more level?"""
        return True

    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        """Once drafting stopped: how many draft nodes V to verify."""
        return plan.size

    def choose_chain(self, tree: DraftTree | None, plan: TreePlan, size: int) -> int:
        """When the plan has a chain: how many of its first tokens to verify along with the head's ``size``
        nodes (``tree``: None when nothing was drafted). Default: all of them."""
        return len(plan.chain)

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


_NOUNS = {int: "integers", float: "numbers"}


def comma_list(value: str | Sequence[Any], convert: Callable[[Any], Any] = int, what: str = "the list") -> tuple:
    """``"5,7,9"`` (blanks skipped) or a sequence, as a tuple of ``convert``-ed items; a ValueError names
    ``what`` and the value when an item does not convert."""
    items = [x.strip() for x in value.split(",")] if isinstance(value, str) else list(value)
    try:
        return tuple(convert(x) for x in items if not isinstance(x, str) or x)
    except ValueError:
        noun = _NOUNS.get(convert, "values")
        raise ValueError(f"{what} must be comma-separated {noun}, got {value!r}") from None


@dataclass
class TreeShape:
    """The fields a tree method's config starts with: beam width W, (maximum) draft depth and verification size
    V, range-checked on construction (:func:`check_shape`). A config redeclares a field for its own default or
    help text; the field keeps its place, so ``Config(W, D, V)`` works for every such config."""

    width: int = 10
    """Beam width W: top-k per expansion and beam size."""
    depth: int = 8
    """Draft depth D: draft forwards per cycle = levels of the tree."""
    size: int = 60
    """Verification size V: draft nodes sent to the target (the root is extra)."""

    depth_name: ClassVar[str] = "depth"
    """How a range error names the depth."""
    unset_depth: ClassVar[int] = 1
    """What is range-checked when the depth is None (a method that takes its depth from its policy)."""
    unset_size: ClassVar[int] = 60
    """V when the size is None (a method that takes V per depth from the machine's tree, and EAGLE-3's 60 without
    one): what is range-checked and what :meth:`plan` carries."""

    def __post_init__(self) -> None:
        check_shape(self.width, self.unset_depth if self.depth is None else self.depth,
                    self.unset_size if self.size is None else self.size, self.depth_name)
        check_fields(self)  # every field's own range and choices (adaptree.core.config), the subclass's too

    def plan(self, depth: int | None = None) -> TreePlan:
        """The :class:`TreePlan` of this shape, with ``depth`` instead of the config's when given (a policy's, or
        this cycle's)."""
        return TreePlan(self.width, self.depth if depth is None else depth,
                        self.unset_size if self.size is None else self.size)


class AutoregressiveController(Controller):
    """One token per target forward; the draft head is never run."""

    name = "ar"
    uses_draft = False

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        return TreePlan(width=1, max_depth=0, size=0)


@dataclass
class StaticConfig(TreeShape):
    """EAGLE-3's static tree hyperparameters (SPEC.md §1; LTD's baseline uses depth 8)."""

    depth_name: ClassVar[str] = "depth (D)"


class StaticController(Controller):
    """EAGLE-3's dynamic tree with static hyperparameters: the same (W, D, V) every cycle. Depth rules that
    keep one plan and only stop drafting early subclass it with their own config class."""

    name = "static"
    config_class: type[TreeShape] = StaticConfig

    def __init__(self, config: TreeShape | None = None) -> None:
        self.config = config or self.config_class()
        self.plan = self.config.plan()

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        return self.plan
