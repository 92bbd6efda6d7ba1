"""RADAR (seeds/radar-rl-dynamic-draft-trees.txt, SPEC.md §4): an LSTM decides after every draft
forward whether to run another one, from the beam's top-W cumulative log-probs.

The tree is EAGLE-3's (W=10); the maximum depth defaults to the policy's D_max (8 = the paper's
maximum of 8 draft calls). At inference the decision is deterministic by default: stop iff
P(STOP) >= ``threshold`` (0.5 = argmax of the two logits); ``stochastic=True`` samples the decision as the
paper's released code does (a seeded generator of its own: the sampled tokens stay lossless either
way, only the tree shape is random). The LSTM state is reset at every cycle.

V follows the machine: a cycle that stopped at depth d verifies the V of the machine's best static tree of that
depth (``size_by_depth`` in the machine setup's static_gs.json, given by ``tuned``:
:func:`~adaptree.offline.oracle.sizes_by_depth`), since a fixed V = 60 makes every tree deeper than one level lose
where verification is dear (CPUs) and is too small where it is nearly free (GPUs). Without a table, a policy trained
with tables (``size_table``) verifies the table it stores (``reference_sizes``: the median of its validation
machines') and an older one EAGLE-3's V = 60; ``size`` fixes V at every depth.

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

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from adaptree.core.config import between
from adaptree.core.controller import Controller, CycleContext, TreePlan, TreeShape
from adaptree.core.tree import DraftStep, DraftTree
from adaptree.methods.common import LearnedRuntime, LearnedSeam

log = logging.getLogger(__name__)

def read_size_table(path: str | Path, width: int | None = None) -> dict[int, int] | None:
    """The V per depth (``size_by_depth``) of a static_gs.json, None when it has none (written before the tables, or
    by ``adaptree tune-static``) or when it was searched for another beam width than ``width`` (a warning)."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
        table = obj.get("size_by_depth")
        if table is None:
            return None
        out = {int(d): int(v) for d, v in table.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a static_gs.json with a size_by_depth table ({e})") from None
    if not out or min(out) < 1 or min(out.values()) < 1:
        raise ValueError(f"{path}: size_by_depth needs depths and V >= 1, got {table}")
    if width is not None and "width" in obj and int(obj["width"]) != int(width):
        log.warning("%s: its V table is for W=%s, RADAR runs W=%d: not used", path, obj["width"], width)
        return None
    return out


@dataclass
class RadarConfig(LearnedRuntime, TreeShape):
    """RADAR's inference settings (tree shape from EAGLE-3, paper §3.1)."""

    width: int = 10
    """Beam width W; must equal the policy's input width."""
    depth: int | None = None
    """Maximum draft depth (draft forwards per cycle); None = the policy's D_max."""
    size: int | None = None
    """V at every depth; None = the machine's V for the depth the cycle stopped at (``tuned``'s table), else the
    policy's own table (policies trained with one), else 60 (EAGLE-3's)."""
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

    def __post_init__(self) -> None:
        if self.tuned is not None and not Path(self.tuned).is_file():
            raise FileNotFoundError(f"RADAR's V table {self.tuned!r} (a static_gs.json) does not exist")
        super().__post_init__()


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
        table = None
        if cfg.size is None:
            table = read_size_table(cfg.tuned, cfg.width) if cfg.tuned else None
            if table is None and pc.size_table:
                table = dict(enumerate(pc.reference_sizes, start=1))
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.hc = None
        self.last_p_stop = float("nan")
        self.costs = (policy.costs_tensor(None) if pc.cost_features and pc.reference_costs is not None
                      and not pc.tree_features else None)
        self.observes = pc.match_features
        self.start_runtime(cfg, chain_calibration, self.observes)
        if pc.tree_features and pc.reference_costs is not None and self.machine_tree is not None:
            self.costs = policy.costs_tensor(policy.machine_values(pc.reference_costs, self.machine_tree))  # no latency
        self.match: list[float] | None = None
        self.use_sizes(table)
        self.load_latency(cfg)

    def use_sizes(self, table: dict[int, int] | None) -> None:
        """Verify ``table[d]`` nodes in a cycle that stopped at depth ``d`` (None: the plan's V at every depth); a
        depth the table lacks takes the deepest entry above it (the shallowest entry below the table's first).
        Replays over several machines set each one's table here."""
        self.sizes = None if table is None else {int(d): int(v) for d, v in table.items()}
        if self.sizes is not None and (not self.sizes or min(self.sizes.values()) < 1):
            raise ValueError(f"a V table needs V >= 1 at every depth, got {table}")
        # the AR gate prices a probe at the smallest tree: depth 1 with its V (with a fixed V: V at any depth)
        self.smallest = (self.plan.width, self.size_at(1), self.plan.max_depth)

    def size_at(self, depth: int) -> int:
        """V of a cycle that stopped at ``depth`` (the engine clamps it to the candidates and the room)."""
        t = self.sizes
        if t is None:
            return self.plan.size
        if depth in t:
            return t[depth]
        below = [d for d in t if d <= depth]
        return t[max(below)] if below else t[min(t)]

    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        return self.size_at(tree.depth)

    def use_latency(self, latency) -> None:
        super().use_latency(latency)  # first: a latency model that carries a machine tree sets it
        if self.policy.config.cost_features:
            from adaptree.offline.family import cost_features

            costs = cost_features(latency, self.config.width)
            tree = self.require_tree() if self.policy.config.tree_features else None
            self.costs = self.policy.costs_tensor(self.policy.machine_values(costs, tree))

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
