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
    g.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="uvicorn's log level (default info)")
    g.add_argument("--access-log", action="store_true", help="log every request (uvicorn's access log)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from adaptree.serve import serve

    config = _server_flags().build(args)  # bad values fail before the model loads
    if config.api_key is None:
        config.api_key = os.environ.get("ADAPTREE_API_KEY") or None
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
