"""How far can any controller get past the hybrid rule with the information a controller has? Replayed on the
profiles where trees pay (the best static tree in hindsight >= 1.3x AR), on Table 1's traces.

The hybrid rule prices every candidate with one number: the acceptance calibration of its path score (fitted on the
training traces). The chain oracle, which knows every cycle's outcome, is 25-46% ahead of it. A learned controller can
only take a share of that gap where what it observes predicts acceptance better than that calibration does. Each arm
below gives the rule a better predictor and replays it: a bound on what a policy with the same information could gain
by pricing better.

- ``hybrid``: the rule, calibrations fitted on the training traces (as a machine setup fits them).
- ``in-sample calibration``: the same, both calibrations fitted on the evaluation traces themselves (optimistic:
  the best a score calibration can be on these prompts).
- ``online shift eta``: the calibration's logit shifted per generation, after every drafted cycle, by ``eta`` x
  (accepted - predicted accepted), the chain's probabilities too (the generation's acceptance so far: what a policy
  observing the previous cycles' acceptance could learn).
- ``richer predictor``: each candidate priced by a small network on its path score, its own log-prob, its depth, the
  entropy of the distribution it was drafted from, its rank among its siblings and the root's best first-level
  log-prob (fitted on the training traces with BCE; what LTD's and C2T's inputs hold and more). It enters the rule
  where the calibration did: the values of the top-V candidates and of the look-ahead's beam nodes.
- ``one level past the look-ahead``: the rule drafts one level more than its one-step look-ahead asks for (does the
  myopic depth decision leave value that a policy looking further could take?).
- ``best fixed depth``: every cycle drafts the same depth (1..8, the best per profile in hindsight), V and chain priced
  by the rule.
- ``chain oracle``: every cycle's best tree and chain in hindsight.

Also written: the held-out log-loss and Brier score of the calibration and of the network on the top-60 candidates
by score of every evaluation root, and how much of the hybrid rule's per-cycle error (accepted - predicted) the target's
root features (what Re-SpS observes) explain held out (ridge regression fitted on the training traces' cycles on one
profile).

    python scripts/pricing_headroom.py --traces runs/t1/eval-traces --train-traces runs/f59/train-traces \\
        --out docs/results/pricing-headroom-2026-11-29/headroom

Writes OUT.json and OUT.md. About 2.5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from table1 import PAYS, SHARED_MACHINES, profiles
from torch import nn
from tqdm import tqdm
from transfer_table import CHAIN_ORACLE_SIZES, CHAINS, calibrations

from adaptree.methods.common import ChainCalibration
from adaptree.methods.costaware.acceptance import AcceptanceCalibration
from adaptree.methods.hybrid.controller import HybridConfig, HybridController
from adaptree.offline.oracle import best_static, oracle_all
from adaptree.offline.runs import write_json
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import TraceStore, match_mask, num_candidates

W = 10
FEATURES = ("score", "own_logp", "depth", "row_entropy", "sibling_rank", "root_best")
ETAS = (0.02, 0.05, 0.1, 0.2)
TOP = 60  # candidates per root in the predictive scores: the V the rule verifies is at most this


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-4, 1 - 1e-4)
    return np.log(p / (1 - p))


def candidate_features(wt, pos: np.ndarray) -> np.ndarray:
    """``[J, C, len(FEATURES)]`` of every recorded candidate at roots ``pos`` (the trace's level-by-level layout)."""
    d_max = wt.max_depth
    level = np.concatenate([np.ones(W, int)] + [np.full(W * W, d) for d in range(2, d_max + 1)])
    rank = np.concatenate([np.arange(W)] + [np.tile(np.arange(W), W)] * (d_max - 1))
    row = np.concatenate([np.zeros(W, int)] + [np.repeat(np.arange(W), W)] * (d_max - 1))  # the beam row drafting it
    sc = wt.scores[pos].astype(np.float32)
    par = wt.parents()[pos]
    parent = np.where(par >= 0, np.take_along_axis(sc, np.maximum(par, 0), 1), 0.0)
    cols = [np.maximum(sc, -30.0), np.maximum(sc - parent, -30.0), np.broadcast_to(level, sc.shape),
            np.nan_to_num(wt.entropy[pos][:, level - 1, row]), np.broadcast_to(rank, sc.shape),
            np.broadcast_to(sc[:, :W].max(1, keepdims=True), sc.shape)]
    return np.stack(cols, -1).astype(np.float32)


class Predictor:
    """P(candidate on the accepted path) from :data:`FEATURES`: an MLP fitted with BCE on a quarter of the training
    traces' candidates (every root, every depth), features standardised."""

    def __init__(self, train, seed: int = 0, epochs: int = 12) -> None:
        if any(t.width(W).entropy is None for t in train):
            raise SystemExit("pricing_headroom: the training traces hold no draft entropies; record them again")
        rng, torch_gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
        xs, ys = [], []
        for t in train:
            wt, pos = t.width(W), np.arange(t.end)
            x, y = candidate_features(wt, pos), match_mask(wt, t.output, pos)
            keep = rng.random(y.shape) < 0.25
            xs.append(x[keep])
            ys.append(y[keep])
        x, y = np.concatenate(xs), np.concatenate(ys).astype(np.float32)
        self.mu, self.sd = x.mean(0), x.std(0) + 1e-6
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(len(FEATURES), 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(),
                                 nn.Linear(64, 1))
        opt = torch.optim.AdamW(self.net.parameters(), lr=3e-3)
        X, Y = torch.from_numpy((x - self.mu) / self.sd), torch.from_numpy(y)
        for ep in tqdm(range(epochs), desc="predictor", unit="epoch"):
            for g in opt.param_groups:
                g["lr"] = 3e-3 * 0.75 ** ep
            perm = torch.randperm(len(X), generator=torch_gen)
            for i in range(0, len(X), 8192):
                b = perm[i:i + 8192]
                loss = nn.functional.binary_cross_entropy_with_logits(self.net(X[b]).squeeze(-1), Y[b])
                opt.zero_grad()
                loss.backward()
                opt.step()
        self.net.eval()
        self.samples = len(X)

    @torch.inference_mode()
    def __call__(self, x: np.ndarray) -> np.ndarray:
        z = torch.from_numpy((x - self.mu) / self.sd)
        return torch.sigmoid(self.net(z).squeeze(-1)).double().numpy()


class Priced:
    """The calibration the rule calls, answering from a table of this tree's candidates (score -> probability) and
    from the base calibration for any other score. Candidates with bit-equal scores share one entry: rare, and
    either value is a prediction for that score."""

    def __init__(self, base: AcceptanceCalibration) -> None:
        self.base, self.table, self.shift = base, None, 0.0

    def __call__(self, scores) -> np.ndarray:
        s = scores.detach().cpu().double().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores, float)
        p = self.base(s)
        if self.table is not None:
            p = np.array([self.table.get(float(v), q) for v, q in zip(s.reshape(-1), p.reshape(-1))]).reshape(s.shape)
        return p if self.shift == 0.0 else 1 / (1 + np.exp(-(logit(p) + self.shift)))

    def rates(self, width: int) -> np.ndarray:
        return self.base.rates(width)


class ShiftedChain:
    """The chain calibration with its probabilities shifted in logit by the head calibration's current shift."""

    def __init__(self, base: ChainCalibration, priced: Priced) -> None:
        self.base, self.priced = base, priced

    def __getattr__(self, name: str):
        return getattr(self.base, name)

    def probs(self, match, k=None, temperature: float = 0.0) -> np.ndarray:
        p = self.base.probs(match, k, temperature)
        b = self.priced.shift
        return p if b == 0.0 or not p.size else 1 / (1 + np.exp(-(logit(p) + b)))


class Probe(HybridController):
    """Hybrid with its candidates priced by ``predictor`` (None: the calibration), its logit (the head's and the
    chain's) shifted online by ``eta`` (0: never) and ``extra`` levels drafted past where its look-ahead stops (or
    every cycle ``depth`` levels, when given); logs (root position, predicted accepted, accepted) of its drafted
    cycles, one list per generation in ``logs``."""

    def __init__(self, cfg, latency, acceptance, chain, predictor: Predictor | None = None, eta: float = 0.0,
                 extra: int = 0, depth: int | None = None):
        self.logs: list[list] = []
        super().__init__(cfg, latency, Priced(acceptance), chain)
        self.chain_cal = ShiftedChain(self.chain_cal, self.calibration)
        self.predictor, self.eta, self.extra, self.depth = predictor, eta, extra, depth

    def reset(self) -> None:
        super().reset()
        self.calibration.shift, self.calibration.table, self.pred = 0.0, None, None
        self.logs.append([])  # a new generation

    def begin_cycle(self, ctx):
        plan = super().begin_cycle(ctx)
        self.pred, self.root, self.past = None, ctx.context_len, 0
        return plan

    def _price(self, tree) -> None:
        if self.predictor is not None:
            n = num_candidates(W, tree.depth)
            wt, pos = tree._wt, tree._pos  # a ReplayTree: this root's recorded tree
            p = self.predictor(candidate_features(wt, np.array([pos]))[0, :n])
            self.calibration.table = dict(zip(wt.scores[pos, :n].astype(np.float64).tolist(), p.tolist()))

    def continue_drafting(self, step) -> bool:
        self._price(step.tree)
        if self.depth is not None:
            return step.depth < self.depth
        if self.past == 0 and super().continue_drafting(step):
            return True
        self.past += 1
        return self.past <= self.extra

    def choose_size(self, tree, plan) -> int:
        self._price(tree)
        return super().choose_size(tree, plan)

    def _drafted(self, v, expected, adv) -> None:
        super()._drafted(v, expected, adv)
        self.pred = expected - 1.0

    def end_cycle(self, record) -> None:
        super().end_cycle(record)
        if self.pred is not None and record.size + record.chain_nodes > 0:
            self.logs[-1].append((self.root, self.pred, record.accepted))
            self.calibration.shift += self.eta * (record.accepted - self.pred)


def replay(ctl: Probe, traces, latency):
    """(modelled speedup, (trace, its log) per trace) of ``ctl`` over ``traces``, one generation each."""
    ctl.logs = []
    speedup = simulate(ctl, traces, latency, measure_policy=False).speedup
    return speedup, list(zip(traces, ctl.logs, strict=True))


def predictive(traces, acceptance: AcceptanceCalibration, predictor: Predictor) -> dict:
    """Held-out log-loss and Brier score of the calibration and of the network on each root's top-TOP candidates."""
    out = {"calibration": [[], []], "richer predictor": [[], []]}
    for t in traces:
        wt, pos = t.width(W), np.arange(t.end)
        top = np.argsort(-wt.scores[pos], 1, kind="stable")[:, :TOP]
        y = np.take_along_axis(match_mask(wt, t.output, pos), top, 1).reshape(-1)
        x = np.take_along_axis(candidate_features(wt, pos), top[..., None], 1).reshape(-1, len(FEATURES))
        for name, p in (("calibration", acceptance(np.take_along_axis(wt.scores[pos], top, 1).reshape(-1))),
                        ("richer predictor", predictor(x))):
            p = np.clip(p, 1e-4, 1 - 1e-4)
            out[name][0].append(-(y * np.log(p) + (1 - y) * np.log(1 - p)))
            out[name][1].append((p - y) ** 2)
    return {k: {"log_loss": round(float(np.concatenate(v[0]).mean()), 5),
                "brier": round(float(np.concatenate(v[1]).mean()), 5)} for k, v in out.items()}


def residual_r2(train_logs, eval_logs, ridge: float) -> dict:
    """Held-out R^2 of the rule's per-cycle error (accepted - predicted) regressed on the target's root features."""
    def rows(logs):
        x, e = [], []
        for t, log in logs:
            for root, pred, acc in log:
                x.append(t.features[root - t.prompt_len].astype(np.float64))
                e.append(acc - pred)
        return np.array(x), np.array(e)

    xt, et = rows(train_logs)
    xe, ee = rows(eval_logs)
    mu, sd = xt.mean(0), xt.std(0) + 1e-3
    zt, ze = np.c_[(xt - mu) / sd, np.ones(len(xt))], np.c_[(xe - mu) / sd, np.ones(len(xe))]
    w = np.linalg.solve(zt.T @ zt + ridge * np.eye(zt.shape[1]), zt.T @ et)
    resid = ee - ze @ w
    return {"ridge": ridge, "train_cycles": len(et), "eval_cycles": len(ee),
            "error_variance": round(float(ee.var()), 4),
            "r2_held_out": round(float(1 - (resid ** 2).mean() / ((ee - ee.mean()) ** 2).mean()), 4)}


def error_stats(logs) -> dict:
    """Over one replay's drafted cycles: the mean lag-1 correlation of consecutive cycles' errors (accepted -
    predicted) within a generation, and the generations' accepted / predicted (median, smallest, largest)."""
    lag, ratio = [], []
    for _, log in logs:
        e = np.array([a - p for _, p, a in log])
        if e.size > 5 and e[:-1].std() > 0 and e[1:].std() > 0:
            lag.append(np.corrcoef(e[:-1], e[1:])[0, 1])
        if log:
            ratio.append(sum(a for *_, a in log) / max(1e-9, sum(p for _, p, _ in log)))
    return {"lag1_correlation": round(float(np.mean(lag)), 4), "ratio_median": round(float(np.median(ratio)), 4),
            "ratio_min": round(float(min(ratio)), 4), "ratio_max": round(float(max(ratio)), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="greedy evaluation traces (Table 1's)")
    ap.add_argument("--train-traces", required=True, help="traces of training prompts (the calibrations, the network)")
    ap.add_argument("--shared", default=str(SHARED_MACHINES), help="folder of shared machine profiles")
    ap.add_argument("--ridge-profile", default="h100-bf16", help="the profile whose hybrid cycles the ridge fit uses")
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    args = ap.parse_args()
    traces = TraceStore(args.traces).load_all()
    train = TraceStore(args.train_traces).load_all()
    if any(t.features is None for t in traces + train):
        raise SystemExit("pricing_headroom: the traces hold no target features; record them with features kept")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    acc_file, chain_file = calibrations(train, out.parent / f"{out.name}-calibrations")
    acc, chain = AcceptanceCalibration.load(acc_file), ChainCalibration.load(chain_file)
    acc_in, chain_in = AcceptanceCalibration.fit(traces), ChainCalibration.fit(traces)
    predictor = Predictor(train)
    cfg = HybridConfig()
    arms = ["hybrid", "in-sample calibration", *(f"online shift {e:g}" for e in ETAS), "richer predictor",
            "one level past the look-ahead", "best fixed depth", "chain oracle"]
    rows, ridge = {}, None
    for member, _ in tqdm(profiles(Path(args.shared)), desc="profiles", unit="profile"):
        lat = member.model
        best = best_static(traces, lat, widths=(W,), depths=range(1, 13)).speedup
        if best < PAYS:
            continue
        hybrid, logs = replay(Probe(cfg, lat, acc, chain), traces, lat)
        row = {"best_static": round(best, 5), "hybrid": round(hybrid, 5), "errors": error_stats(logs),
               "in-sample calibration": round(replay(Probe(cfg, lat, acc_in, chain_in), traces, lat)[0], 5),
               "richer predictor": round(replay(Probe(cfg, lat, acc, chain, predictor), traces, lat)[0], 5),
               "one level past the look-ahead": round(replay(Probe(cfg, lat, acc, chain, extra=1), traces, lat)[0], 5),
               "chain oracle": round(oracle_all(traces, lat, widths=(W,), chains=CHAINS,
                                                sizes=CHAIN_ORACLE_SIZES).speedup, 5)}
        fixed = {d: replay(Probe(cfg, lat, acc, chain, depth=d), traces, lat)[0] for d in range(1, 9)}
        row["best fixed depth"], row["fixed_depth"] = round(max(fixed.values()), 5), max(fixed, key=fixed.get)
        for e in ETAS:
            row[f"online shift {e:g}"] = round(replay(Probe(cfg, lat, acc, chain, eta=e), traces, lat)[0], 5)
        if member.name == args.ridge_profile:
            ridge = residual_r2(replay(Probe(cfg, lat, acc, chain), train, lat)[1], logs, ridge=1e4)
        rows[member.name] = row
    if ridge is None:
        raise SystemExit(f"pricing_headroom: --ridge-profile {args.ridge_profile!r} is not a profile where trees pay "
                         f"(those: {sorted(rows)})")
    summary = {a: {"geomean": round(float(np.exp(np.mean([np.log(r[a]) for r in rows.values()]))), 4),
                   "vs_hybrid": round(float(np.exp(np.mean([np.log(r[a] / r["hybrid"]) for r in rows.values()]))), 4),
                   "at_least_hybrid": sum(r[a] >= r["hybrid"] for r in rows.values())} for a in arms}
    share = [(r["hybrid"] - 1) / (r["chain oracle"] - 1) for r in rows.values()]
    pred = predictive(traces, acc, predictor)
    write_json({"meta": {"traces": [t.key for t in traces], "train_traces": sorted(t.key for t in train),
                         "features": list(FEATURES), "predictor_samples": predictor.samples, "etas": list(ETAS)},
                "rows": rows, "summary": summary, "hybrid_share_of_chain_oracle_gain": [round(s, 4) for s in share],
                "predictive_top60": pred, "residual_from_target_features": ridge}, out.with_suffix(".json"))
    n = len(rows)
    lines = [f"Where trees pay ({n} profiles), modelled speedup over AR:", "",
             "| arm | geometric mean | / hybrid | >= hybrid on |", "|---|---|---|---|"]
    lines += [f"| {a} | {s['geomean']:.3f}x | {s['vs_hybrid']:.4f} | {s['at_least_hybrid']}/{n} |"
              for a, s in summary.items()]
    lines += ["", f"Hybrid's share of the chain oracle's gain: median {np.median(share):.3f} "
              f"(range {min(share):.3f}-{max(share):.3f}).", "",
              f"Held out, the top-{TOP} candidates by score of every evaluation root:", "",
              "| predictor | log-loss | Brier |", "|---|---|---|"]
    lines += [f"| {k} | {v['log_loss']:.4f} | {v['brier']:.4f} |" for k, v in pred.items()]
    lines += ["", f"The rule's per-cycle error (accepted - predicted; variance {ridge['error_variance']:.2f}) from the "
              f"target's root features, ridge {ridge['ridge']:g}, fitted on {ridge['train_cycles']} training cycles "
              f"({args.ridge_profile}): held-out R^2 {ridge['r2_held_out']:.3f} over {ridge['eval_cycles']} cycles.",
              "", "Per profile:", "", "| profile | best static | " + " | ".join(arms) + " |",
              "|---|---|" + "---|" * len(arms)]
    lines += [f"| {m} | {r['best_static']:.3f}x | " + " | ".join(f"{r[a]:.3f}x" for a in arms) + " |"
              for m, r in rows.items()]
    lines += ["", "Best fixed depth per profile: " + ", ".join(f"{m} D{r['fixed_depth']}" for m, r in rows.items()) + "."]
    lines += ["", "Hybrid's per-cycle errors (accepted - predicted) within a generation:", "",
              "| profile | lag-1 correlation | accepted / predicted per generation: median | min | max |",
              "|---|---|---|---|---|"]
    lines += [f"| {m} | {e['lag1_correlation']:.3f} | {e['ratio_median']:.3f} | {e['ratio_min']:.2f} | "
              f"{e['ratio_max']:.2f} |" for m, r in rows.items() for e in [r["errors"]]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
