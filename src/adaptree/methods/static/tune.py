"""``adaptree tune-static``: a time-aware grid search for the static tree (W, depth, V) by measured throughput.

Every grid point is a static EAGLE-3 tree; its score is measured tokens/s (wall clock, the engine's own
generation, greedy) on tuning prompts disjoint from the evaluation prompts. Measuring the whole grid on
many prompts costs hours on a CPU, so the search is successive halving: every config on a few prompts,
the best third on three times as many, and so on, until one config is left or the prompts run out; the
winner is the best on the largest prompt set it was measured on. The autoregressive baseline is measured
on the same prompts for a speedup estimate. Records go to ``tune.jsonl`` as they finish (a rerun resumes);
the choice to ``static_gs.json``, which ``--method static-gs`` reads.

Tuning prompts (default): ShareGPT prompts of the validation split (never MT-bench or HumanEval text)
and the last HumanEval problems (a benchmark with ``--limit`` below ``164 - n`` never sees them).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from adaptree.core.config import at_least, check_fields, positive
from adaptree.core.controller import StaticConfig, StaticController

if TYPE_CHECKING:
    from adaptree.core.engine import Engine

TUNED_FILE = "static_gs.json"


@dataclass
class TuneConfig:
    """The grid and the budget. Depth and V extend below the LTD paper's grid (depth 4..12, V 20..240):
    on a CPU the fastest trees are small (SmolLM2-135M on 2 cores: depth 1-2 and V of a few nodes, where
    every verified node costs ~2-3% of a one-token forward), and a grid search that cannot reach them
    is a straw man."""

    depths: list[int] = positive(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8, 10, 12])
    """Draft depths to try."""
    sizes: list[int] = positive(default_factory=lambda: [2, 4, 6, 10, 20, 40, 60, 100, 160, 240])
    """Verification sizes V to try."""
    widths: list[int] = positive(default_factory=lambda: [10])
    """Beam widths W (EAGLE-3's 10 by default; give several to search W too)."""
    prompts: int = positive(12)
    """Tuning prompts available (half ShareGPT validation, half HumanEval tail)."""
    first_round_prompts: int = positive(2)
    """Prompts every config is measured on in the first round."""
    eta: int = at_least(2, 3)
    """Successive-halving factor: keep 1/eta of the configs, measure them on eta times the prompts."""
    max_new_tokens: int = positive(48)
    """Tokens per measured generation."""
    seed: int = 0
    """Seed of the order the configs are measured in on each prompt."""
    out: str = "runs/tune-static"
    """Search folder: tune.jsonl (resumed), tune_config.json, static_gs.json."""

    def __post_init__(self) -> None:
        for name in ("depths", "sizes", "widths"):
            if not getattr(self, name):
                raise ValueError(f"{name} is empty")
        check_fields(self)
        if self.first_round_prompts > self.prompts:
            raise ValueError(f"first_round_prompts ({self.first_round_prompts}) exceeds prompts ({self.prompts})")

    def grid(self) -> list[tuple[int, int, int]]:
        return [(w, d, v) for w in self.widths for d in self.depths for v in self.sizes]


def tuning_prompts(n: int):
    """``n`` prompts disjoint from every MT-bench question and from HumanEval's first ``164 - n // 2``."""
    from adaptree.data.prompts import humaneval, mt_bench, sharegpt
    from adaptree.data.splits import drop_overlap, split_ids

    n_code = n // 2
    he = humaneval()
    code = he[len(he) - n_code:] if n_code else []
    val = split_ids(sharegpt())["validation"]
    chat = [p for p in drop_overlap(val, mt_bench() + he) if 20 <= len(p.turns[0]) <= 2000][: n - n_code]
    prompts = [x for pair in zip(chat, code) for x in pair] + chat[len(code):] + code[len(chat):]
    if len(prompts) < n:
        raise ValueError(f"only {len(prompts)} tuning prompts available, {n} asked")
    return prompts


def _key(r: dict) -> tuple:
    return (r["method"], r["width"], r["depth"], r["size"], r["prompt_id"])


def successive_halving(cfg: TuneConfig, generate, prompt_ids: list[tuple[str, list[int]]], records: Path) -> dict:
    """Run the search. ``generate(config_or_None, ids) -> GenerationResult`` (None = autoregressive).
    Returns the choice with the measurements behind it."""
    done: dict[tuple, dict] = {}
    if records.exists():
        for line in records.read_text().splitlines():
            try:
                r = json.loads(line)
                done[_key(r)] = r
            except (json.JSONDecodeError, KeyError):
                continue
        records.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    rng = random.Random(cfg.seed)
    alive = cfg.grid()
    n = cfg.first_round_prompts
    rounds = []
    with records.open("a") as f:
        def measure(method, conf, pid, ids):
            w, d, v = conf or (0, 0, 0)
            k = (method, w, d, v, pid)
            if k not in done:
                res = generate(conf, ids)
                r = {"method": method, "width": w, "depth": d, "size": v, "prompt_id": pid,
                     "new_tokens": res.new_tokens, "wall_s": res.wall_time_s, "tau": res.tau}
                f.write(json.dumps(r) + "\n")
                f.flush()
                done[k] = r
            return done[k]

        while True:
            use = prompt_ids[:n]
            order = alive[:]
            rng.shuffle(order)  # no config always runs first or last (machine drift)
            bar = tqdm(total=len(use) * (len(order) + 1), desc=f"tune-static: {len(order)} configs x {len(use)} prompts",
                       unit="gen")
            for pid, ids in use:
                measure("ar", None, pid, ids)
                bar.update(1)
                for conf in order:
                    measure("static", conf, pid, ids)
                    bar.update(1)
            bar.close()

            def score(conf):
                rs = [done[("static", *conf, pid)] for pid, _ in use]
                return sum(r["new_tokens"] for r in rs) / sum(r["wall_s"] for r in rs)

            ar = [done[("ar", 0, 0, 0, pid)] for pid, _ in use]
            ar_tps = sum(r["new_tokens"] for r in ar) / sum(r["wall_s"] for r in ar)
            ranked = sorted(alive, key=score, reverse=True)
            rounds.append({"prompts": len(use), "ar_tokens_per_s": ar_tps,
                           "configs": [{"width": w, "depth": d, "size": v, "tokens_per_s": score((w, d, v)),
                                        "speedup": score((w, d, v)) / ar_tps} for w, d, v in ranked]})
            if len(ranked) == 1 or n >= len(prompt_ids):
                best = ranked[0]
                break
            alive = ranked[: max(1, len(ranked) // cfg.eta)]
            n = min(len(prompt_ids), n * cfg.eta)
    w, d, v = best
    return {"width": w, "depth": d, "size": v, "tokens_per_s": rounds[-1]["configs"][0]["tokens_per_s"],
            "speedup_vs_ar": rounds[-1]["configs"][0]["speedup"], "rounds": rounds}


def run_tune(cfg: TuneConfig, engine: Engine, encode: Callable[[str], list[int]], settings: dict,
             command: str | None = None) -> dict:
    """Search the static tree for ``engine``'s model and head on this machine; writes ``static_gs.json``.

    :param encode: a prompt's text -> its token ids (the chat template applied when the model has one).
    :param settings: what the measurements depend on (model, dtype, checksums, threads: the pipeline's
        ``settings()``); a search folder is only resumed under the same ones.
    """
    from adaptree.core.machine import machine_info
    from adaptree.offline.runs import check_out_dir, write_json

    out = check_out_dir(cfg.out)
    prompts = tuning_prompts(cfg.prompts)
    if engine.head is None:
        raise ValueError("tune-static needs a draft head: pass --draft PATH (or use a model that ships one)")
    ids = [(p.id, encode(p.turns[0])[: engine.max_len // 2]) for p in prompts]

    def generate(conf, x):
        ctl = StaticController(StaticConfig(*conf)) if conf else None
        return engine.generate(x, ctl, max_new_tokens=cfg.max_new_tokens)

    generate((10, 4, 20), ids[0][1][:16])  # warm-up
    generate(None, ids[0][1][:16])
    settings = {k: v for k, v in settings.items() if k != "draft"}
    meta_path = out / "tune_config.json"
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old.get("settings") != settings or old.get("config", {}).get("max_new_tokens") != cfg.max_new_tokens:
            raise ValueError(f"{out} holds a search with other settings ({old.get('settings')}); use another --out")
    meta_path.write_text(json.dumps({"config": asdict(cfg), "settings": settings}, indent=2))
    choice = successive_halving(cfg, generate, ids, out / "tune.jsonl")
    choice.update(settings=settings, machine=machine_info(), tuning_prompts=[p.id for p in prompts],
                  command=command)
    path = out / TUNED_FILE
    write_json(choice, path)
    print(f"best static tree: W={choice['width']} depth={choice['depth']} V={choice['size']}: "
          f"{choice['tokens_per_s']:.1f} tok/s, {choice['speedup_vs_ar']:.2f}x AR on "
          f"{choice['rounds'][-1]['prompts']} tuning prompts")
    print(f"wrote {path} (use it with --method static-gs --tuned {path})")
    return choice
