"""``adaptree train ltd``: LTD's two policies trained with PPO (Stable-Baselines3), co-adapted.

Stages (SPEC.md §2), each a PPO run on a gymnasium environment of :mod:`adaptree.offline.envs`:

==============  ======  =========================================================  ======================
stage           learns  the other decision                                          validated as
==============  ======  =========================================================  ======================
stage1-size     π_V     depth uniform in 1..max_depth (RandomDepthController)        ltd-size, depth 8
stage1-depth    π_D     V = 60 (EAGLE-3's), or π_V of stage1-size (``depth_partner``)  ltd-depth, V 60 / ltd
iter1-size      π_V     π_D of stage1-depth, frozen                                   ltd (both)
iter2-depth     π_D     π_V of iter1-size, frozen                                     ltd (both)
iter3-size      π_V     π_D of iter2-depth, frozen                                    ltd (both)
==============  ======  =========================================================  ======================

Iteration k starts from the policy (actor and critic) the previous stage of the same kind ended with. With
``init`` (a fine-tune, e.g. ``adaptree train ltd --machine``) only the iterations run, the first of each kind
starting from the init pair's actor (a fresh critic), and Iter0 is the init pair itself.

Machines: with ``costs`` the observations end with the cost features of the latency model
(:mod:`adaptree.offline.family`); with ``family``/``spread`` every generation of the simulator runs on a member
of a :class:`~adaptree.offline.family.LatencyFamily` drawn for it (rewards are speedups over that member's AR
step), and validation is the geometric mean of the speedups on the family's measured models. Controllers
evaluated here run without the AR fallback (the policies alone).
Every ``eval_every`` rollouts (and at the end) the current actor is extracted as a plain
:class:`~adaptree.offline.policy.MLPPolicy` and replayed on the validation traces (prompts never trained on)
by the simulator; the stage keeps the checkpoint with the best modelled speedup. Then Iter0..Iter3
(= (stage1-depth, stage1-size), (stage1-depth, iter1-size), (iter2-depth, iter1-size),
(iter2-depth, iter3-size)) are compared on validation and the best pair is exported to ``OUT/policy``
(``depth/`` and ``size/``: safetensors + JSON; no pickles anywhere in the run folder).

Environment: the simulator over greedy traces of training prompts (HumanEval problems 82.. and ShareGPT
train-split first turns, :func:`~adaptree.data.splits.policy_training_prompts`) with a calibrated latency
model, by default; ``live=True`` trains on the live engine with wall-clock rewards instead (one
environment, slow; validation still on the simulator). Resumable per stage: a finished stage (its
``result.json``) is skipped on a rerun with the same settings; an interrupted stage restarts.
PPO defaults are the paper's (rollout 2048, minibatch 256, 20 epochs, entropy 0.01, lr 1e-3 with 1%
warm-up then linear decay, γ 0.999 / 0.9, actor [1024] critic [1024, 256] / both [1024, 256]); the step
budgets are smaller than the paper's 1M / 100k (a CPU budget; the validation curves in ``log.csv`` show
whether they suffice).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from adaptree.core.config import at_least, between, check_fields, choice, positive
from adaptree.core.controller import StaticConfig, StaticController
from adaptree.methods.common import CHAIN_OPTIONS, RULE, SIZE_FACTORS, ChainCalibration, ChainRule
from adaptree.methods.costaware.acceptance import AcceptanceCalibration
from adaptree.methods.ltd.controller import (
    DEPTH_ACTIONS,
    LTD_SIZES,
    LTDConfig,
    LTDController,
    LTDObservation,
)
from adaptree.methods.ltd.env import DepthEnv, RandomDepthController, SizeEnv
from adaptree.offline.envs import REWARDS, SimSource
from adaptree.offline.policy import MLPPolicy, MLPPolicyConfig
from adaptree.offline.runs import (
    TrainingResult,
    CsvLog,
    dataclass_from_dict,
    pin_settings,
    save_tensors,
    settings_of,
    split_by_key,
    write_json,
)

STAGES = ("stage1-size", "stage1-depth", "iter1-size", "iter2-depth", "iter3-size")
LOG_FIELDS = ("timesteps", "seconds", "train_reward", "val_speedup", "val_tau", "val_depth", "val_size")


@dataclass
class LTDTrainConfig:
    """Settings of an LTD training run (defaults: the paper's, step budgets for a CPU)."""

    out: str = "runs/ltd"
    """Run folder: per-stage folders, summary.json, policy/ (the export)."""
    width: int = positive(10)
    """Beam width W of the trees (EAGLE-3's)."""
    max_depth: int = positive(12)
    """Largest depth the depth policy may reach (LTD: 12)."""
    fixed_size: int = positive(60)
    """V while the depth policy trains alone (stage 1; EAGLE-3's 60)."""
    depth_partner: str = choice(("fixed", "size"), "fixed")
    """What decides V while π_D trains in stage 1: fixed = ``fixed_size`` (EAGLE-3's 60, the paper); size = the
    stage-1 size policy (over a family of machines no one V suits every member: with V = 60 the depth policy only
    learns that deep trees lose where 60 nodes cost much)."""
    fixed_depth: int = positive(8)
    """Depth when the size policy is validated alone (EAGLE-3's 8)."""
    sizes: tuple[int, ...] = LTD_SIZES
    """The size policy's actions (LTD: 20, 40, ..., 240)."""
    size_steps: int = positive(60_000)
    """Stage-1 environment steps of π_V (paper: 100k)."""
    depth_steps: int = positive(150_000)
    """Stage-1 environment steps of π_D (paper: 1M)."""
    iter_steps: int = positive(40_000)
    """Environment steps of each co-adaptation iteration."""
    iterations: int = between(0, 3, 3)
    """Co-adaptation iterations after stage 1 (0..3: Iter1..Iter3)."""
    only: str | None = choice(("size", "depth"), None)
    """``size`` or ``depth``: train that stage-1 policy alone and export it (the paper's reward and
    observation ablations are on the size policy alone); None = the whole pipeline."""
    reward: str = choice(REWARDS[:3], "throughput")
    """throughput (LTD), acceptance or time (the paper's reward ablation); see adaptree.offline.envs."""
    use_depth: bool = True
    """Observation includes D (ablation P+L when False)."""
    use_length: bool = True
    """Observation includes L (ablation P+D when False)."""
    n_envs: int = positive(8)
    """Environments stepped together (a rollout is ``rollout`` steps in all)."""
    rollout: int = positive(2048)
    """PPO rollout length (all environments together; paper: 2048)."""
    batch_size: int = positive(256)
    n_epochs: int = positive(20)
    ent_coef: float = 0.01
    lr: float = 1e-3
    warmup: float = 0.01
    """Fraction of a stage's steps with a linear learning-rate warm-up; then linear decay to 0."""
    gamma_depth: float = 0.999
    gamma_size: float = 0.9
    depth_pi: tuple[int, ...] = (1024,)
    depth_vf: tuple[int, ...] = (1024, 256)
    size_pi: tuple[int, ...] = (1024, 256)
    size_vf: tuple[int, ...] = (1024, 256)
    val_fraction: float = between(0.0, 1.0, 0.25, lo_open=True, hi_open=True)
    """Share of the training traces (by prompt) held out for checkpoint selection."""
    eval_every: int = positive(8)
    """Validate every this many rollouts (and at the end of a stage)."""
    costs: bool = False
    """The policies see the machine's cost features (adaptree.offline.family)."""
    family: tuple[str, ...] = ()
    """More latency models to train over, next to the main one: JSON files, or a family index (``standard``: the
    shipped one, adaptree.offline.family; its held-out members are never trained on). Each generation runs on a
    member drawn at random (perturbed by ``spread``); validation is the geometric mean over the given files, or over
    the index's validation members."""
    spread: float = at_least(1.0, 1.0)
    """Perturbation of the family's members: draft step, verification growth and overhead each scaled by a factor
    drawn log-uniformly from [1/spread, spread] (1 = none)."""
    match: bool = False
    """The policies observe the cycle's context match and every cycle carries the context's chain (the chain
    calibration is fitted on the training traces, ``OUT/chain.json``)."""
    chain_tokens: int = positive(16, integer=True)
    """With ``match``: the longest context chain per cycle."""
    machine_tree: bool = False
    """The policies see the machine's static tree (its depth, the best V at the current depth) and the size policy
    chooses V as a factor of that V (adaptree.methods.common.SIZE_FACTORS; ``sizes`` is then unused): each family
    member's tree is fitted on the training traces, the machine setup's static_gs.json gives it at inference."""
    first_decision: bool = False
    """π_D is also asked before the first draft forward: STOP makes the cycle an AR step with the context's chain
    (with ``init``, added to the init pair's observation)."""
    validation_band: tuple[float, ...] = ()
    """``(lo, hi)``: the family index's training members whose verification of 64 nodes costs lo..hi rows are not
    trained on but validated on (checkpoints and the iteration pair are chosen on them too): a region held out so that
    a policy that only pays where it trained (the first decision's "chain alone") is caught. Empty: none."""
    chain_split: bool = False
    """π_V chooses how the cycle's verified nodes divide between the head and the context chain: V and the chain's
    length (adaptree.methods.common.CHAIN_OPTIONS: a token count, or the chain rule's length) together, instead of V
    alone with the rule sizing the chain after it. Needs ``match``. With ``init`` (a plain size policy), each of its
    V actions is paired with every chain option, the rule's keeping its logit and the others starting
    ``CHAIN_INIT_GAP`` below it: the fine-tune starts from the init pair's decisions."""
    rule: bool = False
    """The policies may defer to the hybrid rule: π_D has a third action, RULE (costaware's look-ahead decides), and
    π_V the priced V (hybrid's V; with ``chain_split`` next to the chain rule's length), both at the rule's price (the
    cycles' running throughput); the acceptance calibration is fitted on the training traces (``OUT/acceptance.json``).
    Needs ``match``. With ``init`` the two actions are added to the init pair with leading logits
    (:func:`with_rule_action`): the fine-tune starts from the rule's decisions and learns where to leave them."""
    init: str | None = None
    """A policy pair folder (depth/ and size/) to start from: a fine-tune (e.g. for one machine) that runs the
    co-adaptation iterations only, each policy starting from the init's actor; Iter0 is the init pair."""
    seed: int = 0
    threads: int | None = None
    """torch threads for PPO updates (None: torch's default)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.rollout % self.n_envs:
            raise ValueError(f"rollout ({self.rollout}) must be a multiple of n_envs ({self.n_envs})")
        if not 1 <= self.fixed_depth <= self.max_depth:
            raise ValueError(f"fixed_depth must be in 1..max_depth={self.max_depth}, got {self.fixed_depth}")
        self.sizes = tuple(int(v) for v in self.sizes)
        if len(self.sizes) < 2 or min(self.sizes) < 1:
            raise ValueError(f"sizes needs at least 2 values >= 1, got {self.sizes}")
        self.family = tuple(str(f) for f in self.family)
        if self.only == "depth" and self.depth_partner == "size":
            raise ValueError("--only depth trains the depth policy alone: it needs --depth-partner fixed")
        self.validation_band = tuple(float(x) for x in self.validation_band)
        if self.validation_band and (len(self.validation_band) != 2 or not self.family):
            raise ValueError(f"validation_band needs two numbers (lo, hi) and a family index, got "
                             f"{list(self.validation_band)}")
        if self.chain_split and not self.match:
            raise ValueError("chain_split needs match: the size policy sizes the context chain it observes")
        if self.rule and not self.match:
            raise ValueError("rule needs match: the rule prices the head's nodes next to the context chain")
        if self.init is not None and (self.only or self.iterations < 1):
            raise ValueError("init (a fine-tune) runs the co-adaptation iterations: it needs iterations >= 1 and "
                             "no --only")

    def observation(self, reference_costs: list[float] | None = None) -> LTDObservation:
        return LTDObservation(width=self.width, max_depth=self.max_depth, use_depth=self.use_depth,
                              use_length=self.use_length, use_costs=self.costs, reference_costs=reference_costs,
                              use_match=self.match, use_tree=self.machine_tree, relative_sizes=self.machine_tree,
                              first_decision=self.first_decision, chain_split=self.chain_split)

    @property
    def size_actions(self) -> list:
        """The size policy's actions: V values, or factors of the machine tree's V (``machine_tree``); with
        ``chain_split`` each paired with every chain option."""
        sizes = list(SIZE_FACTORS) if self.machine_tree else list(self.sizes)
        actions = [[v, k] for v in sizes for k in CHAIN_OPTIONS] if self.chain_split else sizes
        return actions + [PRICED if self.chain_split else RULE] if self.rule else actions

    @property
    def depth_actions(self) -> list[str]:
        return list(DEPTH_ACTIONS if self.rule else DEPTH_ACTIONS[:2])

    def stages(self) -> list[str]:
        if self.only:
            return [f"stage1-{self.only}"]
        if self.init is not None:
            return list(STAGES[2:2 + self.iterations])
        return list(STAGES[:2 + self.iterations])

    def latency_family(self, latency):
        """The family trained over (None: the one ``latency``, as LTD does): ``latency`` first, then every entry of
        ``family`` (a latency model file, or a family index whose members not held out are taken)."""
        from adaptree.offline.family import family_around

        return family_around(latency, self.family, self.spread, self.validation_band or None)


def _lr_schedule(lr: float, warmup: float):
    def f(progress_remaining: float) -> float:
        t = 1.0 - progress_remaining
        if warmup > 0 and t < warmup:
            return lr * max(t, 1e-3 * warmup) / warmup
        return lr * max(0.0, 1.0 - t) / max(1e-9, 1.0 - warmup)
    return f


def split_traces(traces: list, val_fraction: float, seed: int = 0) -> tuple[list, list]:
    """Train / validation traces by prompt key (deterministic, order-free; at least one of each)."""
    return split_by_key(traces, val_fraction, seed, key=lambda t: t.key, both="LTD training needs at least 2 traces")


class Calibrations(NamedTuple):
    """What a run fits on its training traces: the chain calibration (``match``) and the acceptance calibration (the
    rule's decisions, ``rule``); None where the run does not use it."""

    chain: ChainCalibration | None = None
    acceptance: AcceptanceCalibration | None = None


def _ltd(cfg: LTDTrainConfig, depth_policy: MLPPolicy | None = None, size_policy: MLPPolicy | None = None,
         cals: Calibrations = Calibrations(), chain_rule=None, **shape) -> LTDController:
    """An LTD controller of in-memory policies, as training evaluates it: the policies alone (no AR fallback), with
    the run's context chain when it trains with ``match`` (``cals``: the run's calibrations; ``chain_rule``: an
    environment's rule, shared)."""
    chain = dict(chain_tokens=cfg.chain_tokens) if cfg.match else {}
    return LTDController(LTDConfig(width=cfg.width, ar_fallback=False, **chain, **shape), depth_policy=depth_policy,
                         size_policy=size_policy, chain_calibration=cals.chain, chain_rule=chain_rule,
                         acceptance=cals.acceptance)


class _Stage:
    """One PPO run; what it learns, against what, and how it is validated."""

    def __init__(self, name: str, cfg: LTDTrainConfig, partner: MLPPolicy | None, obs: LTDObservation,
                 cals: Calibrations = Calibrations()) -> None:
        self.name, self.cfg, self.partner, self.obs, self.cals = name, cfg, partner, obs, cals
        self.kind = "size" if name.endswith("size") else "depth"
        self.iteration = name.startswith("iter")

    @property
    def steps(self) -> int:
        c = self.cfg
        if self.iteration:
            return c.iter_steps
        return c.size_steps if self.kind == "size" else c.depth_steps

    def policy_config(self) -> MLPPolicyConfig:
        c, obs = self.cfg, self.obs
        if self.kind == "size":
            return MLPPolicyConfig("ltd-size", obs.size_dim, c.size_actions, list(c.size_pi), "tanh", obs.to_dict())
        return MLPPolicyConfig("ltd-depth", obs.depth_dim, c.depth_actions, list(c.depth_pi), "tanh", obs.to_dict())

    def inner(self, rng: np.random.Generator, chain=None):
        """The other decisions during training (``chain``: the environment's chain rule, whose length a chain-split
        size partner chooses)."""
        c = self.cfg
        if self.kind == "size":
            if self.partner is None:
                return RandomDepthController(rng, c.width, 1, c.max_depth, c.fixed_size)
            return _ltd(c, depth=c.max_depth, mode="depth", depth_policy=self.partner, cals=self.cals)
        if self.partner is None:
            return StaticController(StaticConfig(c.width, c.max_depth, c.fixed_size))
        return _ltd(c, depth=c.max_depth, mode="size", size_policy=self.partner, cals=self.cals,
                    chain_rule=chain)

    def controller(self, policy: MLPPolicy) -> LTDController:
        """How the stage's policy is validated (see the module docstring)."""
        c, cal = self.cfg, self.cals
        if self.kind == "size":
            if self.partner is None:
                return _ltd(c, depth=c.fixed_depth, mode="size", size_policy=policy, cals=cal)
            return _ltd(c, depth=c.max_depth, depth_policy=self.partner, size_policy=policy, cals=cal)
        if self.partner is None:
            return _ltd(c, depth=c.max_depth, size=c.fixed_size, mode="depth", depth_policy=policy, cals=cal)
        return _ltd(c, depth=c.max_depth, depth_policy=policy, size_policy=self.partner, cals=cal)

    def make_env(self, source, seed: int):
        c, obs = self.cfg, self.obs
        chain = None
        if c.match:  # one per environment: it has state
            chain = ChainRule(self.cals.chain, c.chain_tokens)
            chain.acceptance = self.cals.acceptance

        def inner(rng: np.random.Generator):
            return self.inner(rng, chain)

        if self.kind == "size":
            return SizeEnv(source, obs, inner, sizes=c.size_actions, reward=c.reward, seed=seed, chain=chain)
        return DepthEnv(source, obs, inner, actions=len(self.policy_config().actions), reward=c.reward, seed=seed,
                        chain=chain)


def evaluate(controller, traces: list, latency) -> dict:
    """Modelled speedup, tau, mean depth and V of ``controller`` replayed on ``traces`` (policy time apart).

    ``latency`` may be a list of latency models (a family's measured members): then the speedup is the
    geometric mean over them (``per_machine`` lists each), the other numbers their means."""
    from adaptree.offline.simulator import simulate

    models = list(latency) if isinstance(latency, (list, tuple)) else [latency]
    rows = []
    for m in models:
        s = simulate(controller, traces, m, measure_policy=False).summary()
        rows.append({k: s[k] for k in ("modelled_speedup", "tau", "mean_depth", "mean_size", "cycles")})
    if len(rows) == 1:
        return rows[0]
    out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    out["modelled_speedup"] = float(np.exp(np.mean(np.log([max(r["modelled_speedup"], 1e-9) for r in rows]))))
    out["per_machine"] = [round(r["modelled_speedup"], 5) for r in rows]
    return out


def _run_stage(stage: _Stage, cfg: LTDTrainConfig, train_source, val_traces, latency, folder: Path,
               init: Path | MLPPolicy | None, progress: bool) -> dict:
    """Train one stage with SB3 PPO; returns its result (best validation, times). ``init``: the previous stage's
    SB3 state (actor and critic), or a policy whose actor starts this stage (a fine-tune)."""
    from safetensors.torch import load_file
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import DummyVecEnv

    folder.mkdir(parents=True, exist_ok=True)
    n_envs = cfg.n_envs if isinstance(train_source, SimSource) else 1
    seed0 = cfg.seed * 1000 + STAGES.index(stage.name) * 100
    venv = DummyVecEnv([lambda i=i: stage.make_env(train_source, seed0 + i) for i in range(n_envs)])
    arch = (dict(pi=list(cfg.size_pi), vf=list(cfg.size_vf)) if stage.kind == "size"
            else dict(pi=list(cfg.depth_pi), vf=list(cfg.depth_vf)))
    model = PPO("MlpPolicy", venv, learning_rate=_lr_schedule(cfg.lr, cfg.warmup), n_steps=cfg.rollout // n_envs,
                batch_size=cfg.batch_size, n_epochs=cfg.n_epochs, ent_coef=cfg.ent_coef,
                gamma=cfg.gamma_size if stage.kind == "size" else cfg.gamma_depth,
                policy_kwargs=dict(net_arch=arch), seed=seed0, device="cpu", verbose=0)
    if isinstance(init, MLPPolicy):  # a fine-tune: the given actor, a fresh critic
        init.into_sb3(model.policy)
    elif init is not None:  # co-adaptation: start from the previous stage's actor and critic
        model.policy.load_state_dict(load_file(str(init)), strict=True)
    pcfg = stage.policy_config()
    log = CsvLog(folder / "log.csv", LOG_FIELDS)
    best = {"modelled_speedup": -1.0}
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=stage.steps, desc=f"ltd {stage.name}", unit="step", dynamic_ncols=True)

    def validate() -> dict:
        nonlocal best
        policy = MLPPolicy.from_sb3(model.policy, pcfg)
        ev = evaluate(stage.controller(policy), val_traces, latency)
        if ev["modelled_speedup"] > best["modelled_speedup"]:
            best = {**ev, "timesteps": int(model.num_timesteps)}
            policy.save(folder / "policy", training={"stage": stage.name, **best})
            save_tensors(model.policy.state_dict(), folder / "sb3_policy.safetensors")
        return ev

    class Callback(BaseCallback):
        rollouts = 0

        def _on_step(self) -> bool:
            return True

        def _on_rollout_end(self) -> None:
            Callback.rollouts += 1
            buf = self.model.rollout_buffer
            r = float(buf.rewards.sum() / max(1, int(buf.episode_starts.sum()) or 1))
            row = dict(timesteps=int(self.model.num_timesteps), seconds=round(time.perf_counter() - t0, 2),
                       train_reward=round(r, 5))
            if Callback.rollouts % cfg.eval_every == 0:
                ev = validate()
                row.update(val_speedup=round(ev["modelled_speedup"], 5), val_tau=round(ev["tau"], 4),
                           val_depth=round(ev["mean_depth"], 3), val_size=round(ev["mean_size"], 2))
                if bar is not None:
                    bar.set_postfix(val=f"{ev['modelled_speedup']:.3f}x", best=f"{best['modelled_speedup']:.3f}x")
            log.append(row)
            if bar is not None:
                bar.update(cfg.rollout)

    threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        model.learn(total_timesteps=stage.steps, callback=Callback())
        validate()
    finally:
        torch.set_num_threads(threads)
        venv.close()
        if bar is not None:
            bar.close()
    return {"stage": stage.name, "kind": stage.kind, "steps": int(model.num_timesteps),
            "seconds": time.perf_counter() - t0, "best": best}


def _settings(cfg: LTDTrainConfig, fingerprints: dict, family) -> dict:
    extra = {"fingerprints": fingerprints}
    if family is not None:
        extra["family"] = family.describe()
    return settings_of(cfg, skip=("out", "threads", "eval_every"), extra=extra)


CHAIN_INIT_GAP = 2.0
"""How far below the rule's logit a plain size policy's other chain options start (``chain_split`` with ``init``):
argmax keeps the init's decisions, PPO samples the others about a third of the time at first."""


def with_chain_options(policy: MLPPolicy, gap: float = CHAIN_INIT_GAP) -> MLPPolicy:
    """A plain size policy as a chain-split one: each V action paired with every chain option (CHAIN_OPTIONS), the
    rule's with the V's logit, the others ``gap`` below it (the same decisions under argmax)."""
    obs = LTDObservation.from_dict(policy.config.observation)
    if obs.chain_split or not obs.use_match:
        raise ValueError("with_chain_options needs a size policy that observes the match and does not size the chain")
    c = policy.config
    out = MLPPolicy(dataclasses.replace(c, actions=[[v, k] for v in c.actions for k in CHAIN_OPTIONS],
                                        observation={**c.observation, "chain_split": True}))
    n = len(CHAIN_OPTIONS)
    with torch.no_grad():
        out.body.load_state_dict(policy.body.state_dict())
        out.head.weight.copy_(policy.head.weight.repeat_interleave(n, 0))
        offset = torch.tensor([0.0 if k == RULE else -gap for k in CHAIN_OPTIONS]).repeat(len(policy.config.actions))
        out.head.bias.copy_(policy.head.bias.repeat_interleave(n) + offset)
    return out.eval()


PRICED = [RULE, RULE]
"""A chain-split size policy's priced action: hybrid's V with the chain rule's length."""


def with_rule_action(policy: MLPPolicy, lead: float = 0.0) -> MLPPolicy:
    """An LTD policy with the hybrid rule's decision as one more action (π_D: RULE; π_V: the priced V, with the chain
    rule's length when it sizes the chain). Its logit is constant, ``lead`` above the largest any other action can
    reach (the head's biases plus the L1 norms of its rows: the layer below is tanh): with ``lead >= 0`` argmax always
    picks it, and the others keep their order below it."""
    c = policy.config
    obs = LTDObservation.from_dict(c.observation)
    if c.kind == "ltd-depth":
        if list(c.actions) != list(DEPTH_ACTIONS[:2]):
            raise ValueError(f"with_rule_action needs a depth policy with actions {list(DEPTH_ACTIONS[:2])}, got "
                             f"{list(c.actions)}")
        rule = DEPTH_ACTIONS[2]
    else:
        if LTDObservation.priced([obs.action_of(a) for a in c.actions]):
            raise ValueError("with_rule_action: the size policy has the priced V already")
        rule = PRICED if obs.chain_split else RULE
    if not obs.use_match:
        raise ValueError("with_rule_action needs a policy that observes the match: the rule prices its chain")
    out = MLPPolicy(dataclasses.replace(c, actions=[*c.actions, rule]))
    with torch.no_grad():
        out.body.load_state_dict(policy.body.state_dict())
        w, b = policy.head.weight, policy.head.bias
        out.head.weight.copy_(torch.cat([w, torch.zeros_like(w[:1])]))
        out.head.bias.copy_(torch.cat([b, (w.abs().sum(1) + b).max().reshape(1) + lead]))
    return out.eval()


def _init_pair(cfg: LTDTrainConfig) -> dict[str, MLPPolicy]:
    """The fine-tune's starting pair, checked against the run's settings (a plain size policy given chain options
    with ``chain_split``)."""
    folder = Path(cfg.init)
    pair = {f"init-{k}": MLPPolicy.load(folder / k, kind=f"ltd-{k}") for k in ("depth", "size")}
    if cfg.chain_split and not LTDObservation.from_dict(pair["init-size"].config.observation).chain_split:
        pair["init-size"] = with_chain_options(pair["init-size"])
    if cfg.rule:
        for k, actions in (("depth", cfg.depth_actions), ("size", cfg.size_actions)):
            if len(pair[f"init-{k}"].config.actions) + 1 == len(actions):  # the init has no rule action yet
                pair[f"init-{k}"] = with_rule_action(pair[f"init-{k}"])
    for name, p in pair.items():
        o = LTDObservation.from_dict(p.config.observation)
        if (o.width, o.max_depth, o.use_costs, o.use_match, o.use_tree) != (cfg.width, cfg.max_depth, cfg.costs,
                                                                              cfg.match, cfg.machine_tree):
            raise ValueError(f"{folder}/{name[5:]}: the policy was trained with W={o.width}, max_depth={o.max_depth}, "
                             f"costs={o.use_costs}, match={o.use_match}; this run has W={cfg.width}, "
                             f"max_depth={cfg.max_depth}, costs={cfg.costs}, match={cfg.match}")
    if list(pair["init-size"].config.actions) != cfg.size_actions:
        raise ValueError(f"{folder}/size chooses V from {pair['init-size'].config.actions}, this run from "
                         f"{list(cfg.sizes)} (pass --sizes to match)")
    return pair


def _calibrations(cfg: LTDTrainConfig, train: list, out: Path) -> Calibrations:
    """The run's calibrations of the training traces (``out/chain.json`` with ``match``, ``out/acceptance.json`` with
    ``rule``; each fitted once)."""
    chain = acceptance = None
    if cfg.match:
        path = out / "chain.json"
        if not path.is_file():
            ChainCalibration.fit(train).save(path)
        chain = ChainCalibration.load(path)
    if cfg.rule:
        path = out / "acceptance.json"
        if not path.is_file():
            AcceptanceCalibration.fit(train).save(path)
        acceptance = AcceptanceCalibration.load(path)
    return Calibrations(chain, acceptance)


def train_ltd(cfg: LTDTrainConfig, traces: list, latency, progress: bool = True, live_source=None) -> TrainingResult:
    """Run every stage (skipping finished ones), compare Iter0..IterN on validation, export the best pair.

    :param traces: greedy traces of training prompts (split here into train / validation by prompt).
    :param latency: the :class:`~adaptree.offline.latency.LatencyModel` of the simulator.
    :param live_source: a :class:`~adaptree.offline.envs.LiveSource` to train on instead of the simulator.
    """
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    fps = traces[0].fingerprints if traces else {}
    if cfg.machine_tree:  # its machine tree goes into the model's meta: the caller's object stays as it was
        latency = dataclasses.replace(latency, meta=dict(latency.meta))
    family = cfg.latency_family(latency)
    settings = _settings(cfg, {k: fps.get(k) for k in ("model", "head")}, family)
    pin_settings(out, settings, "an LTD run")
    train, val = split_traces(traces, cfg.val_fraction, cfg.seed)
    cals = _calibrations(cfg, train, out)
    if cfg.machine_tree:  # every machine's static tree, fitted on the training prompts (a setup fits its own)
        from adaptree.methods.common.machine_tree import attach

        attach(family.bases if family is not None else [latency], train, cfg.width, cfg.max_depth, progress=progress)
    if live_source is not None and cfg.costs:
        live_source.latency = latency
    source = live_source or SimSource(train, latency, family=family)
    val_latency = family.validation_bases if family is not None else latency  # validation: the family's chosen ones
    policies: dict[str, MLPPolicy] = _init_pair(cfg) if cfg.init else {}
    if policies:
        obs = LTDObservation.from_dict(policies["init-depth"].config.observation)
        # a fine-tune may add the first decision and the chain's length
        obs = dataclasses.replace(obs, first_decision=cfg.first_decision, chain_split=cfg.chain_split)
    else:
        obs = cfg.observation(family.reference_costs() if cfg.costs and family is not None
                              else cfg.observation().costs_of(latency))
    t_start = time.perf_counter()
    results: dict[str, dict] = {}
    last_of = {"size": "init-size" if policies else None, "depth": "init-depth" if policies else None}
    for name in cfg.stages():
        kind = "size" if name.endswith("size") else "depth"
        other = "depth" if kind == "size" else "size"
        partner = policies[last_of[other]] if name.startswith("iter") or (
            name == "stage1-depth" and cfg.depth_partner == "size") else None
        # only π_D makes the decision before drafting: a size stage's policy is asked once a tree was drafted
        stage = _Stage(name, cfg, partner, obs if kind == "depth" else dataclasses.replace(obs, first_decision=False),
                       cals)
        folder = out / name
        done = folder / "result.json"
        if done.exists() and (folder / "policy" / "config.json").exists():
            results[name] = json.loads(done.read_text())
        else:
            prev = last_of[kind]
            init = (policies[prev] if prev.startswith("init-") else out / prev / "sb3_policy.safetensors") \
                if prev else None
            results[name] = _run_stage(stage, cfg, source, val, val_latency, folder, init, progress)
            write_json(results[name], done)
        policies[name] = MLPPolicy.load(folder / "policy", kind=f"ltd-{kind}")
        last_of[kind] = name

    if cfg.only:
        return _finish_single(cfg, out, settings, train, val, results, policies, val_latency, fps, t_start, obs,
                              cals)
    # Iter0..IterN: the pairs the co-adaptation went through, on validation
    pairs = [("init-depth", "init-size") if cfg.init else ("stage1-depth", "stage1-size")]
    for name in cfg.stages()[0 if cfg.init else 2:]:
        d, s = pairs[-1]
        pairs.append((name, s) if name.endswith("depth") else (d, name))
    table = []
    for i, (d, s) in enumerate(pairs):
        ev = evaluate(_ltd(cfg, policies[d], policies[s], cals, depth=cfg.max_depth), val, val_latency)
        table.append({"iteration": i, "depth_policy": d, "size_policy": s, **ev})
    best = max(table, key=lambda r: r["modelled_speedup"])
    export = out / "policy"
    for kind, stage_name in (("depth", best["depth_policy"]), ("size", best["size_policy"])):
        policies[stage_name].save(export / kind, training={
            "stage": stage_name, "iteration": best["iteration"], "val_modelled_speedup": best["modelled_speedup"],
            "reward": cfg.reward, "traces_model": fps.get("model"), "traces_head": fps.get("head"),
            **({"family": settings["family"]} if family is not None else {}),
            **({"init": cfg.init} if cfg.init else {})})
    baselines = {"static-default": evaluate(StaticController(StaticConfig(cfg.width, min(8, cfg.max_depth), 60)),
                                            val, val_latency)}
    for kind in ("depth", "size") if not cfg.init else ():
        name = f"stage1-{kind}"
        baselines[f"ltd-{kind}(stage1)"] = evaluate(_Stage(name, cfg, None, obs, cals).controller(policies[name]),
                                                    val, val_latency)
    summary = {"settings": settings, "train_prompts": [t.key for t in train], "val_prompts": [t.key for t in val],
               "stages": results, "iterations": table, "chosen": best, "baselines_val": baselines,
               "train_seconds_this_run": time.perf_counter() - t_start,
               "train_seconds_all_stages": sum(r["seconds"] for r in results.values()), "export": str(export)}
    return TrainingResult.written(summary, out, export)


def _finish_single(cfg, out: Path, settings, train, val, results, policies, latency, fps, t_start,
                   obs: LTDObservation, cals: Calibrations) -> TrainingResult:
    """``only``: export the one stage-1 policy; summary with its validation next to the static default."""
    name = f"stage1-{cfg.only}"
    stage = _Stage(name, cfg, None, obs, cals)
    ev = evaluate(stage.controller(policies[name]), val, latency)
    policies[name].save(out / "policy" / cfg.only, training={
        "stage": name, "val_modelled_speedup": ev["modelled_speedup"], "reward": cfg.reward,
        "traces_model": fps.get("model"), "traces_head": fps.get("head")})
    static = StaticController(StaticConfig(cfg.width, min(8, cfg.max_depth), 60))
    summary = {"settings": settings, "train_prompts": [t.key for t in train], "val_prompts": [t.key for t in val],
               "stages": results, "chosen": {"policy": name, **ev},
               "baselines_val": {"static-default": evaluate(static, val, latency)},
               "train_seconds_this_run": time.perf_counter() - t_start,
               "train_seconds_all_stages": sum(r["seconds"] for r in results.values()),
               "export": str(out / "policy")}
    return TrainingResult.written(summary, out, out / "policy")


def config_from_dict(d: dict) -> LTDTrainConfig:
    return dataclass_from_dict(LTDTrainConfig, d)
