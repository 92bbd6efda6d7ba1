"""Hybrid drafting (training-free): the head's tree and the context's longest earlier match, as one more chain
under the same root, verified together; the head tree's depth and size and the chain's length chosen per cycle
by costaware's expected-tokens-per-modelled-second rule.

- :mod:`.chain`: :class:`ChainCalibration` (per match length, how often each chain token is accepted; plain
  JSON, strict loading)
- :mod:`.controller`: :class:`HybridConfig`, :class:`HybridController`
"""

from adaptree.methods.hybrid.chain import ChainCalibration
from adaptree.methods.hybrid.controller import HybridConfig, HybridController

__all__ = ["ChainCalibration", "HybridConfig", "HybridController"]
