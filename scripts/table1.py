"""The LTD paper's Table 1 for this project: every controller's speedup over AR and τ per dataset, replayed on every
shared machine profile and measured live on this machine.

Replay (greedy): each controller on the same greedy evaluation traces (recorded with the draft hidden states that
SpecDec++ reads), with each profile's latency model; static-gs is the best static tree on the *training* traces under
that profile, and costaware's and the chains' calibrations are fitted on the training traces too, as a machine setup
there would (scripts/transfer_table.py's rules). Profiles: the measured members of the standard family and every
``*.latency.json`` of the shared machines folder.

Live: the ``summary.json`` of ``adaptree bench`` runs (greedy and T=1, in this machine's tree-paying and default
modes) given with ``--live NAME=FOLDER``; their rows are read as they are (speedup = the bench's total-time ratio
to its reference arm, τ = accepted tokens per cycle + 1).

    python scripts/table1.py --traces EVAL --train-traces TRAIN --out docs/results/table1/table1 \
        [--live "bf16 float, greedy=runs/t1-float-t0" ...]

Writes OUT.json and OUT.md. Resumable: profiles already in OUT.json (same settings) are kept.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from transfer_table import calibrations, method_rows

from adaptree.models.assets import shipped_head
from adaptree.offline.family import STANDARD_INDEX, read_index
from adaptree.offline.latency import LatencyModel
from adaptree.offline.oracle import best_static
from adaptree.offline.runs import write_json
from adaptree.offline.traces import TraceStore

METHODS = ("static", "ddd", "svip", "gammatune", "deagle", "specdec", "c2t", "static-gs", "costaware", "hybrid", "ltd",
           "radar", "resps")
"""Table 1's rows, in the paper's order (EAGLE-3's tree first, the training-free rules, the classifiers, grid search,
then this project's rules and the learned methods)."""
LABELS = {"static": "EAGLE-3", "ddd": "+DDD", "svip": "+SVIP", "gammatune": "+Gammatune", "deagle": "+DEAGLE",
          "specdec": "+SpecDec++", "c2t": "+C2T", "static-gs": "+GS", "costaware": "+costaware", "hybrid": "+hybrid",
          "ltd": "+LTD", "radar": "+RADAR", "resps": "+Re-SpS"}
SHARED_MACHINES = Path(__file__).resolve().parents[1].parent / "shared" / "machines"


def profiles(shared: Path) -> list[tuple[SimpleNamespace, Path]]:
    """(member, latency file) of every measured family member and every shared ``*.latency.json``."""
    out = []
    index = Path(STANDARD_INDEX)
    for m in read_index(index):
        if m.group == "measured":
            out.append((m, index.parent / f"{m.name}.json"))
    for f in sorted(shared.glob("*.latency.json")):
        name = f.name.removesuffix(".latency.json")
        out.append((SimpleNamespace(name=f"shared-{name}", model=LatencyModel.load(f)), f))
    return out


def datasets(traces) -> dict[str, list]:
    by: dict[str, list] = {}
    for t in traces:
        by.setdefault(t.key.split("/")[0], []).append(t)
    return {**by, "mean": list(traces)}


def replay_rows(member, latency_file: Path, sets: dict, train, acc: Path, chain: Path, head: Path) -> dict:
    """Dataset -> method -> {modelled_speedup, tau, mean_depth, mean_size} on one profile (static-gs's tree searched
    once on the training traces, for every dataset)."""
    tuned = best_static(train, member.model, widths=(10,), depths=range(1, 13))
    return {name: method_rows(member, latency_file, traces, train, acc, chain, {}, METHODS, head, tuned)
            for name, traces in sets.items()}


def live_rows(folder: Path) -> dict:
    """Dataset -> method -> {speedup, tau, differs} of a bench's summary.json (its reference arm is AR)."""
    s = json.loads((Path(folder) / "summary.json").read_text())
    if s.get("reference") != "ar":
        raise SystemExit(f"table1: {folder}: the bench's reference arm is {s.get('reference')!r}, not ar")
    out = {}
    for ds, rows in s["results"].items():
        if "/" in ds:  # MT-bench second turns: Table 1 is first turns
            continue
        out["mean" if ds == "all" else ds] = {
            m: {"speedup": r["speedup_total_time"], "ci95": r.get("speedup_total_time_ci95"), "tau": r["tau"],
                "tokens_per_s": r["tokens_per_s"], "differs_from_ar": r.get("differs_from_ar")}
            for m, r in rows.items()}
    return {"rows": out, "settings": s["settings"], "machine": s["machine"], "command": s.get("command"),
            "greedy": s.get("greedy")}


def cell(r: dict | None, key: str) -> str:
    if r is None or "skipped" in r:
        return "-"
    return f"{r[key]:.2f}x {r['tau']:.2f}"


def table(title: str, rows: dict, key: str) -> list[str]:
    """A markdown table: one row per method, speedup and τ per dataset."""
    sets = [d for d in rows if d != "mean"] + (["mean"] if "mean" in rows else [])
    lines = [f"#### {title}", "", "| method | " + " | ".join(f"{d} speedup τ" for d in sets) + " |",
             "|---|" + "---|" * len(sets)]
    for m in METHODS:
        if not any(m in rows[d] for d in sets):
            continue
        lines.append(f"| {LABELS[m]} | " + " | ".join(cell(rows[d].get(m), key) for d in sets) + " |")
    return lines + [""]


PAYS, NO_TREE = 1.3, 1.0
"""A profile's trees pay where the best static tree in hindsight models >= PAYS x AR (where the transfer table holds
LTD to its bars), and do not where it models < NO_TREE."""


def regime(p: dict) -> str:
    b = p["best_static"]["speedup"]
    return "trees pay" if b >= PAYS else "trees do not pay" if b < NO_TREE else "in between"


def summary(replay: dict) -> dict:
    """Per regime (trees pay, in between, trees do not pay) and method: the geometric mean of the modelled speedup
    (over all traces) across the profiles, its smallest value, and on how many profiles it is the best row."""
    out = {}
    for reg in ("trees pay", "in between", "trees do not pay"):
        ps = [p for p in replay.values() if regime(p) == reg]
        if not ps:
            continue
        best: dict[str, int] = {}
        for p in ps:
            mean = {m: r["modelled_speedup"] for m, r in p["rows"]["mean"].items() if "skipped" not in r}
            top = max(mean, key=mean.get)
            best[top] = best.get(top, 0) + 1
        rows = {}
        for m in METHODS:
            v = [p["rows"]["mean"][m]["modelled_speedup"] for p in ps
                 if "skipped" not in p["rows"]["mean"].get(m, {"skipped": 1})]
            if v:
                rows[m] = {"geomean_speedup": round(float(np.exp(np.mean(np.log(v)))), 4), "min": round(min(v), 4),
                           "profiles": len(v), "best_on": best.get(m, 0)}
        out[reg] = {"profiles": [n for n, p in replay.items() if regime(p) == reg], "methods": rows}
    return out


def markdown(replay: dict, live: dict, summ: dict) -> str:
    lines = ["### Live, this machine", ""]
    for name, r in live.items():
        st = r["settings"]
        lines += table(f"{name} ({st['dtype']}, weights {st['weights']}, T={st['temperature']}; "
                       f"`{r['command']}`)", r["rows"], "speedup")
    lines += ["### Across the replayed profiles (all traces), by whether trees pay there", ""]
    for reg, r in summ.items():
        lines += [f"#### {reg} ({len(r['profiles'])} profiles: {', '.join(r['profiles'])})", "",
                  "| method | geometric mean | smallest | best on |", "|---|---|---|---|"]
        lines += [f"| {LABELS[m]} | {s['geomean_speedup']:.3f}x | {s['min']:.3f}x | {s['best_on']}/{s['profiles']} |"
                  for m, s in r["methods"].items()] + [""]
    lines += ["### Replayed (greedy) on every profile: modelled speedup over AR and τ", ""]
    for name, p in replay.items():
        b = p["best_static"]
        lines += table(f"{name}: best static tree in hindsight {b['tree']} {b['speedup']:.2f}x ({regime(p)})",
                       p["rows"], "modelled_speedup")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", required=True, help="greedy evaluation traces with draft hidden states "
                                                    "(`adaptree traces record --hidden-dtype float16`)")
    ap.add_argument("--train-traces", required=True, help="traces of training prompts (static-gs and the "
                                                          "calibrations are fitted there)")
    ap.add_argument("--shared", default=str(SHARED_MACHINES), help="folder of shared machine profiles")
    ap.add_argument("--live", action="append", default=[], help="NAME=FOLDER: a bench results folder (repeatable)")
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    args = ap.parse_args()

    traces = TraceStore(args.traces).load_all()
    train = TraceStore(args.train_traces).load_all()
    out = Path(args.out)
    acc, chain = calibrations(train, out.parent / f"{out.name}-calibrations")
    head = shipped_head()
    meta = {"traces": [t.key for t in traces], "train_traces": sorted(t.key for t in train), "methods": list(METHODS)}
    done: dict[str, dict] = {}
    if out.with_suffix(".json").is_file():
        old = json.loads(out.with_suffix(".json").read_text())
        if old.get("meta") == meta:
            done = old["replay"]
    from tqdm import tqdm

    t0 = time.perf_counter()
    sets = datasets(traces)
    live = {}
    for item in args.live:
        name, _, folder = item.rpartition("=")
        if not folder:
            raise SystemExit(f"table1: --live {item!r}: expected NAME=FOLDER")
        live[name] = live_rows(Path(folder))
    for member, latency_file in tqdm(profiles(Path(args.shared)), desc="profiles", unit="profile"):
        if member.name not in done:
            done[member.name] = {"rows": replay_rows(member, latency_file, sets, train, acc, chain, head)}
        elif "best_static" in done[member.name]:
            continue
        best = best_static(traces, member.model, widths=(10,), depths=range(1, 13))
        done[member.name]["best_static"] = {"tree": f"D{best.depth} V{best.size}", "speedup": round(best.speedup, 5)}
        write_json({"meta": meta, "replay": done, "live": live}, out.with_suffix(".json"))
    summ = summary(done)
    write_json({"meta": meta, "replay": done, "live": live, "summary": summ,
                "took_s": round(time.perf_counter() - t0, 1)}, out.with_suffix(".json"))
    out.with_suffix(".md").write_text(markdown(done, live, summ))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
