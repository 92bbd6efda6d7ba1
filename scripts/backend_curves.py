"""The cost of a target forward of T rows on each backend side by side (docs/ggml.md): PyTorch's execution modes and
llama.cpp's (the file's own types and its requantizations; Q4_0 also with its weights in the small pages llama.cpp
leaves them in, where the backend moves them to huge pages), interleaved round by round so that a shared machine's
drift hits all alike. Writes backend_curves.json and backend_curves.md into the output folder.

    python scripts/backend_curves.py [OUT] [--model NAME] [--context 100] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from adaptree.adapt.cache import machine_fields
from adaptree.models import load_model
from adaptree.models.ggml import LlamaModel, ggml_available

ROWS = (1, 2, 4, 8, 16, 32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="docs/results/ggml")
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    modes = [("bfloat16", "int4"), ("bfloat16", "float")]
    if ggml_available() is None:
        modes += [("bfloat16", "ggml"), ("bfloat16", "ggml-q4_0"), ("bfloat16", "ggml-q8_0"),
                  ("bfloat16", "ggml-q4_0 small pages")]
    else:
        print(f"llama.cpp backend skipped: {ggml_available()}")
    targets = {}
    for dtype, weights in modes:
        target, _ = load_model(args.model, getattr(torch, dtype), weights=weights.split()[0])
        if weights.endswith("small pages"):  # the weights where llama.cpp leaves them (the backend collapses them)
            target.gguf = LlamaModel(target.path, huge_pages=False)
        cache = target.new_cache(args.context + max(ROWS) + 1)
        target(torch.randint(0, target.config.vocab_size, (1, args.context)), cache=cache, logits_at=slice(-1, None))
        targets[f"{dtype}+{weights}"] = (target, cache)
    times: dict[str, dict[int, list[float]]] = {m: {t: [] for t in ROWS} for m in targets}
    with torch.inference_mode():
        for r in range(args.repeats + 1):  # the first round warms up
            for t in ROWS:
                ids = torch.randint(0, 1000, (1, t))
                for name, (target, cache) in targets.items():
                    cache.length = args.context
                    t0 = time.perf_counter()
                    target(ids, cache=cache, features=True)
                    if r:
                        times[name][t].append(time.perf_counter() - t0)
            print(f"round {r}/{args.repeats}", end="\r", flush=True)
    ms = {m: {t: 1e3 * statistics.median(v) for t, v in per.items()} for m, per in times.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backend_curves.json").write_text(json.dumps(
        {"ms": ms, "context": args.context, "repeats": args.repeats, "threads": torch.get_num_threads(),
         "model": args.model or "smollm2-135m", "machine": machine_fields()}, indent=1) + "\n")
    lines = ["| T rows | " + " | ".join(ms) + " |", "|---|" + "---|" * len(ms)]
    lines += [f"| {t} | " + " | ".join(f"{ms[m][t]:.1f}" for m in ms) + " |" for t in ROWS]
    (out / "backend_curves.md").write_text(
        f"Forward of T rows after {args.context} cached tokens, ms (medians of {args.repeats}, "
        f"{torch.get_num_threads()} threads)\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
