"""``hybrid``: the head's tree and a context chain in one verification, both sized per cycle by the cost rule.

Training-free. It is :mod:`~adaptree.methods.costaware`'s renewal-reward (Dinkelbach) rule over a larger
choice: besides the head tree's depth and V, how many tokens of the context's longest earlier match
(:class:`~adaptree.core.context.ContextIndex`) to verify as one more path under the same root.

**Values.** A verified node adds its probability of lying on the accepted path to the expected emitted tokens
(at most one path is accepted, so ``E[emitted] = 1 + sum over verified nodes of P(node accepted)``, whatever
the tree). Head candidate ``i``: ``p_i`` from the acceptance calibration of its path score, as in costaware.
Chain token ``t``: ``c_t`` = P(the chain's first ``t`` tokens accepted), from the
:class:`~adaptree.methods.common.chain.ChainCalibration` of the match's length at the cycle's sampling temperature.
A chain's first ``s`` tokens may already be head candidates (the same tokens down the same path): in the tree they
are one node each, valued and paid once, as head nodes.

**Decisions.** ``lambda`` = the running throughput estimate (costaware's), ``verify(n)`` = this machine's
modelled verification seconds for ``n`` nodes at this context length.

* ``begin_cycle``: costaware's plan (a tree, or an AR step in AR mode), with the match's continuation (up to
  ``chain_tokens``) as the plan's chain. In AR mode the chain alone is weighed:
  ``k* = argmax_k C(k) - lambda * verify(k)`` with ``C(k) = sum_{t <= k} c_t`` (``k = 0``: a plain AR step).
* ``continue_drafting``: costaware's (the head's levels alone).
* ``choose_size`` and ``choose_chain`` together: over ``V`` (head nodes, top-V by score) and ``k`` (chain
  tokens), maximise ``G(V) + C(max(k, s_V)) - C(s_V) - lambda * verify(V + max(0, k - s_V))``, where
  ``G(V) = sum_{top V} p`` and ``s_V`` = the chain tokens that are among the top-V head nodes.
* AR mode (costaware's probes and moving average) is driven by the head's *marginal* advantage: the best joint
  value minus the best chain-alone value minus the drafting seconds' worth: the head is drafted while it adds
  more than it costs on top of what the context already offers.

Per cycle this adds a match lookup (O(max_ngram)), a walk of at most ``chain_tokens`` levels of the head's
candidates and a ``[V + 1, k + 1]`` array. Decisions depend on the inputs and modelled costs only: replay
makes the live engine's decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaptree.core.context import MAX_MATCH, ContextIndex
from adaptree.core.controller import AR_PLAN, CycleContext, TreePlan
from adaptree.core.tree import DraftTree
from adaptree.methods.common import ChainCalibration, price_split
from adaptree.methods.costaware.acceptance import AcceptanceCalibration
from adaptree.methods.costaware.controller import CostAwareConfig, CostAwareController, _load
from adaptree.offline.latency import LatencyModel


@dataclass
class HybridConfig(CostAwareConfig):
    """Cost-aware head tree plus a context chain, both sized per cycle (training-free)."""

    chain: str | None = None
    """Chain calibration JSON of this model (ChainCalibration.fit on greedy traces, combined with fit_sampled's rates at
    T=1; the machine setup makes one)."""
    chain_tokens: int = 16
    """Longest context chain proposed per cycle."""
    max_n: int = 4
    """Longest n-gram the context index matches (the chain calibration must have been fitted with the same)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("chain_tokens", "max_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_n > MAX_MATCH:
            raise ValueError(f"max_n must be <= {MAX_MATCH} (the context index's longest match), got {self.max_n}")


class HybridController(CostAwareController):
    """Costaware's rule over the head's tree and a context chain (module docstring)."""

    name = "hybrid"

    def __init__(self, config: HybridConfig | None = None, latency_model: LatencyModel | None = None,
                 calibration: AcceptanceCalibration | None = None,
                 chain_calibration: ChainCalibration | None = None) -> None:
        cfg = config or HybridConfig()
        super().__init__(cfg, latency_model, calibration)
        self.chain_cal = chain_calibration if chain_calibration is not None else _load(
            cfg.chain, "chain calibration", "chain",
            "fit one with adaptree.methods.common.ChainCalibration.fit(traces).save(PATH)", ChainCalibration.load,
            self.name)
        if self.chain_cal.max_ngram != cfg.max_n:
            raise ValueError(f"the chain calibration was fitted with max_ngram {self.chain_cal.max_ngram}, the "
                             f"method matches up to max_n {cfg.max_n}: refit it or set max_n")
        self._sizes = np.arange(cfg.max_size + cfg.chain_tokens + 1)  # verify costs up to V + a whole chain
        self.config: HybridConfig = cfg

    def context_index(self) -> ContextIndex:
        return self.chain_cal.index()

    def reset(self) -> None:
        super().reset()
        self.chain_p = np.zeros(0)
        self.k_star = 0

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        plan = super().begin_cycle(ctx)
        m = ctx.index.match(self.config.chain_tokens, 1)
        self.chain_p = self.chain_cal.probs(m, temperature=ctx.temperature)
        self.gain_c = np.concatenate([[0.0], np.cumsum(self.chain_p)])  # C(k), k = 0..K
        if m is None:
            self.k_star = 0
            return plan
        chain_alone = self.gain_c - self.cost[:self.gain_c.size]  # V = 0: k chain nodes, k = 0..K
        self.chain_alone = float(chain_alone.max())
        if plan is AR_PLAN:
            self.k_star = int(np.argmax(chain_alone))
            return AR_PLAN.with_chain(m.tokens[:self.k_star])
        self.k_star = len(m.tokens)
        return plan.with_chain(m.tokens)

    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        if not plan.chain:
            return super().choose_size(tree, plan)
        limit = min(plan.size, self.config.max_size)
        split = price_split(tree, plan.chain, self.gain_c, self.calibration, limit, self.cost)
        self.k_star = split.chain
        adv = split.value - self.chain_alone - self.rate * tree.depth * self.step_s  # the head's gain on the chain's
        self._drafted(split.size, 1.0 + split.gain, adv)
        return split.size

    def choose_chain(self, tree: DraftTree | None, plan: TreePlan, size: int) -> int:
        return self.k_star


__all__ = ["HybridConfig", "HybridController"]
