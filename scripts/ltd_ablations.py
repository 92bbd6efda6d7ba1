"""LTD's ablations (the paper's §6.2-6.3 and A.4) on the default model, in the simulator.

Trains the size-policy variants (reward = acceptance length / time cost / throughput; observation
P+L / P+D / P+D+L) with ``adaptree train ltd --only size`` on the training traces of a main LTD run, then
replays every variant and the main run's policies on EVALUATION traces (the benchmark prompts, e.g. the
``traces/`` folder that ``adaptree bench --oracle-latency`` records) with the same latency model:

- LTD (the exported pair), -Depth (size policy, depth 8), -Size (depth policy, V 60), -Iterative (Iter0);
- Iter0..Iter3 (the pairs the co-adaptation went through);
- reward ablation and observation ablation (size policy alone, depth 8);
- static EAGLE-3 (W10 D8 V60), the best static tree of the grid and the oracle, with the fraction of the
  oracle's gain each row achieves.

Writes ``OUT/ablations.json`` and ``OUT/ablations.md``. Reruns reuse finished training runs.

    python scripts/ltd_ablations.py --ltd-run runs/ltd --eval-traces runs/bench-greedy/traces \
        --latency runs/latency/latency-bf16.json --out runs/ltd-ablations
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaptree.methods import StaticConfig, StaticController
from adaptree.methods.ltd.controller import LTDConfig, LTDController
from adaptree.methods.ltd.train import LTDTrainConfig, evaluate, train_ltd
from adaptree.offline.latency import load_checked
from adaptree.offline.oracle import best_static, fraction_of_oracle_gain, oracle_all
from adaptree.offline.policy import MLPPolicy
from adaptree.offline.traces import TraceStore

VARIANTS = {  # name -> LTDTrainConfig overrides (size policy alone)
    "reward=acceptance": dict(reward="acceptance"),
    "reward=time": dict(reward="time"),
    "reward=throughput": dict(reward="throughput"),
    "obs=P+L": dict(use_depth=False),
    "obs=P+D": dict(use_length=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ltd-run", required=True, help="folder of the main `adaptree train ltd` run")
    ap.add_argument("--eval-traces", required=True, help="greedy traces of the evaluation prompts")
    ap.add_argument("--latency", required=True)
    ap.add_argument("--out", default="runs/ltd-ablations")
    ap.add_argument("--size-steps", type=int, default=None, help="steps per variant (default: the main run's)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()

    run = Path(args.ltd_run)
    lat = load_checked(args.latency)
    main_settings = json.loads((run / "settings.json").read_text())
    base = {k: v for k, v in main_settings.items() if k in LTDTrainConfig.__dataclass_fields__}
    base["sizes"] = tuple(base["sizes"])
    for k in ("depth_pi", "depth_vf", "size_pi", "size_vf"):
        base[k] = tuple(base[k])
    train_traces = TraceStore(run / "traces").load_all()
    eval_traces = TraceStore(args.eval_traces).load_all()
    if not eval_traces:
        raise SystemExit(f"no traces in {args.eval_traces}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    W, dmax = base["width"], base["max_depth"]

    def pol(path: Path, kind: str) -> MLPPolicy:
        return MLPPolicy.load(path, kind=f"ltd-{kind}")

    def ltd(d=None, s=None, depth=None, size=60):
        mode = "both" if d and s else ("depth" if d else "size")
        return LTDController(LTDConfig(width=W, depth=depth or (dmax if d else 8), size=size, mode=mode),
                             depth_policy=d, size_policy=s)

    rows: dict[str, dict] = {}
    rows["static W10 D8 V60 (EAGLE-3)"] = evaluate(StaticController(StaticConfig(W, 8, 60)), eval_traces, lat)
    summary = json.loads((run / "summary.json").read_text())
    stage = {name: pol(run / name / "policy", "size" if name.endswith("size") else "depth")
             for name in summary["stages"]}
    dp, sp = pol(run / "policy" / "depth", "depth"), pol(run / "policy" / "size", "size")
    rows["LTD"] = evaluate(ltd(dp, sp), eval_traces, lat)
    rows["-Depth (size policy, depth 8)"] = evaluate(ltd(s=sp), eval_traces, lat)
    rows["-Size (depth policy, V 60)"] = evaluate(ltd(d=dp), eval_traces, lat)
    rows["-Iterative (Iter0)"] = evaluate(ltd(stage["stage1-depth"], stage["stage1-size"]), eval_traces, lat)
    for it in summary["iterations"]:
        rows[f"Iter{it['iteration']}"] = evaluate(ltd(stage[it["depth_policy"]], stage[it["size_policy"]]),
                                                  eval_traces, lat)
    for name, over in VARIANTS.items():
        folder = out / name.replace("=", "-").replace("+", "")
        cfg = LTDTrainConfig(**{**base, **over, "only": "size", "out": str(folder)})
        if args.size_steps:
            cfg.size_steps = args.size_steps
        train_ltd(cfg, train_traces, lat, progress=not args.quiet)
        rows[f"size policy, {name}"] = evaluate(ltd(s=pol(Path(cfg.out) / "policy" / "size", "size")), eval_traces, lat)
    st = best_static(eval_traces, lat, widths=[W], depths=list(range(1, dmax + 1)))
    rows[f"best static W{st.width} D{st.depth} V{st.size} (grid on these prompts)"] = {
        "modelled_speedup": st.speedup, "tau": None, "mean_depth": st.depth, "mean_size": st.size}
    orc = oracle_all(eval_traces, lat, widths=[W])
    rows["oracle (per-cycle best depth and V)"] = {"modelled_speedup": orc.speedup, "tau": orc.tau,
                                                   **{k: orc.summary()[k] for k in ("mean_depth", "mean_size")}}
    for r in rows.values():
        r["fraction_of_oracle_gain"] = fraction_of_oracle_gain(r["modelled_speedup"], orc.speedup)
    (out / "ablations.json").write_text(json.dumps({"eval_traces": args.eval_traces, "latency": args.latency,
                                                    "ltd_run": args.ltd_run, "rows": rows}, indent=2) + "\n")
    table = markdown_table(rows, "variant")
    (out / "ablations.md").write_text(table + "\n")
    print(table)


def markdown_table(rows: dict[str, dict], first: str) -> str:
    """The rows (name -> evaluate()-style dict with ``fraction_of_oracle_gain``) as a markdown table."""
    lines = [f"| {first} | modelled speedup vs AR | τ | mean depth | mean V | fraction of oracle gain |",
             "|---|---|---|---|---|---|"]

    def f(x, p=3):
        return "—" if x is None else f"{x:.{p}f}"

    for name, r in rows.items():
        lines.append(f"| {name} | {f(r['modelled_speedup'])}x | {f(r.get('tau'), 2)} | {f(r.get('mean_depth'), 2)} | "
                     f"{f(r.get('mean_size'), 1)} | {f(r['fraction_of_oracle_gain'], 2)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
