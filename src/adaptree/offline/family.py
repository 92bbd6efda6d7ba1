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
* The standard family (:func:`standard_synthetic` and the measured members, written by
  ``scripts/build_family.py`` into :data:`STANDARD_INDEX`): synthetic members that span the hardware users run,
  from CPUs where every verified node costs a large part of a step to GPUs where verification is nearly free
  (:func:`synthetic`), next to measured ones (CPU profiles, an H100 member built from its forward curve,
  :func:`from_forward_curve`). Whole regions are held out of training (:data:`HELD_OUT_BAND` and every measured
  member), so that a table over the family tests transfer, not memory.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
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
        if not 0 <= self.validation_only < len(self.bases):
            raise ValueError(f"validation_only must leave at least one base to train on, got {self.validation_only} "
                             f"of {len(self.bases)}")
        if self.validation is not None:
            self.validation = sorted({int(i) for i in self.validation})
            if not self.validation or not 0 <= self.validation[0] <= self.validation[-1] < len(self.bases):
                raise ValueError(f"validation must name bases 0..{len(self.bases) - 1}, got {self.validation}")

    validation: list[int] | None = None
    """Indices of the bases a trainer validates on (None: all of them)."""
    validation_only: int = 0
    """How many of the last bases are validated on and never drawn for training (a validation band:
    :func:`family_around`)."""

    @classmethod
    def from_files(cls, paths: Sequence[str | os.PathLike], spread: float = 1.0) -> "LatencyFamily":
        models, names, val = load_members(paths)
        return cls(models, spread, names, val)

    @property
    def validation_bases(self) -> list[LatencyModel]:
        """The bases a trainer validates on (:attr:`validation`)."""
        return self.bases if self.validation is None else [self.bases[i] for i in self.validation]

    def sample(self, rng: np.random.Generator) -> LatencyModel:
        base = self.bases[int(rng.integers(len(self.bases) - self.validation_only))]
        if self.spread == 1.0:
            return base
        f = np.exp(rng.uniform(-np.log(self.spread), np.log(self.spread), size=3))
        return scaled(base, *map(float, f))

    def describe(self) -> dict:
        """The family as a summary records it: the bases' names and cost features, the spread."""
        out = {"spread": self.spread, "bases": {n: [round(x, 4) for x in cost_features(m)]
                                                for n, m in zip(self.names, self.bases)},
               "cost_features": list(COST_FEATURES)}
        if self.validation is not None:
            out["validation"] = [self.names[i] for i in self.validation]
        if self.validation_only:
            out["validation_only"] = self.names[len(self.names) - self.validation_only:]
        return out

    def reference_costs(self) -> list[float]:
        """The per-feature median over the bases: the costs a policy assumes when it is given no latency model."""
        return np.median(np.array([cost_features(m) for m in self.bases]), axis=0).round(6).tolist()


STANDARD_INDEX = Path(__file__).with_name("machines") / "family.json"
"""The standard family's index (``scripts/build_family.py`` writes it and its members next to it)."""

HELD_OUT_BAND = (1.7, 2.6)
"""Synthetic members whose verification of 64 nodes costs this many times one row (lower bound included) are held
out of training: the region of the AMX CPU in bfloat16 (1.85x), so that no member like it is trained on."""

GRID = {"step": (0.0, 0.3, 0.8), "growth": (0.001, 0.004, 0.012, 0.03, 0.08, 0.2, 0.6),
        "draft": (0.03, 0.1, 0.3, 1.0), "other": (0.005, 0.12)}
"""The synthetic members' parameters (:func:`synthetic`): every combination."""

SYNTHETIC_KNOTS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513)


def synthetic(step: float, growth: float, draft: float, other: float, row_s: float = 0.02,
              length_growth: float = 0.3) -> LatencyModel:
    """A machine described by four numbers, relative to one target forward over one row (``row_s`` seconds at
    context 0): a verification of N = V + 1 rows costs ``row_s * (1 + step*[N > 1] + growth*(N - 1))`` (``step``:
    the jump from matrix-vector to matrix-matrix kernels a CPU shows at a few rows; ``growth``: each further row,
    from ~0 on a GPU that is far from compute-bound to 1 where a row costs a whole step), a draft step (W = 10)
    costs ``draft`` of the one-row forward, the per-cycle overhead ``other`` of it; every time grows by
    ``length_growth`` per 1000 tokens of context."""
    if min(step, growth, other) < 0 or draft <= 0 or row_s <= 0 or length_growth < 0:
        raise ValueError(f"synthetic member needs step, growth, other, length_growth >= 0 and draft, row_s > 0, got "
                         f"step={step}, growth={growth}, draft={draft}, other={other}, row_s={row_s}, "
                         f"length_growth={length_growth}")
    per_l = length_growth / 1000.0
    verify = []
    for n in SYNTHETIC_KNOTS:
        v = row_s * (1.0 + (step if n > 1 else 0.0) + growth * (n - 1))
        verify += [v, v * per_l]
    d = draft * row_s
    meta = {"synthetic": {"step": step, "growth": growth, "draft": draft, "other": other, "row_s": row_s,
                          "length_growth": length_growth}}
    return LatencyModel([d, 0.0, d * per_l, 0.0], verify, other * row_s, meta, list(SYNTHETIC_KNOTS))


def verify_ratio(model: LatencyModel, size: int = 64, context_len: int = COST_CONTEXT) -> float:
    """verify(V) / verify(0) at ``context_len``: how much a tree of ``size`` nodes costs over one row."""
    return model.verify_time(size, context_len) / max(model.verify_time(0, context_len), 1e-12)


def from_forward_curve(ms: dict, draft_ms: float, other_ms: float, meta: dict | None = None) -> LatencyModel:
    """A member from a target forward's cost curve (``{rows: milliseconds}`` at one context length) and a draft step
    and per-cycle overhead in milliseconds. Host noise only ever adds time, so each row count gets the least time
    measured at it or at any larger row count (a larger tree never costs less); no context-length term (the curve
    has one length)."""
    rows = sorted((int(k), float(v)) for k, v in ms.items())
    if len(rows) < 2 or rows[0][0] < 1:
        raise ValueError(f"a forward curve needs at least 2 row counts >= 1, got {sorted(ms)}")
    times = [min(t for _, t in rows[i:]) for i in range(len(rows))]
    verify = [x for t in times for x in (t / 1e3, 0.0)]
    return LatencyModel([draft_ms / 1e3, 0.0, 0.0, 0.0], verify, other_ms / 1e3, dict(meta or {}),
                        [n for n, _ in rows])


@dataclass
class Member:
    """One member of a family index: a name, its latency model, whether training may use it, where it came from."""

    name: str
    model: LatencyModel
    held_out: bool
    source: str
    group: str = field(default="synthetic")
    """synthetic | measured."""


def standard_synthetic() -> list[Member]:
    """The synthetic members of the standard family (:data:`GRID`), the ones in :data:`HELD_OUT_BAND` held out."""
    out = []
    for step, growth, draft, other in itertools.product(*GRID.values()):
        m = synthetic(step, growth, draft, other)
        lo, hi = HELD_OUT_BAND
        name = f"syn-s{step:g}-g{growth:g}-d{draft:g}-o{other:g}"
        out.append(Member(name, m, lo <= verify_ratio(m) < hi, "synthetic", "synthetic"))
    return out


def write_index(members: Sequence[Member], folder: str | os.PathLike) -> Path:
    """Each member's latency model as ``folder/<name>.json`` and the index ``folder/family.json`` (names, files,
    held-out marks, sources, cost features)."""
    from adaptree.offline.runs import write_json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for m in members:
        m.model.save(folder / f"{m.name}.json")
        rows.append({"name": m.name, "file": f"{m.name}.json", "held_out": m.held_out, "group": m.group,
                     "source": m.source, "cost_features": [round(x, 4) for x in cost_features(m.model)],
                     "verify64_ratio": round(verify_ratio(m.model), 4)})
    index = folder / "family.json"
    write_json({"version": 1, "cost_features": list(COST_FEATURES), "held_out_band": list(HELD_OUT_BAND),
                "members": rows}, index)
    return index


def read_index(path: str | os.PathLike = STANDARD_INDEX) -> list[Member]:
    """The members of a family index (:func:`write_index`), loaded strictly."""
    path = Path(path)
    with open(path) as f:
        d = json.load(f)
    unknown = set(d) - {"version", "cost_features", "held_out_band", "members"}
    if d.get("version") != 1 or unknown or "members" not in d:
        raise ValueError(f"{path}: not a family index (version 1 with members; unknown fields {sorted(unknown)})")
    if list(d.get("cost_features", COST_FEATURES)) != list(COST_FEATURES):
        raise ValueError(f"{path}: written for cost features {d['cost_features']}, this version has "
                         f"{list(COST_FEATURES)}")
    out = []
    for r in d["members"]:
        out.append(Member(r["name"], LatencyModel.load(path.parent / r["file"]), bool(r["held_out"]),
                          r.get("source", ""), r.get("group", "synthetic")))
    return out


def is_index(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a family index (``standard`` names :data:`STANDARD_INDEX`)."""
    return str(path) == "standard" or Path(path).name == "family.json"


VALIDATION_MEMBERS = 12
"""How many training members a trainer validates on (spread over the index's order: every grid region)."""


def in_band(model: LatencyModel, band: Sequence[float] | None) -> bool:
    """Whether ``model``'s verification of 64 nodes costs ``band[0] <= ratio < band[1]`` rows (:func:`verify_ratio`)."""
    return band is not None and band[0] <= verify_ratio(model) < band[1]


def load_members(paths: Sequence[str | os.PathLike]) -> tuple[list[LatencyModel], list[str], list[int] | None]:
    """Latency models for a family: each path a latency model JSON, or a family index (``standard`` = the shipped
    one) of which only the members not held out are taken. Returns (models, names, validation indices): with an
    index, :data:`VALIDATION_MEMBERS` of its training members spread over it; else None (validate on all)."""
    return _members(paths, None)[:3]


def _members(paths: Sequence[str | os.PathLike], band: Sequence[float] | None
             ) -> tuple[list[LatencyModel], list[str], list[int] | None, list[Member]]:
    """:func:`load_members`, the indexes' training members in ``band`` (:func:`in_band`) set apart: returned last,
    each index read once."""
    models, names, val, held = [], [], None, []
    for p in paths:
        if is_index(p):
            members = [m for m in read_index(STANDARD_INDEX if str(p) == "standard" else p) if not m.held_out]
            held += [m for m in members if in_band(m.model, band)]
            train = [m for m in members if not in_band(m.model, band)]
            if not train:
                raise ValueError(f"family index {p} has no member that is not held out")
            first = len(models)
            picks = np.linspace(0, len(train) - 1, min(VALIDATION_MEMBERS, len(train))).round().astype(int)
            val = (val or []) + [first + int(i) for i in sorted(set(picks.tolist()))]
            models += [m.model for m in train]
            names += [m.name for m in train]
        else:
            models.append(LatencyModel.load(p))
            names.append(_label(p))
    return models, names, val, held


def family_around(latency: LatencyModel, entries: Sequence[str | os.PathLike], spread: float = 1.0,
                  band: Sequence[float] | None = None) -> LatencyFamily | None:
    """A trainer's family: ``latency`` (named ``main``) first, then every entry (:func:`load_members`: a latency
    model file, or a family index whose members not held out are taken), perturbed by ``spread``; validated on
    ``latency`` and the index's validation members (on all of them without an index). None without entries and
    without a spread: the trainer runs on ``latency`` alone.

    ``band`` (a validation band, ``(lo, hi)`` verification ratios, :func:`in_band`): the indexes' training members in
    it are never trained on; the trainer validates on them too (the family's last bases, ``validation_only``), so that
    a checkpoint that only pays in the region it trained on is not chosen."""
    if not entries and spread == 1.0:
        return None
    if band is not None and not 0 < band[0] < band[1]:
        raise ValueError(f"a validation band needs 0 < lo < hi, got {list(band)}")
    models, names, val, held = _members(entries, band)
    if band is not None and not held:
        raise ValueError(f"no training member of the family lies in the validation band {list(band)}")
    n = 1 + len(models)  # members in the band (from an index: val is not None) come last
    return LatencyFamily([latency, *models, *(m.model for m in held)], spread,
                         ["main", *names, *(m.name for m in held)],
                         None if val is None else [0, *(i + 1 for i in val), *range(n, n + len(held))], len(held))


def _label(path: str | os.PathLike) -> str:
    p = Path(path)
    return f"{p.parent.name}/{p.name}" if p.parent.name else p.name
