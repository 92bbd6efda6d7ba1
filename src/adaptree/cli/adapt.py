"""``adaptree adapt``: measure this machine for a model and head (or show the cached result)."""

from __future__ import annotations

import json

import torch

from adaptree.cli.common import ConfigFlags, add_model_args, add_output_args


def _adapt_flags() -> ConfigFlags:
    from adaptree.adapt import AdaptConfig

    return ConfigFlags(AdaptConfig)


def register(sub) -> None:
    a = sub.add_parser("adapt", help="measure this machine once (latency model, dtype, static tree, default method; "
                                     "cached): what bench, generate and adaptree.load() do on first use")
    add_model_args(a, adapt=False)
    _adapt_flags().add(a.add_argument_group("measurement"))
    a.add_argument("--force", action="store_true", help="measure again even when a setup is cached")
    add_output_args(a, json_help="print the setup as one JSON object")
    a.set_defaults(func=cmd_adapt)


def cmd_adapt(args) -> int:
    from adaptree.adapt.execution import choose_execution, execution_candidates
    from adaptree.api import load_execution

    cfg = _adapt_flags().build(args)
    progress = not args.quiet
    if args.threads:
        torch.set_num_threads(args.threads)

    def load_mode(mode):  # the pipeline in ``mode``, its attention dtype measured (choose_execution compiles, adapts)
        return load_execution(args.model, args.draft, mode, args.device, args.max_seq_len, measure=True,
                              compile="off")

    candidates = execution_candidates(args.model, args.device, args.dtype, args.weights)
    p = choose_execution(load_mode, candidates, args.model, args.draft, args.device, args.max_seq_len, cfg,
                         force=args.force, progress=progress, compile=args.compile)
    setup = p.machine
    if setup is None:
        raise ValueError("adapting needs a draft head (--draft); with none the only method is ar")
    if args.json:
        print(json.dumps({**setup.to_dict(), "folder": str(setup.folder)}, indent=1))
        return 0
    fp = setup.fingerprint
    print(f"machine: {fp['cpu']} ({', '.join(fp['cpu_flags'])}); PyTorch kernels {fp['cpu_capability']}, oneDNN "
          f"{fp['onednn_max_isa']}; {fp['torch_threads']} torch threads; {p.execution} (attention in {fp.get('attention')})")
    print(f"setup: {setup.folder} (made {setup.created} in {setup.took_s.get('total', 0):.0f} s)")
    probes = setup.execution_choice.get("probes") or {}
    if probes:
        print("execution mode chosen by a short probe of each (best method, modelled tok/s): " + ", ".join(
            f"{mode} {v['method']} {v['tokens_per_s']:.1f}" for mode, v in probes.items()))
    print(setup.table())
    return 0
