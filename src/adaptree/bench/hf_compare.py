"""Autoregressive speed of this engine vs Hugging Face transformers ``generate`` on the same weights.

Both arms get the same prompts (MT-bench first turns through the chat template), the same weights,
dtype and threads, generate exactly ``max_new_tokens`` tokens (no EOS stop in either arm, so token
counts are identical), greedy, batch size 1, one warm-up each, and are interleaved per prompt so
machine drift hits both alike. Results: ``results.jsonl`` (one line per run) and ``summary.json``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from adaptree.bench.hf_arms import hf_twin
from adaptree.core.config import check_fields, positive
from adaptree.core.machine import machine_info

if TYPE_CHECKING:
    from adaptree.core.pipeline import PipelineLike


@dataclass
class CompareConfig:
    """``adaptree compare-hf``: how many MT-bench first turns, tokens per run and repeats."""

    prompts: int = positive(6)
    """Number of MT-bench first turns."""
    max_new_tokens: int = positive(128)
    """Tokens per run."""
    repeats: int = positive(1)
    """Runs of every prompt."""
    out: str = "runs/compare-hf"
    """Results folder (results.jsonl, summary.json)."""

    def __post_init__(self) -> None:
        check_fields(self)


def run_compare(cfg: CompareConfig, pipeline: PipelineLike) -> dict:
    """Autoregressive tokens/s of this engine vs transformers ``generate`` on ``pipeline``'s target."""
    from adaptree.core.engine import Engine
    from adaptree.data.prompts import mt_bench

    target = pipeline.target
    hf = hf_twin(target)
    engine = Engine(target, None, eos_token_ids=())  # no EOS stop: both arms make exactly N tokens
    prompts = [pipeline.encode(p.turns[0]) for p in mt_bench()[: cfg.prompts]]
    n = cfg.max_new_tokens
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    def ours(ids):
        t0 = time.perf_counter()
        res = engine.generate(ids, None, max_new_tokens=n)
        return time.perf_counter() - t0, res.token_ids

    def theirs(ids):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0, y[0, len(ids):].tolist()

    arms = {"adaptree_ar": ours, "hf_generate": theirs}
    for fn in arms.values():  # warm-up
        fn(prompts[0][:32])
    rows = []
    with (out / "results.jsonl").open("w") as f:
        for rep in range(cfg.repeats):
            for i, ids in enumerate(tqdm(prompts, desc=f"compare-hf (repeat {rep + 1}/{cfg.repeats})")):
                got = {}
                for arm, fn in arms.items():
                    sec, toks = fn(ids)
                    got[arm] = toks
                    row = {"prompt": i, "repeat": rep, "arm": arm, "prompt_tokens": len(ids),
                           "new_tokens": len(toks), "seconds": sec, "tokens_per_s": len(toks) / sec}
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
                rows[-1]["same_ids"] = rows[-2]["same_ids"] = got["adaptree_ar"] == got["hf_generate"]
    dtype = pipeline.settings()["dtype"]
    summary: dict = {"machine": machine_info(), "dtype": dtype, "model": str(pipeline.model or "default"),
                     "max_new_tokens": n, "prompts": len(prompts), "repeats": cfg.repeats, "arms": {}}
    for arm in arms:
        rs = [r for r in rows if r["arm"] == arm]
        summary["arms"][arm] = {
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "total_seconds": sum(r["seconds"] for r in rs),
            "total_tokens": sum(r["new_tokens"] for r in rs),
        }
    a, b = summary["arms"]["adaptree_ar"], summary["arms"]["hf_generate"]
    ratios = [r1["seconds"] / r0["seconds"] for r0, r1 in zip(rows[0::2], rows[1::2])]
    summary["speed_ratio_total_time"] = b["total_seconds"] / a["total_seconds"]
    summary["speed_ratio_median_per_prompt"] = statistics.median(ratios)
    summary["identical_outputs"] = sum(r["same_ids"] for r in rows[0::2])
    summary["runs_per_arm"] = len(ratios)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{'arm':<14}{'median tok/s':>14}{'total s':>10}{'tokens':>8}")
    for arm, s in summary["arms"].items():
        print(f"{arm:<14}{s['median_tokens_per_s']:>14.1f}{s['total_seconds']:>10.2f}{s['total_tokens']:>8}")
    print(f"adaptree AR / HF generate speed: {summary['speed_ratio_total_time']:.3f}x (total time), "
          f"{summary['speed_ratio_median_per_prompt']:.3f}x (median per prompt); identical outputs "
          f"{summary['identical_outputs']}/{len(ratios)}; dtype {dtype}, threads {torch.get_num_threads()}")
    print(f"wrote {out / 'results.jsonl'} and {out / 'summary.json'}")
    return summary
