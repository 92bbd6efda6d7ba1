"""The cost rule's decisions as functions: what :mod:`adaptree.methods.costaware` and :mod:`adaptree.methods.hybrid`
decide each cycle, and what a learned method's RULE actions defer to (:meth:`~.chain.ChainRule.priced_size`,
:meth:`~.chain.ChainRule.priced_continue`), written once so that a policy that picks the rule makes the rule's
decision.

The values are the renewal-reward ones of :mod:`adaptree.methods.costaware.controller`: a verified node adds its
probability of lying on the accepted path to the expected emitted tokens, and costs the throughput ``lambda`` times
the seconds it adds (``cost[n]`` = ``lambda`` x the verification seconds of ``n`` nodes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MAX_SIZE = 60
"""The rule's largest V (costaware's and hybrid's ``max_size``, EAGLE-3's V)."""


def top_probs(tree, limit: int, calibration) -> np.ndarray:
    """Calibrated acceptance probabilities of ``tree``'s top-``limit`` candidates by score, descending."""
    scores = tree.candidate_scores()
    k = min(int(limit), scores.numel())
    if k <= 0:
        return np.zeros(0)
    return calibration(torch.topk(scores, k, sorted=True).values)


def best_size(p: np.ndarray, cost: np.ndarray) -> tuple[int, float]:
    """(V*, value) of ``max_V sum_{top V} p - cost[V]`` for ``p`` sorted descending (the smallest V on ties)."""
    gain = np.zeros(p.size + 1)
    np.cumsum(p, out=gain[1:])
    value = gain - cost[:gain.size]
    v = int(np.argmax(value))
    return v, float(value[v])


def level_pays(step, calibration, child_rates: np.ndarray, limit: int, cost: np.ndarray, step_cost: float) -> bool:
    """Costaware's one-step look-ahead after the draft forward ``step``: does the next level pay? Its children are
    predicted (child rank ``k`` of beam node ``b``: ``p_b * child_rates[k]``) and merged with the tree's top-``limit``
    candidates; True iff the best value gains more than ``step_cost`` (``lambda`` x one draft step)."""
    cur = top_probs(step.tree, limit, calibration)
    _, now = best_size(cur, cost)
    children = np.outer(calibration(step.beam_scores), child_rates[:step.width]).reshape(-1)
    merged = np.sort(np.concatenate([cur, children]))[::-1][:limit]
    _, then = best_size(merged, cost)
    return then - now > step_cost


def shared_ranks(tree, chain: Sequence[int], order: torch.Tensor) -> np.ndarray:
    """Ranks (in the top-V order ``order`` of ``tree``'s candidates) of the head candidates on ``chain``'s path,
    from the root down, as long as the chain follows the head's candidates: the chain's first ``s`` tokens are
    already among the top-V nodes for every ``V`` above the first ``s`` ranks."""
    tokens, parents = tree.candidate_tokens(), tree.candidate_parents()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    out, cur = [], -1
    for t in chain:
        hit = ((parents == cur) & (tokens == int(t))).nonzero()
        if hit.numel() == 0:
            break
        cur = int(hit[0, 0])
        out.append(int(rank[cur]))
    return np.asarray(out, np.int64)


@dataclass(frozen=True)
class Split:
    """One cycle's priced division of the verified nodes (:func:`price_split`)."""

    size: int
    """V: the head's top-V candidates."""
    chain: int
    """k: the chain's first k tokens (its first ``shared`` are among the top V)."""
    shared: int
    """s_V: the chain's first tokens that are top-V head nodes (one node each, counted once)."""
    gain: float
    """Expected accepted tokens of the verified nodes, G(V) + C(k) - C(s_V) (the bonus token apart)."""
    value: float
    """gain - cost[V + k - s_V]: what the split maximises."""


def price_split(tree, chain: Sequence[int], chain_gain: np.ndarray, calibration, limit: int,
                cost: np.ndarray) -> Split:
    """The hybrid rule's joint choice (:mod:`adaptree.methods.hybrid.controller`): over V (the top-V head candidates
    by score, ``V <= limit``) and k (``chain``'s first k tokens, ``k < chain_gain.size``), the pair maximising
    ``G(V) + C(max(k, s_V)) - C(s_V) - cost[V + max(0, k - s_V)]``; ``G(V)`` = the ``calibration``'s acceptance
    probabilities of the top V summed, ``C`` = ``chain_gain`` (C(0) = 0); ``cost`` has at least
    ``limit + chain_gain.size`` entries. The first maximum on ties."""
    scores = tree.candidate_scores()
    order = torch.sort(scores, descending=True, stable=True).indices  # the engine's top-V order
    k_v = min(int(limit), scores.numel())
    p = calibration(scores[order[:k_v]]) if k_v else np.zeros(0)
    gain_h = np.concatenate([[0.0], np.cumsum(p)])  # G(V), V = 0..k_v
    shared = shared_ranks(tree, chain, order) if len(chain) else np.zeros(0, np.int64)
    v_all = np.arange(k_v + 1)
    s_v = (shared[None, :] < v_all[:, None]).sum(1) if shared.size else np.zeros(k_v + 1, np.int64)
    kk = np.maximum(np.arange(chain_gain.size)[None, :], s_v[:, None])  # a chain shorter than the shared part adds 0
    added = kk - s_v[:, None]
    gain = gain_h[:, None] + chain_gain[kk] - chain_gain[s_v][:, None]
    value = gain - cost[v_all[:, None] + added]
    v, k = np.unravel_index(int(np.argmax(value)), value.shape)
    return Split(int(v), int(kk[v, k]), int(s_v[v]), float(gain[v, k]), float(value[v, k]))


__all__ = ["MAX_SIZE", "Split", "best_size", "level_pays", "price_split", "shared_ranks", "top_probs"]
