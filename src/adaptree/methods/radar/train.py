"""Offline REINFORCE for RADAR's prediction model (SPEC.md §4), on a dataset of :mod:`.dataset`.

One episode = one recorded cycle. The states (beam scores after each draft forward) do not depend on
the decisions, only how far the episode gets, so a whole batch of episodes is one LSTM pass:

1. logits for the decisions after draft forwards ``1 .. D-1``; sample STOP/CONTINUE at every one;
   the stop point ``k`` is the first STOP (``D-1``: drafting reached D_max, a forced stop);
2. ``acc ~ dist[k]`` (the recorded exact distribution of that stop point's tree);
3. rewards: ``-alpha`` per CONTINUE; ``beta * speed`` at the stop, ``speed = (acc + 1) / T(k)`` with
   ``T(k) = t_fixed + (k + 1) * t_draft + decisions(k) * t_policy``: ``k + 1`` draft calls, ``decisions(k) =
   min(k + 1, D - 1)`` policy calls, ``t_fixed`` = verification of that tree + per-cycle overhead
   (``+ 1``: the bonus token, which the paper's released code omits; ``bonus=False`` drops it). At a
   forced stop the terminal reward comes one (discounted) step after the last CONTINUE;
4. discounted returns ``G_t`` (gamma 0.99), minus a per-step batch-mean baseline (variance reduction;
   ``baseline="none"`` is plain REINFORCE), loss ``-sum_t log pi(a_t|s_t) (G_t - b_t)``, Adam (lr 1e-4,
   weight decay 1e-4), gradient clipping 1.0, cosine learning-rate schedule, dropout 0.1 in the MLP.

Timing constants: a :class:`~adaptree.offline.latency.LatencyModel` (per cycle: ``t_draft = draft_step(W, L)``,
``t_fixed = verify_time(V_k, L) + other_s`` with the stop point's own V_k and the cycle's context
length L) or three given numbers. ``beta`` defaults to ``1 / throughput`` of the always-continue policy
(EAGLE-3's static depth D_max) on the training cycles, so terminal rewards are about 1 and ``alpha`` is
in those units. A grid over ``alpha`` is trained; each policy is evaluated on a held-out split of the
prompts by the EXACT expected throughput of its deterministic rule (stop iff P(STOP) >= threshold):
``sum_n E[acc_n + 1 | k_n] / sum_n T_n(k_n)`` (tokens per modelled second; no sampling), and the best
is exported. Everything is CPU minutes; no model but the policy is involved.

Greedy traces instead of the dataset (``traces``): a machine's cycles are the roots its best static tree visits on
the traces (:class:`~adaptree.methods.radar.dataset.TraceCycles`), stop point ``k`` verifying the machine's V for
depth ``k + 1`` (:func:`~adaptree.offline.oracle.sizes_by_depth` on the training traces, once per machine) and
accepting the recorded greedy continuation (a point mass). Over a family every drawn member gets its own table,
cycles, rewards and cost features; the exported policy says it verifies a machine's V table (``size_table``) and
stores the lower median of its validation machines' tables for a machine that gives none.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from adaptree.core.config import at_least, between, bounded, check_fields, choice, positive
from adaptree.methods.common.machine_tree import static_features
from adaptree.methods.radar.policy import CONTINUE, STOP, RadarModelConfig, RadarPolicy
from adaptree.offline.latency import LatencyModel
from adaptree.offline.policy import load_strict
from adaptree.offline.runs import (
    TrainingResult,
    CsvLog,
    load_optimizer_tensors,
    optimizer_tensors,
    pin_settings,
    restore_rng,
    rng_tensors,
    save_tensors,
    settings_of,
    split_by_key,
    tensor_metadata,
    write_json,
)


@dataclass
class RadarTrainConfig:
    """REINFORCE settings (paper §3.1 and SPEC.md §4 where they give a number)."""

    data: str = "runs/radar-data"
    """A folder written by ``adaptree radar dataset`` (not read with ``traces``)."""
    traces: str | None = None
    """Train on greedy traces instead (a folder of ``adaptree traces record``, as LTD trains on): every machine's
    cycles come from the same traces, each stop point verifying that machine's V for its depth
    (adaptree.offline.oracle.sizes_by_depth); the exported policy then verifies the machine's V table."""
    width: int | None = at_least(1, None, integer=True)
    """With traces: the beam width W (one of those recorded; default: the only one recorded)."""
    max_depth: int | None = at_least(2, None, integer=True)
    """With traces: D_max, the most draft forwards per cycle (default: the traces' max_depth)."""
    out: str = "runs/radar"
    """Run folder: one sub-folder per alpha (log.csv, checkpoint, policy/), summary.json, policy/ (the best)."""
    alphas: tuple[float, ...] = between(0.0, math.inf, (0.0, 0.003, 0.01, 0.03), hi_open=True)
    """Grid over the per-CONTINUE penalty alpha (in units of beta * speed)."""
    beta: float | None = bounded(None, lo=0.0, lo_open=True)
    """Terminal reward scale; None = 1 / throughput of always-continue on the training cycles."""
    gamma: float = between(0.0, 1.0, 0.99, lo_open=True)
    """Discount (paper: ~0.99)."""
    lr: float = bounded(1e-4, lo=0.0, lo_open=True)
    """Adam learning rate (paper: 1e-4), cosine-annealed to 0 over ``steps``."""
    weight_decay: float = at_least(0.0, 1e-4)
    """Adam weight decay (paper: 1e-4)."""
    dropout: float = between(0.0, 1.0, 0.1, hi_open=True)
    """MLP dropout (paper: 0.1)."""
    grad_clip: float = bounded(1.0, lo=0.0, lo_open=True)
    """Gradient-norm clipping (paper: 1.0)."""
    hidden: int = positive(128)
    """LSTM hidden size (paper: 128)."""
    batch_size: int = positive(256)
    """Episodes (cycles, drawn with replacement) per update."""
    steps: int = positive(4000)
    """Updates per alpha."""
    baseline: str = choice(("mean", "none"), "mean")
    """'mean' (per-step batch-mean return subtracted) or 'none' (plain REINFORCE)."""
    bonus: bool = True
    """Count the target's bonus token in the speed numerator (acc + 1)."""
    latency: str | None = None
    """LatencyModel JSON (adaptree.offline.latency); else t_fixed / t_draft / t_policy."""
    t_fixed: float | None = between(0.0, math.inf, None, hi_open=True)
    """Seconds per cycle outside drafting: verification + overhead (without a latency model)."""
    t_draft: float | None = between(0.0, math.inf, None, hi_open=True)
    """Seconds per draft forward (without a latency model)."""
    t_policy: float = between(0.0, math.inf, 0.0, hi_open=True)
    """Seconds per policy decision (measure with `adaptree radar train --measure-policy`; 0 = ignore)."""
    val_fraction: float = between(0.0, 1.0, 0.1, hi_open=True)
    """Fraction of the recorded prompts held out for choosing alpha (split by prompt key)."""
    threshold: float = between(0.0, 1.0, 0.5, lo_open=True)
    """Deterministic rule used for evaluation: stop iff P(STOP) >= threshold."""
    eval_every: int = positive(500)
    """Validation (exact expected throughput) every this many updates."""
    checkpoint_every: int = positive(500)
    """Checkpoint every this many updates (and at the end)."""
    costs: bool = False
    """The policy sees the machine's cost features (adaptree.offline.family); needs a latency model."""
    machine_tree: bool = False
    """With ``costs`` and ``traces``: the policy also sees the machine's static tree (its depth and V, fitted per
    machine on the training traces; the machine setup's static_gs.json at inference)."""
    family: tuple[str, ...] = ()
    """More latency models to train over, next to ``latency``: JSON files, or family indexes (``standard`` or a
    path ending in family.json: their members not held out). Each training cycle is replicated ``members`` times,
    each replica on a member drawn at random (perturbed by ``spread``); alpha is chosen by the geometric mean of the
    validation speedups on ``latency`` and the given models (with an index: on the members it picks for
    validation)."""
    spread: float = at_least(1.0, 1.0)
    """Perturbation of the family's members: draft step, verification growth and overhead each scaled by a factor
    drawn log-uniformly from [1/spread, spread] (1 = none)."""
    members: int = positive(8)
    """Family members drawn per training cycle (with a family)."""
    match: bool = False
    """The policy observes the cycle's context match: needs a dataset recorded with --chain-tokens and a chain
    calibration (``chain``); with traces every tree is verified with the whole 16-token context chain."""
    chain: str | None = None
    """With match: the chain calibration JSON (the machine setup's chain.json) the match features are read from;
    with traces and none given, one fitted on the training traces (OUT/chain.json)."""
    seed: int = 0
    resume: bool = False
    """Continue the runs in ``out`` (refused if their settings differ)."""

    def __post_init__(self) -> None:
        if isinstance(self.alphas, str):
            self.alphas = tuple(float(a) for a in self.alphas.split(",") if a.strip())
        self.alphas = tuple(float(a) for a in self.alphas)
        check_fields(self)
        if not self.alphas or len(set(self.alphas)) != len(self.alphas):
            raise ValueError(f"alphas must be distinct and at least one, got {self.alphas!r}")
        if self.latency is None and (self.t_fixed is None or self.t_draft is None):
            raise ValueError("give a latency model (latency=PATH) or both t_fixed and t_draft")
        if self.latency is None and self.t_fixed + self.t_draft <= 0.0:
            raise ValueError(f"t_fixed + t_draft must be > 0, got {self.t_fixed} + {self.t_draft}")
        self.family = tuple(str(f) for f in self.family)
        if self.match and not self.chain and not self.traces:
            raise ValueError("match needs a chain calibration (chain=PATH: the machine setup's chain.json)")
        if not self.traces and (self.width is not None or self.max_depth is not None):
            raise ValueError("width and max_depth are read from a RADAR dataset: give them only with traces")
        if (self.costs or self.family or self.spread > 1.0) and self.latency is None:
            raise ValueError("cost features and latency families need a latency model (latency=PATH)")

    @property
    def uses_family(self) -> bool:
        return bool(self.family) or self.spread > 1.0

    def latency_family(self, latency):
        """The family trained over (None without one): ``latency`` first, then every entry of ``family`` (a latency
        model file, or a family index whose members not held out are taken), validated on ``latency`` and the
        index's validation members (every member when no index is given)."""
        from adaptree.offline.family import family_around

        return family_around(latency, self.family, self.spread)

    def run_settings(self) -> dict:
        """What must match to resume (everything but the bookkeeping fields)."""
        return settings_of(self, skip=("resume", "out", "eval_every", "checkpoint_every"))


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------


@dataclass
class Episodes:
    """Cycles as arrays: ``scores [N, D, W]``, ``dist [N, D, D+1]``, ``time [N, D]`` (seconds of a cycle
    stopped at k), ``tokens [N, D]`` (expected acc + bonus at k), ``ar [N]`` (seconds of one AR step at the cycle's
    context: speeds times it read as speedups; ones without a latency model), ``costs [N, C]`` (the cost features
    of each cycle's machine, or None), ``match [N, M]`` (each cycle's match features, or None)."""

    scores: torch.Tensor
    dist: torch.Tensor
    time: torch.Tensor
    tokens: torch.Tensor
    keys: list[str] = field(default_factory=list)
    ar: torch.Tensor | None = None
    costs: torch.Tensor | None = None
    match: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.ar is None:
            self.ar = torch.ones(self.scores.shape[0], dtype=torch.float64)

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @property
    def depth(self) -> int:
        return int(self.scores.shape[1])

    def subset(self, idx) -> "Episodes":
        return Episodes(self.scores[idx], self.dist[idx], self.time[idx], self.tokens[idx], ar=self.ar[idx],
                        costs=None if self.costs is None else self.costs[idx],
                        match=None if self.match is None else self.match[idx])

    @staticmethod
    def cat(parts: list["Episodes"]) -> "Episodes":
        costs = None if parts[0].costs is None else torch.cat([p.costs for p in parts])
        match = None if parts[0].match is None else torch.cat([p.match for p in parts])
        return Episodes(*(torch.cat([getattr(p, f) for p in parts]) for f in ("scores", "dist", "time", "tokens")),
                        [k for p in parts for k in p.keys], torch.cat([p.ar for p in parts]), costs, match)


def cycle_times(sizes: np.ndarray, context_len: np.ndarray, width: int, cfg: RadarTrainConfig,
                latency=None) -> np.ndarray:
    """``[N, D]`` modelled seconds of each cycle stopped at each k (see the module docstring)."""
    n, d = sizes.shape
    k = np.arange(d)[None, :]
    decisions = np.minimum(k + 1, d - 1)
    if latency is not None:
        L = context_len.astype(np.float64)[:, None]
        t_draft = latency.draft_steps(width, L)
        t_fixed = latency.verify_times(sizes, L) + latency.other_s
    else:
        t_draft = np.full((n, 1), float(cfg.t_draft))
        t_fixed = np.full((n, d), float(cfg.t_fixed))
    return t_fixed + (k + 1) * t_draft + decisions * cfg.t_policy


def match_features(records, calibration) -> torch.Tensor:
    """``[N, M]`` the match features of every recorded cycle
    (:meth:`~adaptree.methods.common.chain.ChainRule.features` of its match length, read through ``calibration``;
    zeros without a match)."""
    from adaptree.core.context import ContextMatch
    from adaptree.methods.common import MATCH_FEATURES, ChainRule

    rule = ChainRule(calibration, 1)
    memo: dict[int, list[float]] = {0: [0.0] * len(MATCH_FEATURES)}
    rows = []
    for r in records:
        for n in r.match_length.tolist():
            if n not in memo:
                rule.begin_match(ContextMatch(int(n), 1, 0, (0,)), 0)
                memo[n] = rule.features()
            rows.append(memo[n])
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, len(MATCH_FEATURES))


def make_episodes(records, cfg: RadarTrainConfig, width: int, latency=None, calibration=None,
                  tree=None) -> Episodes:
    """``tree``: the machine's static tree (depth, size), for a policy with ``machine_tree``."""
    scores = np.concatenate([r.scores for r in records]).astype(np.float32)
    dist = np.concatenate([r.dist for r in records]).astype(np.float64)
    dist = dist / dist.sum(-1, keepdims=True)
    sizes = np.concatenate([r.sizes for r in records])
    ctx = np.concatenate([r.context_len for r in records])
    t = cycle_times(sizes, ctx, width, cfg, latency)
    j = np.arange(dist.shape[-1], dtype=np.float64)
    tokens = (dist * j).sum(-1) + (1.0 if cfg.bonus else 0.0)
    keys = [r.key for r in records for _ in range(r.cycles)]
    ar = costs = None
    if latency is not None:
        ar = torch.from_numpy(latency.ar_steps(ctx.astype(np.float64)))
        if cfg.costs:
            from adaptree.offline.family import cost_features

            values = cost_features(latency, width)
            if cfg.machine_tree:  # the policy's max_depth is the stop points' count
                values = [*values, *static_features(tree.depth, tree.size, records[0].dist.shape[1])]
            costs = torch.tensor([values], dtype=torch.float32).expand(len(keys), -1)
    match = match_features(records, calibration) if cfg.match else None
    return Episodes(torch.from_numpy(scores), torch.from_numpy(dist), torch.from_numpy(t), torch.from_numpy(tokens),
                    keys, ar, costs, match)


def _split(items, cfg: RadarTrainConfig, what: str):
    """Training and validation prompts (:func:`split_records`) and a note when there are too few to hold any out
    (validation then runs on the training cycles)."""
    tr, va = split_records(items, cfg.val_fraction, cfg.seed)
    if not tr:
        raise ValueError(f"no training prompts after holding out {cfg.val_fraction:.0%} of {len(items)}")
    if not va:
        return tr, tr, f"no validation prompts (too few {what}): alpha chosen on the training cycles"
    return tr, va, None


def split_records(records, val_fraction: float, seed: int):
    """Train / validation records by prompt key (deterministic, :func:`adaptree.offline.runs.split_by_key`)."""
    return split_by_key(records, val_fraction, seed, key=lambda r: r.key)


# --------------------------------------------------------------------------------------------------
# evaluation (exact) and the REINFORCE step
# --------------------------------------------------------------------------------------------------


def stop_points(p_stop: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[N]`` stop point of the deterministic rule from ``p_stop [N, D-1]``: first P(STOP) >= threshold."""
    stop = p_stop >= threshold
    d1 = p_stop.shape[1]
    first = torch.where(stop, torch.arange(d1)[None, :], torch.full_like(stop, d1, dtype=torch.long))
    return first.min(dim=1).values


def evaluate_stops(ep: Episodes, k: torch.Tensor) -> dict:
    """Exact expected metrics of the stop points ``k [N]`` (no sampling); ``speedup`` = AR's time for the same
    tokens over the cycles' time (with a latency model)."""
    idx = torch.arange(len(ep))
    tok, t = ep.tokens[idx, k], ep.time[idx, k]
    return {"throughput": float(tok.sum() / t.sum()), "speedup": float((tok * ep.ar).sum() / t.sum()),
            "mean_speed": float((tok / t).mean()), "tau": float(tok.mean()), "calls": float((k + 1).double().mean()),
            "cycles": len(ep)}


@torch.no_grad()
def evaluate_policy(policy: RadarPolicy, ep: Episodes | list[Episodes], threshold: float = 0.5) -> dict:
    """:func:`evaluate_stops` of the policy's deterministic rule. On a list of episode sets (a family's measured
    machines): the means over them, with ``speedup`` their geometric mean and ``per_machine`` each."""
    if isinstance(ep, list):
        rows = [evaluate_policy(policy, e, threshold) for e in ep]
        out = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
        out["speedup"] = float(np.exp(np.mean(np.log([max(r["speedup"], 1e-12) for r in rows]))))
        out["per_machine"] = [round(r["speedup"], 5) for r in rows]
        return out
    was = policy.training
    policy.eval()
    p_stop = torch.softmax(policy(ep.scores[:, :-1], ep.costs, ep.match), -1)[..., STOP]
    policy.train(was)
    return evaluate_stops(ep, stop_points(p_stop, threshold))


def static_baselines(ep: Episodes) -> dict:
    """Every fixed stop point (static depth k + 1) and the per-cycle oracle of the speed."""
    out = {f"depth_{k + 1}": evaluate_stops(ep, torch.full((len(ep),), k, dtype=torch.long)) for k in range(ep.depth)}
    best = (ep.tokens / ep.time).argmax(dim=1)
    out["oracle_per_cycle"] = evaluate_stops(ep, best)
    return out


def reinforce_loss(policy: RadarPolicy, ep: Episodes, idx: torch.Tensor, alpha: float, beta: float, gamma: float,
                   baseline: str, bonus: bool, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Sample one episode per cycle ``idx`` and return the REINFORCE loss with diagnostics."""
    d = ep.depth
    logits = policy(ep.scores[idx, :-1], None if ep.costs is None else ep.costs[idx],
                    None if ep.match is None else ep.match[idx])  # [B, D-1, 2]
    logp = torch.log_softmax(logits, -1)
    b = idx.numel()
    with torch.no_grad():
        p = logp.exp()
        actions = (torch.rand(b, d - 1, generator=gen) >= p[..., STOP]).long()  # 1 = CONTINUE
        stopped = actions == STOP
        k = torch.where(stopped.any(1), stopped.float().argmax(1), torch.full((b,), d - 1)).long()
        steps = torch.arange(d - 1)[None, :]
        taken = steps <= k[:, None]  # decisions actually taken (all D-1 at a forced stop)
        taken &= steps < d - 1
        acc = torch.multinomial(ep.dist[idx, k], 1, generator=gen).squeeze(1).double()
        speed = (acc + (1.0 if bonus else 0.0)) / ep.time[idx, k] * ep.ar[idx]  # x AR step: a speedup
        rewards = torch.zeros(b, d, dtype=torch.float64)  # column D-1 = the forced stop's terminal step
        rewards[:, :-1] = torch.where(taken & (actions == CONTINUE), -alpha, 0.0)
        rewards[torch.arange(b), k] += beta * speed
        ret = torch.zeros_like(rewards)
        run = torch.zeros(b, dtype=torch.float64)
        for t in range(d - 1, -1, -1):
            run = rewards[:, t] + gamma * run
            ret[:, t] = run
        ret = ret[:, :-1]
        if baseline == "mean":
            cnt = taken.sum(0).clamp(min=1)
            base = (ret * taken).sum(0) / cnt
            adv = ret - base[None, :]
        else:
            adv = ret
        adv = (adv * taken).float()
    chosen = logp.gather(-1, actions[..., None]).squeeze(-1)
    loss = -(chosen * adv).sum() / b
    diag = {"return": float(ret[:, 0].mean()), "calls": float((k + 1).double().mean()),
            "speed": float(speed.mean()), "accepted": float(acc.mean())}
    return loss, diag


# --------------------------------------------------------------------------------------------------
# checkpoints (safetensors: model, Adam state and the generator state; JSON metadata)
# --------------------------------------------------------------------------------------------------


def _prefixed(prefix: str, tensors: dict) -> dict:
    return {prefix + k: v for k, v in tensors.items()}


def _unprefixed(prefix: str, tensors: dict) -> dict:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def save_checkpoint(path: Path, policy: RadarPolicy, opt: torch.optim.Adam, gen: torch.Generator, step: int,
                    meta: dict) -> None:
    """One safetensors file: ``model.*`` (weights), ``opt.<param>.*`` (Adam state), the RNG states (the
    sampler's and torch's: dropout masks), and ``meta`` with the step as JSON metadata."""
    names = [n for n, _ in policy.named_parameters()]
    tensors = {**_prefixed("model.", policy.state_dict()), **_prefixed("opt.", optimizer_tensors(opt, names)),
               **rng_tensors(gen)}
    save_tensors(tensors, path, metadata={"adaptree_radar_ckpt": json.dumps({**meta, "step": step})})


def load_checkpoint(path: Path, policy: RadarPolicy, opt: torch.optim.Adam, gen: torch.Generator) -> dict:
    from safetensors.torch import load_file

    meta = json.loads(tensor_metadata(path)["adaptree_radar_ckpt"])
    t = load_file(str(path))
    load_strict(policy, _unprefixed("model.", t), str(path))
    load_optimizer_tensors(opt, _unprefixed("opt.", t), [n for n, _ in policy.named_parameters()])
    restore_rng(t, gen)
    return meta


# --------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------


def cosine_lr(base: float, step: int, total: int) -> float:
    return 0.5 * base * (1.0 + math.cos(math.pi * min(step, total) / total))


LOG_FIELDS = ("step", "lr", "loss", "return", "calls", "speed", "accepted", "val_throughput", "val_calls",
              "val_tau", "elapsed_s")


def train_alpha(cfg: RadarTrainConfig, alpha: float, beta: float, train: Episodes, val: Episodes | list[Episodes],
                width: int, folder: Path, progress: bool = True, reference_costs: list[float] | None = None,
                reference_sizes: list[int] | None = None) -> tuple[RadarPolicy, dict]:
    """Train one policy for one alpha in ``folder`` (resuming a checkpoint there when ``cfg.resume``);
    ``reference_sizes``: the episodes verify a machine's V per depth (the policy is told so, with these as its
    fallback table)."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    mcfg = RadarModelConfig(width=width, max_depth=train.depth, hidden=cfg.hidden, dropout=cfg.dropout,
                            cost_features=cfg.costs, reference_costs=reference_costs, match_features=cfg.match,
                            tree_features=cfg.machine_tree,
                            size_table=reference_sizes is not None, reference_sizes=reference_sizes)
    policy = RadarPolicy(mcfg)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    ckpt = folder / "checkpoint.safetensors"
    start = 0
    if cfg.resume and ckpt.exists():
        start = int(load_checkpoint(ckpt, policy, opt, gen)["step"])
    log = CsvLog(folder / "log.csv", LOG_FIELDS, keep=start)  # the rows up to the checkpoint
    t0 = time.perf_counter()
    policy.train()
    bar = tqdm(range(start, cfg.steps), desc=f"radar alpha={alpha:g}", unit="step", disable=not progress,
               initial=start, total=cfg.steps)
    meta = {"alpha": alpha, "beta": beta, "settings": cfg.run_settings()}
    val_metrics: dict = {}
    for step in bar:
        lr = cosine_lr(cfg.lr, step, cfg.steps)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(train), (cfg.batch_size,), generator=gen)
        loss, diag = reinforce_loss(policy, train, idx, alpha, beta, cfg.gamma, cfg.baseline, cfg.bonus, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
        opt.step()
        done = step + 1
        row = {"step": done, "lr": lr, "loss": float(loss.detach()), **diag, "elapsed_s": time.perf_counter() - t0}
        if done % cfg.eval_every == 0 or done == cfg.steps:
            val_metrics = evaluate_policy(policy, val, cfg.threshold)
            row.update(val_throughput=val_metrics["throughput"], val_calls=val_metrics["calls"],
                       val_tau=val_metrics["tau"])
            bar.set_postfix(calls=f"{val_metrics['calls']:.2f}", thr=f"{val_metrics['throughput']:.4g}")
        log.append(row)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            save_checkpoint(ckpt, policy, opt, gen, done, meta)
    policy.eval()
    final = evaluate_policy(policy, val, cfg.threshold)
    policy.save(folder / "policy", {"alpha": alpha, "beta": beta, "validation": final, **cfg.run_settings()})
    return policy, final


def load_latency(cfg: RadarTrainConfig):
    return None if cfg.latency is None else LatencyModel.load(cfg.latency)


@dataclass
class _Source:
    """What a run trains and validates on, whichever the cycles came from."""

    train: Episodes
    val: Episodes | list[Episodes]
    width: int
    train_prompts: int
    val_prompts: int
    note: str | None
    family: object | None
    reference_costs: list[float] | None
    reference_sizes: list[int] | None = None
    info: dict = field(default_factory=dict)
    """Summary entries of the source (data/traces folder, settings, fingerprints, V tables)."""
    chain_calibration: object | None = None
    """A chain calibration fitted here (traces with match and no ``chain``): written to OUT/chain.json."""


def _dataset_source(cfg: RadarTrainConfig, latency) -> _Source:
    """Episodes from a RADAR dataset (``cfg.data``): V = the dataset's at every stop point."""
    from adaptree.methods.radar.dataset import RadarStore

    store = RadarStore(cfg.data)
    records = [r for r in store.load_all() if r.cycles]
    if not records:
        raise ValueError(f"no recorded cycles in {cfg.data}")
    st = store.settings
    if st.max_depth < 2:
        raise ValueError(f"the dataset has max_depth {st.max_depth}: no decision to learn")
    calibration = None
    if cfg.match:
        from adaptree.methods.common import ChainCalibration

        if not st.chain_tokens:
            raise ValueError(f"{cfg.data} was recorded without context chains: record it with --chain-tokens K to "
                             "train a policy that observes the match")
        calibration = ChainCalibration.load(cfg.chain).at(st.temperature)  # the rates the dataset was sampled at
        if calibration.max_ngram != st.max_ngram:
            raise ValueError(f"the chain calibration matches n-grams of up to {calibration.max_ngram} tokens, the "
                             f"dataset's index up to {st.max_ngram}")
    tr, va, note = _split(records, cfg, "recorded")
    family = cfg.latency_family(latency)
    reference = None
    if family is not None:
        rng = np.random.default_rng(cfg.seed)
        train = Episodes.cat([make_episodes(tr, cfg, st.width, family.sample(rng), calibration)
                              for _ in range(cfg.members)])
        val = [make_episodes(va, cfg, st.width, m, calibration) for m in family.validation_bases]
        reference = family.reference_costs() if cfg.costs else None
    else:
        train = make_episodes(tr, cfg, st.width, latency, calibration)
        val = make_episodes(va, cfg, st.width, latency, calibration)
        if cfg.costs:
            from adaptree.offline.family import cost_features

            reference = cost_features(latency, st.width)
    return _Source(train, val, st.width, len(tr), len(va) if note is None else 0, note, family, reference,
                   info={"data": str(cfg.data), "dataset_settings": st.to_dict(), "fingerprints": store.fingerprints})


CHAIN_TOKENS = 16
"""With traces and match: the chain verified next to every tree (its whole length, as in a dataset recorded with
chains): what the controller verifies at most by default with a policy that observes the match."""


def _latency_key(model) -> str:
    return json.dumps([list(model.draft), list(model.verify), model.other_s, model.verify_knots])


def _lower_median(values) -> int:
    v = sorted(int(x) for x in values)
    return v[(len(v) - 1) // 2]


def _trace_source(cfg: RadarTrainConfig, latency, progress: bool = True) -> _Source:
    """Episodes from greedy traces (``cfg.traces``): every machine's cycles from the same traces
    (:class:`~adaptree.methods.radar.dataset.TraceCycles`), each with its own V per depth."""
    from tqdm import tqdm

    from adaptree.core.context import DEFAULT_SELECT
    from adaptree.methods.radar.dataset import TraceCycles
    from adaptree.offline.traces import TraceStore

    if latency is None:
        raise ValueError("training on traces needs a latency model (latency=PATH): each machine's V table and "
                         "rewards come from one")
    store = TraceStore(cfg.traces)
    traces = store.load_all()
    if not traces:
        raise ValueError(f"no traces in {cfg.traces}")
    st = store.settings
    width = cfg.width
    if width is None:
        if len(st.widths) != 1:
            raise ValueError(f"{cfg.traces} holds the widths {list(st.widths)}: pick one with width=W")
        width = st.widths[0]
    if width not in st.widths:
        raise ValueError(f"width W={width} was not recorded in {cfg.traces} (recorded: {list(st.widths)})")
    depth = st.max_depth if cfg.max_depth is None else cfg.max_depth
    if not 2 <= depth <= st.max_depth:
        raise ValueError(f"max_depth must be in 2..{st.max_depth} (the traces'), got {depth}")
    tr, va, note = _split(traces, cfg, "traces")
    calibration = fitted = None
    chain = {}
    if cfg.match:
        from adaptree.methods.common import ChainCalibration

        calibration = ChainCalibration.load(cfg.chain) if cfg.chain else ChainCalibration.fit(tr)
        fitted = None if cfg.chain else calibration
        if calibration.select != DEFAULT_SELECT:
            raise ValueError(f"the chain calibration picks occurrences by {calibration.select!r}; chains from traces "
                             f"are the oracle's ({DEFAULT_SELECT!r})")
        calibration = calibration.at(0.0)  # greedy traces: the rates of greedy verification
        chain = {"chain_tokens": CHAIN_TOKENS, "max_ngram": calibration.max_ngram}
    bar = tqdm(total=2, desc="radar trace tables", unit="set", disable=not progress)
    train_cycles = TraceCycles(tr, width, depth, **chain)
    bar.update()
    val_cycles = TraceCycles(va, width, depth, **chain)
    bar.update()
    bar.close()
    machines: dict[str, object] = {}

    def sizes_of(model):  # each machine's V table from the training traces, once
        key = _latency_key(model)
        if key not in machines:
            machines[key] = train_cycles.machine(model)
        return machines[key]

    def episodes(cycles, model) -> Episodes:
        return make_episodes(cycles.records(sizes_of(model)), cfg, width, model, calibration, sizes_of(model))

    family = cfg.latency_family(latency)
    if family is not None:
        rng = np.random.default_rng(cfg.seed)
        members = [family.sample(rng) for _ in range(cfg.members)]
        train = Episodes.cat([episodes(train_cycles, m) for m in tqdm(members, desc="radar members", unit="member",
                                                                       disable=not progress)])
        bases = family.validation_bases
        names = [family.names[i] for i in family.validation] if family.validation is not None else family.names
        val = [episodes(val_cycles, m) for m in bases]
        reference_costs = family.reference_costs() if cfg.costs else None
    else:
        train = episodes(train_cycles, latency)
        bases, names = [latency], ["main"]
        val = episodes(val_cycles, latency)
        reference_costs = None
        if cfg.costs:
            from adaptree.offline.family import cost_features

            reference_costs = cost_features(latency, width)
    tables = {n: sizes_of(m) for n, m in zip(names, bases)}
    reference_sizes = [_lower_median(t.table[d] for t in tables.values()) for d in range(1, depth + 1)]
    info = {"data": None, "traces": str(cfg.traces), "dataset_settings": st.to_dict(),
            "fingerprints": store.fingerprints, "max_depth": depth, "reference_sizes": reference_sizes,
            "size_tables": {n: {"sizes": t.sizes(depth), "reference": [t.depth, t.size]} for n, t in tables.items()},
            "members": len(machines)}
    return _Source(train, val, width, len(tr), len(va) if note is None else 0, note, family, reference_costs,
                   reference_sizes, info, fitted)


def train_radar(cfg: RadarTrainConfig, progress: bool = True) -> TrainingResult:
    """Train the alpha grid on ``cfg.data`` (or ``cfg.traces``) and export the best policy to ``cfg.out/policy``;
    returns the summary (also written to ``cfg.out/summary.json``)."""
    latency = load_latency(cfg)
    src = _trace_source(cfg, latency, progress) if cfg.traces else _dataset_source(cfg, latency)
    train, val, family = src.train, src.val, src.family
    score = "speedup" if family is not None else "throughput"
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = cfg.run_settings()
    if (out / "train_config.json").exists() and not cfg.resume:
        raise ValueError(f"{out} already holds a RADAR run; pass --resume to continue it or use another --out")
    pin_settings(out, settings, "a RADAR run", name="train_config.json")
    if src.chain_calibration is not None:
        src.chain_calibration.save(out / "chain.json")
    always = evaluate_stops(train, torch.full((len(train),), train.depth - 1, dtype=torch.long))
    beta = cfg.beta if cfg.beta is not None else 1.0 / always["speedup"]
    results = {}
    for alpha in cfg.alphas:
        folder = out / f"alpha_{alpha:g}"
        final_path = folder / "final.json"
        if cfg.resume and final_path.exists() and (folder / "policy" / "model.safetensors").exists():
            results[alpha] = json.loads(final_path.read_text())
            continue
        _, final = train_alpha(cfg, alpha, beta, train, val, src.width, folder, progress, src.reference_costs,
                               src.reference_sizes)
        write_json(final, final_path)
        results[alpha] = final
    best = max(cfg.alphas, key=lambda a: (results[a][score], -a))
    chosen = RadarPolicy.load(out / f"alpha_{best:g}" / "policy")
    chosen.save(out / "policy", {"alpha": best, "beta": beta, "validation": results[best],
                                 "dataset_settings": src.info["dataset_settings"],
                                 "fingerprints": src.info["fingerprints"], **settings})
    val_cycles = sum(len(e) for e in val) if isinstance(val, list) else len(val)
    summary = {**src.info, "train_cycles": len(train), "val_cycles": val_cycles,
               "train_prompts": src.train_prompts, "val_prompts": src.val_prompts, "note": src.note,
               "beta": beta, "chosen_alpha": best, "policy": str(out / "policy"),
               "grid": {f"{a:g}": results[a] for a in cfg.alphas}, "chosen_by": score,
               "val_static": static_baselines(val if family is None else val[0]), "settings": settings,
               **({"family": family.describe()} if family is not None else {})}
    return TrainingResult.written(summary, out, out / "policy")


def measure_policy_seconds(width: int = 10, max_depth: int = 8, hidden: int = 128, repeats: int = 300) -> float:
    """Median seconds of one inference decision (:meth:`RadarPolicy.step` + softmax) on this machine, with
    an untrained policy of the given shape (the weights' values do not change the time)."""
    policy = RadarPolicy(RadarModelConfig(width=width, max_depth=max_depth, hidden=hidden)).eval()
    x = -torch.rand(width).cumsum(0)
    out = []
    with torch.inference_mode():
        for _ in range(repeats):
            hc = None
            for t in range(1, max_depth):
                t0 = time.perf_counter()
                logits, hc = policy.step(x, t, hc)
                float(torch.softmax(logits, -1)[0])
                out.append(time.perf_counter() - t0)
    return float(np.median(out))
