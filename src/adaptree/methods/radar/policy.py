"""RADAR's prediction model (SPEC.md §4): an LSTM over the per-step beam scores, then an MLP on
``[lstm_out ; state]`` giving two logits, index 0 = STOP and 1 = CONTINUE.

Input at draft step ``t`` (after ``t`` draft forwards, ``t = 1 .. D_max - 1``): the top-W cumulative
log-probs of the beam (the paper's top-k confidence scores, descending), clamped below at
``score_floor`` so that an (almost) impossible path stays a finite number. ``state`` = that same score
vector plus, with ``step_feature``, the step index ``t / D_max`` (the paper feeds the scores to the LSTM;
which extra inputs its MLP sees is not printed: our choice, documented in docs/radar.md). The LSTM
state is reset at every cycle. Files: a folder with ``config.json`` (:class:`RadarModelConfig`, unknown
fields refused) and ``model.safetensors`` (loaded strictly: a missing, unexpected or mis-shaped tensor
is an error that names it): the folder format of :mod:`adaptree.offline.policy`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from adaptree.methods.common import MATCH_FEATURES, match_values
from adaptree.methods.common.machine_tree import static_features
from adaptree.offline.family import COST_FEATURES, check_costs, costs_or_reference
from adaptree.offline.policy import load_policy, save_policy
from adaptree.offline.runs import dataclass_from_dict

STOP, CONTINUE = 0, 1


@dataclass
class RadarModelConfig:
    """Shape of the prediction model (paper: LSTM hidden 128, one layer)."""

    width: int = 10
    """W: beam scores per step (the tree's beam width; the controller refuses another W)."""
    max_depth: int = 8
    """D_max the model was trained for (most draft forwards per cycle); the controller's default depth."""
    hidden: int = 128
    """LSTM hidden size (paper: 128)."""
    layers: int = 1
    """LSTM layers (paper: 1)."""
    mlp_hidden: int = 128
    """Width of the MLP's hidden layer."""
    dropout: float = 0.1
    """Dropout in the MLP during training (paper: 0.1)."""
    score_floor: float = -30.0
    """Cumulative log-probs below this are clamped to it (finite inputs)."""
    step_feature: bool = True
    """Append t / D_max to the MLP's state input."""
    cost_features: bool = False
    """Append the machine's cost features (adaptree.offline.family.COST_FEATURES) to the MLP's state input."""
    reference_costs: list[float] | None = None
    """The cost features assumed when no latency model is given (the training family's median)."""
    match_features: bool = False
    """Append the cycle's context-match features (adaptree.methods.common.MATCH_FEATURES) to the MLP's state
    input, after the costs."""
    tree_features: bool = False
    """With cost_features: the costs are followed by the machine's static tree, its depth / max_depth and log2 of
    its V / 8 (adaptree.methods.common.machine_tree): where this machine's best fixed tree stops (no reference: the
    machine setup's static_gs.json must give it)."""
    size_table: bool = False
    """Trained with every stop point verifying the machine's V for its depth (a V table: the machine setup's
    ``size_by_depth``, adaptree.offline.oracle.sizes_by_depth); False: EAGLE-3's V = 60 at every depth."""
    reference_sizes: list[int] | None = None
    """With size_table: the V per depth (index d - 1) assumed when the machine gives no table (the lower median of
    the tables of the machines it was validated on)."""

    def __post_init__(self) -> None:
        for name in ("width", "max_depth", "hidden", "layers", "mlp_hidden"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_depth < 2:
            raise ValueError(f"max_depth must be >= 2 (at least one stop/continue decision), got {self.max_depth}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.score_floor < 0.0:
            raise ValueError(f"score_floor must be < 0, got {self.score_floor}")
        self.reference_costs = check_costs(self.reference_costs)
        if self.tree_features and not self.cost_features:
            raise ValueError("tree_features come after the cost features: they need cost_features")
        if self.reference_sizes is not None:
            self.reference_sizes = [int(v) for v in self.reference_sizes]
            if len(self.reference_sizes) != self.max_depth or min(self.reference_sizes) < 1:
                raise ValueError(f"reference_sizes needs one V >= 1 per depth 1..{self.max_depth}, got "
                                 f"{self.reference_sizes}")
        if self.size_table and self.reference_sizes is None:
            raise ValueError("a policy trained with a V table (size_table) needs its reference_sizes")

    @property
    def n_costs(self) -> int:
        return (len(COST_FEATURES) + (2 if self.tree_features else 0)) if self.cost_features else 0

    @property
    def n_match(self) -> int:
        return len(MATCH_FEATURES) if self.match_features else 0

    @classmethod
    def from_dict(cls, d: dict) -> "RadarModelConfig":
        config = dataclass_from_dict(cls, d, "RADAR model", allowed=("kind", "version"))
        if d.get("kind", "radar") != "radar":
            raise ValueError(f"config kind {d.get('kind')!r} is not a RADAR policy")
        return config


class RadarPolicy(nn.Module):
    """LSTM + MLP stop/continue predictor."""

    def __init__(self, config: RadarModelConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or RadarModelConfig()
        self.lstm = nn.LSTM(c.width, c.hidden, num_layers=c.layers, batch_first=True)
        state = c.width + (1 if c.step_feature else 0) + c.n_costs + c.n_match
        self.mlp = nn.Sequential(nn.Linear(c.hidden + state, c.mlp_hidden), nn.ReLU(), nn.Dropout(c.dropout),
                                 nn.Linear(c.mlp_hidden, 2))

    def costs_tensor(self, costs) -> torch.Tensor:
        """The cost features as a tensor (``[C]`` or ``[B, C]``; the reference costs when None); empty when the
        policy does not use them."""
        c = self.config
        if not c.cost_features:
            return torch.zeros(0)
        if c.tree_features:  # costs then the machine tree's two numbers: no reference stands in for the tree
            if costs is None:
                raise ValueError("this RADAR policy observes the machine's static tree: give it a latency model and "
                                 "the machine setup's static_gs.json (--radar-latency, --radar-tuned)")
            return torch.as_tensor(costs, dtype=torch.float32)
        return torch.as_tensor(costs_or_reference(costs, c.reference_costs, "radar"), dtype=torch.float32)

    def machine_values(self, costs: list[float], tree) -> list[float]:
        """The cost input of a machine: its cost features, then (``tree_features``) its static tree's depth /
        max_depth and log2 of its V / 8."""
        if not self.config.tree_features:
            return list(costs)
        return [*costs, *static_features(tree.depth, tree.size, self.config.max_depth)]

    def match_tensor(self, match) -> torch.Tensor:
        """The match features as a tensor (``[M]`` or ``[B, M]``); empty when the policy does not use them."""
        if not self.config.match_features:
            return torch.zeros(0)
        if isinstance(match, torch.Tensor) and match.dim() == 2:
            if match.shape[-1] != len(MATCH_FEATURES):
                raise ValueError(f"match features [B, {len(MATCH_FEATURES)}] expected, got {list(match.shape)}")
            return match.float()
        return torch.tensor(match_values(None if match is None else list(match), "RADAR"), dtype=torch.float32)

    def _inputs(self, scores: torch.Tensor, steps: torch.Tensor, costs=None,
                match=None) -> tuple[torch.Tensor, torch.Tensor]:
        x = scores.float().clamp(min=self.config.score_floor)
        x = torch.nan_to_num(x, nan=self.config.score_floor)
        parts = [x]
        if self.config.step_feature:
            parts.append((steps.float() / self.config.max_depth)[..., None].expand(*x.shape[:-1], 1))
        for on, k in ((self.config.cost_features, lambda: self.costs_tensor(costs)),
                      (self.config.match_features, lambda: self.match_tensor(match))):
            if on:
                k = k()
                k = k[:, None, :] if k.dim() == 2 else k[None, None, :]
                parts.append(k.expand(*x.shape[:-1], k.shape[-1]))
        return x, torch.cat(parts, -1)

    def forward(self, scores: torch.Tensor, costs=None, match=None) -> torch.Tensor:
        """``scores [B, T, W]`` (steps 1..T of a cycle), the cost features (``[C]``, ``[B, C]`` or None: the
        reference ones) and the match features (``[M]`` or ``[B, M]``, for a policy that uses them) -> logits
        ``[B, T, 2]`` (LSTM from a zero state)."""
        b, t, _ = scores.shape
        steps = torch.arange(1, t + 1, device=scores.device).expand(b, t)
        x, state = self._inputs(scores, steps, costs, match)
        out, _ = self.lstm(x)
        return self.mlp(torch.cat([out, state], dim=-1))

    def step(self, scores: torch.Tensor, step: int, hc: tuple[torch.Tensor, torch.Tensor] | None = None,
             costs: torch.Tensor | None = None,
             match=None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One decision: ``scores [W]`` at draft step ``step`` (1-based), the LSTM state (None at the start of a
        cycle), the cost features (:meth:`costs_tensor`) and the match features -> logits ``[2]`` and the new state.
        Same numbers as :meth:`forward` (one LSTM cell by hand for a one-layer model: ~4x less call overhead than
        ``nn.LSTM`` on one position)."""
        c = self.config
        x = torch.nan_to_num(scores.float(), nan=c.score_floor).clamp(min=c.score_floor)
        state = torch.cat([x, x.new_tensor([step / c.max_depth])]) if c.step_feature else x
        if c.cost_features:
            state = torch.cat([state, costs if costs is not None else self.costs_tensor(None)])
        if c.match_features:
            state = torch.cat([state, self.match_tensor(match)])
        if c.layers == 1:
            if hc is None:
                z = x.new_zeros(1, c.hidden)
                hc = (z, z)
            h, cell = torch.lstm_cell(x[None], hc, self.lstm.weight_ih_l0, self.lstm.weight_hh_l0,
                                      self.lstm.bias_ih_l0, self.lstm.bias_hh_l0)
            out, hc = h[0], (h, cell)
        else:
            o, hc = self.lstm(x[None, None], hc)
            out = o[0, 0]
        return self.mlp(torch.cat([out, state])), hc

    # ---- files ------------------------------------------------------------------------------------

    def save(self, folder: str | os.PathLike, extra: dict | None = None) -> Path:
        """Write ``config.json`` (config + ``extra`` under ``training``) and ``model.safetensors``."""
        return save_policy(folder, self, {"kind": "radar", "version": 1, **asdict(self.config)}, extra,
                           sort_keys=True)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "RadarPolicy":
        """Load a folder written by :meth:`save`, strictly (see the module docstring)."""
        return load_policy(folder, lambda d: cls(RadarModelConfig.from_dict(
            {k: v for k, v in d.items() if k != "training"})), "RADAR policy")

