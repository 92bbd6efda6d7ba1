"""Command line: ``adaptree traces record``, ``adaptree simulate``, ``adaptree calibrate`` and ``adaptree oracle``
(registered by :func:`add_traces_parser`)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time


def _int_list(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


def tokenizer_digest(tok) -> str:
    """sha256 of a tokenizer's vocabulary, chat template and EOS ids (what turns prompt text into ids)."""
    h = hashlib.sha256()
    vocab = tok.tokenizer.get_vocab() if hasattr(tok.tokenizer, "get_vocab") else {}
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update((tok.chat_template or "").encode())
    h.update(json.dumps(list(tok.eos_token_ids)).encode())
    return h.hexdigest()


def cmd_traces_record(args) -> int:
    from adaptree.cli import encode_prompt, load_models
    from adaptree.data.prompts import load_dataset, load_question_file
    from adaptree.offline.traces import TraceSettings, open_store_for

    target, tok, head = load_models(args)
    if head is None:
        raise ValueError("recording traces needs a draft head: pass --draft PATH (or use a model that ships one)")
    sets = [(name, load_dataset(name)[: args.limit]) for name in args.datasets.split(",") if name]
    if args.question_file:
        qs = load_question_file(args.question_file)
        sets.append((qs[0].dataset if qs else "questions", qs[: args.limit]))
    chat = bool(tok.chat_template) if args.chat is None else args.chat
    settings = TraceSettings(widths=args.width, max_depth=args.max_depth, max_new_tokens=args.max_new_tokens,
                             eos_token_ids=tuple(tok.eos_token_ids), max_seq_len=args.max_seq_len,
                             feature_dtype=args.feature_dtype,
                             extra=(("tokenizer", tokenizer_digest(tok)), ("chat", str(chat))))
    store = open_store_for(args.out, target, head, settings)
    prompts = [(f"{ds}/{p.id}", encode_prompt(tok, p.turns[0], chat)) for ds, ps in sets for p in ps]
    counts = store.record(target, head, prompts, progress=not args.quiet)
    print(f"traces in {store.folder}: {counts['recorded']} recorded, {counts['skipped']} already there")
    return 0


def cmd_simulate(args) -> int:
    from adaptree.cli import build_controller
    from adaptree.offline.latency import load_checked
    from adaptree.offline.simulator import simulate
    from adaptree.offline.traces import TraceStore

    store = TraceStore(args.traces)
    traces = store.load_all()
    if not traces:
        raise ValueError(f"no traces in {args.traces}")
    lat = load_checked(args.latency) if args.latency else None
    controller = build_controller(args, head=True)
    t0 = time.perf_counter()
    res = simulate(controller, traces, lat, max_new_tokens=args.max_new_tokens, measure_policy=not args.json)
    replay_s = time.perf_counter() - t0
    summary = {"method": controller.name, **res.summary(), "replay_s": replay_s}
    if lat is not None and replay_s > 0:
        summary["modelled_over_replay"] = summary["modelled_s"] / replay_s
    if args.json:
        print(json.dumps(summary))
    else:
        line = (f"[{summary['method']}] {summary['prompts']} prompts, {summary['cycles']} cycles, "
                f"{summary['new_tokens']} tokens, tau {summary['tau']:.3f}, mean depth {summary['mean_depth']:.2f}, "
                f"mean V {summary['mean_size']:.1f}")
        if lat is not None:
            line += (f"; modelled {summary['modelled_s']:.3f} s vs AR {summary['modelled_ar_s']:.3f} s, "
                     f"speedup {summary['modelled_speedup']:.3f}x; replayed in {replay_s:.3f} s "
                     f"({summary['modelled_over_replay']:.0f}x faster than the generation it models)")
        print(line)
    return 0


def _prompt_sets(args):
    from adaptree.data.prompts import load_dataset, load_question_file

    sets = [(name, load_dataset(name)[: args.limit]) for name in args.datasets.split(",") if name]
    if args.question_file:
        qs = load_question_file(args.question_file)
        sets.append((qs[0].dataset if qs else "questions", qs[: args.limit]))
    return sets


def _writable_file(path: str):
    from pathlib import Path

    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        probe = p.parent / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {path!r}: cannot write in {str(p.parent)!r}: {e.strerror or e}") from None
    return p


def cmd_calibrate(args) -> int:
    import sys
    from pathlib import Path

    import torch

    from adaptree.cli import encode_prompt, load_models
    from adaptree.core.engine import Engine
    from adaptree.offline.calibration import (
        CalibrationConfig,
        config_dict,
        format_validation,
        parse_shapes,
        predicted,
        run_calibration,
    )
    from adaptree.offline.traces import head_fingerprint, model_fingerprint

    shapes = parse_shapes(args.validate) if args.validate.strip() else ()
    cfg = CalibrationConfig(widths=args.widths, sizes=args.sizes, lengths=args.lengths, repeats=args.repeats,
                            shapes=shapes, max_new_tokens=args.max_new_tokens, refit=args.refit, goal=args.goal,
                            warmup=args.warmup, verify_model=args.verify_model)
    out = _writable_file(args.out)
    sets = _prompt_sets(args) if shapes else []  # bad dataset files fail before the models load
    target, tok, head = load_models(args)
    if head is None:
        raise ValueError("calibrating needs a draft head: pass --draft PATH (or use a model that ships one)")
    chat = bool(tok.chat_template) if args.chat is None else args.chat
    prompts = [encode_prompt(tok, p.turns[0], chat) for _, ps in sets for p in ps]
    if shapes and not prompts:
        raise ValueError("validation needs prompts: give --datasets or --question-file (or --validate '' to skip)")
    engine = Engine(target, head, eos_token_ids=tok.eos_token_ids, max_seq_len=args.max_seq_len)
    res = run_calibration(target, head, engine, prompts, cfg, progress=not args.quiet)
    draft = getattr(args, "draft_path", None)
    shown = draft
    if draft:
        from adaptree.models.registry import HEADS_DIR

        if Path(draft).resolve().parent == HEADS_DIR:  # no machine paths in shareable results
            shown = f"shipped:{Path(draft).name}"
    meta = res.model.meta
    meta.update(model=args.model or "smollm2-135m", head=shown, dtype=str(target.dtype).removeprefix("torch."),
                torch=torch.__version__, model_sha256=model_fingerprint(target), head_sha256=head_fingerprint(head),
                config=config_dict(cfg), prompts=len(prompts), command=" ".join(["adaptree", *sys.argv[1:]]))
    res.model.save(out)
    print(format_validation(res.validation))
    print("\n".join(res.model.describe()))
    written = [str(out)]
    if res.records:
        vpath = out.with_name(out.stem + ".validation.json")
        cands = {"micro": res.micro, **({"live": res.live} if res.live is not None else {})}
        rows = [{**r, **{f"{k}_pred": predicted(c, r) for k, c in cands.items()}} for r in res.records]
        vpath.write_text(json.dumps({"summary": res.validation, "micro": res.micro.to_dict(),
                                     "live": res.live.to_dict() if res.live is not None else None,
                                     "cycles": rows}, indent=1) + "\n")
        written.append(str(vpath))
    print(f"wrote {' and '.join(written)}")
    return 0


DEFAULT_SIZES_TEXT = "default"


def _sizes(text: str):
    """``default`` (the oracle's DEFAULT_SIZES), ``all`` or comma-separated V values."""
    from adaptree.offline.oracle import DEFAULT_SIZES

    t = text.strip().lower()
    if t == "default":
        return DEFAULT_SIZES
    if t == "all":
        return "all"
    try:
        out = tuple(int(x) for x in t.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'default', 'all' or comma-separated integers, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative verification sizes, got {text!r}")
    return out


def method_factories(args, names) -> dict:
    """name -> zero-argument controller builder, each method with its defaults plus the method flags given
    (as ``adaptree bench`` builds its arms; learned methods find the policies shipped with the default head)."""
    from adaptree.cli import build_controller
    from adaptree.methods import METHODS

    out = {}
    for name in names:
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
        if name in out:
            raise ValueError(f"method {name!r} is listed twice")
        ns = argparse.Namespace(**{**vars(args), "method": name})
        build_controller(ns, head=True)  # fails now (e.g. a missing policy file), not halfway through
        out[name] = (lambda ns=ns: build_controller(ns, head=True))
    return out


def cmd_oracle(args) -> int:
    import sys

    from adaptree.offline.latency import check_machine, load_checked
    from adaptree.offline.oracle import DEFAULT_SIZES, compare_methods, format_table
    from adaptree.offline.traces import TraceStore

    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    store = TraceStore(args.traces)
    factories = method_factories(args, names)
    traces = store.load_all()
    if not traces:
        raise ValueError(f"no traces in {args.traces}")
    out = _writable_file(args.out) if args.out else None
    lat = load_checked(args.latency)
    static_sizes = args.static_sizes if args.static_sizes != "all" else None
    if static_sizes is None:
        raise ValueError("--static-sizes must be an explicit list (or 'default'): a static tree has one V")
    res = compare_methods(traces, lat, factories, oracle_sizes=args.sizes, static_sizes=static_sizes,
                          max_new_tokens=args.max_new_tokens, measure_policy=args.measure_policy,
                          progress=not args.quiet)
    s = store.settings
    res["setup"] = {
        "traces": str(args.traces), "prompts": len(traces), "latency": str(args.latency),
        "oracle_sizes": args.sizes if args.sizes == "all" else list(args.sizes),
        "static_sizes": list(static_sizes), "widths": list(s.widths), "max_depth": s.max_depth,
        "max_new_tokens": args.max_new_tokens or s.max_new_tokens, "policy_time": args.measure_policy,
        "trace_fingerprints": store.fingerprints, "latency_meta": {k: lat.meta.get(k) for k in (
            "machine", "dtype", "source", "model", "model_sha256", "head_sha256") if k in lat.meta},
        "machine_warnings": check_machine(lat),
        "note": "every number is modelled: the methods replayed over greedy traces with the latency model, not timed"}
    print(format_table(res))
    orc = res["oracle"]
    vset = "every V" if args.sizes == "all" else f"{len(args.sizes)} V values"
    vset += " (the default set)" if args.sizes == DEFAULT_SIZES else ""
    print(f"{len(traces)} prompts, {orc['new_tokens']} tokens; oracle over W in {{{', '.join(map(str, s.widths))}}}, "
          f"d <= {s.max_depth}, {vset}; modelled times (latency model {args.latency})")
    if out is not None:
        out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {out}", file=sys.stdout)
    return 0


def add_traces_parser(sub) -> None:
    """Register ``traces record`` and ``simulate`` on the main parser's subcommands."""
    from adaptree.cli import _positive_int, add_method_args, add_model_args
    from adaptree.offline.traces import FEATURE_DTYPES, TraceSettings

    d = TraceSettings()
    t = sub.add_parser("traces", help="record greedy draft-tree traces for offline simulation and training")
    tsub = t.add_subparsers(dest="traces_command", required=True)
    r = tsub.add_parser("record", help="record the tree at every position of the greedy output, per prompt "
                                       "(resumes: prompts already in --out are skipped)")
    add_model_args(r)
    for action in r._actions:  # float32 by default here: a bfloat16 greedy run need not be the speculative one
        if action.dest == "dtype":
            action.default = "float32"
            action.help = (action.help or "").replace("(default: bfloat16)", "(default here: float32)")
    r.add_argument("--datasets", default="mt_bench,humaneval",
                   help="comma-separated: mt_bench, humaneval, sharegpt (first user turn of each prompt)")
    r.add_argument("--question-file", default=None, help="an EAGLE-format question.jsonl, recorded too")
    r.add_argument("--limit", type=_positive_int, default=8, help="prompts per dataset")
    r.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens)
    r.add_argument("--width", type=_int_list, default=d.widths,
                   help="beam width(s) W, comma-separated (a tree per width; default 10)")
    r.add_argument("--max-depth", type=_positive_int, default=d.max_depth, help="levels drafted per position")
    r.add_argument("--feature-dtype", choices=list(FEATURE_DTYPES), default=d.feature_dtype,
                   help="stored target features of each cycle (default float16)")
    r.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: when the model has one)")
    r.add_argument("--out", default="runs/traces", help="trace folder (manifest.json + one file per prompt)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_traces_record)

    s = sub.add_parser("simulate", help="replay a method over recorded traces: tau, depths, sizes, modelled speedup")
    s.add_argument("--traces", required=True, help="a folder written by `adaptree traces record`")
    add_method_args(s)
    s.add_argument("--latency", default=None, help="latency model JSON (adaptree.rl.latency.LatencyModel)")
    s.add_argument("--max-new-tokens", type=_positive_int, default=None, help="default: the traces'")
    s.add_argument("--json", action="store_true", help="print one JSON object (and skip timing the policy)")
    s.set_defaults(func=cmd_simulate)

    from adaptree.offline.calibration import (
        DEFAULT_VALIDATION,
        REFIT,
        CalibrationConfig,
    )

    cd = CalibrationConfig()
    c = sub.add_parser("calibrate", help="measure the simulator's latency model on this machine (micro-benchmarks), "
                                         "validate it against live cycles, save it as JSON")
    add_model_args(c)
    c.add_argument("--widths", type=_int_list, default=cd.widths, help="draft widths W timed (default 4,8,10,16)")
    c.add_argument("--sizes", type=_int_list, default=cd.sizes,
                   help="verification sizes V timed (default " + ",".join(map(str, cd.sizes)) + ")")
    c.add_argument("--verify-model", choices=("knots", "bilinear"), default=cd.verify_model,
                   help="verification time piecewise linear in V (a knot per --sizes value; default) or bilinear")
    c.add_argument("--lengths", type=_int_list, default=cd.lengths,
                   help="context lengths L timed (default 64,256,512,1024; those past the context limit skipped)")
    c.add_argument("--repeats", type=_positive_int, default=cd.repeats, help="timed runs per shape, median kept")
    c.add_argument("--validate", default=",".join("ar" if d == 0 else f"{w}:{d}:{v}" for w, d, v in DEFAULT_VALIDATION),
                   help="live tree shapes W:D:V (or ar) run to validate the model, comma-separated; '' = no "
                        "validation (default %(default)s)")
    c.add_argument("--datasets", default="mt_bench,humaneval",
                   help="validation prompts: comma-separated mt_bench, humaneval, sharegpt (first user turns)")
    c.add_argument("--question-file", default=None, help="an EAGLE-format question.jsonl, used for validation too")
    c.add_argument("--limit", type=_positive_int, default=2, help="validation prompts per dataset (default 2)")
    c.add_argument("--max-new-tokens", type=_positive_int, default=cd.max_new_tokens,
                   help=f"tokens per validation generation (default {cd.max_new_tokens})")
    c.add_argument("--refit", choices=REFIT, default=cd.refit,
                   help="save the micro-benchmark fit, the refit from live cycles, or (auto) the one with the lower "
                        "held-out error")
    c.add_argument("--goal", type=float, default=cd.goal, help="target median relative cycle-time error (default 0.1)")
    c.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one short untimed generation per validation shape first (default on)")
    c.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: when the model has one)")
    c.add_argument("--out", default="runs/latency/latency.json",
                   help="latency model JSON (a <stem>.validation.json with every live cycle goes next to it)")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_calibrate)

    o = sub.add_parser("oracle", help="the optimal per-cycle (W, d, V) schedule on recorded traces vs the best static "
                                      "tree and named methods, all replayed with a latency model")
    o.add_argument("--traces", required=True, help="a folder written by `adaptree traces record`")
    o.add_argument("--latency", required=True, help="latency model JSON (`adaptree calibrate`)")
    o.add_argument("--methods", default="static,deagle,ddd,svip,gammatune",
                   help="comma-separated methods replayed in the simulator, each with its defaults plus the method "
                        "flags below (default %(default)s)")
    add_method_args(o)
    o.set_defaults(method=None)
    o.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES_TEXT,
                   help="the oracle's V set: 'default' (1..16 and 20, 40, ..., 240), 'all' (every V: exact) or "
                        "comma-separated values")
    o.add_argument("--static-sizes", type=_sizes, default=DEFAULT_SIZES_TEXT,
                   help="V values of the best-static grid, tried with every recorded W and depth (default: 'default')")
    o.add_argument("--max-new-tokens", type=_positive_int, default=None, help="default: the traces'")
    o.add_argument("--measure-policy", action="store_true",
                   help="charge the methods' own measured decision time (default: left out, results deterministic)")
    o.add_argument("--out", default="runs/oracle/oracle.json", help="result JSON ('' = none)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.set_defaults(func=cmd_oracle)
