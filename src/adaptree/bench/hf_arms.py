"""External reference arms for ``adaptree bench``: Hugging Face transformers ``generate`` on the same weights.

- ``hf_generate``: plain greedy (or sampled) autoregressive ``generate``;
- ``hf_prompt_lookup``: its prompt-lookup decoding (n-gram drafts copied from the prompt);
- ``hf_assisted``: its assisted generation with a smaller same-tokenizer draft model (for
  Qwen2.5-Coder-1.5B the 0.5B model; any other pair via ``--assistant-model``).

They show our autoregressive baseline is not a straw man and place adaptree among what a user would
otherwise pick. Each arm returns a :class:`~adaptree.core.records.GenerationResult` (no cycles: transformers
does not expose them) with the EOS token kept, as the engine does, so tokens are counted alike.

The bench runs them in one worker process (:mod:`adaptree.bench.isolation`, :func:`hf_recipe`), which loads the
bench's model again (checked to hold the same weights) and shares one transformers copy among the arms.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from adaptree.bench.isolation import ArmRecipe
from adaptree.core.records import GenerationResult
from adaptree.core.verify import SamplingConfig

if TYPE_CHECKING:
    from adaptree.bench.runner import BenchConfig
    from adaptree.core.pipeline import PipelineLike

HF_METHODS = ("hf_generate", "hf_prompt_lookup", "hf_assisted")


def hf_twin(target):
    """A transformers model carrying exactly our target's weights (same dtype, same device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(target.config.to_hf_dict())
    model_type = cfg.pop("model_type")
    cfg.pop("architectures", None)
    hf_cfg = AutoConfig.for_model(model_type, **cfg)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=target.dtype).eval()
    missing, unexpected = model.load_state_dict(target.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and target.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto transformers' model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(target.device)


class HFArm:
    """One transformers ``generate`` configuration, called like an engine arm.

    :param model: a transformers causal LM (see :func:`hf_twin`).
    :param method: one of :data:`HF_METHODS`.
    :param eos_token_ids: generation stops after any of these (kept in the output, as in the engine).
    :param assistant: the draft model for ``hf_assisted``.
    :param prompt_lookup_tokens: draft length of prompt lookup (transformers' documented example: 10).
    """

    def __init__(self, model, method: str, eos_token_ids: Sequence[int] = (), assistant=None,
                 prompt_lookup_tokens: int = 10) -> None:
        if method not in HF_METHODS:
            raise ValueError(f"unknown Hugging Face arm {method!r}; available: {', '.join(HF_METHODS)}")
        if method == "hf_assisted" and assistant is None:
            raise ValueError("hf_assisted needs an assistant (draft) model with the same tokenizer")
        self.model, self.method, self.assistant = model, method, assistant
        self.eos = [int(t) for t in eos_token_ids]
        self.prompt_lookup_tokens = prompt_lookup_tokens
        for m in (model, assistant):
            if m is not None:
                m.generation_config.eos_token_id = self.eos or None
                m.generation_config.pad_token_id = self.eos[0] if self.eos else 0

    def __call__(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingConfig) -> GenerationResult:
        x = torch.tensor([list(prompt_ids)], device=self.model.device)
        kw: dict = {"max_new_tokens": max_new_tokens, "attention_mask": torch.ones_like(x)}
        if sampling.greedy:
            kw["do_sample"] = False
        else:
            kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        if self.method == "hf_prompt_lookup":
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup_tokens
        elif self.method == "hf_assisted":
            kw["assistant_model"] = self.assistant
        t0 = time.perf_counter()
        with torch.inference_mode():
            y = self.model.generate(x, **kw)
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        wall = time.perf_counter() - t0
        toks = y[0, x.shape[1]:].tolist()
        stop = "max_new_tokens"
        for i, t in enumerate(toks):  # keep up to and including the first EOS (nothing is padded at batch 1)
            if t in self.eos:
                toks, stop = toks[: i + 1], "eos"
                break
        return GenerationResult(prompt_len=len(prompt_ids), token_ids=toks, wall_time_s=wall, stop_reason=stop,
                                method=self.method)


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A digest of every tensor's name, shape, dtype and first 4096 values: tells two loads of a model apart
    without hashing gigabytes."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        head = t.detach().reshape(-1)[:4096].contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(head.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def hf_recipe(method: str, cfg: BenchConfig, pipeline: PipelineLike) -> ArmRecipe:
    """How the bench's worker builds ``method`` (:func:`build_hf_arms`); bad input fails here, in the bench's
    process. Every Hugging Face arm of a bench shares the recipe, hence one worker and one copy of the weights."""
    if pipeline.weights != "float":
        raise ValueError(f"the {method} arm copies the float weights into transformers: use --weights float, not "
                         f"{pipeline.weights}")
    assistant = None
    if "hf_assisted" in cfg.methods:
        from adaptree.models import MODELS, sibling_draft_model

        assistant = cfg.assistant_model or sibling_draft_model(pipeline.model)
        if assistant is None:
            pairs = {n: m.draft_model for n, m in MODELS.items() if m.draft_model}
            raise ValueError(f"hf_assisted needs a same-tokenizer draft model: pass --assistant-model "
                             f"(registered pairs: {pairs})")
    return ArmRecipe(build_hf_arms, {"model": pipeline.model, "dtype": pipeline.dtype,
                                     "max_seq_len": pipeline.max_seq_len,
                                     "eos_token_ids": [int(t) for t in pipeline.tokenizer.eos_token_ids],
                                     "assistant_model": assistant,
                                     "fingerprint": weights_fingerprint(pipeline.target),
                                     "device": str(pipeline.target.device)}, group="hf")


def build_hf_arms(methods: Sequence[str], model: str | None, dtype: torch.dtype, max_seq_len: int | None,
                  eos_token_ids: Sequence[int], assistant_model: str | None, fingerprint: str,
                  device: str = "cpu") -> dict[str, HFArm]:
    """The Hugging Face arms ``methods`` on ``model`` loaded again (in a worker process), sharing one transformers
    copy of it on ``device`` (the bench pipeline's). ``fingerprint`` (:func:`weights_fingerprint` of the bench's
    model) must match what loaded: the reference arms run on exactly the bench's weights."""
    from adaptree.models import load_model

    target, _ = load_model(model, dtype=dtype, max_seq_len=max_seq_len)
    if weights_fingerprint(target) != fingerprint:
        raise ValueError(f"model {model or 'default'!r} loaded in the Hugging Face arms' worker holds other weights "
                         "than the bench's model: load the bench's pipeline with adaptree.load")
    hf = hf_twin(target).to(device)
    del target
    assistant = hf_twin(load_model(assistant_model, dtype=dtype)[0]).to(device) if assistant_model else None
    return {m: HFArm(hf, m, eos_token_ids, assistant=assistant if m == "hf_assisted" else None) for m in methods}
