"""A calibrated latency model of the draft-and-verify cycle, for the simulator.

Two fits, one per kind of forward, plus a constant per-cycle overhead::

    draft step (one head forward over W beam nodes at context L):  a0 + a1*W + a2*L + a3*W*L
    verification (one target forward over V+1 nodes at context L): b0 + b1*N + b2*L + b3*N*L,  N = V + 1

or, with ``verify_knots`` (what :func:`calibrate` fits), a verification time that is linear in L at each
knot N_k and interpolated linearly in N between knots (extrapolated from the last two past the last one).
On a CPU the cost of a forward is far from linear in its row count at small N (matrix-vector vs blocked
matrix-matrix kernels: a 5-row forward costs much more than 5/61 of the way from 1 row to 61), which is
exactly where the fastest trees live; the knots follow that curve, the bilinear form cannot.

A cycle of depth d costs ``d`` draft steps, one verification and ``other_s``. Parameters are plain
JSON (:meth:`LatencyModel.save` / :meth:`LatencyModel.load`). :func:`calibrate` micro-benchmarks the
real pieces (the head's tree step and the target's tree forward on caches filled to L) and fits them;
:meth:`LatencyModel.fit` takes any measured samples (e.g. from live cycle records).

Times hold for the machine they were measured on: ``meta["machine"]`` records it (:func:`machine_meta`:
CPU model, cores, torch threads, GPU) and :func:`check_machine` / :func:`load_checked` name the
differences when a model is used elsewhere.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import torch

from adaptree.core.engine import synchronize

FEATURES = ("1", "x", "L", "x*L")

CALIBRATION_SIZES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 60, 120, 240)
"""Verification sizes V timed by :func:`calibrate`: dense where CPU trees live (the knots of the model)."""


def _design(x: np.ndarray, L: np.ndarray) -> np.ndarray:
    x, L = np.asarray(x, np.float64), np.asarray(L, np.float64)
    return np.stack([np.ones_like(x), x, L, x * L], axis=-1)


@dataclass
class LatencyModel:
    """Seconds per draft step and per verification as bilinear functions of (size, context length)."""

    draft: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    """Coefficients of (1, W, L, W*L) for one draft forward."""
    verify: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    """Coefficients of (1, V+1, L, (V+1)*L) for one target forward."""
    other_s: float = 0.0
    """Per-cycle overhead outside drafting and verification (acceptance, cache compaction)."""
    meta: dict = field(default_factory=dict)
    """Where it was measured (device, dtype, model digests...); informational."""
    verify_knots: list[int] | None = None
    """Row counts N_1 < N_2 < ... (N = V + 1 >= 1) of the piecewise-linear verification model; ``verify`` then
    holds (intercept, slope in L) per knot, 2K coefficients. None: the bilinear form."""
    buckets: list[int] | None = None
    """The fixed step sizes of a graphed engine (:data:`adaptree.core.graphs.BUCKETS`): a draft step of W rows and
    a verification of N = V + 1 rows cost what the smallest bucket holding them costs (sizes past the last bucket
    run the plain forward, as measured). None: costs follow the rows themselves."""

    def __post_init__(self) -> None:
        if self.buckets is not None:
            self.buckets = [int(b) for b in self.buckets]
            if not self.buckets or self.buckets[0] < 1 or any(b <= a for a, b in zip(self.buckets, self.buckets[1:])):
                raise ValueError(f"buckets must be increasing sizes >= 1, got {self.buckets}")
        self.draft = [float(c) for c in self.draft]
        if len(self.draft) != 4:
            raise ValueError(f"LatencyModel.draft needs 4 coefficients {FEATURES}, got {len(self.draft)}")
        self.verify = [float(c) for c in self.verify]
        if self.verify_knots is None:
            if len(self.verify) != 4:
                raise ValueError(f"LatencyModel.verify needs 4 coefficients {FEATURES}, got {len(self.verify)}")
            return
        knots = [int(k) for k in self.verify_knots]
        if len(knots) < 2 or knots[0] < 1 or any(b <= a for a, b in zip(knots, knots[1:])):
            raise ValueError(f"verify_knots must be at least 2 increasing row counts >= 1, got {self.verify_knots}")
        if len(self.verify) != 2 * len(knots):
            raise ValueError(f"LatencyModel.verify needs 2 coefficients (intercept, slope in L) per knot: "
                             f"{2 * len(knots)} for {len(knots)} knots, got {len(self.verify)}")
        self.verify_knots = knots

    def _bucketed(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` raised to the smallest bucket holding them (unchanged past the last bucket or without buckets)."""
        if not self.buckets:
            return rows
        b = np.asarray(self.buckets, np.float64)
        i = np.searchsorted(b, rows, side="left")
        return np.where(i < len(b), b[np.minimum(i, len(b) - 1)], rows)

    def draft_steps(self, width, context_len) -> np.ndarray:
        """Seconds of one draft forward, vectorised over broadcastable arrays of W and L."""
        a = self.draft
        w, L = self._bucketed(np.asarray(width, np.float64)), np.asarray(context_len, np.float64)
        return np.maximum(0.0, a[0] + a[1] * w + a[2] * L + a[3] * w * L)

    def verify_times(self, size, context_len) -> np.ndarray:
        """Seconds of one verification of V draft nodes (V + 1 rows), vectorised over broadcastable V and L."""
        n, L = self._bucketed(np.asarray(size, np.float64) + 1), np.asarray(context_len, np.float64)
        b = self.verify
        if self.verify_knots is None:
            return np.maximum(0.0, b[0] + b[1] * n + b[2] * L + b[3] * n * L)
        knots = np.asarray(self.verify_knots, np.float64)
        c = np.asarray(b, np.float64).reshape(-1, 2)
        i = np.clip(np.searchsorted(knots, n, side="right") - 1, 0, len(knots) - 2)  # segment (extended at ends)
        frac = (n - knots[i]) / (knots[i + 1] - knots[i])
        lo, hi = c[i, 0] + c[i, 1] * L, c[i + 1, 0] + c[i + 1, 1] * L
        return np.maximum(0.0, lo + frac * (hi - lo))

    def ar_steps(self, context_len) -> np.ndarray:
        """Seconds of one autoregressive step (the root alone verified, plus the per-cycle overhead), vectorised
        over L: the time every speedup is measured against."""
        return self.verify_times(0, context_len) + self.other_s

    def draft_step(self, width: int, context_len: int) -> float:
        return float(self.draft_steps(width, context_len))

    def ar_step(self, context_len: int) -> float:
        return float(self.ar_steps(context_len))

    def draft_time(self, width: int, depth: int, context_len: int) -> float:
        return depth * self.draft_step(width, context_len) if depth > 0 else 0.0

    def verify_time(self, size: int, context_len: int) -> float:
        return float(self.verify_times(size, context_len))

    def describe(self) -> list[str]:
        """The fitted forms in milliseconds, one line each (what ``adaptree calibrate`` prints)."""
        a, b = [x * 1e3 for x in self.draft], [x * 1e3 for x in self.verify]
        out = [f"draft step  = {a[0]:.3f} + {a[1]:.4f}*W + {a[2]:.6f}*L + {a[3]:.8f}*W*L ms"]
        if self.verify_knots is None:
            out.append(f"verify      = {b[0]:.3f} + {b[1]:.4f}*N + {b[2]:.6f}*L + {b[3]:.8f}*N*L ms  (N = V + 1)")
        else:
            out.append("verify      = piecewise linear in N = V + 1 between knots, each knot + slope*L ms: " + ", ".join(
                f"N={k}: {b[2 * i]:.2f}{b[2 * i + 1]:+.5f}*L" for i, k in enumerate(self.verify_knots)))
        out.append(f"other_s     = {self.other_s * 1e3:.3f} ms per cycle")
        if self.buckets:
            out.append(f"buckets     = {self.buckets} (W and N cost their bucket's time)")
        return out

    def cycle_time(self, width: int, depth: int, size: int, context_len: int) -> float:
        return self.draft_time(width, depth, context_len) + self.verify_time(size, context_len) + self.other_s

    # ---- fitting ----------------------------------------------------------------------------------

    @staticmethod
    def _lstsq(x, L, t) -> list[float]:
        a = _design(x, L)
        t = np.asarray(t, np.float64)
        if len(t) < 4:
            raise ValueError(f"need at least 4 timing samples to fit, got {len(t)}")
        coef, *_ = np.linalg.lstsq(a, t, rcond=None)
        return coef.tolist()

    @classmethod
    def fit(cls, draft_samples: Iterable[tuple[int, int, float]], verify_samples: Iterable[tuple[int, int, float]],
            other_s: float = 0.0, meta: dict | None = None, knots: bool = False) -> "LatencyModel":
        """Least-squares fit. ``draft_samples``: (W, L, seconds per draft forward); ``verify_samples``:
        (V, L, seconds per target forward over V+1 nodes). ``knots``: the piecewise-linear verification model
        with a knot at every sampled N = V + 1 (each needs two distinct L), made non-decreasing in N (see
        :func:`_knot_fit`); else the bilinear form."""
        d = np.asarray(list(draft_samples), np.float64).reshape(-1, 3)
        v = np.asarray(list(verify_samples), np.float64).reshape(-1, 3)
        if not knots:
            return cls(cls._lstsq(d[:, 0], d[:, 1], d[:, 2]), cls._lstsq(v[:, 0] + 1, v[:, 1], v[:, 2]),
                       float(other_s), dict(meta or {}))
        kn, coef = _knot_fit(v[:, 0] + 1, v[:, 1], v[:, 2])
        return cls(cls._lstsq(d[:, 0], d[:, 1], d[:, 2]), coef, float(other_s), dict(meta or {}), kn)

    @classmethod
    def fit_records(cls, records: Iterable, meta: dict | None = None) -> "LatencyModel":
        """Fit from live :class:`~adaptree.core.records.CycleRecord` objects (or their dicts): per-step draft
        time = draft_s / depth, verification time = verify_s, overhead = median other_s."""
        draft, verify, other = [], [], []
        for r in records:
            r = r if isinstance(r, dict) else r.to_dict()
            if r["depth"] > 0:
                draft.append((r["width"], r["context_len"], r["draft_s"] / r["depth"]))
            verify.append((r["size"], r["context_len"], r["verify_s"]))
            other.append(r.get("other_s", 0.0))
        return cls.fit(draft, verify, statistics.median(other) if other else 0.0, meta)

    # ---- files ------------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LatencyModel":
        unknown = set(d) - {"draft", "verify", "other_s", "meta", "verify_knots", "buckets"}
        if unknown:
            raise ValueError(f"unknown latency model fields {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str | os.PathLike) -> None:
        from adaptree.offline.runs import write_json

        write_json(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LatencyModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _knot_fit(n: np.ndarray, L: np.ndarray, t: np.ndarray) -> tuple[list[int], list[float]]:
    """Per sampled row count N: a least-squares line in L. The lines' values at the smallest and largest
    sampled L are then each made non-decreasing in N (isotonic regression; two lines ordered at both ends
    are ordered in between), so that a larger tree never costs less: micro-benchmark noise must not let the
    oracle or a policy exploit a spurious dip. Returns (knots, [intercept, slope] per knot)."""
    knots = sorted({int(x) for x in n})
    if len(knots) < 2:
        raise ValueError(f"the knot model needs at least 2 distinct verification sizes, got N = {knots}")
    lo, hi = float(L.min()), float(L.max())
    if hi <= lo:
        raise ValueError("the knot model needs at least 2 distinct context lengths")
    at_lo, at_hi = [], []
    for k in knots:
        sel = n == k
        if len(set(L[sel].tolist())) < 2:
            raise ValueError(f"verification size V={k - 1} was timed at fewer than 2 context lengths")
        slope, icpt = np.polyfit(L[sel], t[sel], 1)
        at_lo.append(icpt + slope * lo)
        at_hi.append(icpt + slope * hi)
    from scipy.optimize import isotonic_regression  # least-squares non-decreasing fit (PAVA)

    at_lo, at_hi = (isotonic_regression(np.asarray(v, dtype=float)).x for v in (at_lo, at_hi))
    slope = (at_hi - at_lo) / (hi - lo)
    coef = np.stack([at_lo - slope * lo, slope], axis=1).reshape(-1)
    return knots, coef.tolist()


def machine_meta() -> dict:
    """The machine timings are measured on (:func:`adaptree.core.machine.machine_profile`): CPU model and flags,
    PyTorch's and oneDNN's kernel levels, cores, torch threads and version, platform, GPU."""
    from adaptree.core.machine import machine_profile

    return machine_profile()


def check_machine(model: LatencyModel, current: dict | None = None) -> list[str]:
    """Differences between the machine ``model`` was measured on and this one (``current``, default
    :func:`machine_meta`), one message per differing item (CPU model, torch threads, GPU) naming both
    values; a model that records no machine gets one message saying so. Empty: same machine, or a synthetic model
    (``meta["synthetic"]``: it describes no machine)."""
    meta = model.meta or {}
    if "synthetic" in meta:  # a member of a latency family (adaptree.offline.family): no machine to compare with
        return []
    here = machine_meta() if current is None else current
    there = dict(meta.get("machine") or {})
    if "torch_threads" not in there and "threads" in meta:  # calibrate() before meta["machine"] existed
        there["torch_threads"] = meta["threads"]
    if not there:
        return ["the latency model records no machine (meta['machine']); its times may not hold on this one "
                f"(CPU {here.get('cpu')!r}, {here.get('torch_threads')} torch threads): measure it here with "
                "`adaptree calibrate`"]
    out = []
    for key, what in (("cpu", "CPU"), ("torch_threads", "torch threads"), ("cpu_capability", "PyTorch CPU kernels"),
                      ("onednn_max_isa", "oneDNN ISA limit"), ("gpu", "GPU")):
        a, b = there.get(key), here.get(key)
        if key == "gpu" and a is None and b is None:
            continue
        if a is None and key != "gpu":
            continue  # not recorded: nothing to compare
        if a != b:
            out.append(f"the latency model was measured with {what} {a!r}, this machine has {what} {b!r}: its "
                       f"modelled times may not hold here (recalibrate with `adaptree calibrate`)")
    return out


def load_checked(path: str | os.PathLike, quiet: bool = False) -> LatencyModel:
    """:meth:`LatencyModel.load`, printing a warning to stderr for every :func:`check_machine` difference."""
    model = LatencyModel.load(path)
    if not quiet:
        for msg in check_machine(model):
            print(f"adaptree: warning: {path}: {msg}", file=sys.stderr)
    return model


def require_latency(path: str | os.PathLike | None) -> LatencyModel:
    """The latency model a trainer needs (:func:`load_checked`); an error naming the command that makes one when
    there is none."""
    if not path:
        raise ValueError("pass --latency FILE: the latency model of this machine (`adaptree calibrate`)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"latency model {str(path)!r} does not exist; make one with `adaptree calibrate`")
    return load_checked(path)


def random_tree(n: int, gen: torch.Generator, device=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random tree of ``n`` nodes (node ``i``'s parent drawn uniformly among ``0..i-1``): its depths ``[n]`` and
    its ancestor mask ``[n, n]`` on ``device`` (None for one node: a plain decode step)."""
    from adaptree.core.tree import ancestor_mask

    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    return depth, (ancestor_mask(parents, depth).to(device) if n > 1 else None)


def median_seconds(fn, repeats: int, sync) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` after one warm-up call, ``sync()`` (the device's queue
    drained) before each clock reading."""
    fn()  # warm-up
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


@torch.inference_mode()
def calibrate(target, head, widths: Sequence[int] = (4, 8, 10, 16), sizes: Sequence[int] = CALIBRATION_SIZES,
              lengths: Sequence[int] = (64, 256, 512, 1024), repeats: int = 5, tree_levels: int = 4,
              progress: bool = False, knots: bool = True, graphs: bool | None = None) -> LatencyModel:
    """Micro-benchmark the engine's pieces on ``target``/``head`` and fit a :class:`LatencyModel`.

    Draft: a :class:`~adaptree.core.tree.DraftTree` ``step`` of width W with ``tree_levels`` earlier levels in
    the cache after L committed positions. Verify: a target forward over a random tree of V+1 nodes after
    L cached positions. Cache contents are zeros (values do not change the time). Lengths past the
    model's context limit are skipped. Takes minutes on a real model: not for a shared, busy machine.
    ``other_s`` is left 0 (the per-cycle overhead needs live cycles: ``adaptree calibrate`` sets it).
    ``knots``: fit the piecewise-linear verification model (a knot per size), else the bilinear one.
    ``graphs``: time the steps the way a graphed engine runs them (:class:`~adaptree.core.graphs.StepGraphs`,
    default: on CUDA, as :class:`~adaptree.core.engine.Engine` does): the sizes become the buckets' (V + 1 = 1, 2,
    4, ... up to the bucket of the largest size) and the model records the buckets.
    ``meta`` records the machine (:func:`machine_meta`), dtype and the samples.
    """
    from adaptree.core.graphs import BUCKETS, StepGraphs, bucket_of
    from tqdm import tqdm

    for name, values, low in (("widths", widths, 1), ("sizes", sizes, 0), ("lengths", lengths, 1)):
        if not values or any(int(x) < low for x in values):
            raise ValueError(f"calibration {name} must be integers >= {low}, got {list(values)}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")

    dev = target.device
    sync = partial(synchronize, dev)
    graphs = dev.type == "cuda" if graphs is None else bool(graphs)
    if graphs:  # a graphed verification costs its bucket: time the buckets
        top = bucket_of(max(sizes) + 1) or BUCKETS[-1]
        sizes = tuple(b - 1 for b in BUCKETS if b <= top)
    max_len = target.max_seq_len
    fitting = [L for L in lengths if L + max(sizes) + 1 < max_len]
    if len(set(fitting)) < 2:
        raise ValueError(f"calibration needs two context lengths L with L + max(sizes) + 1 < {max_len} (the context "
                         f"limit); of lengths {list(lengths)} with sizes up to {max(sizes)}, {fitting} fit")
    lengths = fitting
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    hidden = head.config.hidden_size
    draft_samples, verify_samples = [], []
    rows = max(bucket_of(max(widths)) or max(widths), max(widths)) if graphs else max(widths)
    dcache = head.new_cache(max(lengths) + rows * (tree_levels + 1) + 1)
    dsteps = StepGraphs(head, dcache) if graphs else None
    bar = tqdm(total=len(lengths) * (len(widths) + len(sizes)), desc="calibrate", unit="shape", disable=not progress)
    for L in lengths:
        for w in widths:
            toks = torch.randint(0, vocab, (1, w), generator=gen).to(dev)
            h = torch.randn(1, w, hidden, generator=gen).to(device=dev, dtype=head.dtype)
            pos = torch.full((w,), L + tree_levels, dtype=torch.long, device=dev)
            mask = torch.cat([torch.zeros(w, w * tree_levels, dtype=torch.bool, device=dev),
                              torch.eye(w, dtype=torch.bool, device=dev)], dim=1)

            def draft_step():
                dcache.length = L + w * tree_levels
                if dsteps is None or dsteps.forward(toks, pos, mask, h) is None:
                    head(h, toks, position_ids=pos, cache=dcache, tree_mask=mask)

            rows_w = (bucket_of(w) or w) if graphs else w  # what a graphed step runs
            draft_samples.append((rows_w, L, median_seconds(draft_step, repeats, sync)))
            bar.update(1)
        cache = target.new_cache(L + max(sizes) + 1)
        vsteps = StepGraphs(target, cache) if graphs else None
        for v in sizes:
            n = v + 1
            depth, tmask = random_tree(n, gen, dev)
            toks = torch.randint(0, vocab, (1, n), generator=gen).to(dev)
            positions = (L + depth).to(dev)

            def verify_fwd():
                cache.length = L
                if vsteps is None or vsteps.forward(toks, positions, tmask) is None:
                    target(toks, position_ids=positions, cache=cache, tree_mask=tmask, features=True)

            verify_samples.append((v, L, median_seconds(verify_fwd, repeats, sync)))
            bar.update(1)
    bar.close()
    meta = {"device": str(dev), "dtype": str(target.dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "machine": machine_meta(),
            "widths": list(widths), "sizes": list(sizes), "lengths": list(lengths), "repeats": repeats,
            "draft_samples": draft_samples, "verify_samples": verify_samples}
    model = LatencyModel.fit(draft_samples, verify_samples, 0.0, meta, knots=knots)
    if graphs:
        model.buckets = list(BUCKETS)
    return model
