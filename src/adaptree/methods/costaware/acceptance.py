"""Acceptance calibration: from a draft candidate's path score to the probability the target accepts it.

The cost-aware controller (:mod:`.controller`) values a draft tree by its expected emitted tokens,
``1 + sum_i P(path of node i accepted)``. The draft head's own cumulative log-probability (the path score,
:meth:`~adaptree.core.tree.DraftTree.candidate_scores`) is a ranking, not a probability the target agrees
with; :class:`AcceptanceCalibration` is the map between the two, fitted on recorded greedy traces
(:mod:`adaptree.offline.traces`):

* **Samples.** Every candidate of every recorded tree (every root position, every recorded width, every
  level): ``x`` = its path score, ``y`` = :func:`~adaptree.offline.traces.match_mask` (its whole path is the
  target's greedy continuation, i.e. greedy verification accepts it when it is in the tree). A candidate whose
  continuation runs past the recorded output (a context limit) has no label and is left out.
* **Fit.** ``P(accept | x)`` is taken to be non-decreasing in ``x`` and fitted by isotonic regression
  (``scipy.optimize.isotonic_regression``, least squares = the pool-adjacent-violators maximum likelihood of
  a monotone Bernoulli curve) on the samples sorted by score. Samples are first pooled into bins of
  ``resolution`` nats (their counts as weights; memory does not grow with the number of traces), then the
  fitted curve is summarised by at most ``max_knots`` knots ``(x_k, y_k)``: consecutive bins are grouped at
  weight quantiles *and* at equal steps of the fitted probability (so knots are dense both where the samples
  are and where the curve moves), each group giving its weighted mean score and fitted probability. Groups
  are contiguous in score, so the knots stay non-decreasing.
* **Evaluation.** ``np.interp`` on the knots, clamped to the first/last knot outside their range.

Per-level statistic (to predict the value of a level before drafting it): ``child_rates[k]`` = the measured
probability that the ``k``-th ranked child (rank 1 = the draft's top-1) of an *accepted* beam node is accepted,
over all recorded levels and widths (rank ``k`` pooled over widths ``>= k``). Under greedy verification at most
one child of a node is accepted, so ``sum(child_rates) <= 1``. ``alpha = child_rates[0]``: the probability that
the best child of an accepted beam node is accepted. The controller predicts the acceptance probability of
child ``k`` of a beam node of probability ``p`` as ``p * child_rates[k]``.

Files are plain JSON (:meth:`AcceptanceCalibration.save` / :meth:`AcceptanceCalibration.load`): format
``version``, ``knots`` (``[[score, probability], ...]``), ``alpha``, ``child_rates``, ``samples`` (labelled
candidates fitted on) and ``fingerprints`` (the ``model`` and ``head`` digests of the traces:
:meth:`AcceptanceCalibration.check` names a mismatch). Loading is strict: an unknown or missing field is a
``ValueError`` naming it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from adaptree.offline.runs import read_json_as, write_json
from adaptree.offline.traces import PromptTrace, level_offset, match_mask

FORMAT_VERSION = 1
FIELDS = ("version", "knots", "alpha", "child_rates", "samples", "fingerprints")
"""The fields of a calibration file, all required."""
FINGERPRINT_KEYS = ("model", "head")


@dataclass(eq=False)
class AcceptanceCalibration:
    """A monotone map from a draft candidate's path score to its greedy acceptance probability (see the
    module docstring), plus the per-rank child acceptance rates of accepted beam nodes."""

    knots_x: np.ndarray
    """``[K]`` strictly increasing path scores (cumulative draft log-probs)."""
    knots_y: np.ndarray
    """``[K]`` non-decreasing acceptance probabilities in [0, 1] at those scores."""
    child_rates: np.ndarray
    """``[R]`` probability that the rank-``k`` child (k = 1..R) of an accepted beam node is accepted."""
    samples: int = 0
    """Labelled candidates the curve was fitted on."""
    fingerprints: dict[str, str] = field(default_factory=dict)
    """``model`` and ``head`` digests of the traces it was fitted on."""

    def __post_init__(self) -> None:
        self.knots_x = np.asarray(self.knots_x, np.float64).reshape(-1)
        self.knots_y = np.asarray(self.knots_y, np.float64).reshape(-1)
        self.child_rates = np.asarray(self.child_rates, np.float64).reshape(-1)
        kx, ky, r = self.knots_x, self.knots_y, self.child_rates
        if kx.size < 1 or kx.size != ky.size:
            raise ValueError(f"knots need at least one (score, probability) pair, got {kx.size} scores and "
                             f"{ky.size} probabilities")
        if not (np.isfinite(kx).all() and np.isfinite(ky).all()):
            raise ValueError("knots must be finite numbers")
        if (np.diff(kx) <= 0).any():
            raise ValueError(f"knot scores must be strictly increasing, got {kx.tolist()}")
        if (np.diff(ky) < 0).any() or ky.min() < 0.0 or ky.max() > 1.0:
            raise ValueError(f"knot probabilities must be non-decreasing in [0, 1], got {ky.tolist()}")
        if r.size < 1 or not np.isfinite(r).all() or r.min() < 0.0 or r.max() > 1.0 or r.sum() > 1.0 + 1e-6:
            raise ValueError(f"child_rates must be at least one probability, summing to <= 1, got {r.tolist()}")
        if int(self.samples) < 0:
            raise ValueError(f"samples must be >= 0, got {self.samples}")
        self.samples = int(self.samples)
        self.fingerprints = {str(k): str(v) for k, v in dict(self.fingerprints).items()}

    @property
    def alpha(self) -> float:
        """Probability that the best (top-1) child of an accepted beam node is accepted."""
        return float(self.child_rates[0])

    def rates(self, width: int) -> np.ndarray:
        """``[width]`` child rates for ranks 1..width (ranks never recorded: 0)."""
        out = np.zeros(int(width), np.float64)
        n = min(int(width), self.child_rates.size)
        out[:n] = self.child_rates[:n]
        return out

    def __call__(self, scores: torch.Tensor | np.ndarray | Sequence[float]) -> np.ndarray:
        """Acceptance probabilities of path scores (any shape; float64 numpy array of the same shape)."""
        if isinstance(scores, torch.Tensor):
            scores = scores.detach().to("cpu", torch.float64).numpy()
        x = np.asarray(scores, np.float64)
        return np.interp(x, self.knots_x, self.knots_y)

    # ------------------------------------------------------------------------------------------ fitting

    @classmethod
    def fit(cls, traces: PromptTrace | Iterable[PromptTrace], widths: Sequence[int] | None = None,
            max_knots: int = 256, resolution: float = 0.01) -> AcceptanceCalibration:
        """Fit on greedy traces (see the module docstring).

        :param traces: one trace or several (an iterable is consumed once: traces can be loaded one at a time).
        :param widths: the recorded widths to use (default: every recorded width of every trace).
        :param max_knots: at most this many knots are kept (>= 2).
        :param resolution: width in nats of the score bins the samples are pooled into before the fit.
        :raises ValueError: traces of different models or heads, a width not recorded, or no labelled candidate.
        """
        if max_knots < 2:
            raise ValueError(f"max_knots must be >= 2, got {max_knots}")
        if not resolution > 0:
            raise ValueError(f"resolution must be > 0, got {resolution}")
        if isinstance(traces, PromptTrace):
            traces = [traces]
        bins: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # (key, n, sum x, sum y)
        child_hits = np.zeros(0, np.float64)
        child_n = np.zeros(0, np.float64)
        fps: dict[str, str] | None = None
        first = None
        for trace in traces:
            own = {k: trace.fingerprints.get(k, "") for k in FINGERPRINT_KEYS}
            if fps is None:
                fps, first = own, trace.key
            elif own != fps:
                raise ValueError(f"trace {trace.key!r} was recorded with another model or head than {first!r}; "
                                 f"fit one calibration per model/head pair")
            for w in (sorted(trace.widths) if widths is None else widths):
                wt = trace.width(int(w))
                x, y = _samples(wt, trace.output)
                if x.size:
                    bins.append(_pool(x, y, resolution))
                hits, n = _child_counts(wt, trace.output)
                if hits.size > child_hits.size:
                    child_hits = np.pad(child_hits, (0, hits.size - child_hits.size))
                    child_n = np.pad(child_n, (0, n.size - child_n.size))
                child_hits[:hits.size] += hits
                child_n[:n.size] += n
        if not bins:
            raise ValueError("no labelled draft candidates in the traces: nothing to fit an acceptance calibration on")
        key = np.concatenate([b[0] for b in bins])
        uniq, inv = np.unique(key, return_inverse=True)
        n = np.bincount(inv, np.concatenate([b[1] for b in bins]), uniq.size)
        sx = np.bincount(inv, np.concatenate([b[2] for b in bins]), uniq.size)
        sy = np.bincount(inv, np.concatenate([b[3] for b in bins]), uniq.size)
        kx, ky = _isotonic_knots(sx / n, sy / n, n, max_knots)
        rates = np.divide(child_hits, child_n, out=np.zeros_like(child_hits), where=child_n > 0)
        if rates.size == 0:  # depth-1 traces only: no level below an accepted node was ever seen
            rates = np.zeros(1)
        return cls(kx, ky, np.clip(rates, 0.0, 1.0), int(n.sum()), fps or {})

    @classmethod
    def fit_folder(cls, folder: str | os.PathLike, widths: Sequence[int] | None = None,
                   max_knots: int = 256, resolution: float = 0.01) -> AcceptanceCalibration:
        """Fit on every trace of a trace folder (:class:`~adaptree.offline.traces.TraceStore`), loading them one
        at a time."""
        from adaptree.offline.traces import TraceStore, load_trace

        store = TraceStore(folder)
        return cls.fit((load_trace(p, store.fingerprints) for p in store.files()), widths, max_knots, resolution)

    # -------------------------------------------------------------------------------------------- checks

    def check(self, fingerprints: Mapping[str, str]) -> list[str]:
        """Messages naming each of ``model``/``head`` whose digest in ``fingerprints`` differs from the one this
        calibration was fitted with (empty: same model and head, or nothing to compare)."""
        out = []
        for k in FINGERPRINT_KEYS:
            a, b = self.fingerprints.get(k), fingerprints.get(k)
            if a and b and a != b:
                out.append(f"the acceptance calibration was fitted on traces of another {k} (sha256 {a[:12]}..., "
                           f"in use: {b[:12]}...): refit it on traces of this {k}")
        return out

    # --------------------------------------------------------------------------------------------- files

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION,
                "knots": [[float(x), float(y)] for x, y in zip(self.knots_x, self.knots_y)],
                "alpha": self.alpha, "child_rates": [float(r) for r in self.child_rates],
                "samples": self.samples, "fingerprints": dict(self.fingerprints)}

    @classmethod
    def from_dict(cls, d: Mapping) -> AcceptanceCalibration:
        """Strict: unknown or missing fields, another format version or an ``alpha`` that is not
        ``child_rates[0]`` are ValueErrors naming them."""
        if not isinstance(d, Mapping):
            raise ValueError(f"an acceptance calibration must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(FIELDS))
        missing = [k for k in FIELDS if k not in d]
        if unknown or missing:
            parts = ([f"unknown fields {unknown}"] if unknown else []) + ([f"missing fields {missing}"] if missing
                                                                          else [])
            raise ValueError(f"bad acceptance calibration: {'; '.join(parts)}")
        if d["version"] != FORMAT_VERSION:
            raise ValueError(f"acceptance calibration format version {d['version']!r}, this adaptree reads "
                             f"{FORMAT_VERSION}")
        knots = np.asarray(d["knots"], np.float64)
        if knots.ndim != 2 or knots.shape[1] != 2:
            raise ValueError(f"knots must be a list of [score, probability] pairs, got shape {knots.shape}")
        if not isinstance(d["fingerprints"], Mapping):
            raise ValueError("fingerprints must be a JSON object")
        cal = cls(knots[:, 0], knots[:, 1], d["child_rates"], d["samples"], d["fingerprints"])
        if abs(float(d["alpha"]) - cal.alpha) > 1e-9:
            raise ValueError(f"alpha {d['alpha']!r} is not child_rates[0] = {cal.alpha!r}")
        return cal

    def save(self, path: str | os.PathLike) -> None:
        write_json(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> AcceptanceCalibration:
        return read_json_as(path, cls.from_dict, "acceptance calibration")


# ------------------------------------------------------------------------------------------------ helpers


def _samples(wt, output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scores, accepted) of every labelled candidate of ``wt``'s trees (flattened)."""
    j = wt.tokens.shape[0]
    if j == 0:
        return np.zeros(0), np.zeros(0, bool)
    match = match_mask(wt, output)
    labelled = (np.arange(j)[:, None] + wt.depths()[None, :]) < len(output)  # the continuation is recorded
    x = wt.scores.astype(np.float64)[labelled]
    y = match[labelled]
    ok = np.isfinite(x)
    return x[ok], y[ok]


def _pool(x: np.ndarray, y: np.ndarray, resolution: float) -> tuple[np.ndarray, ...]:
    """Samples pooled into score bins of ``resolution``: (bin key, count, sum of scores, sum of labels)."""
    key = np.floor(x / resolution).astype(np.int64)
    uniq, inv = np.unique(key, return_inverse=True)
    return (uniq, np.bincount(inv, minlength=uniq.size).astype(np.float64),
            np.bincount(inv, x, uniq.size), np.bincount(inv, y.astype(np.float64), uniq.size))


def _child_counts(wt, output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per child rank k: (accepted rank-k children of accepted beam nodes, accepted beam nodes), over the levels
    of ``wt`` that have a level below them and a recorded continuation."""
    w, jn = wt.width, wt.tokens.shape[0]
    if wt.max_depth < 2 or jn == 0:
        return np.zeros(0), np.zeros(0)
    match = match_mask(wt, output)
    pos = np.arange(jn)
    hits, n = np.zeros(w), np.zeros(w)
    for d in range(1, wt.max_depth):
        rows = pos + d + 1 < len(output)  # the child's continuation token is recorded
        if not rows.any():
            continue
        prev = level_offset(w, d)
        level = match[rows, prev:prev + (w if d == 1 else w * w)]
        parent_ok = np.take_along_axis(level, wt.beam[rows, d - 1].astype(np.int64), axis=1)  # [J', W]
        start = level_offset(w, d + 1)
        child_ok = match[rows, start:start + w * w].reshape(-1, w, w)  # [J', beam row, rank]
        hits += child_ok[parent_ok].sum(0)
        n += parent_ok.sum()
    return hits, n


def _isotonic_knots(x: np.ndarray, y: np.ndarray, weight: np.ndarray, max_knots: int) -> tuple[np.ndarray, ...]:
    """Weighted isotonic fit of ``y`` on ``x`` (ascending bins), summarised by at most ``max_knots`` knots."""
    from scipy.optimize import isotonic_regression

    order = np.argsort(x, kind="stable")
    x, y, weight = x[order], y[order], weight[order]
    fitted = np.clip(isotonic_regression(y, weights=weight, increasing=True).x, 0.0, 1.0)
    half = max(1, max_knots // 2)
    before = np.concatenate([[0.0], np.cumsum(weight)[:-1]]) / weight.sum()
    by_weight = np.minimum((before * half).astype(np.int64), half - 1)
    by_level = np.minimum((fitted * half).astype(np.int64), half - 1)
    new = np.ones(x.size, bool)
    new[1:] = (np.diff(by_weight) != 0) | (np.diff(by_level) != 0)
    group = np.cumsum(new) - 1
    g = int(group[-1]) + 1
    wsum = np.bincount(group, weight, g)
    kx = np.bincount(group, weight * x, g) / wsum
    ky = np.bincount(group, weight * fitted, g) / wsum
    # Means of contiguous groups of increasing x are increasing; guard against float ties anyway.
    keep = np.concatenate([[True], np.diff(kx) > 0])
    return kx[keep], np.maximum.accumulate(np.clip(ky[keep], 0.0, 1.0))
