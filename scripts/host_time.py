"""Host time per cycle, per method (adaptree.bench.host_time): a cycle's wall time less the target's and the draft
head's forwards, and its parts. Greedy, the default model with the shipped head, in the execution mode given.

    python scripts/host_time.py --out docs/results/host-time/NAME [--methods ar,static,hybrid,...] [--tokens 96]
        [--dtype bfloat16 --weights int4 --compile auto] [--threads 2] [--repeats 3]

Every method runs on an MT-bench and a HumanEval prompt; the methods are interleaved and the whole round is repeated
(``--repeats``), and each number is the median over rounds. Writes OUT.json (per method: milliseconds per cycle of
the cycle, the target's and the head's forwards, the host time and its parts; the machine profile) and prints a
Markdown table. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

DEFAULT_METHODS = "ar,static,static-gs,ngram,costaware,hybrid,deagle,ltd,radar,resps"
COLUMNS = ("cycle", "target", "head", "host", "policy", "other", "draft_loop", "verify_host")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json is written)")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated methods (default {DEFAULT_METHODS})")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per prompt (default 96)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the methods (default 3)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="int4")
    ap.add_argument("--compile", default="auto", help="auto (the measured choice), on or off")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.tokens < 1 or args.repeats < 1:
        raise SystemExit(f"host_time: --tokens and --repeats must be >= 1, got {args.tokens} and {args.repeats}")

    import adaptree
    from adaptree.bench.host_time import ForwardClock, host_split
    from adaptree.core.machine import machine_profile
    from adaptree.data.prompts import humaneval, mt_bench

    p = adaptree.load(device=args.device, dtype=args.dtype, weights=args.weights, compile=args.compile,
                      threads=args.threads, progress=False)
    prompts = [mt_bench()[0].turns[0], humaneval()[0].turns[0]]
    methods = [x for x in args.methods.split(",") if x]
    for m in methods:
        p.generate(prompts[0], m, max_new_tokens=16)  # warm-up (and compile) outside the timing
    rounds: dict[str, list[dict]] = {m: [] for m in methods}
    for _ in range(args.repeats):
        for m in methods:
            with ForwardClock(p.target, p.head) as clock:
                gens = [p.generate(q, m, max_new_tokens=args.tokens).result for q in prompts]
            rounds[m].append(host_split(gens, clock))
    rows = {m: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for m, rs in rounds.items()}
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_profile(), "settings": p.settings(), "tokens": args.tokens, "prompts": len(prompts),
                               "repeats": args.repeats, "ms_per_cycle": rows}, indent=1) + "\n")
    cfg = p.settings()
    print(f"{cfg['dtype']} {cfg['weights']} weights, {cfg['attention']} attention, compiled up to "
          f"{cfg['compile_tokens']} tokens, {cfg['threads']} threads; ms per cycle, medians of {args.repeats} rounds")
    print("| method | tokens/cycle | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for m, r in rows.items():
        print(f"| {m} | {r['tokens_per_cycle']:.2f} | " + " | ".join(f"{r[k]:.2f}" for k in COLUMNS) + " |")


if __name__ == "__main__":
    main()
