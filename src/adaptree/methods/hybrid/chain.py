"""Chain calibration: how often a context match's continuation is what the target says next.

The hybrid rule (:mod:`.controller`) values a context chain (:class:`~adaptree.core.context.ContextMatch`) by its
expected accepted tokens ``sum_i c_i``, ``c_i`` = the probability that its first ``i`` tokens are all accepted.
:class:`ChainCalibration` measures it on recorded greedy traces (:mod:`adaptree.offline.traces`), with the
same :class:`~adaptree.core.context.ContextIndex` the controller keeps:

* **Samples.** At every root ``y_j`` of every trace, the longest earlier match of ``prompt + y_0..y_j`` (at
  least one token; n-grams of up to ``max_ngram``) proposes ``max_tokens`` tokens; greedy verification accepts
  its longest prefix that equals ``y_{j+1}, y_{j+2}, ...`` (a chain token past the recorded output has no
  label and is left out).
* **Rates.** Matches are grouped by their length (the buckets ``edges``: ``[edges[b], edges[b+1])``, the last
  open-ended). ``rates[b][t]`` = P(chain token ``t`` accepted | tokens ``< t`` accepted) in bucket ``b``,
  estimated as ``(hits + s * pooled) / (trials + s)`` with ``s = smoothing`` pseudo-trials at the rate pooled
  over all buckets for that ``t`` (a bucket seen rarely borrows the pooled rate). ``c_i = prod_{t < i}
  rates[b][t]``.

Plain JSON (:meth:`ChainCalibration.save` / :meth:`ChainCalibration.load`), loaded strictly: format ``version``,
``max_ngram``, ``edges``, ``rates``, ``trials`` (per bucket and token: the counts behind each rate), ``samples``
(positions with a match) and ``fingerprints`` (``model`` and ``head`` digests of the traces; the chain
rates depend on the target's outputs only, the head is recorded for :meth:`check`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from adaptree.core.context import ContextMatch
from adaptree.offline.runs import read_json_as, write_json
from adaptree.offline.traces import PromptTrace, context_matches

FORMAT_VERSION = 1
FIELDS = ("version", "max_ngram", "edges", "rates", "trials", "samples", "fingerprints")
DEFAULT_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
"""Match-length buckets: 1, 2, 3, 4-5, 6-7, 8-11, 12-15, 16-31, 32 and more tokens."""


@dataclass(eq=False)
class ChainCalibration:
    """Per match-length bucket, the conditional acceptance rate of each chain token (module docstring)."""

    max_ngram: int
    """Longest n-gram of the index the samples came from (the controller's index must use the same)."""
    edges: np.ndarray
    """``[B]`` strictly increasing lower bounds of the match-length buckets, the first 1."""
    rates: np.ndarray
    """``[B, T]`` P(chain token t accepted | the tokens before it accepted), per bucket."""
    trials: np.ndarray = None  # type: ignore[assignment]
    """``[B, T]`` samples behind each rate (chains that reached token t)."""
    samples: int = 0
    """Root positions with a match."""
    fingerprints: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.edges = np.asarray(self.edges, np.int64).reshape(-1)
        self.rates = np.asarray(self.rates, np.float64)
        self.trials = np.zeros_like(self.rates) if self.trials is None else np.asarray(self.trials, np.float64)
        if self.max_ngram < 1 or int(self.max_ngram) != self.max_ngram:
            raise ValueError(f"max_ngram must be a positive integer, got {self.max_ngram!r}")
        self.max_ngram = int(self.max_ngram)
        e, r = self.edges, self.rates
        if e.size < 1 or e[0] != 1 or (np.diff(e) <= 0).any():
            raise ValueError(f"edges must be strictly increasing match lengths starting at 1, got {e.tolist()}")
        if r.ndim != 2 or r.shape[0] != e.size or r.shape[1] < 1:
            raise ValueError(f"rates must be [buckets={e.size}, tokens >= 1], got shape {list(r.shape)}")
        if not np.isfinite(r).all() or r.min() < 0.0 or r.max() > 1.0:
            raise ValueError("rates must be probabilities in [0, 1]")
        if self.trials.shape != r.shape or (self.trials < 0).any():
            raise ValueError(f"trials must be non-negative counts of the rates' shape {list(r.shape)}")
        self.samples = int(self.samples)
        self.fingerprints = {str(k): str(v) for k, v in dict(self.fingerprints).items()}

    @property
    def max_tokens(self) -> int:
        """Longest chain the rates cover (a longer one is valued with the last token's rate)."""
        return int(self.rates.shape[1])

    def bucket(self, length: int) -> int:
        return int(np.searchsorted(self.edges, int(length), side="right")) - 1

    def probs(self, match: ContextMatch | None, k: int | None = None) -> np.ndarray:
        """``[k]`` (default: the match's tokens) probabilities that the chain's first 1..k tokens are all accepted."""
        if match is None:
            return np.zeros(0)
        k = len(match.tokens) if k is None else min(int(k), len(match.tokens))
        r = self.rates[self.bucket(match.length)]
        if k > r.size:
            r = np.concatenate([r, np.full(k - r.size, r[-1])])
        return np.cumprod(r[:k])

    # ------------------------------------------------------------------------------------------ fitting

    @classmethod
    def fit(cls, traces: PromptTrace | Iterable[PromptTrace], max_ngram: int = 4, max_tokens: int = 16,
            edges: Sequence[int] = DEFAULT_EDGES, smoothing: float = 4.0) -> ChainCalibration:
        """Fit on greedy traces (module docstring); an iterable is consumed once."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if smoothing < 0:
            raise ValueError(f"smoothing must be >= 0, got {smoothing}")
        if isinstance(traces, PromptTrace):
            traces = [traces]
        edges_a = np.asarray(edges, np.int64)
        hits = np.zeros((edges_a.size, max_tokens))
        trials = np.zeros((edges_a.size, max_tokens))
        samples, fps, first = 0, None, None
        for trace in traces:
            own = {k: trace.fingerprints.get(k, "") for k in ("model", "head")}
            if fps is None:
                fps, first = own, trace.key
            elif own["model"] != fps["model"]:
                raise ValueError(f"trace {trace.key!r} was recorded with another model than {first!r}; fit one "
                                 f"chain calibration per model")
            y = trace.output.tolist()
            for j, m in context_matches(trace, trace.end, max_tokens, max_ngram, max(max_ngram, int(edges_a[-1]))):
                if m is None:
                    continue
                samples += 1
                b = int(np.searchsorted(edges_a, m.length, side="right")) - 1
                for t, tok in enumerate(m.tokens):
                    if j + 1 + t >= len(y):  # past the recorded output: no label
                        break
                    trials[b, t] += 1
                    if tok != y[j + 1 + t]:
                        break
                    hits[b, t] += 1
        pooled = np.divide(hits.sum(0), trials.sum(0), out=np.zeros(max_tokens), where=trials.sum(0) > 0)
        rates = (hits + smoothing * pooled) / np.maximum(trials + smoothing, 1e-12)
        rates[(trials + smoothing) == 0] = 0.0
        return cls(max_ngram, edges_a, np.clip(rates, 0.0, 1.0), trials, samples, fps or {})

    def check(self, fingerprints: Mapping[str, str]) -> list[str]:
        """A message when ``fingerprints``' model differs from the one the rates were measured on."""
        a, b = self.fingerprints.get("model"), fingerprints.get("model")
        if a and b and a != b:
            return [f"the chain calibration was fitted on traces of another model (sha256 {a[:12]}..., in use: "
                    f"{b[:12]}...): refit it on traces of this model"]
        return []

    # --------------------------------------------------------------------------------------------- files

    def to_dict(self) -> dict:
        return {"version": FORMAT_VERSION, "max_ngram": self.max_ngram, "edges": self.edges.tolist(),
                "rates": [[round(float(x), 6) for x in row] for row in self.rates],
                "trials": [[int(x) for x in row] for row in self.trials], "samples": self.samples,
                "fingerprints": dict(self.fingerprints)}

    @classmethod
    def from_dict(cls, d: Mapping) -> ChainCalibration:
        if not isinstance(d, Mapping):
            raise ValueError(f"a chain calibration must be a JSON object, got {type(d).__name__}")
        unknown, missing = sorted(set(d) - set(FIELDS)), [k for k in FIELDS if k not in d]
        if unknown or missing:
            raise ValueError(f"bad chain calibration: unknown fields {unknown}, missing fields {missing}")
        if d["version"] != FORMAT_VERSION:
            raise ValueError(f"chain calibration format version {d['version']!r}, this adaptree reads {FORMAT_VERSION}")
        return cls(d["max_ngram"], d["edges"], d["rates"], d["trials"], d["samples"], d["fingerprints"])

    def save(self, path: str | os.PathLike) -> None:
        write_json(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ChainCalibration:
        return read_json_as(path, cls.from_dict, "chain calibration")


__all__ = ["ChainCalibration", "DEFAULT_EDGES"]
