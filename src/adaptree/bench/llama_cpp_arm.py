"""llama.cpp as a reference arm of ``adaptree bench``: the same GGUF file through ``llama-cpp-python``.

- ``llama_cpp``: its autoregressive decoding (greedy or sampled);
- ``llama_cpp_lookup``: its prompt-lookup decoding (``LlamaPromptLookupDecoding``: n-gram drafts copied from the
  context, 10 tokens).

A CPU user's alternative to adaptree is llama.cpp on the same file, so it is the bar the engine is measured
against (docs/performance.md). Optional: ``pip install 'adaptree[llama-cpp]'`` (``llama-cpp-python`` builds
llama.cpp from source: a C++ compiler and CMake, minutes on 2 cores); CI does not need it. The arm uses the
torch thread count for llama.cpp's threads (decode and prompt), runs the prompt's token ids as given (the same
chat-templated ids as every other arm) and keeps the EOS token, as the engine does. llama.cpp computes with its
own kernels on the quantized blocks, so its greedy text may differ from ours in a near-tie; the bench reports
such an arm's agreement with ``ar`` like any other. The bench runs each llama.cpp arm in a worker process of its
own (:mod:`adaptree.bench.isolation`, :func:`llama_cpp_recipe`): a llama.cpp built for another CPU can die with
SIGILL, which then drops the arm instead of ending the bench.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from adaptree.bench.isolation import ArmRecipe
from adaptree.core.records import GenerationResult
from adaptree.core.verify import SamplingConfig

if TYPE_CHECKING:
    from adaptree.bench.runner import BenchConfig
    from adaptree.core.pipeline import PipelineLike

LLAMA_CPP_METHODS = ("llama_cpp", "llama_cpp_lookup")


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _needs_llama_cpp(method: str) -> str:
    return f"the {method} arm needs llama-cpp-python: pip install 'adaptree[llama-cpp]'"


def llama_cpp_recipe(method: str, cfg: BenchConfig, pipeline: PipelineLike) -> ArmRecipe:
    """How the bench's worker builds ``method`` (:func:`build_llama_cpp_arms`); a missing llama-cpp-python or GGUF
    file fails here, in the bench's process."""
    if not llama_cpp_available():
        raise ValueError(_needs_llama_cpp(method))
    from adaptree.models.assets import gguf_file

    return ArmRecipe(build_llama_cpp_arms, {"gguf_path": str(gguf_file(pipeline.model, f"the {method} arm")),
                                            "eos_token_ids": [int(t) for t in pipeline.tokenizer.eos_token_ids],
                                            "n_ctx": pipeline.engine.max_len})


def build_llama_cpp_arms(methods: Sequence[str], gguf_path: str, eos_token_ids: Sequence[int],
                         n_ctx: int) -> dict[str, LlamaCppArm]:
    """The llama.cpp arms ``methods`` on ``gguf_path`` (in a worker process, on the bench's torch thread count)."""
    return {m: LlamaCppArm(gguf_path, m, eos_token_ids, n_ctx=n_ctx) for m in methods}


class LlamaCppArm:
    """One llama.cpp configuration on ``gguf_path``, called like an engine arm."""

    def __init__(self, gguf_path: str | Path, method: str, eos_token_ids: Sequence[int] = (), n_ctx: int = 4096,
                 threads: int | None = None, lookup_tokens: int = 10) -> None:
        if method not in LLAMA_CPP_METHODS:
            raise ValueError(f"unknown llama.cpp arm {method!r}; available: {', '.join(LLAMA_CPP_METHODS)}")
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError:
            raise ValueError(_needs_llama_cpp(method)) from None
        threads = threads or torch.get_num_threads()
        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens) if method == "llama_cpp_lookup" else None
        self.method = method
        self.eos = {int(t) for t in eos_token_ids}
        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         draft_model=draft, verbose=False)

    def __call__(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingConfig) -> GenerationResult:
        if sampling.greedy:
            kw = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
        else:
            kw = {"temp": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k, "min_p": 0.0}
            if sampling.seed is not None:
                self.llm.set_seed(int(sampling.seed))
        toks: list[int] = []
        stop = "max_new_tokens"
        t0 = time.perf_counter()
        for tok in self.llm.generate(list(prompt_ids), reset=True, repeat_penalty=1.0, **kw):
            toks.append(int(tok))
            if tok in self.eos:
                stop = "eos"
                break
            if len(toks) >= max_new_tokens:
                break
        wall = time.perf_counter() - t0
        return GenerationResult(prompt_len=len(prompt_ids), token_ids=toks, wall_time_s=wall, stop_reason=stop,
                                method=self.method)
