"""Command line: ``adaptree generate | compare-hf | train-head``."""

from __future__ import annotations

import argparse
import json
import logging
import sys


from adaptree.api import DTYPES


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    from adaptree.models.registry import DEFAULT_MODEL_NAME, MODELS

    names = ", ".join(MODELS)
    p.add_argument("--model", default=None,
                   help=f"a model name ({names}), a Hugging Face checkpoint folder or a .gguf file "
                        f"(default: {DEFAULT_MODEL_NAME}, the embedded SmolLM2-135M-Instruct); GGUF models are "
                        "converted once to a float cache under $ADAPTREE_CACHE (default ~/.cache/adaptree)")
    p.add_argument("--draft", default="auto",
                   help="EAGLE-3 draft head folder (config.json + model.safetensors); 'auto' (default) = the head "
                        "adaptree ships for a registered model, 'none' = no head")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                   help="weights and activations; float32 for bit-exact lossless greedy output (default: bfloat16)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-seq-len", type=_positive_int, default=None, help="context limit (default: the model's, <= 8192)")


def add_method_args(p: argparse.ArgumentParser) -> None:
    from adaptree.methods import (
        METHODS,
        DDDConfig,
        DeagleConfig,
        GammatuneConfig,
        StaticConfig,
        SVIPConfig,
    )

    d, dg, dd, sv, gt = StaticConfig(), DeagleConfig(), DDDConfig(), SVIPConfig(), GammatuneConfig()
    p.add_argument("--method", choices=METHODS, default=None,
                   help="ar = autoregressive; static = EAGLE-3 static tree; static-gs = the tree tune-static chose; "
                        "deagle, ddd, svip = EAGLE-3 tree with a dynamic depth; gammatune = per-cycle depth from the "
                        "acceptance rate (default: static with a draft head, else ar)")
    p.add_argument("--width", "-W", type=int, default=None, help=f"beam width W, every tree method (default {d.width})")
    p.add_argument("--depth", "-D", type=int, default=None,
                   help=f"static: draft depth D (default {d.depth}); deagle/ddd/svip: maximum depth (default "
                        f"{dg.depth}); gammatune: default depth D0 (default {gt.depth})")
    p.add_argument("--size", "-V", type=int, default=None,
                   help=f"verification size V, every tree method (default {d.size})")
    p.add_argument("--deagle-tau-s", type=float, default=dg.tau_s,
                   help=f"deagle: stop vote if the top-W survival sum S_d < this (default {dg.tau_s})")
    p.add_argument("--deagle-tau-rho", type=float, default=dg.tau_rho,
                   help=f"deagle: momentum vote once S_d/S_(d-1) < this twice in a cycle (default {dg.tau_rho})")
    p.add_argument("--deagle-votes", default=",".join(dg.votes),
                   help="deagle: comma-separated votes cast, of survival, momentum, expected (default all three)")
    p.add_argument("--deagle-min-votes", type=int, default=None,
                   help=f"deagle: votes needed to stop (default {dg.min_votes}, or 1 when a single vote is given)")
    p.add_argument("--deagle-expected-offset", type=int, default=dg.expected_offset,
                   help=f"deagle: expected vote if d >= ceil(E_d) + this; 1 counts the bonus token, 0 is the literal "
                        f"rule (default {dg.expected_offset})")
    p.add_argument("--ddd-threshold", type=float, default=dd.threshold,
                   help=f"ddd: stop if the beam's cumulative log-prob is below this at a checked depth "
                        f"(default {dd.threshold})")
    p.add_argument("--ddd-check-depths", default=",".join(map(str, dd.check_depths)),
                   help="ddd: comma-separated depths after which the threshold is checked (default 5,7,9)")
    p.add_argument("--ddd-heuristic", choices=("logsumexp", "best"), default=dd.heuristic,
                   help="ddd: logsumexp of the beam's scores (DDD's) or the best path's score (default logsumexp)")
    p.add_argument("--svip-entropy-factor", type=float, default=sv.entropy_factor,
                   help=f"svip: gamma of the acceptance bound 1 - sqrt(gamma*H) (default {sv.entropy_factor})")
    p.add_argument("--svip-min-entropy", type=float, default=sv.min_entropy,
                   help=f"svip: stop once sqrt(gamma*H) of the best beam node exceeds this (default {sv.min_entropy})")
    p.add_argument("--tuned", default=None,
                   help="static-gs: the static_gs.json of `adaptree tune-static` (default: the one shipped with the "
                        "model's head)")
    p.add_argument("--gammatune-rate", type=float, default=gt.rate,
                   help=f"gammatune: smoothing rate eta of the acceptance rate (default {gt.rate})")
    p.add_argument("--radar-policy", default=None,
                   help="radar: policy folder (config.json + model.safetensors) of `adaptree radar train` (default: "
                        "the radar/ folder shipped next to the model's head)")
    p.add_argument("--radar-threshold", type=float, default=None,
                   help="radar: stop drafting iff P(stop) >= this (default 0.5 = argmax)")
    p.add_argument("--radar-stochastic", action="store_true", default=None,
                   help="radar: sample the stop/continue decision (the paper's code) instead of thresholding")
    p.add_argument("--ltd-depth-policy", default=None,
                   help="ltd, ltd-depth: depth policy folder of `adaptree train ltd` (default: ltd/depth/ shipped "
                        "next to the model's head)")
    p.add_argument("--ltd-size-policy", default=None,
                   help="ltd, ltd-size: size policy folder (default: ltd/size/ shipped next to the model's head)")
    p.add_argument("--resps-policy", default=None,
                   help="resps: policy folder of `adaptree train resps` (default: resps/ shipped next to the model's "
                        "head)")
    p.add_argument("--resps-interval", type=int, default=None,
                   help="resps: cache interval N, cycles a chosen (TT, d, k) is kept (default 30, the paper's)")
    p.add_argument("--resps-state", choices=("concat", "mean", "embedding"), default=None,
                   help="resps: state the policy was trained on, checked (default: the policy's)")
    p.add_argument("--resps-temperature", type=float, default=None,
                   help="resps: 0 = argmax, > 0 samples the action at this temperature (max-entropy: 1.5; default: "
                        "the policy's recorded inference temperature)")


def load_pipeline(args):
    """The :class:`~adaptree.api.Pipeline` of the common model flags (``args.draft_path`` is set to the head
    folder in use, for the method flags)."""
    from adaptree.api import load

    p = load(args.model, head=getattr(args, "draft", "none"), dtype=args.dtype, threads=args.threads,
             max_seq_len=args.max_seq_len)
    args.draft_path = str(p.head_folder) if p.head_folder else None
    return p


def load_models(args):
    """Target, tokenizer bundle and (optional) head from the common model flags."""
    p = load_pipeline(args)
    return p.target, p.tokenizer, p.head


def method_options(args, method: str) -> dict:
    """The config fields of ``method`` given on the command line (flags not given keep the method's defaults:
    depth is 8 for static, 12 for deagle, ...)."""
    if method == "ar":
        return {}
    flags = {} if method in ("static-gs", "resps") else {"width": "width", "depth": "depth", "size": "size"}
    flags.update({
        "static-gs": {"tuned": "tuned"},
        "deagle": {"tau_s": "deagle_tau_s", "tau_rho": "deagle_tau_rho", "votes": "deagle_votes",
                   "min_votes": "deagle_min_votes", "expected_offset": "deagle_expected_offset"},
        "ddd": {"threshold": "ddd_threshold", "check_depths": "ddd_check_depths", "heuristic": "ddd_heuristic"},
        "svip": {"entropy_factor": "svip_entropy_factor", "min_entropy": "svip_min_entropy"},
        "gammatune": {"rate": "gammatune_rate"},
        "radar": {"policy": "radar_policy", "threshold": "radar_threshold", "stochastic": "radar_stochastic"},
        "ltd": {"depth_policy": "ltd_depth_policy", "size_policy": "ltd_size_policy"},
        "ltd-depth": {"depth_policy": "ltd_depth_policy"},
        "ltd-size": {"size_policy": "ltd_size_policy"},
        "resps": {"policy": "resps_policy", "interval": "resps_interval", "state": "resps_state",
                  "temperature": "resps_temperature"},
    }.get(method, {}))
    opts = {field: getattr(args, attr) for field, attr in flags.items() if getattr(args, attr, None) is not None}
    if method == "deagle" and "votes" in opts:
        opts["votes"] = tuple(v.strip() for v in str(opts["votes"]).split(",") if v.strip())
        opts.setdefault("min_votes", min(2, len(opts["votes"])) or 1)
    return opts


def build_controller(args, head, tokenizer=None):
    """The controller of ``args.method`` (default: static with a draft head, else ar) with its flags; learned
    methods' policies and static-gs's tree come from next to the head in use (``args.draft_path``)."""
    from adaptree.methods import make_controller

    method = args.method or ("static" if head is not None else "ar")
    return make_controller(method, head_folder=getattr(args, "draft_path", None), model=args.model,
                           tokenizer=tokenizer, **method_options(args, method))


def encode_prompt(tok, text: str, chat: bool | None) -> list[int]:
    use_chat = bool(tok.chat_template) if chat is None else chat
    if use_chat:
        if not tok.chat_template:
            raise ValueError("--chat was given but this model has no chat template")
        return tok.apply_chat([{"role": "user", "content": text}])
    return tok.encode(text)


def cmd_generate(args) -> int:
    from adaptree.core.verify import SamplingConfig

    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    pipe = load_pipeline(args)
    controller = build_controller(args, pipe.head, pipe.tokenizer)
    prompt = encode_prompt(pipe.tokenizer, args.prompt, args.chat)
    if args.json:
        gen = pipe.generate(prompt, controller=controller, max_new_tokens=args.max_new_tokens, sampling=sampling)
    else:
        stream = pipe.stream(prompt, controller=controller, max_new_tokens=args.max_new_tokens, sampling=sampling)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        gen = stream.generation
    res = gen.result
    if args.json:
        print(json.dumps({
            "text": gen.text, "token_ids": res.token_ids, "prompt_tokens": res.prompt_len,
            "new_tokens": res.new_tokens, "cycles": len(res.cycles), "tau": res.tau,
            "wall_time_s": res.wall_time_s, "prefill_s": res.prefill_s, "tokens_per_s": res.tokens_per_s,
            "stop_reason": res.stop_reason, "method": res.method, **res.time_split(),
        }))
    else:
        sys.stdout.write("\n")
        print(f"[{res.method}] {res.new_tokens} tokens in {res.wall_time_s:.2f} s "
              f"({res.tokens_per_s:.1f} tok/s), {len(res.cycles)} cycles, tau {res.tau:.2f}, "
              f"stop: {res.stop_reason}", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from adaptree.bench.runner import BenchConfig, run_bench

    cfg = BenchConfig(methods=[m for m in args.methods.split(",") if m],
                      datasets=[d for d in args.datasets.split(",") if d], question_file=args.question_file,
                      limit=args.limit, turns=args.turns, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                      repeats=args.repeats, reference=args.reference or None,
                      assistant_model=args.assistant_model, warmup=args.warmup, out=args.out,
                      oracle_latency=args.oracle_latency)
    pipe = load_pipeline(args)
    options = {m: method_options(args, m) for m in cfg.methods}
    run_bench(cfg, pipe, options, command="adaptree " + " ".join(sys.argv[1:]))
    return 0


def cmd_report(args) -> int:
    from adaptree.bench.runner import rebuild_report

    rebuild_report(args.folder)
    return 0


def cmd_tune_static(args) -> int:
    from adaptree.methods.static.tune import TuneConfig, run_tune

    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    cfg = TuneConfig(depths=ints(args.depths), sizes=ints(args.sizes), widths=ints(args.widths), prompts=args.prompts,
                     first_round_prompts=args.first_round_prompts, eta=args.eta,
                     max_new_tokens=args.max_new_tokens, seed=args.seed, out=args.out)
    run_tune(cfg, load_pipeline(args), command="adaptree " + " ".join(sys.argv[1:]))
    return 0


def add_tune_parser(sub) -> None:
    from adaptree.methods.static.tune import TuneConfig

    d = TuneConfig()
    csv = lambda xs: ",".join(map(str, xs))  # noqa: E731
    t = sub.add_parser("tune-static", help="grid search (successive halving, measured tokens/s) for the static tree; "
                                           "the choice is --method static-gs")
    add_model_args(t)
    t.add_argument("--depths", default=csv(d.depths), help=f"draft depths to try (default {csv(d.depths)})")
    t.add_argument("--sizes", default=csv(d.sizes), help=f"verification sizes V to try (default {csv(d.sizes)})")
    t.add_argument("--widths", default=csv(d.widths), help=f"beam widths W to try (default {csv(d.widths)})")
    t.add_argument("--prompts", type=_positive_int, default=d.prompts,
                   help=f"tuning prompts, disjoint from the benchmark's (default {d.prompts})")
    t.add_argument("--first-round-prompts", type=_positive_int, default=d.first_round_prompts)
    t.add_argument("--eta", type=int, default=d.eta, help="keep 1/eta of the configs per round (default 3)")
    t.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens)
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--out", default=d.out, help=f"search folder (tune.jsonl resumed; static_gs.json; default {d.out})")
    t.set_defaults(func=cmd_tune_static)


def cmd_compare_hf(args) -> int:
    from adaptree.bench.hf_compare import CompareConfig, run_compare

    args.draft = "none"
    cfg = CompareConfig(prompts=args.prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats, out=args.out)
    run_compare(cfg, load_pipeline(args))
    return 0


def cmd_train_head(args) -> int:
    from adaptree.head_training import TrainHeadConfig, train_head

    names = ("model", "out", "source", "num_prompts", "val_prompts", "max_len", "max_new_tokens", "gen_temperature",
             "gen_batch_size", "draft_vocab", "epochs", "ttt_steps", "lr", "batch_tokens", "max_steps", "seed",
             "device", "threads", "resume", "train_dtype")
    cfg = TrainHeadConfig(**{n: getattr(args, n) for n in names}, target_dtype=args.dtype,
                          command="adaptree " + " ".join(sys.argv[1:]))
    s = train_head(cfg)
    v = s["validation"]["final"]
    if v:
        print(f"validation acceptance per TTT step: {' '.join(f'{a:.3f}' for a in v['step_acc'])}; "
              f"chain tau {v.get('chain_tau', float('nan')):.2f}")
    print(f"head: {s['export']}  summary: {cfg.out}/training_summary.json")
    return 0


def add_train_head_parser(sub) -> None:
    from adaptree.head_training import TrainHeadConfig

    d = TrainHeadConfig()
    t = sub.add_parser("train-head", help="train an EAGLE-3 draft head for a target (self-distillation or ShareGPT)")
    t.add_argument("--model", default=None, help="target: short name, HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    t.add_argument("--out", default=d.out, help=f"run folder (corpus, features, checkpoints, head/; default {d.out})")
    t.add_argument("--source", choices=("self", "sharegpt"), default=d.source,
                   help="responses: generated by the target (self) or ShareGPT's own (default self)")
    t.add_argument("--num-prompts", type=_positive_int, default=d.num_prompts)
    t.add_argument("--val-prompts", type=_positive_int, default=None, help="held-out conversations (default N/20, >= 8)")
    t.add_argument("--max-len", type=_positive_int, default=d.max_len, help="longest sequence in tokens")
    t.add_argument("--max-new-tokens", type=_positive_int, default=d.max_new_tokens, help="self: longest response")
    t.add_argument("--gen-temperature", type=float, default=d.gen_temperature, help="self: 0 = greedy (default)")
    t.add_argument("--gen-batch-size", type=_positive_int, default=d.gen_batch_size)
    t.add_argument("--draft-vocab", type=_positive_int, default=d.draft_vocab)
    t.add_argument("--epochs", type=_positive_int, default=d.epochs)
    t.add_argument("--ttt-steps", type=_positive_int, default=d.ttt_steps, help="K unrolled training-time-test steps")
    t.add_argument("--lr", type=float, default=d.lr)
    t.add_argument("--batch-tokens", type=_positive_int, default=d.batch_tokens, help="padded tokens per step")
    t.add_argument("--max-steps", type=_positive_int, default=None, help="cap on optimizer steps")
    t.add_argument("--train-dtype", choices=("bfloat16", "float32"), default=d.train_dtype)
    t.add_argument("--dtype", choices=sorted(DTYPES), default=d.target_dtype, help="target dtype (generation, features)")
    t.add_argument("--seed", type=int, default=d.seed)
    t.add_argument("--device", default=d.device, help="cpu or cuda")
    t.add_argument("--threads", type=_positive_int, default=None)
    t.add_argument("--resume", action="store_true", help="continue the checkpoint in --out")
    t.set_defaults(func=cmd_train_head)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaptree", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text, streaming it to the terminal")
    g.add_argument("prompt")
    add_model_args(g)
    add_method_args(g)
    g.add_argument("--max-new-tokens", type=_positive_int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: when the model has one)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)

    from adaptree.methods import METHODS

    b = sub.add_parser("bench", help="benchmark methods side by side: speedup vs AR, tau, losslessness")
    add_model_args(b)
    add_method_args(b)
    b.set_defaults(method=None)
    from adaptree.bench.runner import MAIN_JOB_METHODS

    b.add_argument("--methods", default=",".join(MAIN_JOB_METHODS),
                   help="comma-separated arms, must include ar: engine methods (" + ", ".join(METHODS) +
                        ") and Hugging Face references (hf_generate, hf_prompt_lookup, hf_assisted)")
    b.add_argument("--datasets", default="mt_bench,humaneval", help="comma-separated: mt_bench, humaneval, sharegpt")
    b.add_argument("--question-file", default=None, help="an EAGLE-format question.jsonl, benchmarked too")
    b.add_argument("--limit", type=_positive_int, default=3, help="prompts per dataset (default 3)")
    b.add_argument("--turns", type=_positive_int, default=None,
                   help="turns per conversation (MT-bench has 2; default all, MT-bench protocol)")
    b.add_argument("--max-new-tokens", type=_positive_int, default=128, help="per turn (default 128)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--seed", type=int, default=0, help="sampling seed (repeat r uses seed + r)")
    b.add_argument("--repeats", type=_positive_int, default=1)
    b.add_argument("--reference", default="static",
                   help="method the others are tested against (Wilcoxon, speed ratio); '' = none (default static)")
    b.add_argument("--assistant-model", default=None,
                   help="hf_assisted: same-tokenizer draft model (default: the registered smaller sibling)")
    b.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one short untimed generation per arm first (default on)")
    b.add_argument("--out", default="runs/bench",
                   help="results folder: results.jsonl (resumed if present), summary.json, report.md, plots")
    from adaptree.bench.oracle_section import add_bench_args

    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    r = sub.add_parser("report", help="rebuild summary.json, report.md and the plots of a bench folder")
    r.add_argument("folder", help="a bench --out folder (with results.jsonl and bench_config.json)")
    r.set_defaults(func=cmd_report)

    c = sub.add_parser("compare-hf", help="autoregressive tokens/s: this engine vs transformers generate()")
    add_model_args(c)
    c.add_argument("--prompts", type=_positive_int, default=6, help="number of built-in prompts")
    c.add_argument("--max-new-tokens", type=_positive_int, default=128)
    c.add_argument("--repeats", type=_positive_int, default=1)
    c.add_argument("--out", default="runs/compare-hf", help="results folder (results.jsonl, summary.json)")
    c.set_defaults(func=cmd_compare_hf)

    add_train_head_parser(sub)
    add_tune_parser(sub)
    from adaptree.cli.offline import add_traces_parser

    add_traces_parser(sub)
    from adaptree.cli.radar import add_radar_parser

    add_radar_parser(sub)
    from adaptree.cli.train import add_train_parser

    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"adaptree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("adaptree: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
