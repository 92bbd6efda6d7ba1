"""``adaptree train ltd``, ``train resps``, ``train radar``, ``train specdec`` and ``train c2t``: the learned
controllers' trainers."""

from __future__ import annotations

import json

from adaptree.cli import common, radar
from adaptree.cli.common import ConfigFlags, add_model_args, add_output_args

OBS_ABLATIONS = {"pdl": (True, True), "pl": (False, True), "pd": (True, False)}
"""``--obs`` -> LTD's (use_depth, use_length)."""

LTD_PPO_INTERNALS = ("batch_size", "n_epochs", "ent_coef", "lr", "gamma_depth", "gamma_size", "depth_pi", "depth_vf",
                     "size_pi", "size_vf")
"""LTD's PPO settings left at the paper's values (no flags)."""


def _prompt_flags(**defaults) -> ConfigFlags:
    from adaptree.offline.recording import TrainingPrompts

    return ConfigFlags(TrainingPrompts, defaults=defaults)


def _ltd_flags() -> ConfigFlags:
    from adaptree.methods.ltd.train import LTDTrainConfig

    return ConfigFlags(LTDTrainConfig, exclude=("use_depth", "use_length", "threads", *LTD_PPO_INTERNALS),
                       short={"width": "-W"})


def _resps_flags() -> ConfigFlags:
    from adaptree.methods.resps.train import ReSpSTrainConfig

    return ConfigFlags(ReSpSTrainConfig, exclude=("time_budget_s", "threads"), rename={"n_epochs": "epochs"})


RESPS_PROMPTS = {"train_code": 0, "train_chat": 64}
"""Re-SpS trains on ShareGPT (LTD on HumanEval and ShareGPT alike)."""

CLASSIFIER_PROMPTS = {"train_code": 32, "train_chat": 0}
"""SpecDec++ and C2T train on drafts of HumanEval (LTD Appendix A.1)."""

CLASSIFIERS = {"specdec": "SpecDec++: a ResNet on the draft head's hidden states that stops drafting when a rejection "
                          "gets likely (5 epochs)",
               "c2t": "C2T: an FFN on each candidate's probability and depth that sizes the verified tree (50 epochs)"}


def _classifier_flags(kind: str) -> ConfigFlags:
    import importlib

    from adaptree.methods.common.classifier import ClassifierTrainConfig

    default = importlib.import_module(f"adaptree.methods.{kind}.controller").DEFAULT_TRAINING
    return ConfigFlags(ClassifierTrainConfig, defaults={"out": default.out, "epochs": default.epochs})


def add_latency_arg(p, needed: str = "") -> None:
    p.add_argument("--latency", default=None,
                   help=f"latency model JSON of this machine (`adaptree calibrate`, same --dtype){needed}")


def register(sub) -> None:
    t = sub.add_parser("train", help="train a learned controller (ltd, resps, radar) on the simulator or the live "
                                     "engine")
    tsub = t.add_subparsers(dest="train_command", required=True)

    p = tsub.add_parser("ltd", help="LTD: PPO depth and size policies, stage 1 then co-adaptation; exports the best "
                                    "pair on validation to OUT/policy (safetensors + JSON)")
    add_model_args(p, adapt=False)
    add_latency_arg(p)
    _prompt_flags().add(p.add_argument_group("training prompts"))
    g = p.add_argument_group("training")
    _ltd_flags().add(g)
    g.add_argument("--obs", choices=sorted(OBS_ABLATIONS), default="pdl",
                   help="observation: pdl = scores + D + L (LTD), pl = without D, pd = without L (default pdl)")
    g.add_argument("--live", action="store_true",
                   help="train on the live engine with wall-clock rewards (slow; validation stays on the simulator)")
    g.add_argument("--machine", action="store_true",
                   help="retrain for this machine (minutes): start from the policies next to the head (--init), "
                        "fine-tune them on this machine's latency model (its setup, measured first if missing) over "
                        "training traces cached per model and head, and export the best pair into the machine's "
                        "setup folder, where ltd uses it from then on")
    add_output_args(p, json_help="print the summary as JSON")
    p.set_defaults(func=cmd_train_ltd)

    p = tsub.add_parser("resps", help="Re-SpS: a PPO policy choosing the tree (TT, d, k) every N cycles from the "
                                      "target's features; exports the best checkpoint on validation to OUT/policy")
    add_model_args(p, adapt=False)
    add_latency_arg(p, "; needed unless both training and validation are live")
    _prompt_flags(**RESPS_PROMPTS).add(p.add_argument_group("training prompts"))
    from adaptree.methods.resps.workflow import VALIDATION
    from adaptree.offline.traces import FEATURE_DTYPES

    p.add_argument("--feature-dtype", choices=[k for k in FEATURE_DTYPES if k != "none"], default="float16",
                   help="stored target features of the traces (default float16)")
    g = p.add_argument_group("training")
    _resps_flags().add(g)
    g.add_argument("--live", action="store_true",
                   help="train online on the live engine with wall-clock rewards (the paper's mode; slow)")
    g.add_argument("--val", choices=VALIDATION, default="sim",
                   help="validate on held-out prompts in the simulator (default) or on the live engine (tokens/s)")
    g.add_argument("--time-budget-min", type=float, default=None,
                   help="stop with a checkpoint after this many minutes of training; rerun to continue")
    add_output_args(p, json_help="print the summary as JSON")
    p.set_defaults(func=cmd_train_resps)

    radar.add_train_args(tsub.add_parser("radar", help=f"RADAR: {radar.TRAIN_HELP} (= `adaptree radar train`)"))

    for kind, text in CLASSIFIERS.items():
        p = tsub.add_parser(kind, help=f"{text}; supervised on balanced samples of the default EAGLE-3 tree's drafts "
                                       f"in greedy traces (recorded with the draft hidden states into --traces, "
                                       f"default OUT/traces; resumable), exported to OUT/policy")
        add_model_args(p, adapt=False)
        _prompt_flags(**CLASSIFIER_PROMPTS).add(p.add_argument_group("training prompts"))
        _classifier_flags(kind).add(p.add_argument_group("training"))
        add_output_args(p, json_help="print the summary as JSON")
        p.set_defaults(func=cmd_train_classifier, classifier=kind)


MACHINE_LTD = {"iter_steps": 12_000, "iterations": 2, "eval_every": 2}
"""``train ltd --machine``'s budget where the flags are left at their defaults (about 5 minutes of PPO on 2 cores)."""


def cmd_train_ltd(args) -> int:
    from adaptree.methods.ltd.workflow import train_ltd_for
    from adaptree.offline.latency import require_latency

    use_depth, use_length = OBS_ABLATIONS[args.obs]
    overrides = dict(use_depth=use_depth, use_length=use_length, threads=args.threads)
    if args.machine:
        return _train_ltd_machine(args, overrides)
    cfg = _ltd_flags().build(args, **overrides)
    prompts = _prompt_flags().build(args)
    latency = require_latency(args.latency)  # before the models load
    s = train_ltd_for(common.load_pipeline(args), cfg, latency, prompts, live=args.live, progress=not args.quiet)
    _print_ltd(args, cfg, s)
    return 0


def _train_ltd_machine(args, overrides: dict) -> int:
    """``train ltd --machine``: the shipped pair fine-tuned on this machine's latency model, exported to its setup."""
    import dataclasses
    import shutil
    from pathlib import Path

    from adaptree.adapt.cache import traces_dir
    from adaptree.adapt.setup import MACHINE_POLICIES
    from adaptree.methods.ltd.controller import LTDObservation
    from adaptree.methods.ltd.train import LTDTrainConfig
    from adaptree.methods.ltd.workflow import train_ltd_for
    from adaptree.offline.latency import LatencyModel
    from adaptree.offline.policy import MLPPolicy
    from adaptree.offline.store import head_fingerprint, model_fingerprint

    if args.live or args.latency:
        raise ValueError("--machine trains on this machine's own latency model in the simulator: drop --live and "
                         "--latency")
    args.adapt = True
    pipeline = common.load_pipeline(args)
    setup = pipeline.machine
    if setup is None:
        raise ValueError("no machine setup could be made for this model (it needs a draft head)")
    default = {f.name: f.default for f in dataclasses.fields(LTDTrainConfig)}
    for name, value in MACHINE_LTD.items():  # the short budget, where the flag was left at its default
        if getattr(args, name) == default[name]:
            overrides[name] = value
    init = Path(args.init) if args.init else Path(pipeline.head_folder) / "ltd"
    obs = LTDObservation.from_dict(MLPPolicy.load(init / "depth", kind="ltd-depth").config.observation)
    sizes = MLPPolicy.load(init / "size", kind="ltd-size").config.actions
    cfg = _ltd_flags().build(args, **{**overrides, "init": str(init), "costs": obs.use_costs,
                                      "sizes": tuple(int(v) for v in sizes), "max_depth": obs.max_depth,
                                      "width": obs.width,
                                      "out": args.out if args.out != default["out"] else str(setup.folder / "ltd-run")})
    prompts = _prompt_flags().build(args)
    if prompts.traces is None:  # machine-independent: one folder per model and head, reused by every machine
        prompts = dataclasses.replace(prompts, traces=str(
            traces_dir() / f"{model_fingerprint(pipeline.target)[:16]}-{head_fingerprint(pipeline.head)[:16]}-ltd"))
    s = train_ltd_for(pipeline, cfg, LatencyModel.load(setup.latency_path), prompts, progress=not args.quiet)
    for option, sub in MACHINE_POLICIES.items():
        dst = setup.folder / sub
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(Path(s["export"]) / sub.split("/")[-1], dst)
    _print_ltd(args, cfg, s)
    if not args.json:
        print(f"this machine's LTD policies: {setup.folder / 'ltd'} (used by ltd, ltd-depth and ltd-size here from "
              f"now on; delete the folder to go back to the shipped ones)")
    return 0


def _print_ltd(args, cfg, s) -> None:
    if args.json:
        print(json.dumps(dict(s)))
        return
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
    print(f"chosen: {chosen}; policies in {s['export']} (summary: {cfg.out}/summary.json)")


def cmd_train_resps(args) -> int:
    from adaptree.methods.resps.train import format_table
    from adaptree.methods.resps.workflow import train_resps_for
    from adaptree.offline.latency import require_latency

    budget = None if args.time_budget_min is None else 60.0 * args.time_budget_min
    cfg = _resps_flags().build(args, time_budget_s=budget, threads=args.threads)
    prompts = _prompt_flags(**RESPS_PROMPTS).build(args)
    simulated = not args.live or args.val == "sim"
    latency = require_latency(args.latency) if simulated else None  # before the models load
    s, train_keys, val_keys = train_resps_for(common.load_pipeline(args), cfg, latency, prompts, live=args.live,
                                              validation=args.val, feature_dtype=args.feature_dtype,
                                              progress=not args.quiet)
    if args.json:
        print(json.dumps(dict(s)))
        return 0
    if s.get("interrupted"):
        print(f"time budget reached after {s['timesteps']} PPO steps; checkpoint in {s['checkpoint']}: rerun the "
              f"same command to continue")
        return 0
    print(f"{len(train_keys)} training / {len(val_keys)} validation prompts "
          f"({'live engine' if args.live else 'simulator'} training)")
    print(format_table(s))
    print(f"summary: {cfg.out}/summary.json, {cfg.out}/summary.md; log: {cfg.out}/log.csv")
    return 0


def cmd_train_classifier(args) -> int:
    import importlib

    kind = args.classifier
    cfg = _classifier_flags(kind).build(args)
    prompts = _prompt_flags(**CLASSIFIER_PROMPTS).build(args)
    module = importlib.import_module(f"adaptree.methods.{kind}.controller")
    s = getattr(module, f"train_{kind}_for")(common.load_pipeline(args), cfg, prompts, progress=not args.quiet)
    if args.json:
        print(json.dumps(s))
        return 0
    last = s["history"][-1]
    print(f"{kind}: {s['samples']} balanced training samples from {s['train_prompts']} prompts; validation on "
          f"{s['validation_prompts']} prompts ({s['validation_samples']} samples, "
          f"{s['validation_accepted_share'] or 0:.1%} accepted)")
    print(" ".join(f"{k} {v:.4f}" for k, v in last.items() if k != "epoch"))
    print(f"classifier: {s['export']} (copy it to HEAD/{kind} to ship it); summary: {cfg.out}/summary.json")
    return 0
