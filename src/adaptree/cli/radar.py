"""Command line: ``adaptree radar dataset`` and ``adaptree radar train`` (registered by :func:`add_radar_parser`)."""

from __future__ import annotations

import argparse
import json


def cmd_radar_dataset(args) -> int:
    from adaptree.cli import encode_prompt, load_models
    from adaptree.cli.offline import tokenizer_digest
    from adaptree.core.engine import Engine
    from adaptree.data.splits import policy_training_prompts
    from adaptree.methods.radar.dataset import RadarDataSettings, RadarStore
    from adaptree.offline.traces import head_fingerprint, model_fingerprint

    target, tok, head = load_models(args)
    if head is None:
        raise ValueError("a RADAR dataset needs a draft head: pass --draft PATH (or use a model that ships one)")
    chat = bool(tok.chat_template) if args.chat is None else args.chat
    settings = RadarDataSettings(width=args.width, max_depth=args.max_depth, size=args.size,
                                 temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                 max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len,
                                 eos_token_ids=tuple(tok.eos_token_ids),
                                 extra=(("tokenizer", tokenizer_digest(tok)), ("chat", str(chat)),
                                        ("split_seed", str(args.split_seed))))
    store = RadarStore(args.out, {"model": model_fingerprint(target), "head": head_fingerprint(head)}, settings)
    prompts = []
    for p in policy_training_prompts(0, args.limit, args.split_seed, max_chars=4000):
        ids = encode_prompt(tok, p.turns[0], chat)
        if len(ids) <= args.max_prompt_tokens:
            prompts.append((f"{p.dataset}/{p.id}", ids))
    engine = Engine(target, head, eos_token_ids=tok.eos_token_ids, max_seq_len=args.max_seq_len)
    counts = store.record(engine, prompts, progress=not args.quiet)
    print(f"RADAR dataset in {store.folder}: {counts['recorded']} prompts recorded ({counts['cycles']} cycles), "
          f"{counts['skipped']} already there")
    return 0


def cmd_radar_train(args) -> int:
    from adaptree.methods.radar.train import (
        RadarTrainConfig,
        measure_policy_seconds,
        train_radar,
    )

    if args.latency:
        from adaptree.offline.latency import load_checked

        load_checked(args.latency)  # warns when it was measured on another machine
    t_policy = args.t_policy
    if t_policy is None:
        t_policy = measure_policy_seconds(hidden=args.hidden) if args.measure_policy else 0.0
    cfg = RadarTrainConfig(data=args.data, out=args.out, alphas=args.alphas, beta=args.beta, gamma=args.gamma,
                           lr=args.lr, weight_decay=args.weight_decay, dropout=args.dropout, grad_clip=args.grad_clip,
                           hidden=args.hidden, batch_size=args.batch_size, steps=args.steps, baseline=args.baseline,
                           bonus=args.bonus, latency=args.latency, t_fixed=args.t_fixed, t_draft=args.t_draft,
                           t_policy=t_policy, val_fraction=args.val_fraction, threshold=args.threshold,
                           eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, seed=args.seed,
                           resume=args.resume)
    s = train_radar(cfg, progress=not args.quiet)
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{s['train_cycles']} training / {s['val_cycles']} validation cycles; beta {s['beta']:.4g}")
    for a, m in s["grid"].items():
        print(f"  alpha {a:>8}: val throughput {m['throughput']:.4g} tok/s, calls {m['calls']:.2f}, tau {m['tau']:.2f}")
    d = max(int(k.split("_")[1]) for k in s["val_static"] if k.startswith("depth_"))
    st = s["val_static"][f"depth_{d}"]
    print(f"  static depth {d}: val throughput {st['throughput']:.4g} tok/s, calls {st['calls']:.2f}, tau {st['tau']:.2f}")
    print(f"chosen alpha {s['chosen_alpha']:g}; policy: {s['policy']}  summary: {cfg.out}/summary.json")
    return 0


def add_radar_parser(sub) -> None:
    """Register ``radar dataset`` and ``radar train`` on the main parser's subcommands."""
    from adaptree.cli import _positive_int, add_model_args
    from adaptree.methods.radar.dataset import RadarDataSettings

    d = RadarDataSettings()
    r = sub.add_parser("radar", help="RADAR: record acceptance-length distributions, train the LSTM stop policy")
    rsub = r.add_subparsers(dest="radar_command", required=True)

    ds = rsub.add_parser("dataset", help="run the engine at T=1 over ShareGPT training prompts and record, per cycle, "
                                         "the beam scores and the exact accepted-length distribution of every stop "
                                         "point (resumes: prompts already in --out are skipped)")
    add_model_args(ds)  # bfloat16 by default, like bench: the scores the policy sees are the deployed ones
    ds.add_argument("--limit", type=_positive_int, default=200, help="ShareGPT training prompts (default 200)")
    ds.add_argument("--split-seed", type=int, default=0, help="seed of the train/validation/eval split of ShareGPT")
    ds.add_argument("--max-prompt-tokens", type=_positive_int, default=1024, help="skip longer prompts")
    ds.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens)
    ds.add_argument("--width", "-W", type=_positive_int, default=d.width, help=f"beam width W (default {d.width})")
    ds.add_argument("--max-depth", type=_positive_int, default=d.max_depth,
                    help=f"D_max: most draft forwards per cycle, stop points 0..D_max-1 (default {d.max_depth})")
    ds.add_argument("--size", "-V", type=_positive_int, default=d.size, help=f"verification size V (default {d.size})")
    ds.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature (default 1)")
    ds.add_argument("--top-p", type=float, default=d.top_p)
    ds.add_argument("--top-k", type=int, default=d.top_k)
    ds.add_argument("--seed", type=int, default=d.seed, help="base sampling seed (per prompt: derived from it and the key)")
    ds.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                    help="apply the model's chat template (default: when the model has one)")
    ds.add_argument("--out", default="runs/radar-data", help="dataset folder (manifest.json + one file per prompt)")
    ds.add_argument("--quiet", action="store_true", help="no progress bar")
    ds.set_defaults(func=cmd_radar_dataset)

    add_radar_train_args(rsub.add_parser("train", help=RADAR_TRAIN_HELP))


RADAR_TRAIN_HELP = "REINFORCE over recorded distributions, a grid over alpha, the best exported"


def add_radar_train_args(tr) -> None:
    """The arguments of ``radar train`` (also registered as ``train radar``)."""
    from adaptree.cli import _positive_int
    from adaptree.methods.radar.train import RadarTrainConfig

    t = RadarTrainConfig(t_fixed=0.0, t_draft=1.0)
    tr.add_argument("--data", default=t.data, help=f"a folder of `adaptree radar dataset` (default {t.data})")
    tr.add_argument("--out", default=t.out, help=f"run folder (default {t.out}); the chosen policy goes to OUT/policy")
    tr.add_argument("--alphas", default=",".join(f"{a:g}" for a in t.alphas),
                    help="comma-separated grid of the per-CONTINUE penalty (units of beta*speed)")
    tr.add_argument("--beta", type=float, default=None, help="terminal reward scale (default 1 / always-continue throughput)")
    tr.add_argument("--gamma", type=float, default=t.gamma)
    tr.add_argument("--lr", type=float, default=t.lr)
    tr.add_argument("--weight-decay", type=float, default=t.weight_decay)
    tr.add_argument("--dropout", type=float, default=t.dropout)
    tr.add_argument("--grad-clip", type=float, default=t.grad_clip)
    tr.add_argument("--hidden", type=_positive_int, default=t.hidden, help="LSTM hidden size (default 128)")
    tr.add_argument("--batch-size", type=_positive_int, default=t.batch_size)
    tr.add_argument("--steps", type=_positive_int, default=t.steps, help=f"updates per alpha (default {t.steps})")
    tr.add_argument("--baseline", choices=("mean", "none"), default=t.baseline)
    tr.add_argument("--bonus", action=argparse.BooleanOptionalAction, default=t.bonus,
                    help="count the bonus token in the speed (default on)")
    tr.add_argument("--latency", default=None, help="LatencyModel JSON (adaptree.rl.latency) for the cycle times")
    tr.add_argument("--t-fixed", type=float, default=None, help="seconds per cycle besides drafting (no --latency)")
    tr.add_argument("--t-draft", type=float, default=None, help="seconds per draft forward (no --latency)")
    tr.add_argument("--t-policy", type=float, default=None, help="seconds per policy decision (default: 0, or "
                                                                  "measured with --measure-policy)")
    tr.add_argument("--measure-policy", action="store_true", help="time one policy decision here for t_policy")
    tr.add_argument("--val-fraction", type=float, default=t.val_fraction)
    tr.add_argument("--threshold", type=float, default=t.threshold, help="evaluation rule: stop iff P(stop) >= this")
    tr.add_argument("--eval-every", type=_positive_int, default=t.eval_every)
    tr.add_argument("--checkpoint-every", type=_positive_int, default=t.checkpoint_every)
    tr.add_argument("--seed", type=int, default=t.seed)
    tr.add_argument("--resume", action="store_true", help="continue the run in --out")
    tr.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    tr.add_argument("--quiet", action="store_true", help="no progress bars")
    tr.set_defaults(func=cmd_radar_train)
