"""How much of the oracle's gain can a policy that sees the draft's scores reach? (the target: 80%)

The oracle (``adaptree.offline.oracle``) knows every cycle's outcome. A controller only sees the draft: after
the first draft forward, the W scores of its children (the first thing LTD's depth policy sees). This
script fits the simplest controller that uses that signal directly against the objective, with no RL:

- bin the best first-level log-prob into quantile bins (fitted on the TRAINING traces);
- per bin, pick the (depth, V) that maximises sum(accepted + 1) - lambda * sum(modelled time) over the
  training positions, lambda iterated to the resulting throughput (Dinkelbach: maximising a ratio of
  sums, the run's throughput, not the mean of per-cycle ratios);

then replays it on the EVALUATION traces in the simulator (trajectories, not positions), next to the
best static tree (chosen on the training traces, and on the evaluation traces themselves), LTD's shipped
pair and the oracle. The same rule fitted on the evaluation traces themselves (in-sample, optimistic)
shows how far the signal goes even when the bins are tuned to the test set.

    python scripts/ltd_headroom.py --train-traces runs/ltd/traces --eval-traces runs/bench/traces \
        --latency runs/latency.json --out runs/ltd-headroom

Writes ``OUT/headroom.json`` and ``OUT/headroom.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from ltd_ablations import markdown_table  # scripts/, next to this file

from adaptree.core.controller import Controller, TreePlan
from adaptree.methods import StaticConfig, StaticController
from adaptree.methods.ltd.controller import LTDConfig, LTDController
from adaptree.methods.ltd.train import evaluate
from adaptree.models import shipped_head
from adaptree.offline.latency import load_checked
from adaptree.offline.oracle import fraction_of_oracle_gain, oracle_all
from adaptree.offline.policy import MLPPolicy
from adaptree.offline.traces import TraceStore, acceptance_table, num_candidates

SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
DEPTHS = (1, 2, 3, 4, 5, 6)


def position_tables(traces, lat, width: int):
    """Per root position: accepted tokens and modelled cycle time of every (depth, V), and the best
    first-level score."""
    acc, time, top1 = [], [], []
    for tr in traces:
        wt = tr.width(width)
        pos = np.arange(max(tr.end - 1, 0))
        if not len(pos):
            continue
        L = tr.prompt_len + pos
        a, t = [], []
        for d in DEPTHS:
            table = acceptance_table(wt, tr.output, d, pos)
            for v in SIZES:
                v_ = min(v, num_candidates(width, d))
                a.append(table[:, v_])
                t.append(d * lat.draft_steps(width, L) + lat.verify_times(v_, L))
        acc.append(np.stack(a, 1))
        time.append(np.stack(t, 1))
        top1.append(wt.scores[pos, :width].max(1))
    return np.concatenate(acc).astype(float), np.concatenate(time), np.concatenate(top1)


ACTIONS = [(d, v) for d in DEPTHS for v in SIZES]


def fit_bins(acc, time, top1, bins: int):
    """Quantile edges of ``top1`` and the (depth, V) of every bin (Dinkelbach on the positions)."""
    edges = np.quantile(top1, np.linspace(0, 1, bins + 1)[1:-1])
    b = np.digitize(top1, edges)
    lam = (acc[:, 0] + 1).sum() / time[:, 0].sum()
    for _ in range(50):
        choice = np.array([int(np.argmax((acc[b == k] + 1).sum(0) - lam * time[b == k].sum(0)))
                           if (b == k).any() else 0 for k in range(bins)])
        rows = choice[b]
        new = (acc[np.arange(len(b)), rows] + 1).sum() / time[np.arange(len(b)), rows].sum()
        if abs(new - lam) < 1e-12:
            break
        lam = new
    return edges, [ACTIONS[c] for c in choice]


class BinnedController(Controller):
    """After the first draft forward: the bin of its best child's log-prob fixes this cycle's depth and V."""

    name = "binned-top1"

    def __init__(self, width: int, edges, actions) -> None:
        self.width, self.edges, self.actions = width, np.asarray(edges), list(actions)
        self.max_depth = max(d for d, _ in self.actions)
        self._pick = self.actions[0]

    def begin_cycle(self, ctx) -> TreePlan:
        return TreePlan(self.width, self.max_depth, 0)

    def continue_drafting(self, step) -> bool:
        if step.depth == 1:
            self._pick = self.actions[int(np.digitize(float(step.child_scores.max()), self.edges))]
        return step.depth < self._pick[0]

    def choose_size(self, tree, plan) -> int:
        return self._pick[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-traces", required=True)
    ap.add_argument("--eval-traces", required=True)
    ap.add_argument("--latency", required=True)
    ap.add_argument("--ltd-policy", default=None, help="folder with depth/ and size/ (default: the shipped pair)")
    ap.add_argument("--width", type=int, default=10)
    ap.add_argument("--bins", default="2,4,8,16")
    ap.add_argument("--out", default="runs/ltd-headroom")
    args = ap.parse_args()

    lat = load_checked(args.latency)
    train = TraceStore(args.train_traces).load_all()
    test = TraceStore(args.eval_traces).load_all()
    w = args.width
    tables = {"train": position_tables(train, lat, w), "eval": position_tables(test, lat, w)}
    rows: dict[str, dict] = {}
    rows["static W10 D8 V60 (EAGLE-3)"] = evaluate(StaticController(StaticConfig(w, 8, 60)), test, lat)
    for where in ("train", "eval"):
        acc, time, _ = tables[where]
        k = int(np.argmax((acc + 1).sum(0) / time.sum(0)))
        d, v = ACTIONS[k]
        rows[f"best static D{d} V{v} (chosen on {where})"] = evaluate(StaticController(StaticConfig(w, d, v)), test, lat)
    folder = Path(args.ltd_policy) if args.ltd_policy else shipped_head() / "ltd"  # the default model's pair
    dp = MLPPolicy.load(folder / "depth", kind="ltd-depth")
    sp = MLPPolicy.load(folder / "size", kind="ltd-size")
    rows["LTD (PPO policies)"] = evaluate(LTDController(LTDConfig(width=w, mode="both"), depth_policy=dp,
                                                        size_policy=sp), test, lat)
    fitted = {}
    for where in ("train", "eval"):
        for bins in (int(b) for b in args.bins.split(",")):
            edges, actions = fit_bins(*tables[where], bins)
            name = f"top-1 score, {bins} bins (fitted on {where}{', in-sample' if where == 'eval' else ''})"
            rows[name] = evaluate(BinnedController(w, edges, actions), test, lat)
            fitted[name] = {"edges": [float(e) for e in edges], "actions": actions}
    no_ar = oracle_all(test, lat, widths=[w], sizes=SIZES, allow_ar=False)
    rows["oracle in LTD's action set (depth >= 1, V in the policy's set)"] = {
        "modelled_speedup": no_ar.speedup, "tau": no_ar.tau,
        **{k: no_ar.summary()[k] for k in ("mean_depth", "mean_size")}}
    orc = oracle_all(test, lat, widths=[w])
    rows["oracle (knows every cycle's outcome; AR steps allowed)"] = {
        "modelled_speedup": orc.speedup, "tau": orc.tau, **{k: orc.summary()[k] for k in ("mean_depth", "mean_size")}}
    for r in rows.values():
        r["fraction_of_oracle_gain"] = fraction_of_oracle_gain(r["modelled_speedup"], orc.speedup)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "headroom.json").write_text(json.dumps({"train_traces": args.train_traces, "eval_traces": args.eval_traces,
                                                   "latency": args.latency, "rows": rows, "fitted": fitted},
                                                  indent=2) + "\n")

    table = markdown_table(rows, "controller")
    (out / "headroom.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
