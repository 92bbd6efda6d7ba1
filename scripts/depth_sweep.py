"""DEAGLE's claim, checked: speedup as the maximum draft depth grows, DEAGLE vs the static tree.

For each maximum depth, one ``adaptree bench`` run (AR, static and DEAGLE interleaved per prompt) into
``OUT/depth-D``; then ``OUT/depth_sweep.json`` and ``OUT/depth_sweep.png``. Extra arguments are passed
to every bench run (e.g. ``--limit 4 --max-new-tokens 64 --dtype bfloat16``). A rerun resumes.

    python scripts/depth_sweep.py --out runs/depth-sweep --depths 6,9,12,15,18 -- --limit 3 --turns 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaptree.cli import main as adaptree


def run(out: Path, depths: list[int], methods: str, extra: list[str]) -> dict:
    rows = {}
    for d in depths:
        folder = out / f"depth-{d}"
        code = adaptree(["bench", "--methods", methods, "--depth", str(d), "--out", str(folder), *extra])
        if code:
            raise SystemExit(code)
        s = json.loads((folder / "summary.json").read_text())
        res = s["results"].get("all") or next(iter(s["results"].values()))
        rows[d] = {m: {k: e.get(k) for k in ("speedup_total_time", "speedup_total_time_ci95", "tau", "mean_depth")}
                   for m, e in res.items()}
    (out / "depth_sweep.json").write_text(json.dumps({"depths": depths, "results": rows}, indent=2))
    return rows


def plot(out: Path, rows: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted(rows)
    methods = [m for m in rows[depths[0]] if m != "ar"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        ys = [rows[d][m]["speedup_total_time"] for d in depths]
        ci = [rows[d][m]["speedup_total_time_ci95"] or [None, None] for d in depths]
        lo = [0.0 if c[0] is None else y - c[0] for c, y in zip(ci, ys)]
        hi = [0.0 if c[1] is None else c[1] - y for c, y in zip(ci, ys)]
        ax.errorbar(depths, ys, yerr=[lo, hi], marker="o", capsize=3, label=m)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xlabel("maximum draft depth")
    ax.set_ylabel("speedup vs AR (95% CI)")
    ax.set_title("speedup vs maximum depth")
    ax.legend()
    fig.tight_layout()
    path = out / "depth_sweep.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/depth-sweep")
    p.add_argument("--depths", default="6,9,12,15,18")
    p.add_argument("--methods", default="ar,static,deagle")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(out, [int(x) for x in a.depths.split(",")], a.methods, extra)
    print(f"wrote {out / 'depth_sweep.json'} and {plot(out, rows)}")
