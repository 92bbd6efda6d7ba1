"""``adaptree serve``: an OpenAI-compatible HTTP server on one model (docs/serving.md)."""

from __future__ import annotations

import os
import sys

from adaptree.cli import common
from adaptree.cli.common import ConfigFlags, add_method_args, add_model_args


def _server_flags() -> ConfigFlags:
    from adaptree.serve.config import ServeConfig

    return ConfigFlags(ServeConfig, exclude=("method", "method_options"),
                       help={"api_key": "a key clients must send as 'Authorization: Bearer KEY' (default: "
                                        "$ADAPTREE_API_KEY; none needed when unset)"})


def register(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, "
                                     "/v1/models, /health, /metrics)",
                       description="Serve one model over the OpenAI API, one generation at a time with a bounded "
                                   "FIFO queue (docs/serving.md). --method and the method flags set what requests "
                                   "that name no method get; a request names its own with the extra body fields "
                                   "'method' and 'method_options'.")
    add_model_args(s)
    add_method_args(s)
    g = s.add_argument_group("server")
    _server_flags().add(g)
    v = s.add_argument_group("vLLM engine", "--engine vllm: vLLM's OpenAI server (continuous batching) with "
                                            "adaptree's head and controller; needs adaptree[vllm] (docs/vllm.md)")
    v.add_argument("--engine", choices=["adaptree", "vllm"], default="adaptree",
                   help="adaptree: adaptree's own server, one generation at a time; vllm: vLLM's, many at once, "
                        "for --method ar, static, ngram, static-gs, costaware, hybrid, deagle, radar, ltd (default "
                        "adaptree)")
    v.add_argument("--step-costs", default=None,
                   help="vLLM step-cost file for the methods adaptree's controller decides in vLLM (static-gs, "
                        "costaware, hybrid, deagle, radar, ltd; default: measured on this machine on first use, a few "
                        "minutes, cached)")
    v.add_argument("--max-num-seqs", type=int, default=32, help="requests vLLM runs at once (default 32)")
    g.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="uvicorn's log level (default info)")
    g.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from adaptree.serve import serve

    config = _server_flags().build(args)  # bad values fail before the model loads
    if config.api_key is None:
        config.api_key = os.environ.get("ADAPTREE_API_KEY") or None
    if args.engine == "vllm":
        return _serve_vllm(args, config)
    pipe = common.load_pipeline(args)
    config.method = args.method
    config.method_options = common.method_options(args, args.method or pipe.default_method)
    method = args.method or pipe.default_method
    name = config.served_model_name or pipe.model_label
    host = f"[{config.host}]" if ":" in config.host else config.host
    where = f"http://{host}:{config.port}/v1" if config.port else f"a free port of {host} (uvicorn names it below)"
    print(f"adaptree: serving {name} ({pipe.execution}, default method {method}, context {pipe.engine.max_len}, "
          f"queue {config.max_queue}) on {where}", file=sys.stderr)
    try:
        serve(pipe, config, log_level=args.log_level, access_log=args.access_log)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a clean stop
        print("adaptree: server stopped", file=sys.stderr)
    return 0


def _serve_vllm(args, config) -> int:
    """vLLM's server in place of this process, with what it reads prepared (adaptree.serve.vllm)."""
    from adaptree.vllm_plugin.engine import vllm_available

    if not vllm_available():
        raise SystemExit("adaptree serve: --engine vllm needs vLLM: pip install 'adaptree[vllm]' "
                         "(or bash scripts/setup.sh --vllm)")
    method = args.method or "costaware"
    refused = [f"--{name}" for name in ("width", "size") if getattr(args, name, None) is not None]
    refused += [f"--{f.replace('_', '-')}" for f in common.method_options(args, method) if f != "depth"]
    if refused or args.weights not in ("auto", "float") or args.compile != "auto" or args.device != "cpu" \
            or args.draft_model is not None:
        refused += [flag for flag, bad in (("--weights", args.weights not in ("auto", "float")),
                                           ("--compile", args.compile != "auto"),
                                           ("--device", args.device != "cpu"),
                                           ("--draft-model", args.draft_model is not None)) if bad]
        raise SystemExit(f"adaptree serve: {', '.join(refused)} set adaptree's own engine; vLLM drafts chains of "
                         "--depth tokens on the device vLLM was built for (docs/vllm.md)")
    if args.draft == "none" and method not in ("ar", "ngram"):
        raise SystemExit(f"adaptree serve: --method {method} drafts with a head; --draft none leaves none")
    from tqdm import tqdm

    from adaptree.serve.vllm import vllm_serve_command

    bar = tqdm(total=1, desc="vLLM step costs (first use on this machine)", disable=None)

    def tick(done, total):
        bar.total, bar.n = total, done
        bar.refresh()
    try:
        argv, env = vllm_serve_command(config, model=args.model, head=args.draft,
                                       dtype="bfloat16" if args.dtype == "auto" else args.dtype, method=method,
                                       depth=args.depth, step_costs=args.step_costs,
                                       max_model_len=args.max_seq_len or 4096, threads=args.threads,
                                       max_num_seqs=args.max_num_seqs, progress=tick)
    except ValueError as exc:
        raise SystemExit(f"adaptree serve: {exc}") from None
    finally:
        bar.close()
    print(f"adaptree: serving through vLLM ({method}): {' '.join(argv[1:])}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, {**os.environ, **env})
    return 0  # not reached: exec replaced this process
