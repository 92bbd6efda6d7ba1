"""DDD, Dynamic Depth Decoding (Brown et al. 2024), as LTD ran it (LTD Appendix A.1, SPEC.md §2).

Rule: after the draft forward of depth ``d``, if ``d`` is one of ``check_depths`` (5, 7, 9) and the
confidence heuristic ``H_d`` is below ``threshold`` (-0.3), stop drafting; otherwise go on, up to the
maximum depth (12, LTD's setting for every dynamic-depth baseline). Between checks nothing is looked
at, so a heuristic that dips below the threshold at an unchecked depth and recovers by the next
checked one does not stop the tree.

``H_d`` is a cumulative log-probability of the current beam (the depth-``d`` frontier):

* ``"logsumexp"`` (default): :math:`H_d = \\log \\sum_{i<W} \\exp(\\text{score}_i)`, the log of the total
  probability of the beam's paths — DDD's published heuristic (Brown et al. 2024, "log of the sum of
  the exponentiated beam log-prob sums").
* ``"best"``: the best path's cumulative log-prob, ``score_0`` — SPEC.md's one-line summary of LTD's
  appendix ("the cumulative log-prob of the best path").

Both are "cumulative log-probabilities" in LTD's wording; ``logsumexp >= best``, so ``best`` stops
earlier. The tree is EAGLE-3's (W=10, V=60).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptree.core.config import bounded, choice
from adaptree.core.controller import MAX_DEPTH, StaticController, TreeShape, comma_list
from adaptree.core.tree import DraftStep

HEURISTICS = ("logsumexp", "best")


@dataclass
class DDDConfig(TreeShape):
    """DDD's hyperparameters as LTD ran it (threshold -0.3 checked after depths 5, 7 and 9)."""

    depth: int = 12
    """Maximum draft depth (LTD: 12 for the dynamic-depth baselines)."""
    threshold: float = bounded(-0.3, hi=0.0)
    """Stop if the heuristic (a log-probability, <= 0) is below this at a checked depth."""
    check_depths: tuple[int, ...] = (5, 7, 9)
    """Depths after which the heuristic is checked; elsewhere drafting always goes on."""
    heuristic: str = choice(HEURISTICS, "logsumexp")
    """logsumexp (log of the beam's total path probability, DDD's) or best (the best path's log-prob)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_depths = comma_list(self.check_depths, int, "check_depths")
        bad = [d for d in self.check_depths if not 1 <= d <= MAX_DEPTH]
        if bad:
            raise ValueError(f"check_depths must be in 1..{MAX_DEPTH}, got {bad[0]} in {self.check_depths}")


class DDDController(StaticController):
    """Dynamic Depth Decoding: sparse checks of the beam's cumulative log-probability."""

    name = "ddd"
    config_class = DDDConfig

    def __init__(self, config: DDDConfig | None = None) -> None:
        super().__init__(config)
        self._checks = frozenset(self.config.check_depths)

    def heuristic(self, beam_scores: torch.Tensor) -> float:
        """``H_d`` of a beam (scores descending)."""
        if self.config.heuristic == "best":
            return float(beam_scores[0])
        return float(torch.logsumexp(beam_scores.float(), dim=0))

    def should_stop(self, depth: int, beam_scores: torch.Tensor) -> bool:
        return depth in self._checks and self.heuristic(beam_scores) < self.config.threshold

    def continue_drafting(self, step: DraftStep) -> bool:
        return not self.should_stop(step.depth, step.beam_scores)
