"""SVIP, Self-VerIfication length Policy (Zhang et al. 2024), on EAGLE-3's tree (LTD Appendix A.1).

SVIP bounds the acceptance rate of a draft token from below by the entropy ``H`` (nats) of the draft
distribution it was drawn from: with the target/draft cross-entropy approximated by a constant multiple
of the draft entropy, the bound reads :math:`\\hat\\alpha = 1 - \\sqrt{\\gamma H}`. Drafting stops as soon as
this estimate says the token just drafted is likely to be rejected.

Exact rule implemented here: after the draft forward of depth ``d``, let :math:`H_d` be the entropy of
the distribution the *best beam node* (highest cumulative log-prob at depth ``d``, the node a chain
drafter would have drafted) was drawn from — the root's distribution at depth 1, its parent's afterwards.
Stop drafting iff

.. math:: \\sqrt{\\gamma \\, H_d} > h, \\qquad \\gamma = \\text{entropy\\_factor} = 0.15,\\;
          h = \\text{min\\_entropy} = 0.3,

i.e. iff :math:`H_d > h^2/\\gamma` (0.6 nats with the defaults) — the estimated acceptance
:math:`1 - \\sqrt{\\gamma H_d}` is below :math:`1 - h` = 0.7 — or at the maximum depth (12, LTD's setting).

**Interpretation, stated plainly:** LTD's appendix gives only "entropy factor 0.15, minimum entropy 0.3"
(the values of SVIP's release) and not the formula; the SVIP paper's bound :math:`1 - \\sqrt{\\gamma H}`
is the one above, but we could not check offline how the release combines the two numbers. We read
the entropy factor as :math:`\\gamma` and the "minimum entropy" as the threshold :math:`h` on
:math:`\\sqrt{\\gamma H}`; both are configurable, and ``entropy_source="beam_min"`` uses the most
confident beam node's distribution instead of the best node's. The entropies are computed from
log-probs the tree already holds (:attr:`DraftStep.entropy`), only when this controller asks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from adaptree.core.config import between, choice
from adaptree.core.controller import StaticController, TreeShape
from adaptree.core.tree import DraftStep

SOURCES = ("best", "beam_min")


@dataclass
class SVIPConfig(TreeShape):
    """SVIP's hyperparameters as LTD ran it (entropy factor 0.15, minimum entropy 0.3)."""

    depth: int = 12
    """Maximum draft depth (LTD: 12 for the dynamic-depth baselines)."""
    entropy_factor: float = between(0.0, math.inf, 0.15, lo_open=True, hi_open=True)
    """gamma: the cross-entropy / draft-entropy factor in SVIP's bound 1 - sqrt(gamma * H)."""
    min_entropy: float = between(0.0, 1.0, 0.3, lo_open=True, hi_open=True)
    """h: stop once sqrt(gamma * H_d) exceeds it (estimated acceptance below 1 - h)."""
    entropy_source: str = choice(SOURCES, "best")
    """Whose distribution gives H_d: best (the best beam node's) or beam_min (the lowest over the beam)."""

    @property
    def entropy_threshold(self) -> float:
        """The draft entropy (nats) above which drafting stops: h^2 / gamma."""
        return self.min_entropy ** 2 / self.entropy_factor


class SVIPController(StaticController):
    """SVIP's entropy stop rule on the best beam node (see the module docstring)."""

    name = "svip"
    config_class = SVIPConfig

    def should_stop(self, entropy: float) -> bool:
        """The rule on one draft entropy H_d (nats)."""
        cfg = self.config
        return math.sqrt(cfg.entropy_factor * max(entropy, 0.0)) > cfg.min_entropy

    def step_entropy(self, step: DraftStep) -> float:
        ent = step.beam_entropy
        return float(ent[0] if self.config.entropy_source == "best" else ent.min())

    def continue_drafting(self, step: DraftStep) -> bool:
        return not self.should_stop(self.step_entropy(step))
