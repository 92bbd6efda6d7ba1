"""Gammatune (Gautam et al. 2025) as LTD ran it (LTD Appendix A.1): the draft depth follows the
running acceptance rate, between half and 1.5 times the default depth, adaptation rate 0.2.

Exact rule implemented here (our formulation; the Gammatune paper's own update formula could not be
checked offline, LTD's appendix gives only gamma_min = D0/2, gamma_max = 1.5 D0 and eta = 0.2):

* bounds: ``d_min = max(1, ceil(min_factor * D0))``, ``d_max = min(64, floor(max_factor * D0))``
  (4 and 12 for the default depth D0 = 8), so the depth never leaves [0.5 D0, 1.5 D0];
* after every cycle (:meth:`GammatuneController.end_cycle`) with ``depth > 0`` drafted levels and
  ``accepted`` accepted draft tokens, the per-cycle acceptance rate ``a = accepted / depth`` (in [0, 1])
  updates the exponentially smoothed rate ``r <- (1 - eta) * r + eta * a`` (eta = ``rate`` = 0.2);
* at the start of every cycle (:meth:`GammatuneController.begin_cycle`) the depth is
  ``clamp(round_half_up(d_min + r * (d_max - d_min)), d_min, d_max)``: a linear map of the smoothed
  rate onto the allowed range, r = 1 (every drafted level accepted) giving d_max and r = 0 giving d_min;
* ``r`` starts, at every generation (:meth:`GammatuneController.reset`), at the value that maps to D0
  itself, ``(D0 - d_min) / (d_max - d_min)`` (0.5 with the defaults), so the first cycle uses the default
  depth.

Within a cycle the tree is EAGLE-3's static one of that depth (W=10, V=60): Gammatune decides once
per cycle and never stops drafting early.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from adaptree.core.config import between
from adaptree.core.controller import (
    MAX_DEPTH,
    Controller,
    CycleContext,
    TreePlan,
    TreeShape,
)
from adaptree.core.records import CycleRecord


@dataclass
class GammatuneConfig(TreeShape):
    """Gammatune's hyperparameters as LTD ran it (depth in [0.5, 1.5] x default, rate 0.2)."""

    depth: int = 8
    """Default depth D0 (EAGLE-3's LTD baseline depth); the first cycle of a generation uses it."""
    depth_name: ClassVar[str] = "depth (default depth D0)"
    rate: float = between(0.0, 1.0, 0.2, lo_open=True)
    """eta: weight of the newest cycle's acceptance rate in the exponentially smoothed rate."""
    min_factor: float = between(0.0, 1.0, 0.5, lo_open=True)
    """Smallest depth as a fraction of the default depth (gamma_min = D0 / 2)."""
    max_factor: float = between(1.0, MAX_DEPTH, 1.5)  # past MAX_DEPTH x D0 the depth is capped anyway
    """Largest depth as a multiple of the default depth (gamma_max = 1.5 D0; at most 64)."""

    @property
    def bounds(self) -> tuple[int, int]:
        """(d_min, d_max): the depth range, inside [min_factor, max_factor] x D0."""
        lo = max(1, math.ceil(self.min_factor * self.depth - 1e-9))
        hi = min(MAX_DEPTH, math.floor(self.max_factor * self.depth + 1e-9))
        return lo, max(lo, hi)


class GammatuneController(Controller):
    """Per-cycle depth from the smoothed acceptance rate (see the module docstring)."""

    name = "gammatune"

    def __init__(self, config: GammatuneConfig | None = None) -> None:
        self.config = config or GammatuneConfig()
        self.d_min, self.d_max = self.config.bounds
        span = self.d_max - self.d_min
        self.initial_rate = (self.config.depth - self.d_min) / span if span else 1.0
        self.reset()

    def reset(self) -> None:
        self.smoothed = self.initial_rate
        self.current_depth = self.next_depth()

    def next_depth(self) -> int:
        """The depth the smoothed rate maps to."""
        d = math.floor(self.d_min + self.smoothed * (self.d_max - self.d_min) + 0.5)
        return min(self.d_max, max(self.d_min, d))

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        self.current_depth = self.next_depth()
        return self.config.plan(self.current_depth)

    def end_cycle(self, record: CycleRecord) -> None:
        if record.depth <= 0:
            return
        a = min(1.0, max(0.0, record.accepted / record.depth))
        eta = self.config.rate
        self.smoothed = (1.0 - eta) * self.smoothed + eta * a
