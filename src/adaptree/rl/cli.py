"""Command line: ``adaptree traces record`` and ``adaptree simulate`` (registered by :func:`add_traces_parser`)."""

from __future__ import annotations

import argparse
import hashlib
import json


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
    from ..cli import encode_prompt, load_models
    from ..data.prompts import load_dataset, load_question_file
    from .traces import TraceSettings, open_store_for

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
    from ..cli import build_controller
    from .latency import LatencyModel
    from .simulator import simulate
    from .traces import TraceStore

    store = TraceStore(args.traces)
    traces = store.load_all()
    if not traces:
        raise ValueError(f"no traces in {args.traces}")
    lat = LatencyModel.load(args.latency) if args.latency else None
    controller = build_controller(args, head=True)
    res = simulate(controller, traces, lat, max_new_tokens=args.max_new_tokens, measure_policy=not args.json)
    summary = {"method": controller.name, **res.summary()}
    if args.json:
        print(json.dumps(summary))
    else:
        line = (f"[{summary['method']}] {summary['prompts']} prompts, {summary['cycles']} cycles, "
                f"{summary['new_tokens']} tokens, tau {summary['tau']:.3f}, mean depth {summary['mean_depth']:.2f}, "
                f"mean V {summary['mean_size']:.1f}")
        if lat is not None:
            line += (f"; modelled {summary['modelled_s']:.3f} s vs AR {summary['modelled_ar_s']:.3f} s, "
                     f"speedup {summary['modelled_speedup']:.3f}x")
        print(line)
    return 0


def add_traces_parser(sub) -> None:
    """Register ``traces record`` and ``simulate`` on the main parser's subcommands."""
    from ..cli import _positive_int, add_method_args, add_model_args
    from .traces import FEATURE_DTYPES, TraceSettings

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
