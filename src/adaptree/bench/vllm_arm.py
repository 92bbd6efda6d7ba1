"""vLLM as reference arms of ``adaptree bench``, one prompt at a time beside the engine's methods, and N at once
with ``--streams N`` (:mod:`adaptree.bench.streams`; several N in one run: ``adaptree vllm-bench``; docs/vllm.md).

- ``vllm``: vLLM's plain decoding;
- ``vllm_ngram``: its n-gram drafts, 3 per step;
- ``vllm_eagle3``: adaptree's head exported for vLLM, a fixed 3 drafts per step (the fastest fixed lengths for
  SmolLM2 and Qwen2.5-Coder-0.5B on 2 CPU cores were 2-3; ``adaptree vllm-bench`` measures the grid);
- ``vllm_costaware``: the same head with adaptree's cost-aware controller deciding each step's drafts (up to 5),
  from vLLM's step costs on this machine (measured on first use, minutes, cached);
- ``vllm_hybrid``: the same, each request verifying the context's chain in place of the head's drafts where that is
  worth more (adaptree's ``hybrid``);
- ``vllm_static-gs``: the fixed length a grid search on vLLM measured fastest at the step's batch size;
- ``vllm_deagle``, ``vllm_radar``, ``vllm_ltd``: costaware's drafts, each request's chain verified up to where
  DEAGLE's vote, RADAR's policy or LTD's depth policy (the policies shipped with the head) stops it, from the
  drafter's log-probs.

Each arm runs in a worker process of its own (:mod:`adaptree.bench.isolation`): vLLM sets process-wide state
(its OpenMP threads, its engine core). The target is the model's Hugging Face folder vLLM loads (a GGUF model's
cached float form, in the bench's dtype: bfloat16 or float32); vLLM runs it in eager mode on the bench's threads.
vLLM reports no cycles, so these rows have no τ (``adaptree vllm-bench`` reports vLLM's own acceptance counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from adaptree.bench.isolation import ArmRecipe
from adaptree.core.records import GenerationResult
from adaptree.core.verify import SamplingConfig
from adaptree.vllm_plugin.control import COSTED_CONTROLLERS

if TYPE_CHECKING:
    from adaptree.bench.runner import BenchConfig
    from adaptree.core.pipeline import PipelineLike

CONTROLLED = tuple(f"vllm_{c}" for c in COSTED_CONTROLLERS)
"""The arms whose drafts adaptree's controller decides, from vLLM's step costs on this machine."""
VLLM_METHODS = ("vllm", "vllm_ngram", "vllm_eagle3", *CONTROLLED)
DRAFTS = {"vllm": 0, "vllm_ngram": 3, "vllm_eagle3": 3, **dict.fromkeys(CONTROLLED, 5)}
"""Drafts per step (the cap, for adaptree's controllers)."""


def vllm_recipe(method: str, cfg: BenchConfig, pipeline: PipelineLike) -> ArmRecipe:
    """How the bench's worker builds ``method``; a missing vLLM, head or unsupported dtype fails here."""
    import torch

    from adaptree.vllm_plugin.engine import vllm_available

    if not vllm_available():
        raise ValueError(f"the {method} arm needs vLLM: pip install 'adaptree[vllm]' (or bash scripts/setup.sh --vllm)")
    dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(pipeline.dtype)
    if dtype is None:
        raise ValueError(f"the {method} arm runs vLLM in bfloat16 or float32; the bench's dtype is {pipeline.dtype}")
    head = None
    if method in ("vllm_eagle3", *CONTROLLED):
        if pipeline.head_folder is None:
            raise ValueError(f"the {method} arm drafts with a head; this bench has none (--draft)")
        head = str(pipeline.head_folder)
    return ArmRecipe(build_vllm_arm, {"model": pipeline.model, "head": head, "dtype": dtype,
                                      "max_model_len": pipeline.engine.max_len, "max_num_seqs": cfg.streams})


def build_vllm_arm(methods: Sequence[str], model: str | None, head: str | None, dtype: str,
                   max_model_len: int, max_num_seqs: int = 1) -> dict:
    """The vLLM arms ``methods`` (in a worker process, one engine each: the recipe's group is the arm's own)."""
    return {m: VllmArm(m, model, head, dtype, max_model_len, max_num_seqs) for m in methods}


class VllmArm:
    """One vLLM configuration, called like an engine arm with one prompt's ids, or with ``[prompts, N]`` to serve
    them N at once (``adaptree bench --streams N``: :mod:`adaptree.bench.streams`), returning a
    :class:`~adaptree.vllm_plugin.engine.BatchResult`."""

    def __init__(self, method: str, model: str | None, head: str | None, dtype: str, max_model_len: int,
                 max_num_seqs: int = 1) -> None:
        import torch

        from adaptree.bench.vllm_bench import vllm_arm
        from adaptree.vllm_plugin.cache import prepared_head, prepared_step_costs
        from adaptree.vllm_plugin.engine import generate_batch, make_llm
        from adaptree.vllm_plugin.export import target_folder

        if method not in VLLM_METHODS:
            raise ValueError(f"unknown vLLM arm {method!r}; available: {', '.join(VLLM_METHODS)}")
        k = DRAFTS[method]
        threads = torch.get_num_threads()
        exported = costs = None
        if method in ("vllm_eagle3", *CONTROLLED):
            exported = str(prepared_head(model, head, dtype))
        if method in CONTROLLED:
            costs = str(prepared_step_costs(model, Path(exported), dtype, k, threads))
        # the same vLLM configurations as adaptree vllm-bench's arms of these names and K
        arm = vllm_arm(f"{method}:{k}" if k else method, exported, costs, head, model)
        self.method = method
        self.llm = make_llm(target_folder(model, getattr(torch, dtype)), arm, dtype=dtype,
                            max_model_len=max_model_len, threads=threads, max_num_seqs=max_num_seqs)
        self._generate = generate_batch
        self._generate(self.llm, [[1, 2, 3]], 8)  # warm-up

    def __call__(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingConfig) -> GenerationResult:
        if prompt_ids and isinstance(prompt_ids[0], list):  # [prompts, N]
            prompts, streams = prompt_ids
            return self._generate(self.llm, prompts, max_new_tokens, temperature=sampling.temperature or 0.0,
                                  seed=sampling.seed or 0, streams=streams)
        res = self._generate(self.llm, [list(prompt_ids)], max_new_tokens, temperature=sampling.temperature or 0.0,
                             seed=sampling.seed or 0)
        out = res.outputs[0]
        return GenerationResult(prompt_len=len(prompt_ids), token_ids=out, wall_time_s=res.wall_s,
                                stop_reason="max_new_tokens" if len(out) >= max_new_tokens else "eos",
                                method=self.method)
