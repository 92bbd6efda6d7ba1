"""The GPU check: on a machine with CUDA, in one command and a few minutes, everything a session lent a GPU needs to
know about adaptree there, written into one small folder (at most 8 files, so a remote run can bring it back).

    bash scripts/gpu_check.sh [OUT]                      # OUT default: gpu-check
    python scripts/gpu_check.py --out OUT [--device cuda] [--prompts 2] [--tokens 128]
    python scripts/gpu_check.py --out OUT --device cpu --threads 16    # the same steps on a many-core host's CPU

Steps (each timed; a step that fails is recorded and the next one runs):

1. the machine: GPU, torch, CUDA, host cores;
2. the forward curve: one target forward over T = 1 .. 256 new tokens after 256 cached, median of 20, bf16 and
   float32 (what the latency model's verification term is made of; the H100 run of 2026-11-26 measured 8.5 ms at
   T = 1, host-bound);
3. the fixed-shape steps (``adaptree.core.graphs``: CUDA graphs per size bucket) against the plain forward at the
   same sizes, bf16 and float32: milliseconds, capture time and the largest logit difference; AR's tokens/s and
   ids through each;
4. the machine setup (``adaptree.load(device=...)``, dtype auto): its seconds (the goal: <= 60 s), the mode,
   static tree and default method, and what every method models there;
5. fp32 losslessness: every registered method's greedy ids against AR's on the first MT-bench and HumanEval
   prompts (the setup's latency model, calibrations and static tree given, so the AR gate, the chains and the
   learned policies all act);
6. a short bench in the setup's dtype with float weights: every method and the Hugging Face reference arms,
   ``--prompts`` MT-bench + HumanEval first turns, ``--tokens`` new tokens.

Files: ``summary.md`` (the tables), ``gpu_check.json`` (everything), ``forward_curve.json``, ``graph_steps.json``, ``setup.json``,
``bench.tar.gz`` (the bench folder: report, summary, results, plots) and ``log.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

CURVE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BENCH_METHODS = ("ar", "static", "static-gs", "costaware", "hybrid", "ngram", "deagle", "ltd", "radar", "resps")
REFERENCE_ARMS = ("hf_generate", "hf_prompt_lookup")


class Check:
    """The results and the log, written after every step."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.result: dict = {"steps": {}}
        self.log = open(out / "log.txt", "a")

    def say(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def step(self, name: str, fn) -> object:
        self.say(f"== {name}")
        t0 = time.perf_counter()
        try:
            value = fn()
            status = "ok"
        except Exception as e:  # the next step still runs: a remote run brings back what it has
            value, status = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            self.log.write(traceback.format_exc())
        took = time.perf_counter() - t0
        self.result["steps"][name] = {"status": status, "seconds": round(took, 1)}
        self.say(f"   {status} in {took:.1f} s")
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=1) + "\n")
        return value


def machine(device: str) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "host_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": device,
            "platform": platform.platform()}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device")
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(torch.device(device)).total_memory / 2**30, 1)
    return info


def forward_curve(device: str, repeats: int) -> dict:
    import adaptree
    from adaptree.bench.profile import profile_forward

    curves = {}
    for dtype in ("bfloat16", "float32"):
        p = adaptree.load(device=device, dtype=dtype, weights="float", compile="off", adapt=False, progress=False)
        rows = profile_forward(p.target, context=256, tokens=CURVE_TOKENS, repeats=repeats)
        curves[dtype] = {str(r["tokens"]): round(r["wall_ms"], 3) for r in rows}
        curves[dtype + "_dispatch_ms"] = {str(r["tokens"]): round(r["split_ms"]["dispatch"], 3) for r in rows}
        del p
    return {"what": "one target forward over T new tokens after 256 cached positions, median of "
                    f"{repeats}, milliseconds (adaptree.bench.profile.profile_forward), eager, compile off",
            "ms": curves}


def graph_steps(device: str, repeats: int) -> dict:
    """The target's forward through the fixed-shape steps (adaptree.core.graphs, CUDA graphs on CUDA) against the
    plain forward: per size, the milliseconds of each, the capture's, and the largest logit difference; then AR's
    tokens/s through each on an MT-bench prompt."""
    import statistics

    import torch

    import adaptree
    from adaptree.core.engine import Engine, synchronize
    from adaptree.core.graphs import StepGraphs
    from adaptree.data.prompts import mt_bench
    from adaptree.offline.latency import random_tree

    dev = torch.device(device)
    result = {}
    for dtype in ("bfloat16", "float32"):
        p = adaptree.load(device=device, dtype=dtype, weights="float", compile="off", adapt=False, progress=False)
        tg = p.target
        cache = tg.new_cache(1024)
        with torch.inference_mode():
            tg(torch.randint(0, tg.config.vocab_size, (1, 256), device=dev), cache=cache)
            steps = StepGraphs(tg, cache)
            gen = torch.Generator().manual_seed(0)
            rows = {}
            for n in CURVE_TOKENS:
                depth, mask = random_tree(n, gen, dev)
                ids = torch.randint(0, tg.config.vocab_size, (1, n), device=dev)
                pos = (depth + 256).to(dev)

                def plain():
                    cache.length = 256
                    return tg(ids, position_ids=pos, cache=cache, tree_mask=mask, features=True)

                def fixed():
                    cache.length = 256
                    return steps.forward(ids, pos, mask)

                synchronize(dev)
                t0 = time.perf_counter()
                b = fixed()  # the first use captures the bucket
                synchronize(dev)
                capture_ms = 1000 * (time.perf_counter() - t0)
                a = plain()
                diff = float((a.logits.float() - b.logits.float()).abs().max())
                times = {"plain": [], "fixed": []}
                for _ in range(repeats):
                    for name, fn in (("plain", plain), ("fixed", fixed)):
                        synchronize(dev)
                        t0 = time.perf_counter()
                        fn()
                        synchronize(dev)
                        times[name].append(1000 * (time.perf_counter() - t0))
                rows[str(n)] = {"plain_ms": round(statistics.median(times["plain"]), 3),
                                "fixed_ms": round(statistics.median(times["fixed"]), 3),
                                "capture_ms": round(capture_ms, 1), "max_logit_diff": round(diff, 6)}
        # both dtypes: float32's ids must match AR's through the plain forward; bfloat16's may flip at near-ties (the
        # fixed steps pad to a bucket's shape, which rounds differently)
        ar = {}
        ids = p.encode(mt_bench()[0].turns[0])
        for graphs in (False, True):
            eng = Engine(tg, None, max_seq_len=2048, graphs=graphs)
            eng.generate(ids, max_new_tokens=8)
            g = eng.generate(ids, max_new_tokens=128)
            ar["graphs" if graphs else "plain"] = {"tokens_per_s": round(g.tokens_per_s, 1),
                                                   "ids": g.token_ids}
        ar["identical"] = ar["graphs"].pop("ids") == ar["plain"].pop("ids")
        result[dtype] = {"ms": rows, "ar": ar}
        del p
    return {"what": "target forward over T new tokens (random tree) after 256 cached: plain forward against the "
                    "fixed-shape step (CUDA graph on CUDA), medians of interleaved runs; AR through each",
            "by_dtype": result}


def setup(device: str, threads: int | None):
    import adaptree

    t0 = time.perf_counter()
    p = adaptree.load(device=device, threads=threads, progress=False)
    took = time.perf_counter() - t0
    s = p.machine
    info = {"load_seconds": round(took, 1), "execution": p.execution, "dtype": p.dtype_name, "weights": p.weights}
    if s is not None:
        info.update({"setup": s.to_dict(), "table": s.table(), "default_method": s.default_method})
    return p, info


def lossless(device: str, assets: dict | None, tokens: int) -> dict:
    import adaptree
    from adaptree.data.prompts import humaneval, mt_bench
    from adaptree.methods import METHODS, make_controller, method

    p = adaptree.load(device=device, dtype="float32", weights="float", compile="off", adapt=False, progress=False)
    prompts = [mt_bench()[0].turns[0], humaneval()[0].turns[0]]
    ref = [p.generate(q, "ar", max_new_tokens=tokens).token_ids for q in prompts]
    rows, skipped = {}, {}
    for m in METHODS:
        if m == "ar":
            continue
        if method(m).needs_draft_model:  # a second model of the target's tokenizer, which this check does not load
            skipped[m] = "needs a draft model"
            continue
        try:
            ctl = lambda: make_controller(m, head_folder=p.head_folder, model=p.model_label,  # noqa: E731
                                          tokenizer=p.tokenizer, machine=assets)
            gens = [p.generate(q, controller=ctl(), max_new_tokens=tokens) for q in prompts]
            rows[m] = {"identical": all(g.token_ids == r for g, r in zip(gens, ref)),
                       "tau": round(sum(g.tau for g in gens) / len(gens), 3)}
        except Exception as e:
            rows[m] = {"identical": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return {"tokens": tokens, "prompts": len(prompts), "methods": rows, "skipped": skipped,
            "all_identical": all(r["identical"] for r in rows.values())}


def bench(device: str, dtype: str, prompts: int, tokens: int, out: Path, timeout: int, threads: int | None) -> dict:
    cmd = [sys.executable, "-m", "adaptree.cli", "bench", "--device", device, "--dtype", dtype, "--weights", "float",
           "--methods", ",".join(BENCH_METHODS + REFERENCE_ARMS), "--limit", str(prompts), "--turns", "1",
           "--max-new-tokens", str(tokens), "--reference", "static-gs", "--out", str(out)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"bench exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"command": "adaptree " + " ".join(cmd[3:]), "summary": summary}


def results_table(report: Path) -> str:
    """The '## Results' section of a bench report."""
    text = report.read_text()
    start = text.find("## Results")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None].strip() if start >= 0 else ""


def write_summary(out: Path, r: dict) -> None:
    lines = ["# adaptree GPU check", ""]
    m = r.get("machine") or {}
    lines.append(f"Machine: {m.get('gpu', m.get('device'))}, torch {m.get('torch')} (CUDA {m.get('cuda')}), "
                 f"{m.get('host_cores')} host cores ({m.get('torch_threads')} torch threads), python "
                 f"{m.get('python')}.")
    lines += ["", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {k} | {v['status']} | {v['seconds']} |" for k, v in r["steps"].items()]
    curve = (r.get("forward_curve") or {}).get("ms")
    if curve:
        lines += ["", "## Forward curve (ms, after 256 cached)", "",
                  "| dtype | " + " | ".join(f"T={t}" for t in CURVE_TOKENS) + " |",
                  "|---|" + "---|" * len(CURVE_TOKENS)]
        for name, row in curve.items():
            lines.append(f"| {name} | " + " | ".join(f"{row.get(str(t), float('nan')):.2f}" for t in CURVE_TOKENS)
                         + " |")
    g = (r.get("graph_steps") or {}).get("by_dtype")
    if g:
        lines += ["", "## Fixed-shape steps (CUDA graphs on CUDA) against the plain forward (ms, after 256 cached)", "",
                  "| dtype | T | plain | fixed | capture | max logit diff |", "|---|---|---|---|---|---|"]
        for name, d in g.items():
            lines += [f"| {name} | {n} | {x['plain_ms']:.2f} | {x['fixed_ms']:.2f} | {x['capture_ms']:.0f} | "
                      f"{x['max_logit_diff']:.2g} |" for n, x in d["ms"].items()]
        lines += [f"\nAR ({name}, 128 tokens): {d['ar']['plain']['tokens_per_s']} tok/s plain, "
                  f"{d['ar']['graphs']['tokens_per_s']} with fixed steps; same ids: {d['ar']['identical']}"
                  for name, d in g.items() if d.get("ar")]
    s = r.get("setup")
    if s:
        lines += ["", f"## Machine setup: {s['load_seconds']} s, {s['execution']}, default method "
                      f"{s.get('default_method')}", "", "```", s.get("table", ""), "```"]
    ll = r.get("lossless")
    if ll:
        lines += ["", f"## fp32 greedy = AR ({ll['prompts']} prompts x {ll['tokens']} tokens): "
                      f"{'all identical' if ll['all_identical'] else 'NOT all identical'}", "",
                  "| method | identical | tau |", "|---|---|---|"]
        lines += [f"| {k} | {v.get('identical')} | {v.get('tau', v.get('error', ''))} |"
                  for k, v in ll["methods"].items()]
        lines += [f"| {k} | skipped | {why} |" for k, why in ll.get("skipped", {}).items()]
    if (out / "bench" / "report.md").is_file():
        lines += ["", "## Bench", "", f"`{r['bench']['command']}`" if r.get("bench") else "", "",
                  results_table(out / "bench" / "report.md")]
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-check", help="results folder (default gpu-check)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu to try the script without a GPU")
    ap.add_argument("--prompts", type=int, default=2, help="MT-bench and HumanEval prompts each in the bench (2)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per bench prompt (128)")
    ap.add_argument("--lossless-tokens", type=int, default=64, help="new tokens per fp32 lossless prompt (64)")
    ap.add_argument("--repeats", type=int, default=20, help="timed forwards per forward-curve point (20)")
    ap.add_argument("--bench-timeout", type=int, default=300, help="seconds the bench may take (300)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads for every step (default: torch's choice, all cores): with --device cpu, "
                         "the CPU profile of a host of that many threads")
    args = ap.parse_args()
    for name in ("prompts", "tokens", "lossless_tokens", "repeats", "bench_timeout"):
        if getattr(args, name) < 1:
            raise SystemExit(f"gpu_check: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"gpu_check: --threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)  # the curves and the lossless check; the setup and bench are told too
    out = Path(args.out)
    c = Check(out)
    t0 = time.perf_counter()
    c.result["machine"] = c.step("machine", lambda: machine(args.device))
    if c.result["machine"] is None:
        write_summary(out, c.result)
        raise SystemExit(f"gpu_check: no usable device {args.device!r} (log: {out / 'log.txt'})")
    c.result["forward_curve"] = c.step("forward curve", lambda: forward_curve(args.device, args.repeats))
    if c.result["forward_curve"]:
        (out / "forward_curve.json").write_text(json.dumps(c.result["forward_curve"], indent=1) + "\n")
    c.result["graph_steps"] = c.step("fixed-shape steps", lambda: graph_steps(args.device, args.repeats))
    if c.result["graph_steps"]:
        (out / "graph_steps.json").write_text(json.dumps(c.result["graph_steps"], indent=1) + "\n")
    got = c.step("machine setup", lambda: setup(args.device, args.threads))
    pipe, c.result["setup"] = got if got else (None, None)
    if c.result["setup"]:
        (out / "setup.json").write_text(json.dumps(c.result["setup"], indent=1, default=str) + "\n")
    assets = pipe.machine.assets if pipe is not None and pipe.machine is not None else None
    dtype = pipe.dtype_name if pipe is not None else "bfloat16"
    del pipe
    c.result["lossless"] = c.step("fp32 lossless", lambda: lossless(args.device, assets, args.lossless_tokens))
    c.result["bench"] = c.step("bench", lambda: bench(args.device, dtype, args.prompts, args.tokens, out / "bench",
                                                      args.bench_timeout, args.threads))
    c.result["seconds"] = round(time.perf_counter() - t0, 1)
    write_summary(out, c.result)
    (out / "gpu_check.json").write_text(json.dumps(c.result, indent=1, default=str) + "\n")
    if (out / "bench").is_dir():
        with tarfile.open(out / "bench.tar.gz", "w:gz") as tar:
            tar.add(out / "bench", arcname="bench")
        shutil.rmtree(out / "bench")
    c.say(f"done in {c.result['seconds']:.0f} s: {out / 'summary.md'}")


if __name__ == "__main__":
    main()
