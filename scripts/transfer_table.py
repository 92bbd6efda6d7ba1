"""Every member of a latency family x every method, in the simulator: how the controllers do on machines they
were (and were not) trained on.

For each member of the family index (default: the standard family, adaptree.offline.family; held-out members
marked), every method is replayed on the same greedy evaluation traces with that member's latency model: modelled
speedup over AR (ratio of summed times), the oracle (per-cycle best depth and V with hindsight, AR steps allowed;
and the same with context chains of up to 16 tokens), the best static tree in hindsight, and each method's fraction
of the oracle's gain over AR (of the chain oracle's for methods that verify chains). ``static-gs`` is the tree a
machine setup would choose there: the best static tree on the *training* traces, never on the evaluation ones;
costaware's acceptance and the chain rates are fitted on the training traces too. Writes JSON and Markdown.

    python scripts/transfer_table.py --traces runs/f40/eval-traces --train-traces runs/f40/train-traces \
        --out docs/results/transfer/transfer [--ltd FOLDER] [--radar FOLDER] [--resps FOLDER] [--members NAME,...]

Learned methods run as shipped (their runtime defaults: the AR fallback, the chain when their policies observe the
match), with policy folders overridable to compare candidates before shipping them. Resumable: members already in
OUT.json (same settings) are kept; ``--refresh ltd,radar`` replays those methods again on them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from adaptree.methods import make_controller
from adaptree.models.assets import shipped_head
from adaptree.methods.common.chain import ChainCalibration
from adaptree.methods.costaware.acceptance import AcceptanceCalibration
from adaptree.offline.family import STANDARD_INDEX, cost_features, read_index, verify_ratio
from adaptree.offline.oracle import best_static, fraction_of_oracle_gain, oracle_all
from adaptree.offline.runs import write_json
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import TraceStore

LEARNED = ("ltd", "radar", "resps")
METHODS = ("static", "static-gs", "costaware", "hybrid", "ngram", *LEARNED)
CHAINS = 16
"""Longest context chain of the chain oracle (the hybrid's and the learned methods' chain_tokens)."""
CHAIN_ORACLE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 20, 40, 60, 80, 120, 160, 200, 240)
"""The chain oracle's V set (LTD's family set: the oracle with every V and 17 chain lengths takes minutes a member)."""
TABLE_GRID = {"step": (0.0, 0.8), "growth": (0.001, 0.012, 0.08, 0.6), "draft": (0.1, 0.3), "other": (0.005,)}
"""The synthetic members of the default table (with every measured member): the corners and the middle of the
standard grid, held-out ones among them (replaying every method on all 168 takes hours on 2 cores)."""


def default_members(members: list) -> list:
    keep = []
    for m in members:
        syn = m.model.meta.get("synthetic")
        if syn is None or all(syn[k] in v for k, v in TABLE_GRID.items()):
            keep.append(m)
    return keep


def record(folder: str) -> None:
    """The evaluation traces: the first 16 MT-bench first turns and 16 HumanEval problems, 128 greedy tokens, bf16
    (greedy acceptance does not depend on the machine), with the target features Re-SpS observes."""
    import adaptree
    from adaptree.data.prompts import humaneval, mt_bench
    from adaptree.offline.recording import record_prompts

    p = adaptree.load(dtype="bfloat16", weights="float", compile="off", adapt=False)
    record_prompts(p, folder, mt_bench()[:16] + humaneval()[:16], widths=(10,), max_depth=12, max_new_tokens=128,
                   feature_dtype="float16")


def calibrations(train, folder: Path) -> tuple[Path, Path]:
    """costaware's acceptance calibration and the greedy chain rates of the training traces (fitted once)."""
    folder.mkdir(parents=True, exist_ok=True)
    acc, chain = folder / "acceptance.json", folder / "chain.json"
    if not acc.is_file():
        AcceptanceCalibration.fit(train).save(acc)
    if not chain.is_file():
        ChainCalibration.fit(train).save(chain)
    return acc, chain


def method_rows(member, latency_file: Path, traces, train, acc: Path, chain: Path, policies: dict,
                methods=METHODS, head: Path | None = None, tuned=None) -> dict:
    """One member's rows of ``methods`` (without their fractions of the oracle's gain); ``tuned``: the member's best
    static tree on ``train``, when the caller already searched it."""
    lat = member.model
    if tuned is None:
        tuned = best_static(train, lat, widths=(10,), depths=range(1, 13))
    by_depth = tuned.size_by_depth()
    tuned_file = acc.parent / f"static_gs-{member.name}.json"  # what a setup on that machine would write
    write_json({"width": tuned.width, "depth": tuned.depth, "size": tuned.size,
                "size_by_depth": {str(d): v for d, v in by_depth.items()}}, tuned_file)
    machine = {"latency": str(latency_file), "acceptance": str(acc), "chain": str(chain), "tuned": str(tuned_file)}
    rows = {}
    for name in methods:
        opts = dict(policies.get(name, {}))
        try:
            if name == "static-gs":
                ctl = make_controller("static", width=tuned.width, depth=tuned.depth, size=tuned.size)
            else:
                ctl = make_controller(name, machine=machine, head_folder=head, **opts)
            s = simulate(ctl, traces, lat, measure_policy=False).summary()
        except ValueError as e:  # e.g. a policy whose widths the traces do not hold
            rows[name] = {"skipped": str(e).splitlines()[0][:160]}
            continue
        rows[name] = {k: round(float(s[k]), 5) for k in ("modelled_speedup", "tau", "mean_depth", "mean_size")}
        rows[name]["chains"] = bool(getattr(ctl, "chain_rule", None) is not None or name in ("hybrid", "ngram"))
        if name == "static-gs":
            rows[name]["tree"] = f"D{tuned.depth} V{tuned.size}"
    return rows


def add_fractions(row: dict) -> None:
    """Each method's fraction of the oracle's gain (of the chain oracle's for methods that verify chains)."""
    for r in (r for r in row["methods"].values() if "skipped" not in r):
        r["frac_oracle"] = fraction_of_oracle_gain(r["modelled_speedup"],
                                                   row["oracle_chains"] if r["chains"] else row["oracle"])


def member_rows(member, latency_file: Path, traces, train, acc: Path, chain: Path, policies: dict,
                head: Path | None = None) -> dict:
    """One member: every method's row, the best static tree, the oracles."""
    lat = member.model
    rows = method_rows(member, latency_file, traces, train, acc, chain, policies, head=head)
    best = best_static(traces, lat, widths=(10,), depths=range(1, 13))
    orc = oracle_all(traces, lat, widths=(10,)).speedup
    orc_c = oracle_all(traces, lat, widths=(10,), chains=CHAINS, sizes=CHAIN_ORACLE_SIZES).speedup
    row = {"member": member.name, "group": member.group, "held_out": member.held_out, "source": member.source,
           "cost_features": [round(x, 4) for x in cost_features(lat)], "verify64_ratio": round(verify_ratio(lat), 3),
           "best_static": {"tree": f"D{best.depth} V{best.size}", "speedup": round(best.speedup, 5)},
           "oracle": round(orc, 5), "oracle_chains": round(orc_c, 5), "methods": rows}
    add_fractions(row)
    return row


def checks(row: dict) -> dict[str, bool]:
    """The bars the learned methods are held to on one member: where the best static tree models >= 1.3x, LTD >=
    1.05x the best of static-gs and costaware, LTD >= hybrid (both with chains), RADAR and Re-SpS >= static-gs;
    elsewhere every learned method >= 0.98x AR."""
    m = {k: v.get("modelled_speedup", 0.0) for k, v in row["methods"].items()}  # a skipped method fails its bars
    if row["best_static"]["speedup"] >= 1.3:
        return {"ltd >= 1.05 x max(static-gs, costaware)": m["ltd"] >= 1.05 * max(m["static-gs"], m["costaware"]),
                "ltd >= hybrid": m["ltd"] >= m["hybrid"], "radar >= static-gs": m["radar"] >= m["static-gs"],
                "resps >= static-gs": m["resps"] >= m["static-gs"]}
    return {f"{k} >= 0.98": m[k] >= 0.98 for k in LEARNED}


def markdown(rows: list[dict]) -> str:
    cols = list(METHODS)
    head = ("| member | held out | v(64)/v(0) | draft/AR | best static | oracle (+chains) | "
            + " | ".join(cols) + " | LTD frac. of oracle gain | bars met |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        m, ok = r["methods"], checks(r)
        frac = m["ltd"].get("frac_oracle")
        lines.append(
            f"| {r['member']} | {'yes' if r['held_out'] else ''} | {r['verify64_ratio']:.2f} | "
            f"{r['cost_features'][0]:.2f} | {r['best_static']['tree']} {r['best_static']['speedup']:.2f}x | "
            f"{r['oracle']:.2f}x ({r['oracle_chains']:.2f}x) | "
            + " | ".join(f"{m[c]['modelled_speedup']:.2f}x" if "skipped" not in m[c] else "skipped" for c in cols)
            + f" | {'-' if frac is None else f'{frac:.2f}'} | {sum(ok.values())}/{len(ok)} |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    """Per group (training members, held-out synthetic, measured): how many members meet each bar, LTD's median
    fraction of the oracle's gain."""
    out = {}
    groups = {"trained-on": [r for r in rows if not r["held_out"]],
              "held-out synthetic": [r for r in rows if r["held_out"] and r["group"] == "synthetic"],
              "measured (held out)": [r for r in rows if r["group"] == "measured"]}
    for g, rs in groups.items():
        if not rs:
            continue
        bars: dict[str, list[int]] = {}
        for r in rs:
            for k, v in checks(r).items():
                bars.setdefault(k, [0, 0])
                bars[k][0] += int(v)
                bars[k][1] += 1
        fr = [r["methods"]["ltd"].get("frac_oracle") for r in rs]
        fr = [x for x in fr if x is not None]
        out[g] = {"members": len(rs), "bars": {k: f"{a}/{b}" for k, (a, b) in bars.items()},
                  "ltd_frac_oracle_median": round(float(np.median(fr)), 3) if fr else None,
                  "geomean": {k: round(float(np.exp(np.mean([np.log(r["methods"][k]["modelled_speedup"])
                                                             for r in rs]))), 4)
                              for k in METHODS if all("skipped" not in r["methods"][k] for r in rs)}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="greedy evaluation traces (recorded there if missing: 16 "
                                                    "MT-bench + 16 HumanEval first turns, 128 tokens)")
    ap.add_argument("--train-traces", required=True, help="traces of the policies' training prompts (static-gs, "
                                                          "costaware's and the chains' calibrations are fitted there)")
    ap.add_argument("--family", default=str(STANDARD_INDEX), help="family index (family.json)")
    ap.add_argument("--members", default="", help="comma-separated member names, or 'all' (default: every measured "
                                                 "member and the synthetic ones of TABLE_GRID)")
    ap.add_argument("--model", default=None, help="the registered model whose shipped head's policies are replayed "
                                                  "when no folder is given (default: the default model)")
    for name in LEARNED:
        ap.add_argument(f"--{name}", default=None, help=f"a {name} policy folder instead of the shipped one")
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    ap.add_argument("--refresh", default="", help="comma-separated methods to replay again on the members already "
                                                  "in OUT.json, keeping the rest of their rows (after a change to "
                                                  "those methods; the oracles take most of a member's time)")
    args = ap.parse_args()
    refresh = [m for m in args.refresh.split(",") if m]
    if set(refresh) - set(METHODS):
        raise SystemExit(f"transfer_table: --refresh {sorted(set(refresh) - set(METHODS))}: not among {METHODS}")

    if not (Path(args.traces) / "manifest.json").is_file():
        record(args.traces)
    traces = TraceStore(args.traces).load_all()
    train = TraceStore(args.train_traces).load_all()
    out = Path(args.out)
    acc, chain = calibrations(train, out.parent / f"{out.name}-calibrations")
    head = shipped_head(args.model)
    policies = {}
    if args.ltd:
        policies["ltd"] = {"depth_policy": f"{args.ltd}/depth", "size_policy": f"{args.ltd}/size"}
    if args.radar:
        policies["radar"] = {"policy": args.radar}
    if args.resps:
        policies["resps"] = {"policy": args.resps}
    members = read_index(args.family)
    if not args.members:
        members = default_members(members)
    elif args.members != "all":
        want = args.members.split(",")
        unknown = set(want) - {m.name for m in members}
        if unknown:
            raise SystemExit(f"transfer_table: no member {sorted(unknown)} in {args.family}")
        members = [m for m in members if m.name in want]
    family = Path(args.family).resolve()
    family = family.relative_to(Path.cwd()) if family.is_relative_to(Path.cwd()) else family  # no machine paths
    meta = {**({"model": args.model} if args.model else {}), "traces": args.traces,
            "train_traces": args.train_traces, "family": str(family),
            "prompts": [t.key for t in traces], "policies": policies, "chains": CHAINS}
    done: dict[str, dict] = {}
    if out.with_suffix(".json").is_file():
        old = json.loads(out.with_suffix(".json").read_text())
        if old.get("meta") == meta:
            done = {r["member"]: r for r in old["rows"]}
        elif refresh:
            raise SystemExit(f"transfer_table: --refresh needs {out.with_suffix('.json')} made with the same settings")
    from tqdm import tqdm

    rows = []
    t0 = time.perf_counter()
    for m in tqdm(members, desc="members", unit="member"):
        latency_file = Path(args.family).parent / f"{m.name}.json"
        if m.name not in done:
            done[m.name] = member_rows(m, latency_file, traces, train, acc, chain, policies, head)
        elif refresh:
            done[m.name]["methods"].update(method_rows(m, latency_file, traces, train, acc, chain, policies, refresh,
                                                       head))
            add_fractions(done[m.name])
        else:
            continue
        write_json({"meta": meta, "rows": list(done.values())}, out.with_suffix(".json"))
        rows.append(done[m.name])
    result = {"meta": meta, "rows": rows, "summary": summary(rows), "seconds": round(time.perf_counter() - t0, 1)}
    write_json(result, out.with_suffix(".json"))
    text = markdown(rows)
    out.with_suffix(".md").write_text("## Summary\n\n```\n" + json.dumps(result["summary"], indent=1)
                                      + "\n```\n\n" + text + "\n")
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
