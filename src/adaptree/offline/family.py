"""What a machine charges, as policy inputs, and families of latency models to train policies over.

A learned controller that never sees the hardware can only be right on the machine it was trained on: the
best depth and V move by 10x between a CPU with native bfloat16 and one without. Two pieces make a policy
transfer:

* :func:`cost_features` — a handful of dimensionless numbers read off a :class:`~.latency.LatencyModel`, all
  relative to one autoregressive step on the same machine: the draft step, the verification's growth at
  V = 4, 16 and 64 (log ratios), the per-cycle overhead. A policy that takes them as inputs (LTD's
  ``use_costs``, RADAR's ``cost_features``) is told at inference what *this* machine's calibration measured.
* :class:`LatencyFamily` — measured latency models (``bases``) and log-uniform perturbations of them (the
  draft step, the verification's growth over one row and the overhead each scaled by a factor in
  ``[1/spread, spread]``). Training samples one member per generation (the simulator's rewards and the cost
  features come from the same member), so the policy learns how the best tree moves with the costs instead of
  one machine's answer.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adaptree.offline.latency import LatencyModel

COST_FEATURES = ("draft_step/ar", "log verify(4)/verify(0)", "log verify(16)/verify(0)", "log verify(64)/verify(0)",
                 "other/ar")
"""Names of :func:`cost_features`' entries, in order."""

COST_CONTEXT = 256
"""Context length the cost features are read at (the policies see the actual length as a feature of its own)."""


def cost_features(model: LatencyModel, width: int = 10, context_len: int = COST_CONTEXT) -> list[float]:
    """The machine as a policy sees it: see :data:`COST_FEATURES` (all relative to this machine's own
    autoregressive step ``verify(0) + other_s``, so a uniformly faster machine has the same features)."""
    L = int(context_len)
    v0 = max(model.verify_time(0, L), 1e-9)
    ar = v0 + model.other_s  # one AR step (verify(0) kept away from 0 for the ratios)
    growth = [float(np.log(max(model.verify_time(v, L), v0) / v0)) for v in (4, 16, 64)]
    return [model.draft_step(width, L) / ar, *growth, model.other_s / ar]


def check_costs(values: Sequence[float] | None) -> list[float] | None:
    """Reference cost features as stored in a policy's config: None, or one float per :data:`COST_FEATURES` (a
    ValueError names the values otherwise)."""
    if values is None:
        return None
    out = [float(x) for x in values]
    if len(out) != len(COST_FEATURES):
        raise ValueError(f"reference_costs needs {len(COST_FEATURES)} values {COST_FEATURES}, got {out}")
    return out


def costs_or_reference(costs, reference: list[float] | None, method: str):
    """The cost features a policy runs on: ``costs`` (this machine's), else its ``reference`` ones; a ValueError
    naming the flag when it has neither."""
    if costs is not None:
        return costs
    if reference is None:
        raise ValueError(f"this {method.upper()} policy sees the machine's costs: give it a latency model (the "
                         f"machine setup's, or --{method}-latency PATH)")
    return reference


def scaled(model: LatencyModel, draft: float = 1.0, verify: float = 1.0, other: float = 1.0) -> LatencyModel:
    """``model`` with the draft step times ``draft``, the verification's growth over one row (``verify(V) -
    verify(0)``) times ``verify`` and the per-cycle overhead times ``other`` (one row's cost kept)."""
    if min(draft, verify, other) <= 0:
        raise ValueError(f"scale factors must be > 0, got draft={draft}, verify={verify}, other={other}")
    b = list(model.verify)
    if model.verify_knots is None:  # b0 + b1 N + b2 L + b3 N L: growth over N = 1 is (b1 + b3 L)(N - 1)
        b = [b[0] + (1 - verify) * b[1], verify * b[1], b[2] + (1 - verify) * b[3], verify * b[3]]
    else:  # per knot (intercept, slope in L): each knot's excess over the first scaled
        c = np.asarray(b, np.float64).reshape(-1, 2)
        b = (c[0] + verify * (c - c[0])).reshape(-1).tolist()
    meta = {**model.meta, "scaled": {"draft": draft, "verify": verify, "other": other}}
    return LatencyModel([x * draft for x in model.draft], b, model.other_s * other, meta, model.verify_knots)


@dataclass
class LatencyFamily:
    """Measured latency models and log-uniform perturbations of them (see the module docstring)."""

    bases: list[LatencyModel]
    spread: float = 1.0
    """Each of the draft step, the verification's growth and the overhead is scaled by a factor drawn
    log-uniformly from ``[1/spread, spread]`` (1 = the measured models only)."""
    names: list[str] | None = None
    """A label per base (file names), for summaries."""

    def __post_init__(self) -> None:
        if not self.bases:
            raise ValueError("a latency family needs at least one measured latency model")
        if not self.spread >= 1.0:
            raise ValueError(f"spread must be >= 1 (1 = no perturbation), got {self.spread}")
        self.names = list(self.names or [f"base{i}" for i in range(len(self.bases))])

    @classmethod
    def from_files(cls, paths: Sequence[str | os.PathLike], spread: float = 1.0) -> "LatencyFamily":
        return cls([LatencyModel.load(p) for p in paths], spread, [_label(p) for p in paths])

    def sample(self, rng: np.random.Generator) -> LatencyModel:
        base = self.bases[int(rng.integers(len(self.bases)))]
        if self.spread == 1.0:
            return base
        f = np.exp(rng.uniform(-np.log(self.spread), np.log(self.spread), size=3))
        return scaled(base, *map(float, f))

    def describe(self) -> dict:
        """The family as a summary records it: the bases' names and cost features, the spread."""
        return {"spread": self.spread, "bases": {n: [round(x, 4) for x in cost_features(m)]
                                                 for n, m in zip(self.names, self.bases)},
                "cost_features": list(COST_FEATURES)}

    def reference_costs(self) -> list[float]:
        """The per-feature median over the bases: the costs a policy assumes when it is given no latency model."""
        return np.median(np.array([cost_features(m) for m in self.bases]), axis=0).round(6).tolist()


def _label(path: str | os.PathLike) -> str:
    p = Path(path)
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name
