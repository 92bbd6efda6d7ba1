"""``adaptree bench``, ``report``, ``compare-hf`` and ``tune-static``: measured speed on this machine."""

from __future__ import annotations

import sys

from adaptree.cli import common
from adaptree.cli.common import ConfigFlags, add_method_args, add_model_args, command_line


def _bench_flags() -> ConfigFlags:
    from adaptree.bench.runner import BenchConfig

    return ConfigFlags(BenchConfig)


def _compare_flags() -> ConfigFlags:
    from adaptree.bench.hf_compare import CompareConfig

    return ConfigFlags(CompareConfig)


def _tune_flags() -> ConfigFlags:
    from adaptree.methods.static.tune import TuneConfig

    return ConfigFlags(TuneConfig)


def register(sub) -> None:
    b = sub.add_parser("bench", help="benchmark methods side by side: speedup vs AR, tau, losslessness")
    add_model_args(b)
    _bench_flags().add(b.add_argument_group("benchmark"))
    add_method_args(b)  # every arm gets its method's flags
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("report", help="rebuild summary.json, report.md and the plots of a bench folder")
    r.add_argument("folder", help="a bench --out folder (with results.jsonl and bench_config.json)")
    r.set_defaults(func=cmd_report)

    f = sub.add_parser("profile", help="where one target forward spends its time (matmul, attention, norm, ...) for "
                                       "a decode step and small trees, in this execution mode")
    add_model_args(f)
    f.set_defaults(draft="none")
    f.add_argument("--context", type=common.positive_int, default=256, help="cached tokens before the new ones (256)")
    f.add_argument("--tokens", type=common.comma_type(common.positive_int), default=(1, 4, 16, 64),
                   help="new tokens per forward, comma-separated (1 = a decode step; default 1,4,16,64)")
    f.add_argument("--repeats", type=common.positive_int, default=20, help="timed forwards per size (20)")
    f.add_argument("--out", default="results/profile", help="folder for profile.json and profile.md")
    f.set_defaults(func=cmd_profile)

    c = sub.add_parser("compare-hf", help="autoregressive tokens/s: this engine vs transformers generate()")
    add_model_args(c, adapt=False)
    _compare_flags().add(c)
    c.set_defaults(func=cmd_compare_hf)

    t = sub.add_parser("tune-static", help="grid search (successive halving, measured tokens/s) for the static tree; "
                                           "the choice is --method static-gs")
    add_model_args(t, adapt=False)
    _tune_flags().add(t)
    t.set_defaults(func=cmd_tune_static)


def cmd_profile(args) -> int:
    from adaptree.bench.profile import run_profile

    pipe = common.load_pipeline(args)
    run_profile(pipe, args.out, context=args.context, tokens=args.tokens, repeats=args.repeats,
                command=command_line())
    return 0


def cmd_bench(args) -> int:
    from adaptree.bench.runner import MAIN_JOB_METHODS, run_bench

    cfg = _bench_flags().build(args)
    pipe = common.load_pipeline(args)
    if tuple(cfg.methods) == MAIN_JOB_METHODS:  # the main job: this machine's default method is one of its arms
        if pipe.machine is None:
            cfg.methods.remove("costaware")  # it needs this machine's latency model
            print("adaptree: no machine setup (--no-adapt): costaware left out; the default method is ar",
                  file=sys.stderr)
        elif pipe.default_method not in cfg.methods:
            cfg.methods.append(pipe.default_method)
    options = {m: common.method_options(args, m) for m in cfg.methods}
    run_bench(cfg, pipe, options, command=command_line())
    return 0


def cmd_report(args) -> int:
    from adaptree.bench.runner import rebuild_report

    rebuild_report(args.folder)
    return 0


def cmd_compare_hf(args) -> int:
    from adaptree.bench.hf_compare import run_compare

    args.draft = "none"
    cfg = _compare_flags().build(args)
    run_compare(cfg, common.load_pipeline(args))
    return 0


def cmd_tune_static(args) -> int:
    from adaptree.methods.static.tune import run_tune

    cfg = _tune_flags().build(args)
    pipe = common.load_pipeline(args)
    run_tune(cfg, pipe.engine, pipe.encode, pipe.settings(), command=command_line())
    return 0
