"""``adaptree radar dataset`` and ``adaptree radar train`` (the latter also as ``adaptree train radar``)."""

from __future__ import annotations

import json

from adaptree.cli import common
from adaptree.cli.common import ConfigFlags, add_chat_arg, add_model_args, add_output_args, positive_int

TRAIN_HELP = "REINFORCE over recorded distributions, a grid over alpha, the best exported"


def _dataset_flags() -> ConfigFlags:
    from adaptree.methods.radar.dataset import RadarDataSettings

    return ConfigFlags(RadarDataSettings, exclude=("max_seq_len", "eos_token_ids", "extra"),
                       short={"width": "-W", "size": "-V"})


def _train_flags() -> ConfigFlags:
    from adaptree.methods.radar.train import RadarTrainConfig

    return ConfigFlags(RadarTrainConfig, defaults={"t_policy": None},
                       help={"t_policy": "seconds per policy decision (default: 0, or measured with --measure-policy)"})


def register(sub) -> None:
    r = sub.add_parser("radar", help="RADAR: record acceptance-length distributions, train the LSTM stop policy")
    rsub = r.add_subparsers(dest="radar_command", required=True)
    ds = rsub.add_parser("dataset", help="run the engine at T=1 over ShareGPT training prompts and record, per cycle, "
                                         "the beam scores and the exact accepted-length distribution of every stop "
                                         "point (resumes: prompts already in --out are skipped)")
    add_model_args(ds, adapt=False)  # the dtype bench deploys (auto): the scores the policy sees are the deployed ones
    ds.add_argument("--limit", type=positive_int, default=200, help="ShareGPT training prompts (default 200)")
    ds.add_argument("--split-seed", type=int, default=0, help="seed of the train/validation/eval split of ShareGPT")
    ds.add_argument("--max-prompt-tokens", type=positive_int, default=1024, help="skip longer prompts (default 1024)")
    _dataset_flags().add(ds)
    add_chat_arg(ds)
    ds.add_argument("--out", default="runs/radar-data", help="dataset folder (manifest.json + one file per prompt)")
    add_output_args(ds)
    ds.set_defaults(func=cmd_radar_dataset)
    add_train_args(rsub.add_parser("train", help=TRAIN_HELP))


def add_train_args(p) -> None:
    """The flags of ``radar train`` (also registered as ``train radar``)."""
    _train_flags().add(p)
    p.add_argument("--measure-policy", action="store_true", help="time one policy decision here for t_policy")
    add_output_args(p, json_help="print the summary as one JSON object")
    p.set_defaults(func=cmd_radar_train)


def cmd_radar_dataset(args) -> int:
    from adaptree.methods.radar.workflow import record_radar_dataset

    settings = _dataset_flags().build(args)
    pipe = common.load_pipeline(args)
    store, counts = record_radar_dataset(pipe, args.out, settings, limit=args.limit, split_seed=args.split_seed,
                                         max_prompt_tokens=args.max_prompt_tokens, chat=args.chat,
                                         progress=not args.quiet)
    print(f"RADAR dataset in {store.folder}: {counts['recorded']} prompts recorded ({counts['cycles']} cycles), "
          f"{counts['skipped']} already there")
    return 0


def cmd_radar_train(args) -> int:
    from adaptree.methods.radar.train import measure_policy_seconds, train_radar

    if args.latency:
        from adaptree.offline.latency import load_checked

        load_checked(args.latency)  # warns when it was measured on another machine
    t_policy = args.t_policy
    if t_policy is None:
        t_policy = measure_policy_seconds(hidden=args.hidden) if args.measure_policy else 0.0
    cfg = _train_flags().build(args, t_policy=t_policy)
    s = train_radar(cfg, progress=not args.quiet)
    if args.json:
        print(json.dumps(dict(s)))
        return 0
    print(f"{s['train_cycles']} training / {s['val_cycles']} validation cycles; beta {s['beta']:.4g}")
    if s.get("size_tables"):
        print(f"V per depth (reference table {s['reference_sizes']}):")
        for name, t in s["size_tables"].items():
            print(f"  {name}: {t['sizes']} (best static: depth {t['reference'][0]}, V {t['reference'][1]})")
    for a, m in s["grid"].items():
        speed = f"val speedup {m['speedup']:.4g}x (geometric mean), " if s["chosen_by"] == "speedup" else ""
        print(f"  alpha {a:>8}: {speed}val throughput {m['throughput']:.4g} tok/s, calls {m['calls']:.2f}, "
              f"tau {m['tau']:.2f}")
    d = max(int(k.split("_")[1]) for k in s["val_static"] if k.startswith("depth_"))
    st = s["val_static"][f"depth_{d}"]
    print(f"  static depth {d}: val throughput {st['throughput']:.4g} tok/s, calls {st['calls']:.2f}, tau {st['tau']:.2f}")
    print(f"chosen alpha {s['chosen_alpha']:g}; policy: {s['policy']}  summary: {cfg.out}/summary.json")
    return 0
