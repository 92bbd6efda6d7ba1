"""Hybrid drafting (training-free): the head's tree and the context's longest earlier match, as one more chain
under the same root, verified together; the head tree's depth and size and the chain's length chosen per cycle
by costaware's expected-tokens-per-modelled-second rule.

- :mod:`.controller`: :class:`HybridConfig`, :class:`HybridController`

The chain values come from a :class:`~adaptree.methods.common.chain.ChainCalibration` (per match length and
temperature, how often each chain token is accepted), which the learned methods' chains share
(:mod:`adaptree.methods.common`).
"""

from adaptree.methods.hybrid.controller import HybridConfig, HybridController

__all__ = ["HybridConfig", "HybridController"]
