"""``adaptree traces record``, ``simulate``, ``calibrate`` and ``oracle``: greedy traces, their replay with a
latency model, the latency model itself, and the best schedule any controller could follow."""

from __future__ import annotations

import argparse
import json
import sys
import time

from adaptree.cli import common
from adaptree.cli.common import (
    ConfigFlags,
    add_chat_arg,
    add_method_args,
    add_model_args,
    add_output_args,
    add_prompt_args,
    command_line,
    positive_int,
    prompt_sets,
    writable_file,
)


def _trace_flags() -> ConfigFlags:
    from adaptree.offline.traces import TraceSettings

    return ConfigFlags(TraceSettings, only=("widths", "max_depth", "max_new_tokens", "feature_dtype", "hidden_dtype"),
                       rename={"widths": "width"})


def _calibration_flags() -> ConfigFlags:
    from adaptree.offline.calibration import DEFAULT_VALIDATION, CalibrationConfig

    return ConfigFlags(CalibrationConfig, rename={"shapes": "validate"}, types={"shapes": str},
                       defaults={"shapes": ",".join("ar" if d == 0 else f"{w}:{d}:{v}"
                                                    for w, d, v in DEFAULT_VALIDATION)},
                       help={"shapes": "live tree shapes W:D:V (or ar) run to validate the model, comma-separated; "
                                       "'' = no validation"})


def _oracle_sizes(text: str):
    """``default`` (the oracle's DEFAULT_SIZES), ``all`` or comma-separated V values."""
    from adaptree.core.controller import comma_list
    from adaptree.offline.oracle import DEFAULT_SIZES

    t = text.strip().lower()
    if t in ("default", "all"):
        return DEFAULT_SIZES if t == "default" else "all"
    try:
        out = comma_list(t, int)
    except ValueError:
        out = ()
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected 'default', 'all' or comma-separated non-negative integers, "
                                         f"got {text!r}")
    return out


def register(sub) -> None:
    t = sub.add_parser("traces", help="record greedy draft-tree traces for offline simulation and training")
    tsub = t.add_subparsers(dest="traces_command", required=True)
    r = tsub.add_parser("record", help="record the tree at every position of the greedy output, per prompt "
                                       "(resumes: prompts already in --out are skipped)")
    add_model_args(r, dtype="float32", why=" here: a bfloat16 greedy run need not be the speculative one",
                   adapt=False)
    add_prompt_args(r, limit=8, what="prompts")
    _trace_flags().add(r)
    add_chat_arg(r)
    r.add_argument("--out", default="runs/traces", help="trace folder (manifest.json + one file per prompt)")
    add_output_args(r)
    r.set_defaults(func=cmd_traces_record)

    s = sub.add_parser("simulate", help="replay a method over recorded traces: tau, depths, sizes, modelled speedup")
    s.add_argument("--traces", required=True, help="a folder written by `adaptree traces record`")
    s.add_argument("--latency", default=None, help="latency model JSON (`adaptree calibrate`)")
    s.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the traces'")
    add_output_args(s, json_help="print one JSON object (and skip timing the policy)", quiet=False)
    add_method_args(s)
    s.set_defaults(func=cmd_simulate)

    c = sub.add_parser("calibrate", help="measure the simulator's latency model on this machine (micro-benchmarks), "
                                         "validate it against live cycles, save it as JSON")
    add_model_args(c, adapt=False)
    _calibration_flags().add(c)
    add_prompt_args(c, limit=2, what="validation prompts")
    add_chat_arg(c)
    c.add_argument("--out", default="runs/latency/latency.json",
                   help="latency model JSON (a <stem>.validation.json with every live cycle goes next to it)")
    add_output_args(c)
    c.set_defaults(func=cmd_calibrate)

    o = sub.add_parser("oracle", help="the optimal per-cycle (W, d, V) schedule on recorded traces vs the best static "
                                      "tree and named methods, all replayed with a latency model")
    o.add_argument("--traces", required=True, help="a folder written by `adaptree traces record`")
    o.add_argument("--latency", required=True, help="latency model JSON (`adaptree calibrate`)")
    o.add_argument("--methods", type=common.comma_type(str), default=("static", "deagle", "ddd", "svip", "gammatune"),
                   help="comma-separated methods replayed in the simulator, each with its defaults plus the method "
                        "flags below (default static,deagle,ddd,svip,gammatune)")
    o.add_argument("--sizes", type=_oracle_sizes, default="default",
                   help="the oracle's V set: 'default' (1..16 and 20, 40, ..., 240), 'all' (every V: exact) or "
                        "comma-separated values")
    o.add_argument("--static-sizes", type=_oracle_sizes, default="default",
                   help="V values of the best-static grid, tried with every recorded W and depth (default: 'default')")
    o.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the traces'")
    o.add_argument("--measure-policy", action="store_true",
                   help="charge the methods' own measured decision time (default: left out, results deterministic)")
    o.add_argument("--chains", type=int, default=0,
                   help="also the oracle that verifies up to this many context-chain tokens per cycle (the bound for "
                        "ngram and hybrid; 0 = none)")
    o.add_argument("--out", default="runs/oracle/oracle.json", help="result JSON ('' = none)")
    add_output_args(o)
    add_method_args(o)
    o.set_defaults(func=cmd_oracle)


def cmd_traces_record(args) -> int:
    from adaptree.offline.recording import record_prompts

    settings = _trace_flags().values(args)
    sets = prompt_sets(args)
    pipe = common.load_pipeline(args)
    store, counts = record_prompts(pipe, args.out, [p for _, ps in sets for p in ps], chat=args.chat,
                                   progress=not args.quiet, **settings)
    print(f"traces in {store.folder}: {counts['recorded']} recorded, {counts['skipped']} already there")
    return 0


def cmd_simulate(args) -> int:
    from adaptree.offline.latency import load_checked
    from adaptree.offline.simulator import simulate
    from adaptree.offline.traces import TraceStore

    traces = TraceStore(args.traces).load_all()
    if not traces:
        raise ValueError(f"no traces in {args.traces}")
    lat = load_checked(args.latency) if args.latency else None
    controller = common.build_controller(args, head=True)
    t0 = time.perf_counter()
    res = simulate(controller, traces, lat, max_new_tokens=args.max_new_tokens, measure_policy=not args.json)
    replay_s = time.perf_counter() - t0
    summary = {"method": controller.name, **res.summary(), "replay_s": replay_s}
    if lat is not None and replay_s > 0:
        summary["modelled_over_replay"] = summary["modelled_s"] / replay_s
    if args.json:
        print(json.dumps(summary))
        return 0
    line = (f"[{summary['method']}] {summary['prompts']} prompts, {summary['cycles']} cycles, "
            f"{summary['new_tokens']} tokens, tau {summary['tau']:.3f}, mean depth {summary['mean_depth']:.2f}, "
            f"mean V {summary['mean_size']:.1f}")
    if lat is not None:
        line += (f"; modelled {summary['modelled_s']:.3f} s vs AR {summary['modelled_ar_s']:.3f} s, "
                 f"speedup {summary['modelled_speedup']:.3f}x; replayed in {replay_s:.3f} s "
                 f"({summary['modelled_over_replay']:.0f}x faster than the generation it models)")
    print(line)
    return 0


def cmd_calibrate(args) -> int:
    from adaptree.offline.calibration import calibrate_pipeline, format_validation, parse_shapes

    shapes = parse_shapes(args.validate) if args.validate.strip() else ()
    cfg = _calibration_flags().build(args, shapes=shapes)
    out = writable_file(args.out)
    sets = prompt_sets(args) if shapes else []  # bad dataset files fail before the models load
    pipe = common.load_pipeline(args)
    res, written = calibrate_pipeline(pipe, [p for _, ps in sets for p in ps], cfg, out, chat=args.chat,
                                      command=command_line(), progress=not args.quiet)
    print(format_validation(res.validation))
    print("\n".join(res.model.describe()))
    print(f"wrote {' and '.join(map(str, written))}")
    return 0


def cmd_oracle(args) -> int:
    from adaptree.methods import controller_factories
    from adaptree.offline.oracle import DEFAULT_SIZES, compare_on_traces, format_table

    factories = controller_factories(args.methods, {m: common.method_options(args, m) for m in args.methods})
    out = writable_file(args.out) if args.out else None
    res = compare_on_traces(args.traces, args.latency, factories, oracle_sizes=args.sizes,
                            static_sizes=args.static_sizes, max_new_tokens=args.max_new_tokens,
                            measure_policy=args.measure_policy, progress=not args.quiet, chains=args.chains)
    print(format_table(res))
    setup, orc = res["setup"], res["oracle"]
    vset = "every V" if args.sizes == "all" else f"{len(args.sizes)} V values"
    vset += " (the default set)" if args.sizes == DEFAULT_SIZES else ""
    print(f"{setup['prompts']} prompts, {orc['new_tokens']} tokens; oracle over W in "
          f"{{{', '.join(map(str, setup['widths']))}}}, d <= {setup['max_depth']}, {vset}; modelled times (latency "
          f"model {args.latency})")
    if out is not None:
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {out}", file=sys.stdout)
    return 0
