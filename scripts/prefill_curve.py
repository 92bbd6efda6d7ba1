"""int4 against dense prefills of the default model (adaptree.adapt.prefill): what the machine setup's rule measures,
at more prompt lengths. Interleaved, medians of --repeats.

    python scripts/prefill_curve.py --out docs/results/prefill/NAME [--sizes 8,16,64,300] [--threads 2]

Writes OUT.json (the machine profile, CPU kernel level, milliseconds per size for int4 and dense) and prints a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json is written)")
    ap.add_argument("--sizes", default="8,16,32,64,128,300", help="prompt lengths (default 8,16,32,64,128,300)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x]
    except ValueError:
        raise SystemExit(f"prefill_curve: --sizes must be comma-separated integers, got {args.sizes!r}") from None
    if not sizes or min(sizes) < 1 or args.repeats < 1:
        raise SystemExit(f"prefill_curve: sizes and --repeats must be >= 1, got {args.sizes!r} and {args.repeats}")

    import torch

    from adaptree.adapt.attention import attention_dtype
    from adaptree.adapt.prefill import _time_prefills
    from adaptree.core.machine import machine_profile
    from adaptree.models import load_model
    from adaptree.models.llama import set_attention_dtype

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # loaded directly: adaptree.load would apply (and, where dense never paid, drop) the machine's cached choice
    target, _ = load_model(None, dtype=torch.bfloat16, weights="int4")
    set_attention_dtype(target, attention_dtype(target, measure=False))
    t = _time_prefills(target, sizes, repeats=args.repeats)
    rows = {str(n): {"int4_ms": round(1e3 * t["int4"][n], 2), "dense_ms": round(1e3 * t["dense"][n], 2)}
            for n in sizes}
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_profile(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                               "threads": torch.get_num_threads(), "repeats": args.repeats, "ms": rows}, indent=1) + "\n")
    print(f"{torch.backends.cpu.get_cpu_capability()} kernels, {torch.get_num_threads()} threads")
    print("| prompt tokens | int4 ms | dense ms | dense / int4 |\n|---|---|---|---|")
    for n, r in rows.items():
        print(f"| {n} | {r['int4_ms']:.1f} | {r['dense_ms']:.1f} | {r['dense_ms'] / r['int4_ms']:.2f} |")


if __name__ == "__main__":
    main()
