"""Cost-aware trees: per cycle, the depth and V that maximise expected emitted tokens per modelled second.

Training-free: the only inputs are the draft's own path scores, mapped to acceptance probabilities by an
:class:`~.acceptance.AcceptanceCalibration` fitted on greedy traces, and this machine's
:class:`~adaptree.offline.latency.LatencyModel`.

**Objective (renewal reward).** Decoding is a sequence of independent-ish cycles; a cycle with tree ``T`` emits
``R(T)`` tokens in ``C(T)`` seconds, and the long-run throughput of a policy is ``E[R] / E[C]`` (renewal-reward
theorem: a ratio of means, not a mean of ratios). Maximising a ratio is Dinkelbach's problem: with ``lambda``
= the best achievable throughput, the optimal policy maximises, cycle by cycle, the *linear* value
``E[R(T)] - lambda * C(T)``, and ``lambda`` is found by iterating "solve the linear problem, set ``lambda`` to the
throughput it achieves". The controller runs that iteration online: ``lambda`` is its running throughput
estimate, ``EMA(emitted tokens) / EMA(cycle seconds)`` over the cycles so far (weight ``smoothing``), started at
the autoregressive rate ``1 / (verify(0, L) + other_s)`` of the first cycle. The cycle seconds are, with
``timing="model"`` (default), the latency model's time of the cycle's (W, depth, V, L) as recorded in its
:class:`~adaptree.core.records.CycleRecord`: ``lambda`` is then in the units of the modelled costs it multiplies
(a machine uniformly slower than its model scales measured seconds, not the modelled costs, and would make every
cost look cheaper), decisions never depend on the wall clock, and a replay makes the live engine's decisions.
``timing="record"`` takes the record's ``draft_s + verify_s + other_s`` instead (measured live, modelled in replay).

**Expected tokens.** With ``p_i`` = calibrated acceptance probability of candidate ``i``'s whole path, a tree of
the top-``V`` candidates (the engine keeps the top-``V`` by score; the calibration is monotone, so these are the
``V`` largest ``p_i``) emits in expectation ``1 + sum_{top V} p_i`` tokens (the bonus token, plus every verified
node whose path is accepted: exactly the nodes of the accepted path).

**Decisions.** ``L`` = the cycle's context length; all times are the latency model's.

* ``choose_size``: ``V* = argmax_{V in 0..min(candidates, max_size)} sum_{top V} p - lambda * verify(V, L)``
  (one cumulative sum; ``V = 0`` verifies the root alone; the smallest ``V`` on ties).
* ``continue_drafting`` (one-step look-ahead): the next level's children are predicted before drafting them:
  child rank ``k`` of beam node ``b`` gets ``p_b * child_rates[k]`` (the calibration's measured probability that
  the rank-``k`` child of an accepted beam node is accepted). Draft on iff the best linear value of the
  candidates with the predicted ones merged in exceeds the best value without them by more than
  ``lambda * draft_step(W, L)``: the gain is capped by what ``max_size`` can still take and pays for the extra
  verification of the nodes it adds to the best tree. The value of a level shrinks with depth (each level
  multiplies the path probabilities by a rate below 1), so stopping at the first level that does not pay is
  the one-step look-ahead rule of optimal stopping for such monotone problems. Depth is capped by
  ``max_depth`` through the plan.
* ``begin_cycle``: ``TreePlan(width, max_depth, max_size)``, or an autoregressive step ``TreePlan(1, 0, 0)``
  (no drafting) in AR mode, except every ``probe_every``-th AR-mode cycle, which drafts to re-check (each probe
  that finds no tree paying doubles that interval, up to ``max_probe_every``). The
  *predicted advantage* of a drafted cycle over an AR step at the same ``lambda`` is
  ``[1 + sum_{top V*} p - lambda*(depth*draft_step + verify(V*) + other_s)] - [1 - lambda*(verify(0) + other_s)]``;
  AR mode is entered when its exponential moving average (weight ``smoothing``, started at the first value)
  falls below 0, and left when a probe cycle's advantage is positive.

Per cycle the controller costs a top-``max_size`` of the scores, an interpolation and a few vectors of
``max_size + W^2`` entries (no Python loop over candidates). Its decisions depend only on its inputs (scores,
context length, the records' seconds): deterministic, no wall clock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from adaptree.core.config import between, bounded, check_fields, choice, positive
from adaptree.core.controller import AR_PLAN, Controller, CycleContext, TreePlan, check_shape
from adaptree.core.records import CycleRecord
from adaptree.core.tree import DraftStep, DraftTree
from adaptree.methods.common.pricing import MAX_SIZE, best_size, level_pays, top_probs
from adaptree.methods.costaware.acceptance import AcceptanceCalibration
from adaptree.offline.latency import LatencyModel, load_checked

TIMINGS = ("model", "record")
"""Where the throughput estimate's cycle seconds come from (:attr:`CostAwareConfig.timing`)."""


@dataclass
class CostAwareConfig:
    """Cost-aware trees: depth and V maximising expected tokens per modelled second (training-free)."""

    width: int = 10
    """Beam width W: top-k per expansion and beam size."""
    max_depth: int = 8
    """Largest draft depth (draft forwards per cycle); the cost rule usually stops earlier."""
    max_size: int = MAX_SIZE
    """Largest verification size V (draft nodes sent to the target; the root is extra)."""
    latency: str | None = None
    """Latency model JSON of this machine (`adaptree calibrate`)."""
    acceptance: str | None = None
    """Acceptance calibration JSON of this model and head (AcceptanceCalibration.fit on greedy traces)."""
    probe_every: int = positive(8, integer=True)
    """In AR mode, draft one cycle in this many to re-check whether a tree pays."""
    max_probe_every: int = 64
    """Each probe that finds no tree paying doubles that interval, up to this many cycles."""
    smoothing: float = between(0.0, 1.0, 0.1, lo_open=True)
    """Weight of the newest cycle in the moving averages (throughput estimate, predicted tree advantage)."""
    price_scale: float = bounded(1.0, lo=0.0, lo_open=True)
    """Multiplies the price lambda of verified nodes and draft steps (1: the renewal-reward rule's; other values
    test whether the rule sits at its optimum: docs/ltd.md)."""
    timing: str = choice(TIMINGS, "model")
    """Cycle seconds behind the throughput estimate: model (the latency model's time of the cycle's W, depth and V:
    the units of the modelled costs; deterministic, the same live and in replay) or record (the record's draft_s +
    verify_s + other_s: measured live, modelled in replay)."""

    def __post_init__(self) -> None:
        check_shape(self.width, self.max_depth, self.max_size, "max_depth")
        check_fields(self)
        if int(self.max_probe_every) != self.max_probe_every or self.max_probe_every < self.probe_every:
            raise ValueError(f"max_probe_every must be an integer >= probe_every ({self.probe_every}), got "
                             f"{self.max_probe_every!r}")

    def plan(self) -> TreePlan:
        return TreePlan(self.width, self.max_depth, self.max_size)




class CostAwareController(Controller):
    """Per-cycle depth and V by the renewal-reward (Dinkelbach) rule of the module docstring.

    :param config: the settings; its ``latency`` / ``acceptance`` paths are read when no object is given.
    :param latency_model: this machine's latency model (wins over ``config.latency``).
    :param calibration: the acceptance calibration (wins over ``config.acceptance``).
    :raises ValueError: a latency model or calibration is neither given nor named in the config.
    :raises FileNotFoundError: a named file does not exist.
    """

    name = "costaware"
    reads_features = False

    def __init__(self, config: CostAwareConfig | None = None, latency_model: LatencyModel | None = None,
                 calibration: AcceptanceCalibration | None = None) -> None:
        self.config = cfg = config or CostAwareConfig()
        self.latency = latency_model if latency_model is not None else _load(
            cfg.latency, "latency model", "latency", "make one with `adaptree calibrate`", load_checked, self.name)
        self.calibration = calibration if calibration is not None else _load(
            cfg.acceptance, "acceptance calibration", "acceptance",
            "fit one with adaptree.methods.costaware.AcceptanceCalibration.fit(traces).save(PATH)",
            AcceptanceCalibration.load, self.name)
        self.plan = cfg.plan()
        self.rates = self.calibration.rates(cfg.width)
        self._sizes = np.arange(cfg.max_size + 1)
        self.reset()

    # ------------------------------------------------------------------------------------------- state

    def use_latency(self, latency) -> None:
        """The machine's latency model (in replay: the simulated machine's) replaces the configured one."""
        self.latency = latency

    def reset(self) -> None:
        self.tok_avg: float | None = None  # EMA of emitted tokens per cycle
        self.sec_avg = 0.0  # EMA of cycle seconds
        self.rate = 0.0  # lambda: tokens per second
        self.advantage: float | None = None  # EMA of the predicted advantage of a tree over an AR step
        self.ar_mode = False
        self.ar_cycles = 0  # AR steps since entering AR mode or since the last probe
        self.interval = int(self.config.probe_every)  # AR steps before the next probe
        self.probing = False
        self.last_size = 0
        self.last_expected = 1.0  # predicted emitted tokens of the last drafted cycle
        self.last_advantage = 0.0

    # --------------------------------------------------------------------------------- decision points

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        lat, cfg = self.latency, self.config
        L = ctx.context_len
        self.L = L
        self.verify_s = lat.verify_times(self._sizes, L)  # [max_size + 1] seconds, V = 0..max_size
        self.t_ar = float(self.verify_s[0]) + lat.other_s
        if self.tok_avg is None:  # first cycle of the generation: the AR rate
            self.tok_avg, self.sec_avg = 1.0, self.t_ar
            self.rate = 1.0 / self.t_ar if self.t_ar > 0 else 0.0
        lam = self.rate * cfg.price_scale
        self.cost = lam * self.verify_s
        self.step_s = lat.draft_step(cfg.width, L)
        self.step_cost = lam * self.step_s
        self.probing = False
        if self.ar_mode:
            self.ar_cycles += 1
            if self.ar_cycles < self.interval:
                return AR_PLAN
            self.ar_cycles, self.probing = 0, True
        return self.plan

    def continue_drafting(self, step: DraftStep) -> bool:
        return level_pays(step, self.calibration, self.rates, self.config.max_size, self.cost, self.step_cost)

    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        p = top_probs(tree, min(plan.size, self.config.max_size), self.calibration)
        v, value = best_size(p, self.cost)
        lam = self.rate
        # Predicted advantage over an AR step at the same lambda: [1 + gain - lam*(depth*step + verify(V) + other)]
        # - [1 - lam*(verify(0) + other)] = value - lam*(depth*step - verify(0)).
        adv = value - lam * (tree.depth * self.step_s - float(self.verify_s[0]))
        self._drafted(v, 1.0 + float(p[:v].sum()), adv)
        return v

    def _drafted(self, v: int, expected: float, adv: float) -> None:
        """A drafted cycle chose ``v`` nodes expected to emit ``expected`` tokens, with the predicted advantage
        ``adv`` over an AR step: update the AR-mode state (probe outcome, or the advantage's moving average)."""
        self.last_size, self.last_expected, self.last_advantage = v, expected, adv
        beta = self.config.smoothing
        if self.probing:
            if adv > 0:
                self.ar_mode, self.advantage, self.interval = False, adv, int(self.config.probe_every)
            else:
                self.interval = min(2 * self.interval, int(self.config.max_probe_every))
        else:
            self.advantage = adv if self.advantage is None else (1 - beta) * self.advantage + beta * adv
            if self.advantage < 0:
                self.ar_mode, self.ar_cycles = True, 0

    def end_cycle(self, record: CycleRecord) -> None:
        if self.config.timing == "model":
            seconds = self.latency.cycle_time(record.width, record.depth, record.size + record.chain_nodes,
                                              record.context_len)
        else:
            seconds = record.draft_s + record.verify_s + record.other_s
        if seconds <= 0:  # no timings (a replay without a latency model): keep lambda
            return
        beta = self.config.smoothing
        self.tok_avg = (1 - beta) * self.tok_avg + beta * record.emitted
        self.sec_avg = (1 - beta) * self.sec_avg + beta * seconds
        self.rate = self.tok_avg / self.sec_avg if self.sec_avg > 0 else 0.0


def _load(path: str | None, what: str, option: str, remedy: str, loader, method: str = "costaware"):
    if not path:
        article = "an" if what[0] in "aeiou" else "a"
        raise ValueError(f"method {method!r} needs {article} {what}: pass one to its controller or set the config's "
                         f"{option!r} (--{method}-{option} FILE); {remedy}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {str(path)!r} ({method} {option!r}) does not exist; {remedy}")
    return loader(path)
