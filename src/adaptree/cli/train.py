"""Command line: ``adaptree train ltd`` (registered by :func:`add_train_parser`)."""

from __future__ import annotations

import json
from pathlib import Path


def record_training_traces(args, models, folder: Path, prompts, widths=(10,), max_depth: int = 12,
                           feature_dtype: str = "none"):
    """Greedy traces of the policy-training ``prompts`` (:func:`~adaptree.data.splits.policy_training_prompts`),
    recorded into ``folder`` if not there yet (resumable); returns them loaded."""
    from adaptree.cli import encode_prompt
    from adaptree.cli.offline import tokenizer_digest
    from adaptree.offline.traces import TraceSettings, open_store_for

    target, tok, head = models
    if head is None:
        raise ValueError("training a policy needs a draft head: pass --draft PATH (or use a model that ships one)")
    chat = bool(tok.chat_template)
    settings = TraceSettings(widths=tuple(widths), max_depth=max_depth, max_new_tokens=args.max_new_tokens,
                             eos_token_ids=tuple(tok.eos_token_ids), max_seq_len=args.max_seq_len,
                             feature_dtype=feature_dtype,
                             extra=(("tokenizer", tokenizer_digest(tok)), ("chat", str(chat))))
    store = open_store_for(folder, target, head, settings)
    prompts = [(f"{p.dataset}/{p.id}", encode_prompt(tok, p.turns[0], chat)) for p in prompts]
    store.record(target, head, prompts, progress=not args.quiet)
    keys = {k for k, _ in prompts}
    return [t for t in store.load_all() if t.key in keys]


def load_latency(path: str | None):
    """The latency model at ``path`` (a warning when it was measured on another machine)."""
    from adaptree.offline.latency import load_checked

    if not path:
        raise ValueError("pass --latency FILE: the latency model of this machine (`adaptree calibrate`)")
    if not Path(path).is_file():
        raise FileNotFoundError(f"latency model {path!r} does not exist; make one with `adaptree calibrate`")
    return load_checked(path)


OBS_ABLATIONS = {"pdl": (True, True), "pl": (False, True), "pd": (True, False)}


def cmd_train_ltd(args) -> int:
    from adaptree.cli import encode_prompt, load_models
    from adaptree.core.engine import Engine
    from adaptree.data.splits import policy_training_prompts
    from adaptree.methods.ltd.train import LTDTrainConfig, train_ltd

    use_d, use_l = OBS_ABLATIONS[args.obs]
    cfg = LTDTrainConfig(out=args.out, width=args.width, max_depth=args.max_depth, size_steps=args.size_steps,
                         depth_steps=args.depth_steps, iter_steps=args.iter_steps, iterations=args.iterations,
                         only=args.only, reward=args.reward, use_depth=use_d, use_length=use_l, n_envs=args.n_envs,
                         eval_every=args.eval_every, seed=args.seed, threads=args.threads,
                         **({"sizes": args.sizes} if args.sizes else {}))
    latency = load_latency(args.latency)
    folder = Path(args.traces) if args.traces else Path(args.out) / "traces"
    models = load_models(args)
    prompts = policy_training_prompts(args.train_code, args.train_chat, args.split_seed)
    traces = record_training_traces(args, models, folder, prompts, (args.width,), args.max_depth)
    live = None
    if args.live:
        from adaptree.offline.envs import LiveSource

        target, tok, head = models
        engine = Engine(target, head, eos_token_ids=tok.eos_token_ids, max_seq_len=args.max_seq_len)
        live = LiveSource(engine, [encode_prompt(tok, p.turns[0], None) for p in prompts],
                          max_new_tokens=args.max_new_tokens)
    s = train_ltd(cfg, traces, latency, progress=not args.quiet, live_source=live)
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{len(s['train_prompts'])} training / {len(s['val_prompts'])} validation prompts; "
          f"{s['train_seconds_all_stages']:.0f} s of PPO in all stages")
    for name, r in s["stages"].items():
        b = r["best"]
        print(f"  {name:<13} {r['steps']:>8} steps {r['seconds']:7.1f} s  best val {b['modelled_speedup']:.3f}x "
              f"(tau {b['tau']:.2f}, depth {b['mean_depth']:.2f}, V {b['mean_size']:.1f})")
    for r in s.get("iterations", []):
        print(f"  Iter{r['iteration']}: val {r['modelled_speedup']:.3f}x  tau {r['tau']:.2f}  depth "
              f"{r['mean_depth']:.2f}  V {r['mean_size']:.1f}")
    for name, r in s["baselines_val"].items():
        print(f"  {name:<18} val {r['modelled_speedup']:.3f}x  tau {r['tau']:.2f}")
    chosen = f"Iter{s['chosen']['iteration']}" if "iteration" in s["chosen"] else s["chosen"]["policy"]
    print(f"chosen: {chosen}; policies in {s['export']} (summary: {args.out}/summary.json)")
    return 0


def add_train_parser(sub) -> None:
    """Register ``train ltd`` and ``train resps``."""
    from adaptree.cli import _positive_int, add_model_args
    from adaptree.cli.offline import _int_list
    from adaptree.methods.ltd.train import LTDTrainConfig
    from adaptree.offline.envs import REWARDS

    d = LTDTrainConfig()
    t = sub.add_parser("train", help="train a learned controller (ltd, resps) on the simulator or the live engine")
    tsub = t.add_subparsers(dest="train_command", required=True)
    p = tsub.add_parser("ltd", help="LTD: PPO depth and size policies, stage 1 then co-adaptation; exports the best "
                                    "pair on validation to OUT/policy (safetensors + JSON)")
    add_model_args(p)
    p.add_argument("--latency", default=None, help="latency model JSON of this machine (`adaptree calibrate`)")
    p.add_argument("--traces", default=None,
                   help="greedy traces of the training prompts (default OUT/traces; recorded there if missing)")
    p.add_argument("--train-code", type=int, default=24, help="HumanEval training problems (index 82 on; default 24)")
    p.add_argument("--train-chat", type=int, default=24, help="ShareGPT train-split prompts (default 24)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT split")
    p.add_argument("--max-new-tokens", type=_positive_int, default=192, help="tokens per training prompt (default 192)")
    p.add_argument("--width", "-W", type=_positive_int, default=d.width)
    p.add_argument("--max-depth", type=_positive_int, default=d.max_depth)
    p.add_argument("--size-steps", type=_positive_int, default=d.size_steps,
                   help=f"stage-1 steps of the size policy (default {d.size_steps}; paper 100k)")
    p.add_argument("--depth-steps", type=_positive_int, default=d.depth_steps,
                   help=f"stage-1 steps of the depth policy (default {d.depth_steps}; paper 1M)")
    p.add_argument("--iter-steps", type=_positive_int, default=d.iter_steps,
                   help=f"steps of each co-adaptation iteration (default {d.iter_steps})")
    p.add_argument("--iterations", type=int, default=d.iterations, help="co-adaptation iterations 0..3 (default 3)")
    p.add_argument("--only", choices=("size", "depth"), default=None,
                   help="train this stage-1 policy alone and export it (the reward/observation ablations)")
    p.add_argument("--sizes", type=_int_list, default=None,
                   help="the size policy's V values, comma-separated (default LTD's 20,40,...,240)")
    p.add_argument("--reward", choices=REWARDS[:3], default=d.reward,
                   help="throughput (LTD), acceptance or time (the reward ablation)")
    p.add_argument("--obs", choices=sorted(OBS_ABLATIONS), default="pdl",
                   help="observation: pdl = scores + D + L (LTD), pl = without D, pd = without L")
    p.add_argument("--n-envs", type=_positive_int, default=d.n_envs)
    p.add_argument("--eval-every", type=_positive_int, default=d.eval_every, help="validate every N rollouts")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--live", action="store_true",
                   help="train on the live engine with wall-clock rewards (slow; validation stays on the simulator)")
    p.add_argument("--out", default=d.out, help=f"run folder (default {d.out})")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train_ltd)
    from adaptree.cli.resps import add_resps_parser

    add_resps_parser(tsub)
    from adaptree.cli.radar import RADAR_TRAIN_HELP, add_radar_train_args

    add_radar_train_args(tsub.add_parser("radar", help="RADAR: " + RADAR_TRAIN_HELP + " (= `adaptree radar train`)"))
