"""Statistics for paired benchmark arms: bootstrap confidence intervals and the Wilcoxon signed-rank test.

Every statistic works on *paired* runs: the same prompt (and turn, and repeat) measured for two arms,
interleaved in time so machine drift hits both alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def ratio_of_sums(num: Sequence[float], den: Sequence[float]) -> float:
    """``sum(num) / sum(den)``: the speedup of total times (AR seconds over method seconds)."""
    d = float(np.sum(den))
    return float(np.sum(num)) / d if d > 0 else math.nan


def throughput_ratio(tok: Sequence[float], sec: Sequence[float], ref_tok: Sequence[float],
                     ref_sec: Sequence[float]) -> float:
    """``(Σ tok / Σ sec) / (Σ ref_tok / Σ ref_sec)``: a method's tokens per second over a reference's on the
    same runs (the speedup). When every run generated as many tokens in both arms (greedy float32) it is
    ``Σ ref_sec / Σ sec``, the ratio of total times; when the outputs differ in length (sampling, bf16
    rounding) it still compares like with like, which the ratio of times does not."""
    t, s, rt, rs = (float(np.sum(x)) for x in (tok, sec, ref_tok, ref_sec))
    return (t * rs) / (s * rt) if s > 0 and rt > 0 else math.nan


def bootstrap_throughput_ratio_ci(tok: Sequence[float], sec: Sequence[float], ref_tok: Sequence[float],
                                  ref_sec: Sequence[float], level: float = 0.95, resamples: int = 4000,
                                  seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of :func:`throughput_ratio`, resampling the paired runs with replacement
    (``scipy.stats.bootstrap``).

    With fewer than two runs the interval is undefined: ``(nan, nan)``.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    cols = [np.asarray(x, dtype=float) for x in (tok, sec, ref_tok, ref_sec)]
    if len({c.shape for c in cols}) != 1:
        raise ValueError(f"paired samples differ in length: {[c.size for c in cols]}")
    if cols[0].size < 2:
        return math.nan, math.nan
    from scipy.stats import bootstrap

    def ratio(t, s, rt, rs, axis=-1):
        t, s, rt, rs = (x.sum(axis=axis) for x in (t, s, rt, rs))
        return (t * rs) / np.maximum(s * rt, 1e-300)

    # paired=True resamples the run indices jointly, drawn as rng.integers(0, n, (resamples, n)): the same draws
    # (and intervals, to float rounding) as the hand-written bootstrap this replaced; the seed fixes them.
    res = bootstrap(cols, ratio, n_resamples=resamples, paired=True, vectorized=True, method="percentile",
                    confidence_level=level, rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def bootstrap_ratio_ci(num: Sequence[float], den: Sequence[float], level: float = 0.95, resamples: int = 4000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``sum(num) / sum(den)``, resampling the pairs with replacement.

    With fewer than two pairs the interval is undefined: ``(nan, nan)``.
    """
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {a.size} vs {b.size}")
    ones = np.ones_like(a)
    return bootstrap_throughput_ratio_ci(ones, b, ones, a, level, resamples, seed)


def bootstrap_mean_ci(values: Sequence[float], level: float = 0.95, resamples: int = 4000,
                      seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean (e.g. of per-prompt speed ratios)."""
    v = np.asarray(values, dtype=float)
    return bootstrap_ratio_ci(v, np.ones_like(v), level, resamples, seed)


def wilcoxon_paired(x: Sequence[float], y: Sequence[float]) -> dict:
    """Two-sided paired Wilcoxon signed-rank test of ``x`` vs ``y`` (e.g. per-prompt tokens/s of a method
    vs the reference method), as the Re-SpS paper reports it.

    Returns ``{"n", "statistic", "p_value", "wins"}`` where ``wins`` counts pairs with ``x > y``. Zero
    differences are dropped (Wilcox's rule); with no non-zero difference the p-value is 1.0.
    """
    from scipy.stats import wilcoxon

    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {a.size} vs {b.size}")
    d = a - b
    wins = int((d > 0).sum())
    nz = d[d != 0]
    if nz.size == 0:
        return {"n": int(a.size), "statistic": 0.0, "p_value": 1.0, "wins": wins}
    res = wilcoxon(nz, zero_method="wilcox", alternative="two-sided")
    return {"n": int(a.size), "statistic": float(res.statistic), "p_value": float(res.pvalue), "wins": wins}


def acceptance_by_position(accepted: Sequence[int], depths: Sequence[int]) -> dict[str, list[float]]:
    """Per draft position i = 1..max depth, from per-cycle accepted lengths (bonus excluded) and depths:

    - ``at_least[i-1]`` = P(accepted >= i): the share of cycles that got at least i draft tokens;
    - ``conditional[i-1]`` = P(accepted >= i | accepted >= i-1 and the tree reached depth i): how often
      the i-th draft token is accepted once it is reachable (the "per-position acceptance rate").
    """
    acc, dep = np.asarray(accepted, dtype=int), np.asarray(depths, dtype=int)
    if acc.size == 0 or dep.max(initial=0) == 0:
        return {"at_least": [], "conditional": []}
    at_least, conditional = [], []
    for i in range(1, int(dep.max()) + 1):
        at_least.append(float((acc >= i).mean()))
        reach = (acc >= i - 1) & (dep >= i)
        conditional.append(float((acc[reach] >= i).mean()) if reach.any() else math.nan)
    return {"at_least": at_least, "conditional": conditional}
