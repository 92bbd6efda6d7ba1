"""Host reads of tensor values per cycle, per method (adaptree.bench.host_reads): what would each be a wait for the
device on a GPU. Greedy, compile off, the default model in bf16 with the shipped head and no machine setup.

    python scripts/host_reads.py --out docs/results/host-reads [--methods ar,static,hybrid,...] [--tokens 64]

Writes OUT.json (per method: reads per cycle, those an accelerator run would make, per draft forward, by kind, the
top call sites) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_METHODS = "ar,static,static-gs,ngram,costaware,hybrid,deagle,ltd,radar,resps"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json is written)")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated methods (default {DEFAULT_METHODS})")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = ap.parse_args()
    if args.tokens < 1:
        raise SystemExit(f"host_reads: --tokens must be >= 1, got {args.tokens}")

    import adaptree
    from adaptree.bench.host_reads import HostReads
    from adaptree.data.prompts import humaneval, mt_bench

    p = adaptree.load(device=args.device, dtype="bfloat16", weights="float", compile="off", adapt=False,
                      progress=False)
    prompts = [mt_bench()[0].turns[0], humaneval()[0].turns[0]]
    rows = {}
    for m in [x for x in args.methods.split(",") if x]:
        p.generate(prompts[0], m, max_new_tokens=8)  # warm-up outside the count
        with HostReads() as reads:
            gens = [p.generate(q, m, max_new_tokens=args.tokens) for q in prompts]
        cycles = sum(len(g.cycles) for g in gens)
        drafts = sum(c.depth for g in gens for c in g.cycles)
        rows[m] = {"cycles": cycles, "reads": reads.total, "per_cycle": round(reads.per_cycle(cycles), 2),
                   "accelerator_per_cycle": round(reads.per_cycle(cycles, accelerator=True), 2),
                   "per_draft_forward": round(reads.accelerator / drafts, 2) if drafts else None,
                   "kinds": dict(reads.kinds), "top_sites": reads.top(8)}
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": args.device, "tokens": args.tokens, "prompts": len(prompts),
                               "methods": rows}, indent=1) + "\n")
    print("| method | cycles | host reads per cycle (all) | on an accelerator | per draft forward | most frequent site |")
    print("|---|---|---|---|---|---|")
    for m, r in rows.items():
        site = f"{r['top_sites'][0][0]} ({r['top_sites'][0][1]})" if r["top_sites"] else "-"
        per_d = "-" if r["per_draft_forward"] is None else r["per_draft_forward"]
        print(f"| {m} | {r['cycles']} | {r['per_cycle']} | {r['accelerator_per_cycle']} | {per_d} | {site} |")


if __name__ == "__main__":
    main()
