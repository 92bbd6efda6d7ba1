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
        with a chain rule (``chain=``), ``(ctx, match) -> observation``, ``match`` its match features; with
        ``costs_of``, it is also given ``costs=`` the cost features of the generation's latency model.
    :param costs_of: ``latency -> cost features`` (:meth:`~adaptree.methods.resps.controller.ReSpSState.costs_of`),
        for a state that sees the machine: each generation's features come from the latency model it runs on (a
        family member drawn for it in training; none on a live source without one: the state's reference costs).
    """

    decision = "plan"

    def __init__(self, source, plans: Sequence[tuple[int, int, int]], obs_dim: int,
                 observe_features: Callable[..., np.ndarray], interval: int = 10,
                 reward: str = "cycle_throughput", inner: Controller | None = None,
                 costs_of: Callable[..., list[float] | None] | None = None,
                 relative: Sequence[tuple[int, float]] | None = None, max_depth: int = 12, **kwargs) -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.relative, self.max_depth = (list(relative) if relative is not None else None), max_depth
        """With relative actions: (depth offset, V factor) per action, the plan made from the generation's machine
        tree (its latency model's, adaptree.methods.common.machine_tree); ``plans`` then only give the inner rule."""
        self.machine = None
        self.plans = [TreePlan(*map(int, p)) for p in plans]
        if len(self.plans) < 2:
            raise ValueError(f"PlanEnv needs at least 2 plans, got {len(self.plans)}")
        self.interval, self._observe, self._costs_of = interval, observe_features, costs_of
        p0 = self.plans[0]
        n = len(self.relative) if self.relative is not None else len(self.plans)
        super().__init__(source, inner or StaticController(StaticConfig(p0.width, max(1, p0.max_depth), max(1, p0.size))),
                         obs_dim, n, reward=reward, **kwargs)
        self.costs: list[float] | None = None
        """The cost features of the generation running now (with ``costs_of``)."""
        if costs_of is not None and self.latency is not None:
            self.costs = costs_of(self.latency)

    def use_latency(self, latency) -> None:
        super().use_latency(latency)
        if self._costs_of is not None:
            self.costs = self._costs_of(latency)
        if self.relative is not None:
            from adaptree.methods.common import MachineTree

            self.machine = MachineTree.of(latency)
            if self.machine is None:
                raise ValueError("relative Re-SpS actions need every latency model's machine tree "
                                 "(adaptree.methods.common.machine_tree.attach)")

    def observe(self, ctx: CycleContext) -> np.ndarray:
        args = () if self.chain is None else (self.chain.features(),)
        kw = {} if self._costs_of is None else {"costs": self.costs}
        if self.relative is not None:
            kw["machine"] = self.machine
        return np.asarray(self._observe(ctx, *args, **kw), dtype=np.float32)

    def plan_of(self, action: int) -> TreePlan:
        if self.relative is not None:
            from adaptree.methods.resps.controller import relative_plan

            return relative_plan(self.machine, self.relative[action], self.max_depth)
        return self.plans[action]
