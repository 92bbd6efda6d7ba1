"""``adaptree train-head``: train an EAGLE-3 draft head for a target."""

from __future__ import annotations

from adaptree.cli.common import ConfigFlags, command_line


def _flags() -> ConfigFlags:
    from adaptree.api import DTYPES
    from adaptree.head_training import TrainHeadConfig

    return ConfigFlags(TrainHeadConfig, exclude=("command",), rename={"target_dtype": "dtype"},
                       choices={"source": ("self", "sharegpt"), "train_dtype": ("bfloat16", "float32"),
                                "target_dtype": sorted(DTYPES)},
                       positive=("num_prompts", "val_prompts", "max_len", "max_new_tokens", "gen_batch_size",
                                 "draft_vocab", "epochs", "ttt_steps", "batch_tokens", "max_steps", "threads"))


def register(sub) -> None:
    t = sub.add_parser("train-head", help="train an EAGLE-3 draft head for a target (self-distillation or ShareGPT)")
    _flags().add(t)
    t.set_defaults(func=cmd_train_head)


def cmd_train_head(args) -> int:
    from adaptree.head_training import train_head

    cfg = _flags().build(args, command=command_line())
    s = train_head(cfg)
    v = s["validation"]["final"]
    if v:
        print(f"validation acceptance per TTT step: {' '.join(f'{a:.3f}' for a in v['step_acc'])}; "
              f"chain tau {v.get('chain_tau', float('nan')):.2f}")
    print(f"head: {s['export']}  summary: {cfg.out}/training_summary.json")
    return 0
