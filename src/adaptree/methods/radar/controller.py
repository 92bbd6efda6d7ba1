"""RADAR (seeds/radar-rl-dynamic-draft-trees.txt, SPEC.md §4): an LSTM decides after every draft
forward whether to run another one, from the beam's top-W cumulative log-probs.

The tree is EAGLE-3's (W=10, V=60); the maximum depth defaults to the policy's D_max (8 = the paper's
maximum of 8 draft calls). At inference the decision is deterministic by default: stop iff
P(STOP) >= ``threshold`` (0.5 = argmax of the two logits); ``stochastic=True`` samples the decision as the
paper's released code does (a seeded generator of its own: the sampled tokens stay lossless either
way, only the tree shape is random). The LSTM state is reset at every cycle.

``chain_tokens`` verifies the context's chain next to RADAR's tree every cycle, its length chosen by
:class:`~adaptree.methods.common.chain.ChainRule` (the learned methods' shared runtime,
:mod:`adaptree.methods.common.runtime`, with the latency model and the AR fallback); a policy trained on a dataset
with chains (``adaptree radar dataset --chain-tokens K``, ``adaptree radar train --match``) also observes the match
(its features enter the MLP's state input) and then needs a chain calibration (``chain``).

The policy is a folder (``config.json`` + ``model.safetensors``,
:class:`~adaptree.methods.radar.policy.RadarPolicy`) given by ``policy``; None = the policy shipped next to the
default model's head (``heads/smollm2-135m/radar/``), an error naming the flag when none is shipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from adaptree.core.config import between
from adaptree.core.controller import Controller, CycleContext, TreePlan, TreeShape
from adaptree.core.tree import DraftStep
from adaptree.methods.common import LearnedRuntime, LearnedSeam


@dataclass
class RadarConfig(LearnedRuntime, TreeShape):
    """RADAR's inference settings (tree shape from EAGLE-3, paper §3.1)."""

    width: int = 10
    """Beam width W; must equal the policy's input width."""
    depth: int | None = None
    """Maximum draft depth (draft forwards per cycle); None = the policy's D_max."""
    policy: str | None = None
    """Policy folder (config.json + model.safetensors; ``radar/`` next to the head in use when built through the
    method registry)."""
    threshold: float = between(0.0, 1.0, 0.5, lo_open=True)
    """Deterministic rule: stop iff P(STOP) >= threshold (0.5 = argmax)."""
    stochastic: bool = False
    """Sample the decision from the policy (the paper's released behaviour) instead of thresholding."""
    seed: int = 0
    """Seed of the stochastic decisions' generator (reset with every generation)."""

    unset_depth: ClassVar[int] = 1


class RadarController(LearnedSeam, Controller):
    """EAGLE-3's tree with RADAR's learned continue/stop decisions.

    :param policy: a loaded :class:`~adaptree.methods.radar.policy.RadarPolicy` (overrides ``config.policy``).
    :param chain_calibration: a loaded :class:`~adaptree.methods.common.ChainCalibration` (overrides ``chain``).
    """

    name = "radar"

    def __init__(self, config: RadarConfig | None = None, policy=None, chain_calibration=None) -> None:
        from adaptree.methods.radar.policy import RadarPolicy

        self.config = cfg = config or RadarConfig()
        if policy is None:
            if not cfg.policy:
                raise ValueError("no RADAR policy given: pass --radar-policy PATH (train one with "
                                 "`adaptree radar dataset` then `adaptree radar train`, see docs/radar.md)")
            policy = RadarPolicy.load(cfg.policy)
        self.policy = policy.eval()
        pc = policy.config
        if pc.width != cfg.width:
            raise ValueError(f"width (W) {cfg.width} does not match the RADAR policy's input width {pc.width}")
        depth = cfg.depth if cfg.depth is not None else pc.max_depth
        self.plan = cfg.plan(depth)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.hc = None
        self.last_p_stop = float("nan")
        self.costs = policy.costs_tensor(None) if pc.cost_features and pc.reference_costs is not None else None
        self.observes = pc.match_features
        self.start_runtime(cfg, chain_calibration, self.observes)
        self.match: list[float] | None = None
        self.smallest = (self.plan.width, self.plan.size, self.plan.max_depth)  # V nodes whatever depth it stops at
        self.load_latency(cfg)

    def use_latency(self, latency) -> None:
        if self.policy.config.cost_features:
            from adaptree.offline.family import cost_features

            self.costs = self.policy.costs_tensor(cost_features(latency, self.config.width))
        super().use_latency(latency)

    def reset(self) -> None:
        self.gen.manual_seed(self.config.seed)
        self.hc = None
        super().reset()

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        self.hc = None  # the LSTM state lives for one cycle
        return super().begin_cycle(ctx)

    @torch.inference_mode()
    def continue_drafting(self, step: DraftStep) -> bool:
        logits, self.hc = self.policy.step(step.beam_scores.float().cpu(), step.depth, self.hc, self.costs, self.match)
        p_stop = float(torch.softmax(logits.float(), -1)[0])
        self.last_p_stop = p_stop
        if self.config.stochastic:
            return bool(torch.rand((), generator=self.gen) >= p_stop)
        return p_stop < self.config.threshold
