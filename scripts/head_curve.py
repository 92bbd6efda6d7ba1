"""Held-out acceptance of draft heads against their training data: a table and a plot.

    python scripts/head_curve.py RUN_OR_SUMMARY [...] [--out docs/results/head-training/curve]

Each argument is a ``train-head`` run folder (its ``training_summary.json``) or a summary file; optionally
``LABEL=PATH``. The x axis is the number of response tokens the head was trained on (the training split's,
or for summaries older than that field, the corpus's response tokens scaled by the training split's share of
all tokens); the y axes are the exported head's held-out step-0 acceptance and chain tau (teacher-forced TTT
validation, ``train-head``'s own measure); the table adds, where recorded, the T=1 step-0 acceptance of speculative
sampling and the target's probability mass on the draft vocabulary. Writes ``<out>.json``, ``<out>.md`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402


def _load(arg: str) -> tuple[str, dict]:
    label, _, path = arg.rpartition("=") if "=" in arg else ("", "", arg)
    p = Path(path)
    if p.is_dir():
        p = p / "training_summary.json"
    if not p.is_file():
        raise SystemExit(f"no training summary at {p}")
    return label or p.parent.name, json.loads(p.read_text())


def point(label: str, s: dict) -> dict:
    d = s["data"]
    train_resp = d.get("train_response_tokens")
    if train_resp is None:  # older summaries: the corpus's response tokens, the training split's share
        c = d["corpus"]
        train_resp = round(c["response_tokens"] * d["train_tokens"] / max(1, d["train_tokens"] + d["val_tokens"]))
    v = s["validation"]["final"]
    cfg = s["config"]
    return {"label": label, "train_response_tokens": train_resp, "train_tokens": d["train_tokens"],
            "step0": v["step_acc"][0], "step_acc": v["step_acc"], "chain_tau": v.get("chain_tau"),
            "step0_sampled": v.get("step0_sampled_acc"), "coverage": v.get("coverage"),
            "selected": s["validation"].get("selected", {"by": "last"}), "draft_vocab": cfg["draft_vocab"],
            "ttt_steps": cfg["ttt_steps"], "epochs": cfg["epochs"], "lr": cfg["lr"],
            "val_sequences": d["val_sequences"], "command": s.get("command"),
            "steps": s.get("throughput", {}).get("steps"), "init_head": cfg.get("init_head"),
            "history": [{k: h[k] for k in ("step", "chain_tau") if k in h} | {"step0": h["step_acc"][0]}
                        for h in s["validation"].get("history", []) if "step_acc" in h]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders or training_summary.json files (LABEL=PATH to name one)")
    ap.add_argument("--out", default="docs/results/head-training/curve", help="output path without extension")
    args = ap.parse_args(argv)
    pts = sorted((point(*_load(a)) for a in args.runs), key=lambda p: p["train_response_tokens"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(pts, indent=1) + "\n")
    lines = ["| head | training response tokens | draft vocab | TTT | epochs | lr | step-0 acc. | chain tau | "
             "T=1 step-0 acc. | vocab mass | exported step |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    opt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731 (older summaries lack the T=1 fields)
    for p in pts:
        lines.append(f"| {p['label']} | {p['train_response_tokens'] / 1e6:.3f}M | {p['draft_vocab']} | "
                     f"{p['ttt_steps']} | {p['epochs']} | {p['lr']:g} | {p['step0']:.3f} | "
                     f"{p['chain_tau']:.2f} | {opt(p['step0_sampled'])} | {opt(p['coverage'])} | "
                     f"{p['selected'].get('step', '?')} ({p['selected']['by']}) |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    mega = FuncFormatter(lambda x, _: f"{x / 1e6:g}M")
    for a, key, name in ((ax[0], "step0", "held-out step-0 acceptance"), (ax[1], "chain_tau", "held-out chain tau")):
        for i, p in enumerate(pts):
            color = f"C{i % 10}"
            a.plot([p["train_response_tokens"]], [p[key]], "o", color=color, label=p["label"])
            # a one-epoch run from scratch has its validations on the same axis: the response tokens seen so far
            # (a warm start's are not: it began with another run's tokens behind it)
            h = p["history"]
            if p["epochs"] == 1 and not p["init_head"] and p["steps"] and len(h) > 1 and all(key in v for v in h):
                seen = [v["step"] / p["steps"] * p["train_response_tokens"] for v in h]
                a.plot(seen, [v[key] for v in h], "-", color=color, alpha=0.5, lw=1,
                       label=f"{p['label']}: validations during the run")
        a.set_xscale("log")
        a.xaxis.set_major_formatter(mega)
        a.xaxis.set_minor_formatter(NullFormatter())
        a.set_xlabel("training response tokens")
        a.set_title(name, fontsize=10)
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
