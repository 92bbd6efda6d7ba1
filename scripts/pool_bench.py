"""Pool repeated `adaptree bench` runs of the same arms and prompts: on a shared, noisy machine one bench of 6 runs
per arm moves by 30% from one hour to the next, so the comparison that holds is the paired one over every run of
every bench.

    python scripts/pool_bench.py BENCH_DIR [BENCH_DIR ...] --reference static-gs --out POOLED.json

For each method: the geometric mean over paired runs (same bench, prompt and turn) of its tokens/s over AR's and
over the reference's, the runs it is faster than the reference, and the paired Wilcoxon signed-rank p against the
reference. Writes JSON and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from adaptree.bench.stats import wilcoxon_paired


def load_runs(folders: list[str]) -> dict[tuple, float]:
    """tokens/s of every run, keyed by (bench index, dataset, prompt, turn, repeat, method)."""
    runs = {}
    for i, folder in enumerate(folders):
        path = Path(folder) / "results.jsonl"
        if not path.is_file():
            raise SystemExit(f"pool_bench: {path} not found (a bench --out folder holds results.jsonl)")
        for line in path.read_text().splitlines():
            r = json.loads(line)
            runs[(i, r["dataset"], r["prompt_id"], r["turn"], r["repeat"], r["method"])] = r["new_tokens"] / r["wall_s"]
    return runs


def pool(runs: dict[tuple, float], reference: str) -> dict[str, dict]:
    keys = sorted({k[:5] for k in runs})
    methods = sorted({k[5] for k in runs}, key=lambda m: (m != "ar", m != reference, m))
    for need in ("ar", reference):
        if need not in methods:
            raise SystemExit(f"pool_bench: no {need!r} arm in the benches (arms: {', '.join(methods)})")
    out = {}
    for m in methods:
        paired = [k for k in keys if k + (m,) in runs and k + ("ar",) in runs and k + (reference,) in runs]
        tok = np.array([runs[k + (m,)] for k in paired])
        ar = np.array([runs[k + ("ar",)] for k in paired])
        ref = np.array([runs[k + (reference,)] for k in paired])
        test = wilcoxon_paired(tok, ref)  # the bench's own paired test
        row = {"runs": len(paired), "speedup_geomean": float(np.exp(np.mean(np.log(tok / ar)))),
               "vs_reference_geomean": float(np.exp(np.mean(np.log(tok / ref)))),
               "faster_than_reference": test["wins"]}
        if m != reference:
            row["p_vs_reference"] = test["p_value"]
        out[m] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("benches", nargs="+", help="bench --out folders (each with results.jsonl)")
    ap.add_argument("--reference", default="static-gs", help="the arm every method is paired with (default static-gs)")
    ap.add_argument("--out", default=None, help="write the pooled table here as JSON")
    args = ap.parse_args()
    table = pool(load_runs(args.benches), args.reference)
    print(f"| method | runs | speedup over AR (geomean) | vs {args.reference} | faster than {args.reference} | p |")
    print("|---|---|---|---|---|---|")
    for m, r in table.items():
        p = f"{r['p_vs_reference']:.3f}" if "p_vs_reference" in r else "-"
        print(f"| {m} | {r['runs']} | {r['speedup_geomean']:.2f}x | {r['vs_reference_geomean']:.3f}x | "
              f"{r['faster_than_reference']}/{r['runs']} | {p} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"benches": args.benches, "reference": args.reference,
                                              "methods": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
