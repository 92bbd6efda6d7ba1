"""llama.cpp as a reference arm of ``adaptree bench``: the same GGUF file through ``llama-cpp-python``.

- ``llama_cpp``: its autoregressive decoding (greedy or sampled);
- ``llama_cpp_lookup``: its prompt-lookup decoding (``LlamaPromptLookupDecoding``: n-gram drafts copied from the
  context, 10 tokens);
- ``llama_cpp_loop``: llama.cpp's own greedy loop through the low-level API (one ``llama_decode`` per token, argmax
  of its logits; llama.cpp's default context settings, and its weights in the small pages llama.cpp leaves them
  in where adaptree's backend moves them to huge ones), the bar for adaptree's ``ggml`` backend (docs/ggml.md);
  ``llama_cpp_loop_q4_0``: the same on the file requantized to Q4_0 by llama.cpp
  (:func:`adaptree.models.ggml.requantized`).

A CPU user's alternative to adaptree is llama.cpp on the same file, so it is the bar the engine is measured
against (docs/performance.md). It needs llama-cpp-python, which ``bash scripts/setup.sh`` builds from source for
this CPU (a C++ compiler and CMake, about 4.5 minutes on 2 cores, once). The arm uses the
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

LLAMA_CPP_METHODS = ("llama_cpp", "llama_cpp_lookup", "llama_cpp_loop", "llama_cpp_loop_q4_0")


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _needs_llama_cpp(method: str) -> str:
    return f"the {method} arm needs llama-cpp-python: bash scripts/setup.sh builds it for this CPU"


def llama_cpp_recipe(method: str, cfg: BenchConfig, pipeline: PipelineLike) -> ArmRecipe:
    """How the bench's worker builds ``method`` (:func:`build_llama_cpp_arms`); a missing llama-cpp-python or GGUF
    file fails here, in the bench's process."""
    if not llama_cpp_available():
        raise ValueError(_needs_llama_cpp(method))
    if method.startswith("llama_cpp_loop") and not cfg.sampling.greedy:
        raise ValueError(f"{method} decodes greedily only (it is the greedy bar); run the bench without sampling")
    from adaptree.models.assets import gguf_file

    return ArmRecipe(build_llama_cpp_arms, {"gguf_path": str(gguf_file(pipeline.model, f"the {method} arm")),
                                            "eos_token_ids": [int(t) for t in pipeline.tokenizer.eos_token_ids],
                                            "n_ctx": pipeline.engine.max_len})


def build_llama_cpp_arms(methods: Sequence[str], gguf_path: str, eos_token_ids: Sequence[int],
                         n_ctx: int) -> dict[str, LlamaCppArm]:
    """The llama.cpp arms ``methods`` on ``gguf_path`` (in a worker process, on the bench's torch thread count)."""
    return {m: (LlamaCppLoop(gguf_path, m, eos_token_ids, n_ctx=n_ctx) if m.startswith("llama_cpp_loop")
                else LlamaCppArm(gguf_path, m, eos_token_ids, n_ctx=n_ctx)) for m in methods}


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


class LlamaCppLoop:
    """llama.cpp's own greedy decoding through its low-level API: the prompt in one ``llama_decode``, then one
    ``llama_decode`` of one token per step and the argmax of its logits (numpy over the returned row), in a context
    with llama.cpp's default settings. ``llama_cpp_loop_q4_0`` runs the file requantized to Q4_0 first."""

    def __init__(self, gguf_path: str | Path, method: str = "llama_cpp_loop", eos_token_ids: Sequence[int] = (),
                 n_ctx: int = 4096, threads: int | None = None) -> None:
        import numpy as np

        from adaptree.models.ggml import LlamaModel, libllama, requantized

        ll = libllama().ll
        self.method, self.eos, self._ll, self._np = method, {int(t) for t in eos_token_ids}, ll, np
        quant = method.removeprefix("llama_cpp_loop").lstrip("_")
        # its weights in the pages llama.cpp leaves them in: the bar is llama.cpp as it runs for its own users
        self.model = LlamaModel(requantized(gguf_path, quant) if quant else gguf_path, huge_pages=False)
        self.n_vocab = self.model.n_vocab
        threads = threads or torch.get_num_threads()
        cp = ll.llama_context_default_params()
        cp.n_ctx = cp.n_batch = n_ctx
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model.ptr, cp)
        if not self.ctx:
            raise ValueError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self.mem = ll.llama_get_memory(self.ctx)

    def _step(self, ids: list[int]) -> int:
        ll, np = self._ll, self._np
        arr = (ll.llama_token * len(ids))(*ids)
        if ll.llama_decode(self.ctx, ll.llama_batch_get_one(arr, len(ids))) != 0:
            raise RuntimeError(f"llama_decode of {len(ids)} tokens failed")
        return int(np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).argmax())

    def __call__(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingConfig) -> GenerationResult:
        if not sampling.greedy:
            raise ValueError(f"{self.method} decodes greedily only (it is the greedy bar); run it without sampling")
        self._ll.llama_memory_clear(self.mem, True)
        toks: list[int] = []
        stop = "max_new_tokens"
        t0 = time.perf_counter()
        tok = self._step(list(prompt_ids))
        prefill = time.perf_counter() - t0
        while True:
            toks.append(tok)
            if tok in self.eos:
                stop = "eos"
                break
            if len(toks) >= max_new_tokens:
                break
            tok = self._step([tok])
        wall = time.perf_counter() - t0
        return GenerationResult(prompt_len=len(prompt_ids), token_ids=toks, wall_time_s=wall, stop_reason=stop,
                                method=self.method, prefill_s=prefill)

    def __del__(self) -> None:
        ll = getattr(self, "_ll", None)
        if ll is not None and getattr(self, "ctx", None):
            ll.llama_free(self.ctx)  # before the model (``LlamaModel`` frees itself)
            self.ctx = None
