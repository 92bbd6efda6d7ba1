"""``adaptree bench``: every method over the same prompts, side by side, with results files.

Methods are interleaved per prompt (machine drift hits every arm alike), batch size 1, after a
warm-up; the autoregressive baseline runs on the same engine. Per-run records are appended to
``results.jsonl`` as they finish (a rerun with the same folder resumes and never duplicates a record);
``summary.json`` and a printed table come at the end.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .machine import machine_info


@dataclass
class BenchConfig:
    """What to run. Defaults: the README's main job (default model, small MT-bench + HumanEval subset)."""

    methods: list[str] = field(default_factory=lambda: ["ar", "static"])
    datasets: list[str] = field(default_factory=lambda: ["mt_bench", "humaneval"])
    question_file: str | None = None
    """An EAGLE-format question.jsonl benchmarked as one more dataset."""
    limit: int = 8
    """Prompts per dataset (the first ``limit`` of each)."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    repeats: int = 1
    out: str = "runs/bench"

    def __post_init__(self) -> None:
        from ..controllers import METHODS

        for m in self.methods:
            if m not in METHODS:
                raise ValueError(f"unknown method {m!r}; available: {', '.join(METHODS)}")
        if "ar" not in self.methods:
            raise ValueError("the methods must include 'ar': speedups are measured against it")
        for name, value in (("limit", self.limit), ("max_new_tokens", self.max_new_tokens), ("repeats", self.repeats)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


def _prompt_ids(tok, text: str) -> list[int]:
    return tok.apply_chat([{"role": "user", "content": text}]) if tok.chat_template else tok.encode(text)


def _load_prompts(cfg: BenchConfig):
    from ..data.prompts import load_dataset, load_question_file

    sets = [(name, load_dataset(name)[: cfg.limit]) for name in cfg.datasets]
    if cfg.question_file:
        qs = load_question_file(cfg.question_file)
        sets.append((qs[0].dataset if qs else "questions", qs[: cfg.limit]))
    return sets


def _digest(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def run_bench(cfg: BenchConfig, args) -> dict:
    from ..cli import build_controller, load_models
    from ..engine import Engine

    target, tok, head = load_models(args)
    if any(m != "ar" for m in cfg.methods) and head is None:
        raise ValueError("speculative methods need a draft head: pass --draft PATH (or use a model that ships one)")
    engine = Engine(target, head, eos_token_ids=tok.eos_token_ids)
    controllers = {}
    for m in cfg.methods:
        args.method = m
        controllers[m] = build_controller(args, head)
    rows = bench_loop(cfg, engine, lambda text: _prompt_ids(tok, text), controllers, _load_prompts(cfg))
    summary = summarize(rows, cfg)
    summary["config"] = asdict(cfg)
    summary["machine"] = machine_info()
    summary["dtype"] = args.dtype
    summary["model"] = args.model or "smollm2-135m (default)"
    summary["draft"] = str(getattr(args, "draft_path", None) or args.draft)
    out = Path(cfg.out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_table(summary)
    print(f"wrote {out / 'results.jsonl'} and {out / 'summary.json'}")
    return summary


def _read_done(results: Path) -> dict[tuple, dict]:
    """Records already written; a line cut by an interruption is dropped (that run is redone) and the
    file rewritten so later appends stay line-aligned."""
    done: dict[tuple, dict] = {}
    if results.exists():
        for line in results.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[(r["dataset"], r["prompt_id"], r["method"], r["repeat"])] = r
        results.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    return done


def bench_loop(cfg: BenchConfig, engine, encode, controllers: dict, sets) -> list[dict]:
    """Run every (prompt, repeat) through every controller, interleaved; append each record as it finishes."""
    from ..verify import SamplingConfig

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = _read_done(results)
    jobs = [(ds, p, rep) for rep in range(cfg.repeats) for ds, ps in sets for p in ps]
    warm = encode("Hello!")  # warm-up: every method once (kernels, allocator, caches)
    for ctl in controllers.values():
        engine.generate(warm, ctl, max_new_tokens=8)
    with results.open("a") as f:
        for ds, p, rep in tqdm(jobs, desc="bench", unit="prompt"):
            ids = encode(p.turns[0])
            for m, ctl in controllers.items():
                key = (ds, p.id, m, rep)
                if key in done:
                    continue
                sampling = SamplingConfig(cfg.temperature, seed=cfg.seed + rep)
                res = engine.generate(ids, ctl, max_new_tokens=cfg.max_new_tokens, sampling=sampling)
                cyc = res.cycles
                row = {"dataset": ds, "prompt_id": p.id, "method": m, "repeat": rep,
                       "prompt_tokens": len(ids), "new_tokens": res.new_tokens, "wall_s": res.wall_time_s,
                       "prefill_s": res.prefill_s, "cycles": len(cyc),
                       "accepted_plus_one": sum(c.accepted + 1 for c in cyc),
                       "depth_sum": sum(c.depth for c in cyc), "size_sum": sum(c.size for c in cyc),
                       **res.time_split(), "stop": res.stop_reason, "ids_sha1": _digest(res.token_ids)}
                f.write(json.dumps(row) + "\n")
                f.flush()
                done[key] = row
    return list(done.values())


def summarize(rows: list[dict], cfg: BenchConfig) -> dict:
    """Per dataset and method: speedup vs AR (ratio of total times; mean of per-prompt ratios),
    tokens/s, τ, mean depth and V, time split, and prompts whose output differs from AR's."""
    by = {}
    for r in rows:
        by.setdefault((r["dataset"], r["method"]), []).append(r)
    ar_rows = {(r["dataset"], r["prompt_id"], r["repeat"]): r for r in rows if r["method"] == "ar"}
    table = {}
    for (ds, m), rs in sorted(by.items()):
        pairs = [(r, ar_rows.get((ds, r["prompt_id"], r["repeat"]))) for r in rs]
        pairs = [(r, a) for r, a in pairs if a is not None]
        t = sum(r["wall_s"] for r in rs)
        cycles = sum(r["cycles"] for r in rs)
        entry = {
            "runs": len(rs), "total_s": t, "new_tokens": sum(r["new_tokens"] for r in rs),
            "tokens_per_s": sum(r["new_tokens"] for r in rs) / t if t else 0.0,
            "tau": sum(r["accepted_plus_one"] for r in rs) / cycles if cycles else 0.0,
            "mean_depth": sum(r["depth_sum"] for r in rs) / cycles if cycles else 0.0,
            "mean_v": sum(r["size_sum"] for r in rs) / cycles if cycles else 0.0,
            "time_split_s": {k: sum(r[k] for r in rs) for k in ("draft_s", "verify_s", "policy_s", "other_s")},
        }
        if pairs:
            entry["speedup_total_time"] = sum(a["wall_s"] for _, a in pairs) / sum(r["wall_s"] for r, _ in pairs)
            entry["speedup_mean_per_prompt"] = statistics.fmean(a["wall_s"] / r["wall_s"] for r, a in pairs)
            entry["differs_from_ar"] = sum(r["ids_sha1"] != a["ids_sha1"] for r, a in pairs)
        table.setdefault(ds, {})[m] = entry
    return {"results": table, "greedy": cfg.temperature == 0.0}


def print_table(summary: dict) -> None:
    head = f"{'dataset':<12}{'method':<10}{'tok/s':>8}{'speedup':>9}{'tau':>7}{'depth':>7}{'V':>7}{'≠AR':>5}"
    print("\n" + head)
    print("-" * len(head))
    for ds, methods in summary["results"].items():
        for m, e in methods.items():
            print(f"{ds:<12}{m:<10}{e['tokens_per_s']:>8.1f}{e.get('speedup_total_time', 0):>8.2f}x"
                  f"{e['tau']:>7.2f}{e['mean_depth']:>7.1f}{e['mean_v']:>7.1f}{e.get('differs_from_ar', 0):>5}")
    print(f"threads {torch.get_num_threads()}, dtype {summary.get('dtype', '?')}")
