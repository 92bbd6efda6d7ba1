"""How the controllers do on machines they were not tuned on, in the simulator.

For every profile folder under PROFILES (``docs/results/machines/<profile>/latency.json`` and ``static_gs.json``,
written by ``scripts/measure_machines.sh``), every method is replayed on the same greedy evaluation traces with
that profile's latency model: modelled speedup over AR (ratio of summed times) with a 95% bootstrap interval over
prompts, the mean depth and V each chose, and the ratio to the best static tree for that profile in hindsight
(the grid's best on these very traces). Writes JSON and a Markdown table.

    python scripts/transfer_table.py --traces runs/s16/eval-traces --acceptance ACCEPTANCE.json \
        --ltd name=FOLDER ... --radar FOLDER --out docs/results/machines/transfer
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaptree.bench.stats import bootstrap_ratio_ci, ratio_of_sums
from adaptree.methods import make_controller
from adaptree.offline.latency import LatencyModel
from adaptree.offline.oracle import best_static
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import TraceStore


def record(folder: str) -> None:
    """The evaluation traces: the first 16 MT-bench first turns and 16 HumanEval problems, 128 greedy tokens, bf16
    (greedy acceptance does not depend on the machine)."""
    import adaptree
    from adaptree.data.prompts import humaneval, mt_bench
    from adaptree.offline.recording import record_prompts

    p = adaptree.load(dtype="bfloat16", weights="float", compile="off", adapt=False)
    record_prompts(p, folder, mt_bench()[:16] + humaneval()[:16], widths=(10,), max_depth=12, max_new_tokens=128,
                   feature_dtype="none")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="greedy traces of the evaluation prompts (recorded there if "
                                                    "missing: 16 MT-bench + 16 HumanEval, 128 tokens)")
    ap.add_argument("--profiles", default="docs/results/machines", help="folder of profile folders")
    ap.add_argument("--acceptance", required=True, help="costaware's acceptance calibration (fitted on other traces)")
    ap.add_argument("--ltd", action="append", default=[], help="NAME=FOLDER of an LTD pair (depth/, size/)")
    ap.add_argument("--radar", default=None, help="a RADAR policy folder")
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    args = ap.parse_args()

    if not (Path(args.traces) / "manifest.json").is_file():
        record(args.traces)
    traces = TraceStore(args.traces).load_all()
    profiles = sorted(p for p in Path(args.profiles).iterdir() if (p / "latency.json").is_file())
    rows = []
    for prof in profiles:
        lat = LatencyModel.load(prof / "latency.json")
        tree = json.loads((prof / "static_gs.json").read_text())
        best = best_static(traces, lat, widths=(10,), depths=range(1, 13))
        methods = {
            "static (EAGLE-3 W10 D8 V60)": make_controller("static", width=10, depth=8, size=60),
            f"static-gs (this profile: D{tree['depth']} V{tree['size']})": make_controller(
                "static", width=tree["width"], depth=tree["depth"], size=tree["size"]),
            "costaware": make_controller("costaware", latency=str(prof / "latency.json"), acceptance=args.acceptance),
        }
        for spec in args.ltd:
            name, folder = spec.split("=", 1)
            for gate in (True, False):
                methods[name + ("" if gate else " without AR fallback")] = make_controller(
                    "ltd", depth_policy=f"{folder}/depth", size_policy=f"{folder}/size",
                    latency=str(prof / "latency.json"), ar_fallback=gate)
        if args.radar:
            for gate in (True, False):
                methods["radar" + ("" if gate else " without AR fallback")] = make_controller(
                    "radar", policy=args.radar, latency=str(prof / "latency.json"), ar_fallback=gate)
        best_ctl = make_controller("static", width=best.width, depth=best.depth, size=best.size)
        best_res = simulate(best_ctl, traces, lat, measure_policy=False)
        best_speed = ratio_of_sums([r.ar_s for r in best_res.runs], [r.total_s for r in best_res.runs])
        for name, ctl in methods.items():
            res = simulate(ctl, traces, lat, measure_policy=False)
            ar, tot = [r.ar_s for r in res.runs], [r.total_s for r in res.runs]
            s = res.summary()
            speed = ratio_of_sums(ar, tot)
            lo, hi = bootstrap_ratio_ci(ar, tot)
            rows.append({"profile": prof.name, "method": name, "speedup": speed, "ci": [lo, hi],
                         "vs_best_static": speed / best_speed, "tau": s["tau"], "mean_depth": s["mean_depth"],
                         "mean_size": s["mean_size"],
                         "best_static": f"D{best.depth} V{best.size} {best_speed:.3f}x"})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"traces": args.traces, "prompts": [t.key for t in traces], "profiles": [p.name for p in profiles],
            "ltd": args.ltd, "radar": args.radar}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["| profile | method | modelled speedup vs AR [95% CI] | vs best static | tau | depth | V |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['profile']} | {r['method']} | {r['speedup']:.3f}x [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] | "
                     f"{r['vs_best_static']:.3f} | {r['tau']:.2f} | {r['mean_depth']:.2f} | {r['mean_size']:.1f} |")
    best_by = {r["profile"]: r["best_static"] for r in rows}
    lines += ["", "Best static tree per profile in hindsight (on these traces): "
              + "; ".join(f"{k}: {v}" for k, v in best_by.items())]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
