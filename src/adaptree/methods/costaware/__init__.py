"""Cost-aware trees (training-free): per cycle, the depth and V that maximise expected emitted tokens per modelled
second, from the draft's path scores (mapped to acceptance probabilities by a calibration fitted on greedy traces)
and this machine's latency model; an autoregressive step when no tree pays.

- :mod:`.acceptance`: :class:`AcceptanceCalibration` (isotonic map score -> acceptance probability, per-rank
  child acceptance rates; plain JSON, strict loading)
- :mod:`.controller`: :class:`CostAwareConfig`, :class:`CostAwareController` (the renewal-reward / Dinkelbach rule)
"""

from adaptree.methods.costaware.acceptance import AcceptanceCalibration
from adaptree.methods.costaware.controller import CostAwareConfig, CostAwareController

__all__ = ["AcceptanceCalibration", "CostAwareConfig", "CostAwareController"]
