"""``adaptree generate``: one prompt, streamed to the terminal (or one JSON object)."""

from __future__ import annotations

import json
import sys

from adaptree.cli import common
from adaptree.cli.common import ConfigFlags, add_chat_arg, add_method_args, add_model_args, positive_int


def _sampling_flags() -> ConfigFlags:
    from adaptree.core.verify import SamplingConfig

    return ConfigFlags(SamplingConfig)


def register(sub) -> None:
    g = sub.add_parser("generate", help="generate text, streaming it to the terminal")
    g.add_argument("prompt")
    add_model_args(g)
    add_method_args(g)
    s = g.add_argument_group("generation")
    s.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens to generate at most (default 256)")
    _sampling_flags().add(s)
    add_chat_arg(s)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    sampling = _sampling_flags().build(args)  # bad values fail before the model loads
    pipe = common.load_pipeline(args)
    controller = common.pipeline_controller(args, pipe)
    prompt = pipe.encode(args.prompt, args.chat)
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
