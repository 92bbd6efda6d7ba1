"""Command line: ``adaptree generate | serve | adapt | bench | report | compare-hf | tune-static | train-head |
traces record | simulate | calibrate | oracle | radar dataset | radar train | train ltd | train resps | train radar | export-head``
(``serve``: an OpenAI-compatible HTTP server, docs/serving.md)."""

from __future__ import annotations

import argparse
import logging
import sys

from adaptree.cli.common import build_controller, load_pipeline, method_options

DESCRIPTION = ("EAGLE-3 speculative decoding with adaptive draft trees: generate, benchmark, tune, and train heads and "
               "learned controllers. `adaptree COMMAND --help` lists a command's flags.")

__all__ = ["main", "build_parser", "build_controller", "load_pipeline", "method_options"]


def build_parser() -> argparse.ArgumentParser:
    from adaptree.cli import adapt, bench, generate, head, offline, radar, serve, train, vllm

    parser = argparse.ArgumentParser(prog="adaptree", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.register(sub)
    serve.register(sub)
    adapt.register(sub)
    bench.register(sub)
    head.register(sub)
    offline.register(sub)
    radar.register(sub)
    train.register(sub)
    vllm.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input (a ValueError or a missing file) is one line on stderr and exit status 2. ``kill
    PID`` (SIGTERM) interrupts a command as Ctrl-C does, so every long job (corpus growth, trainers, benchmarks) keeps
    what its Ctrl-C handler saves, also when started in the background (where SIGINT is ignored)."""
    from adaptree.offline.runs import interrupt_on_terminate

    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        with interrupt_on_terminate():
            return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"adaptree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("adaptree: interrupted", file=sys.stderr)
        return 130
