"""Candidate LTD pairs against hybrid and the shipped pair, replayed on Table 1's profiles: is a retrained pair worth
shipping?

Each pair (a folder with ``depth/`` and ``size/``, e.g. a training run's ``policy/``) runs as shipped pairs run (the
AR fallback, the context chain, the machine's static tree), on the same greedy evaluation traces and profiles as
``scripts/table1.py`` (every measured member of the standard family and every shared ``*.latency.json``), with
static-gs's tree and the calibrations fitted on the training traces as a machine setup there would. Writes OUT.json
and OUT.md: per profile the modelled speedups, and per pair, over the profiles where trees pay (the best static tree
in hindsight >= 1.3x AR), the geometric mean, the ratio to hybrid and on how many profiles it is >= hybrid.

    python scripts/ltd_candidates.py --traces runs/t1/eval-traces --train-traces runs/f59/train-traces \\
        --out docs/results/ltd-split-2026-11-29/candidates runs/f59/rule-s0/policy runs/f59/rule-s1/policy
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from table1 import PAYS, SHARED_MACHINES, profiles
from transfer_table import calibrations, method_rows
from tqdm import tqdm

from adaptree.models.assets import shipped_head
from adaptree.offline.oracle import best_static
from adaptree.offline.runs import write_json
from adaptree.offline.traces import TraceStore


def geomean(x) -> float:
    return float(np.exp(np.mean(np.log(x))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="+", help="LTD pair folders (depth/ and size/)")
    ap.add_argument("--traces", required=True, help="greedy evaluation traces (Table 1's)")
    ap.add_argument("--train-traces", required=True, help="traces of training prompts (static-gs, the calibrations)")
    ap.add_argument("--shared", default=str(SHARED_MACHINES), help="folder of shared machine profiles")
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    ap.add_argument("--hybrid-scales", default="", help="comma-separated price scales: hybrid with its price lambda "
                    "multiplied by each (costaware's price_scale) as more arms, e.g. 0.85,1.15: is the rule at its "
                    "optimum?")
    args = ap.parse_args()
    scales = [float(x) for x in args.hybrid_scales.split(",") if x]
    for p in args.pairs:
        if not (Path(p) / "depth").is_dir() or not (Path(p) / "size").is_dir():
            raise SystemExit(f"ltd_candidates: {p} has no depth/ and size/ policy folders")
    traces = TraceStore(args.traces).load_all()
    train = TraceStore(args.train_traces).load_all()
    out = Path(args.out)
    acc, chain = calibrations(train, out.parent / f"{out.name}-calibrations")
    head = shipped_head()
    arms = ["hybrid", *(f"hybrid x{c:g}" for c in scales), "shipped", *args.pairs]
    rows = {}
    for member, latency_file in tqdm(profiles(Path(args.shared)), desc="profiles", unit="profile"):
        tuned = best_static(train, member.model, widths=(10,), depths=range(1, 13))
        r = method_rows(member, latency_file, traces, train, acc, chain, {}, ("hybrid", "ltd"), head, tuned)
        row = {"best_static": round(best_static(traces, member.model, widths=(10,), depths=range(1, 13)).speedup, 5),
               "hybrid": r["hybrid"], "shipped": r["ltd"]}
        for c in scales:
            row[f"hybrid x{c:g}"] = method_rows(member, latency_file, traces, train, acc, chain,
                                                {"hybrid": {"price_scale": c}}, ("hybrid",), head, tuned)["hybrid"]
        for p in args.pairs:
            pol = {"ltd": {"depth_policy": f"{p}/depth", "size_policy": f"{p}/size"}}
            row[p] = method_rows(member, latency_file, traces, train, acc, chain, pol, ("ltd",), head, tuned)["ltd"]
        rows[member.name] = row
    pay = [r for r in rows.values() if r["best_static"] >= PAYS]
    summary = {}
    for a in arms:
        s = [r[a]["modelled_speedup"] for r in pay]
        h = [r["hybrid"]["modelled_speedup"] for r in pay]
        summary[a] = {"trees_pay_geomean": round(geomean(s), 4),
                      "vs_hybrid_geomean": round(geomean(np.divide(s, h)), 4),
                      "at_least_hybrid": int(sum(x >= y for x, y in zip(s, h))), "profiles": len(pay),
                      "smallest_elsewhere": round(min(r[a]["modelled_speedup"] for r in rows.values()
                                                      if r["best_static"] < PAYS), 4)}
    write_json({"meta": {"traces": [t.key for t in traces], "train_traces": sorted(t.key for t in train),
                         "pairs": args.pairs}, "rows": rows, "summary": summary}, out.with_suffix(".json"))
    lines = [f"Where trees pay ({len(pay)} profiles: the best static tree in hindsight >= {PAYS}x AR):", "",
             "| pair | geometric mean | / hybrid | >= hybrid on | smallest elsewhere |", "|---|---|---|---|---|"]
    lines += [f"| {a} | {s['trees_pay_geomean']:.3f}x | {s['vs_hybrid_geomean']:.4f} | {s['at_least_hybrid']}/"
              f"{s['profiles']} | {s['smallest_elsewhere']:.3f}x |" for a, s in summary.items()]
    lines += ["", "Per profile (modelled speedup over AR):", "",
              "| profile | best static | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    lines += [f"| {n} | {r['best_static']:.3f}x | " + " | ".join(f"{r[a]['modelled_speedup']:.3f}x" for a in arms)
              + " |" for n, r in rows.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
