"""LTD's two gymnasium environments over the controller seam (the sources and the bridge are
:mod:`adaptree.offline.envs`'s) and the random depth rule its size policy trains under in stage 1."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from adaptree.core.controller import Controller, CycleContext, TreePlan
from adaptree.core.tree import DraftStep, DraftTree
from adaptree.methods.common import MachineTree
from adaptree.offline.envs import CycleEnv


class _LTDEnv(CycleEnv):
    """The cost features of the generation's latency model, for observations that use them."""

    costs: list[float] | None = None
    machine: MachineTree | None = None
    """The generation's machine tree (its latency model's, adaptree.methods.common.machine_tree), for observations
    that use it."""

    def use_latency(self, latency) -> None:
        super().use_latency(latency)
        self.costs = self.obs_spec.costs_of(latency)
        self.machine = MachineTree.of(latency)

    def match(self) -> list[float] | None:
        """The cycle's match features, for observations that use them (the environment's chain rule has them)."""
        if not self.obs_spec.use_match:
            return None
        if self.chain is None:
            raise ValueError("an LTD observation with use_match needs an environment with a chain rule (chain=...)")
        return self.chain.features()


class DepthEnv(_LTDEnv):
    """LTD's depth decisions: after every draft forward, STOP (0) or CONTINUE (1).

    :param observation: an :class:`~adaptree.methods.ltd.controller.LTDObservation` (``depth_obs``).
    :param inner: the rest of the cycle: its ``begin_cycle`` gives W and the maximum depth, its
        ``choose_size`` the V (a StaticController(W, 12, 60) in LTD's stage 1, the frozen size policy later).
    :param actions: 2 (STOP, CONTINUE), or 3 with the hybrid rule's decision (RULE).
    """

    decision = "depth"

    def __init__(self, source, observation, inner, actions: int = 2, **kwargs) -> None:
        self.obs_spec = observation
        super().__init__(source, inner, observation.depth_dim, actions, **kwargs)
        if actions == 3 and self.chain is None:
            raise ValueError("a depth policy with the rule's action trains in an environment with a chain rule "
                             "(chain=...)")

    @property
    def first_decision(self) -> bool:
        """Asked before the first draft forward too (the observation's ``first_decision``)."""
        return self.obs_spec.first_decision

    def observe(self, step: DraftStep) -> np.ndarray:
        return self.obs_spec.depth_obs(step, self.costs, self.match(), self.machine).numpy()

    def continues(self, action: int, step: DraftStep) -> bool:
        return self.obs_spec.continues(action, step, self.chain)

    def observe_first(self, ctx: CycleContext) -> np.ndarray:
        return self.obs_spec.first_obs(ctx.context_len, self.costs, self.match(), self.machine).numpy()


class SizeEnv(_LTDEnv):
    """LTD's size decision: once drafting stopped, V = ``sizes[action]``.

    :param inner: decides the depth (:class:`RandomDepthController` in LTD's stage 1, the frozen depth
        policy later).
    """

    decision = "size"

    def __init__(self, source, observation, inner, sizes: Sequence[float], **kwargs) -> None:
        self.obs_spec = observation
        if not sizes:
            raise ValueError("sizes must be a non-empty list of size actions")
        self.sizes = [observation.action_of(v) for v in sizes]
        super().__init__(source, inner, observation.size_dim, len(self.sizes), **kwargs)
        if observation.chain_split and self.chain is None:
            raise ValueError("a size policy that sizes the chain trains in an environment with a chain rule "
                             "(chain=...)")
        self._tree: DraftTree | None = None

    def observe(self, tree: DraftTree) -> np.ndarray:
        self._tree = tree  # what the action's V is taken on
        return self.obs_spec.size_obs(tree, self.costs, self.match(), self.machine).numpy()

    def size_of(self, action: int) -> int:
        return self.obs_spec.decide(self.sizes[action], self._tree, self.machine, self.chain)


class RandomDepthController(Controller):
    """A tree of a uniformly random depth in ``[min_depth, max_depth]`` per cycle, V fixed: the depth rule
    LTD trains its size policy under in stage 1."""

    name = "random-depth"

    def __init__(self, rng: np.random.Generator, width: int = 10, min_depth: int = 1, max_depth: int = 12,
                 size: int = 60) -> None:
        if not 1 <= min_depth <= max_depth:
            raise ValueError(f"need 1 <= min_depth <= max_depth, got {min_depth}, {max_depth}")
        self.rng, self.width, self.lo, self.hi, self.size = rng, width, min_depth, max_depth, size

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        return TreePlan(self.width, int(self.rng.integers(self.lo, self.hi + 1)), self.size)
