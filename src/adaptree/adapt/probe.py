"""The short probe of an execution mode (:func:`probe`): what :func:`~adaptree.adapt.execution.choose_execution`
ranks the candidate modes by, so that only the best one gets the full machine setup.

A probe times a few shapes once each (a draft step at the smallest and largest draft width, a verification at
:attr:`~adaptree.adapt.setup.AdaptConfig.probe_sizes`, both at the calibration's two context lengths) and fits a
latency model from them, without the live cycles that measure the per-cycle overhead; every method is then replayed
on the shared traces with that model, as the full setup does. The mode's score is its best-modelled candidate for
the default (AR included). The full setup then measures the mode kept: the full calibration, ``torch.compile``'s
check and the live check of the default, which a probe skips.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from adaptree.adapt.setup import (
    AdaptConfig,
    fit_lengths,
    machine_assets,
    model_methods,
    ranked,
    static_tree,
)
from adaptree.core.pipeline import PipelineLike

if TYPE_CHECKING:
    from adaptree.offline.latency import LatencyModel


@dataclass
class Probe:
    """One execution mode's probe (:func:`probe`)."""

    execution: str
    methods: dict
    """Method -> ``{"tokens_per_s", "speedup", ...}`` modelled on the traces with the probe's latency model (as
    :attr:`~adaptree.adapt.setup.MachineSetup.methods`), or ``{"skipped": reason}``."""
    ar_step_ms: float
    """One autoregressive step at the shorter calibration length, as the probe's latency model has it."""
    took_s: float
    calibration_s: float = 0.0
    """Of :attr:`took_s`, the timing of the shapes (the rest replays the methods)."""
    latency: LatencyModel | None = field(default=None, repr=False, compare=False)
    """The probe's :class:`~adaptree.offline.latency.LatencyModel` (not saved)."""

    @property
    def method(self) -> str:
        """The best-modelled candidate for the default method in this mode."""
        return ranked(self.methods)[0]

    @property
    def tokens_per_s(self) -> float:
        """The mode's score: :attr:`method`'s modelled tokens/s."""
        return self.rate(self.method)

    def rate(self, method: str) -> float:
        """``method``'s modelled tokens/s in this probe (0 for one not modelled)."""
        return float(self.methods.get(method, {}).get("tokens_per_s", 0.0))

    def to_dict(self) -> dict:
        """What the execution choice records: the score, its method, the AR step and every method's rate."""
        rates = {m: round(r["tokens_per_s"], 2) for m, r in self.methods.items() if "skipped" not in r}
        return {"method": self.method, "tokens_per_s": self.tokens_per_s, "ar_step_ms": self.ar_step_ms,
                "took_s": self.took_s, "methods": rates}


def probe_shapes(cfg: AdaptConfig, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int]]:
    """The probe's draft widths, verification sizes and context lengths for a context of ``max_len`` tokens."""
    widths = (min(cfg.widths), max(cfg.widths)) if len(set(cfg.widths)) > 1 else tuple(cfg.widths)
    sizes = tuple(sorted({v for v in cfg.probe_sizes if v <= max(cfg.sizes)}))  # within what the setup calibrates
    if len(sizes) < 2:
        sizes = tuple(cfg.sizes)
    return widths, sizes, fit_lengths(cfg.lengths, max_len, max(sizes))


def probe_latency(pipeline: PipelineLike, cfg: AdaptConfig, progress: bool = False) -> LatencyModel:
    """The probe's latency model of ``pipeline``'s mode: the shapes of :func:`probe_shapes` timed
    ``cfg.probe_repeats`` times each (after a warm-up), no live cycles (the per-cycle overhead stays 0)."""
    from adaptree.offline.latency import calibrate

    t0 = time.perf_counter()
    widths, sizes, lengths = probe_shapes(cfg, pipeline.engine.max_len)
    latency = calibrate(pipeline.target, pipeline.head, widths=widths, sizes=sizes, lengths=lengths,
                        repeats=cfg.probe_repeats, progress=progress)
    latency.meta.update(source="probe", took_s=time.perf_counter() - t0)
    return latency


def probe(pipeline: PipelineLike, cfg: AdaptConfig, traces: Sequence, acceptance: Path, progress: bool = False,
          latency: LatencyModel | None = None) -> Probe:
    """Probe ``pipeline``'s execution mode: its :func:`probe_latency` (``latency`` when already timed), and every
    method of ``cfg.methods`` replayed with it on ``traces`` (``acceptance``: their acceptance calibration, beside
    which ``chain.json`` lies). Measures nothing else and writes nothing to the cache."""
    latency = latency if latency is not None else probe_latency(pipeline, cfg, progress)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="adaptree-probe-") as tmp:  # the files the methods read, for this replay
        folder = Path(tmp)
        latency.save(folder / "latency.json")
        static_tree(traces, latency, cfg, folder / "static_gs.json", {"probe": pipeline.execution})
        methods = model_methods(pipeline, cfg, traces, latency, machine_assets(folder, acceptance))
    replayed = time.perf_counter() - t0
    timed = float(latency.meta.get("took_s", 0.0))
    _, _, lengths = probe_shapes(cfg, pipeline.engine.max_len)
    return Probe(pipeline.execution, methods, 1e3 * latency.ar_step(min(lengths)), timed + replayed, timed, latency)


def choice_estimate_s(latency: LatencyModel, cfg: AdaptConfig, modes: int, max_len: int,
                      prompt_tokens: int = 200) -> dict[str, float]:
    """Roughly how many seconds each part of choosing among ``modes`` execution modes takes, from the first mode's
    probe latency model (the traces and the chain calibration are recorded in that mode; forwards of more rows than
    it timed are priced on its last segment): ``traces`` (greedy decoding 8 prompts at a time, one forward over each
    whole sequence, the draft trees of 16 positions at a time), ``chain``
    (:data:`~adaptree.adapt.setup.CHAIN_SAMPLES` outputs per prompt sampled 16 at a time), ``probes`` (the shapes of
    the other modes, priced as this one's), ``setup`` (:func:`setup_estimate_s`, without compiling).
    ``prompt_tokens`` is a typical tuning prompt's length. The methods' replays (seconds each) are not counted."""
    from adaptree.adapt.setup import CHAIN_SAMPLES
    from adaptree.methods.common.chain import SAMPLED_TEMPERATURES

    p, t, d = cfg.prompts, cfg.max_new_tokens, cfg.max_depth
    context = min(prompt_tokens + t // 2, max_len - 1)

    def batched(rows: int, batches: int, steps: int) -> float:  # prefill every row's prompt, then decode
        prefill = latency.verify_time(rows * prompt_tokens - 1, 0)
        return batches * (prefill + steps * latency.verify_time(rows - 1, context))

    steps = t + d + 1  # the traces' look-ahead
    whole = p * latency.verify_time(min(prompt_tokens + steps, max_len) - 1, 0)
    trees = p * math.ceil(t / 16) * d * 16 * latency.draft_step(cfg.width, context)
    chain = len(SAMPLED_TEMPERATURES) * batched(16, math.ceil(CHAIN_SAMPLES * p / 16), t)
    probes = (modes - 1) * float(latency.meta.get("took_s", 0.0))
    setup = setup_estimate_s(Probe("", {}, 0.0, 0.0, 0.0, latency), cfg, max_len)
    return {"traces": batched(8, math.ceil(p / 8), steps) + whole + trees, "chain": chain, "probes": probes,
            "setup": setup}


def next_to_set_up(probes: dict[str, Probe], defaults: dict[str, str]) -> str | None:
    """The next execution mode to give a full setup: the best-probed mode of ``probes`` without one yet (``defaults``:
    each set-up mode's default method), while its probe beats what the set-up modes' defaults were worth in their own
    probes (a live check that kept ``ar`` where the probe counted on a tree lowers that); None: stop."""
    kept = max((probes[n].rate(d) for n, d in defaults.items()), default=-1.0)
    rest = [n for n in probes if n not in defaults]
    if not rest:
        return None
    best = max(rest, key=lambda n: probes[n].tokens_per_s)
    return best if probes[best].tokens_per_s > kept else None


def setup_estimate_s(probed: Probe, cfg: AdaptConfig, max_len: int) -> float:
    """About how many seconds the full setup of a probed mode takes once its traces exist, from the probe's latency
    model: the calibration's timed shapes, its two live generations per shape, the replay of every method (as long
    as the probe's) and the live check's generations (each token priced at an AR step); ``torch.compile``'s own
    compiling is not in it."""
    lat = probed.latency
    if lat is None:
        return 0.0
    lengths = fit_lengths(cfg.lengths, max_len, max(cfg.sizes))
    shapes = sum(sum(lat.draft_step(w, L) for w in cfg.widths) + sum(lat.verify_time(v, L) for v in cfg.sizes)
                 for L in lengths)
    calibration = (cfg.repeats + 1) * shapes
    ar = lat.ar_step(max(lengths))
    validation = 2 * cfg.validate_tokens * (ar + lat.cycle_time(10, 3, 8, max(lengths)))
    confirm = (1 + cfg.confirm_candidates) * (cfg.confirm_rounds * 2 * cfg.confirm_tokens + 8) * ar
    replay = max(0.0, probed.took_s - probed.calibration_s)
    return calibration + validation + replay + (confirm if cfg.confirm_rounds else 0.0)
