"""Re-SpS's gymnasium environment: a whole tree configuration per decision, kept for ``interval`` cycles
(action caching). The sources and the bridge are :mod:`adaptree.offline.envs`'s."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from adaptree.core.controller import (
    Controller,
    CycleContext,
    StaticConfig,
    StaticController,
    TreePlan,
)
from adaptree.offline.envs import CycleEnv


class PlanEnv(CycleEnv):
    """Re-SpS's decisions: a tree configuration ``plans[action]`` = (W, depth, V) kept for ``interval`` cycles.

    :param observe_features: ``ctx -> observation`` (:meth:`~adaptree.methods.resps.controller.ReSpSState.observer`);
        with a chain rule (``chain=``), ``(ctx, match) -> observation``, ``match`` its match features.
    """

    decision = "plan"

    def __init__(self, source, plans: Sequence[tuple[int, int, int]], obs_dim: int,
                 observe_features: Callable[..., np.ndarray], interval: int = 10,
                 reward: str = "cycle_throughput", inner: Controller | None = None, **kwargs) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.plans = [TreePlan(*map(int, p)) for p in plans]
        if len(self.plans) < 2:
            raise ValueError(f"PlanEnv needs at least 2 plans, got {len(self.plans)}")
        self.interval, self._observe = interval, observe_features
        p0 = self.plans[0]
        super().__init__(source, inner or StaticController(StaticConfig(p0.width, max(1, p0.max_depth), max(1, p0.size))),
                         obs_dim, len(self.plans), reward=reward, **kwargs)

    def observe(self, ctx: CycleContext) -> np.ndarray:
        x = self._observe(ctx) if self.chain is None else self._observe(ctx, self.chain.features())
        return np.asarray(x, dtype=np.float32)

    def plan_of(self, action: int) -> TreePlan:
        return self.plans[action]
