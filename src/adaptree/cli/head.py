"""``adaptree train-head``: train an EAGLE-3 draft head for a target; ``adaptree corpus grow | info``: the committed
self-distilled corpora it trains on."""

from __future__ import annotations

import json
import sys

from adaptree.cli.common import ConfigFlags, command_line


def _flags() -> ConfigFlags:
    from adaptree.head_training import TrainHeadConfig

    return ConfigFlags(TrainHeadConfig, exclude=("command",), rename={"target_dtype": "dtype"})


def _corpus_flags() -> ConfigFlags:
    from adaptree.head_training.chunked import CorpusSettings

    # unset: a flag not given takes the corpus's own setting (the default's for a new corpus)
    return ConfigFlags(CorpusSettings, rename={"target_dtype": "dtype"}, unset=True)


def register(sub) -> None:
    from adaptree.head_training.chunked import TARGET_DTYPES

    t = sub.add_parser("train-head", help="train an EAGLE-3 draft head for a target (self-distillation or ShareGPT)")
    _flags().add(t)
    t.set_defaults(func=cmd_train_head)

    c = sub.add_parser("corpus", help="the committed self-distilled corpora head training uses")
    csub = c.add_subparsers(dest="corpus_cmd", required=True)
    g = csub.add_parser("grow", help="generate chunks until the corpus has --chunks training chunks (resumable)")
    g.add_argument("--out", required=True, help="the corpus folder (created with these settings if missing)")
    g.add_argument("--chunks", type=int, required=True, help="training chunks wanted in all (0: the held-out one)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--device", default="cpu", help="where the target runs: cpu (default) or cuda")
    g.add_argument("--chunk-dtype", choices=TARGET_DTYPES, default=None,
                   help="generate this run's chunks in this dtype instead of the corpus's --dtype, each chunk "
                        "recording it (float32 on a CPU without native bfloat16, where bfloat16 is emulated and "
                        "several times slower; docs/head-training.md, 'Committed corpora')")
    _corpus_flags().add(g)
    g.set_defaults(func=cmd_corpus_grow)
    i = csub.add_parser("info", help="a corpus's settings and totals (checksums verified), and the answers an "
                                     "interrupted run left for its unfinished chunks")
    i.add_argument("folder")
    i.set_defaults(func=cmd_corpus_info)


def cmd_train_head(args) -> int:
    from adaptree.head_training import train_head

    cfg = _flags().build(args, command=command_line())
    s = train_head(cfg)
    v = s["validation"]["final"]
    if v:
        sel = s["validation"]["selected"]
        print(f"exported: step {sel['step']} (by {sel['by']}); validation acceptance per TTT step: "
              f"{' '.join(f'{a:.3f}' for a in v['step_acc'])}; chain tau {v.get('chain_tau', float('nan')):.2f}")
    print(f"head: {s['export']}  summary: {cfg.out}/training_summary.json")
    return 0


def emulated_dtype_warning(dtype: str, device: str) -> str | None:
    """What to say when a corpus would be generated in a dtype this CPU only emulates (None: nothing)."""
    from adaptree.adapt.execution import fallback_dtype

    if dtype == "float32" or fallback_dtype(device) != "float32":
        return None
    return (f"warning: {dtype} is emulated on this CPU (no AVX-512 BF16 or AMX kernels that PyTorch may use), so "
            f"generating in it runs several times slower than in float32; --chunk-dtype float32 makes this run's "
            f"chunks in float32")


def cmd_corpus_grow(args) -> int:
    import torch

    from adaptree.adapt.execution import DTYPES
    from adaptree.core.machine import keep_freed_memory
    from adaptree.head_training.chunked import ChunkedCorpus, CorpusSettings
    from adaptree.head_training.features import target_fingerprint
    from adaptree.models import load_model

    if args.chunks < 0:
        raise ValueError(f"--chunks must be >= 0, got {args.chunks}")
    corpus = ChunkedCorpus(args.out)
    settings = CorpusSettings(**{**corpus.manifest.get("settings", {}), **_corpus_flags().values(args)})
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    dtype = args.chunk_dtype or settings.target_dtype
    warning = emulated_dtype_warning(dtype, args.device)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    model = None if settings.model == "default" else settings.model
    target, tok = load_model(model, dtype=DTYPES[dtype])
    target = target.to(args.device).eval()
    try:
        totals = corpus.grow(settings, args.chunks, target, tok, dtype=dtype,
                             fingerprint=target_fingerprint(target, settings.model, DTYPES[settings.target_dtype]),
                             progress=lambda done, want: print(f"chunk {done}/{want} written", flush=True))
    except KeyboardInterrupt:
        left = corpus.pending()
        if left:  # "\n": the progress bar's line is left unfinished
            print(f"\n{left['answers']} answers ({left['response_tokens']} response tokens, {left['dtype']}) of the "
                  f"unfinished chunks wait in {corpus.work}: rerun to continue; to continue on another machine, "
                  f"commit them (git add -f {corpus.work})", file=sys.stderr, flush=True)
        raise
    print(json.dumps(totals, indent=1))
    return 0


def cmd_corpus_info(args) -> int:
    from adaptree.head_training.chunked import ChunkedCorpus

    corpus = ChunkedCorpus(args.folder)
    if not corpus.manifest:
        raise FileNotFoundError(f"{args.folder}: no corpus here (manifest.json missing)")
    corpus.read()  # verifies every checksum
    print(json.dumps({"settings": corpus.manifest["settings"], "target": corpus.manifest["target"].get("name"),
                      "totals": corpus.totals(), "pending": corpus.pending()}, indent=1))
    return 0
