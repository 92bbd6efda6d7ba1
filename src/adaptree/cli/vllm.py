"""``adaptree export-head``: a head as the EAGLE-3 drafter vLLM loads; ``adaptree vllm-bench``: vLLM's arms and
adaptree's controllers inside vLLM at 1 and more streams (docs/vllm.md)."""

from __future__ import annotations

from adaptree.cli.common import ConfigFlags


def _bench_flags() -> ConfigFlags:
    from adaptree.bench.vllm_bench import VllmBenchConfig

    return ConfigFlags(VllmBenchConfig)


def register(sub) -> None:
    from adaptree.vllm_plugin.export import EXPORT_DTYPES

    e = sub.add_parser("export-head", help="write a head as the EAGLE-3 drafter checkpoint vLLM, SGLang and "
                                           "SpecForge load (docs/vllm.md)")
    e.add_argument("out", help="the folder to write (config.json + model.safetensors)")
    e.add_argument("--model", default=None, help="the target: a short name, a .gguf file or a Hugging Face folder "
                                                 "(default: the embedded SmolLM2-135M-Instruct)")
    e.add_argument("--head", default="auto", help="the head folder (default auto: the one shipped for --model)")
    e.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default="bfloat16",
                   help="the floating tensors' dtype, also the target folder's for a GGUF model (default bfloat16)")
    e.set_defaults(func=cmd_export_head)
    b = sub.add_parser("vllm-bench", help="vLLM plain, n-gram, EAGLE-3 with adaptree's head and adaptree's "
                                          "controllers inside vLLM, at 1 and more streams (needs adaptree[vllm])")
    _bench_flags().add(b)
    b.set_defaults(func=cmd_vllm_bench)


def cmd_export_head(args) -> int:
    from adaptree.vllm_plugin.export import EXPORT_DTYPES, export_for_vllm

    out, target = export_for_vllm(args.out, model=args.model, head=args.head, dtype=EXPORT_DTYPES[args.dtype])
    print(f"wrote {out}\nin vLLM: LLM(model={str(target)!r}, speculative_config={{\"method\": \"eagle3\", "
          f"\"model\": {str(out)!r}, \"num_speculative_tokens\": 3}})")
    return 0


def cmd_vllm_bench(args) -> int:
    from adaptree.bench.vllm_bench import run_vllm_bench, table

    summary = run_vllm_bench(_bench_flags().build(args))
    print(table(summary))
    print(f"results in {args.out}")
    return 0
