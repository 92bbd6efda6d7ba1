"""RADAR (seeds/radar-rl-dynamic-draft-trees.txt, SPEC.md §4): an LSTM decides after every draft
forward whether to run another one, from the beam's top-W cumulative log-probs.

The tree is EAGLE-3's (W=10, V=60); the maximum depth defaults to the policy's D_max (8 = the paper's
maximum of 8 draft calls). At inference the decision is deterministic by default: stop iff
P(STOP) >= ``threshold`` (0.5 = argmax of the two logits); ``stochastic=True`` samples the decision as the
paper's released code does (a seeded generator of its own: the sampled tokens stay lossless either
way, only the tree shape is random). The LSTM state is reset at every cycle.

``chain_tokens`` (issue 19) verifies the context's chain next to RADAR's tree every cycle, its length chosen by
:class:`~adaptree.methods.hybrid.chain.ChainRule`; a policy trained on a dataset with chains
(``adaptree radar dataset --chain-tokens K``, ``adaptree radar train --match``) also observes the match (its features
enter the MLP's state input) and then needs a chain calibration (``chain``).

The policy is a folder (``config.json`` + ``model.safetensors``, :class:`~adaptree.rl.radar.RadarPolicy`)
given by ``policy``; None = the policy shipped next to the default model's head
(``heads/smollm2-135m/radar/``), an error naming the flag when none is shipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from adaptree.core.controller import AR_PLAN, Controller, CycleContext, TreePlan, TreeShape
from adaptree.core.records import CycleRecord
from adaptree.core.tree import DraftStep
from adaptree.methods.ar_gate import ARGate
from adaptree.methods.hybrid.chain import ChainRule, ChainSeam, check_chain_tokens

@dataclass
class RadarConfig(TreeShape):
    """RADAR's inference settings (tree shape from EAGLE-3, paper §3.1)."""

    width: int = 10
    """Beam width W; must equal the policy's input width."""
    depth: int | None = None
    """Maximum draft depth (draft forwards per cycle); None = the policy's D_max."""
    policy: str | None = None
    """Policy folder (config.json + model.safetensors; ``radar/`` next to the head in use when built through the
    method registry)."""
    threshold: float = 0.5
    """Deterministic rule: stop iff P(STOP) >= threshold (0.5 = argmax)."""
    stochastic: bool = False
    """Sample the decision from the policy (the paper's released behaviour) instead of thresholding."""
    seed: int = 0
    """Seed of the stochastic decisions' generator (reset with every generation)."""
    latency: str | None = None
    """Latency model JSON of this machine: the cost features of a policy that sees them and the AR fallback's
    costs (filled from the machine setup; without one, the policy's reference costs and no fallback)."""
    ar_fallback: bool = True
    """Take AR steps while RADAR's trees earn fewer tokens per modelled second than AR steps here, with probe cycles
    (adaptree.methods.ar_gate; needs a latency model)."""
    probe_every: int = 8
    """In AR mode, AR steps before a probe, counted in units of the cost of RADAR's smallest tree (the interval
    doubles while probes fail, up to 8x)."""
    chain: str | None = None
    """Chain calibration JSON of this model (the machine setup's chain.json): for a policy that observes the context
    match, and for chain_tokens."""
    chain_tokens: int | None = None
    """Longest context chain verified per cycle next to RADAR's tree (adaptree.methods.hybrid.ChainRule; issue 19).
    Default: 16 with a policy that observes the context match, else none (0)."""

    unset_depth: ClassVar[int] = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_chain_tokens(self.chain_tokens)
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.probe_every < 1 or int(self.probe_every) != self.probe_every:
            raise ValueError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")


class RadarController(ChainSeam, Controller):
    """EAGLE-3's tree with RADAR's learned continue/stop decisions.

    :param policy: a loaded :class:`~adaptree.rl.radar.RadarPolicy` (overrides ``config.policy``).
    :param chain_calibration: a loaded :class:`~adaptree.methods.hybrid.ChainCalibration` (overrides ``chain``).
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
        self.gate = ARGate.of(cfg)
        self.chain_rule = ChainRule.of(cfg, chain_calibration, pc.match_features, self.name)
        self.match: list[float] | None = None
        self.min_size = self.plan.size  # RADAR verifies V nodes whatever depth it stops at
        if cfg.latency:
            from adaptree.offline.latency import load_checked

            self.use_latency(load_checked(cfg.latency, quiet=True))

    def use_latency(self, latency) -> None:
        if self.policy.config.cost_features:
            from adaptree.offline.family import cost_features

            self.costs = self.policy.costs_tensor(cost_features(latency, self.config.width))
        if self.gate is not None:
            self.gate.latency = latency
        if self.chain_rule is not None:
            self.chain_rule.latency = latency

    def reset(self) -> None:
        self.gen.manual_seed(self.config.seed)
        self.hc = None
        if self.gate is not None:
            self.gate.reset()

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        self.hc = None  # the LSTM state lives for one cycle
        plan, gate = self.plan, self.gate
        chain = ()
        if self.chain_rule is not None:
            chain = self.chain_rule.begin(ctx)
            self.match = self.chain_rule.features() if self.policy.config.match_features else None
        if gate is not None and gate.latency is not None and gate.ar_step(plan.width, self.min_size, plan.max_depth,
                                                                          ctx.context_len):
            plan = AR_PLAN
        return plan.with_chain(chain)

    def end_cycle(self, record: CycleRecord) -> None:
        if self.gate is not None:
            self.gate.record(record)

    @torch.inference_mode()
    def continue_drafting(self, step: DraftStep) -> bool:
        logits, self.hc = self.policy.step(step.beam_scores.float().cpu(), step.depth, self.hc, self.costs, self.match)
        p_stop = float(torch.softmax(logits.float(), -1)[0])
        self.last_p_stop = p_stop
        if self.config.stochastic:
            return bool(torch.rand((), generator=self.gen) >= p_stop)
        return p_stop < self.config.threshold
