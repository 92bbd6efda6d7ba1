"""adaptree's EAGLE-3 heads in the drafter format vLLM, SGLang and SpecForge share.

vLLM's ``llama_eagle3.py`` reads a folder with a Llama ``config.json`` (``LlamaForCausalLMEagle3``,
``num_hidden_layers: 1``, ``draft_vocab_size``, ``target_hidden_size``) and one ``model.safetensors`` with the
names adaptree's heads already use (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` as offsets: target
id = i + d2t[i]; ``t2d`` is skipped). Two things differ from adaptree's shipped folders:

- the weights: adaptree ships matrices as int8 rows with per-row scales (half of bfloat16's bytes); vLLM reads
  plain floating tensors, so they are written dequantized, in bfloat16 by default;
- the feature layers: adaptree's head reads the OUTPUTS of the target's decoder layers ``feature_layers``
  (:attr:`adaptree.models.ModelConfig.feature_layers`: 1, L//2-1, L-4); vLLM's
  ``eagle_aux_hidden_state_layer_ids`` name layers whose INPUT it taps (``hidden_states + residual`` before layer
  i runs), so the ids written are adaptree's plus one (SmolLM2's 30 layers: 1, 14, 26 -> 2, 15, 27, vLLM's own
  default for EAGLE-3). ``tests/test_vllm_export.py`` checks the shift on a Hugging Face forward, whose
  ``hidden_states[i]`` is that same layer input.

The target's embeddings are not written: vLLM shares the target's when a drafter checkpoint has none.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from adaptree.models.config import ModelConfig
from adaptree.models.eagle3 import ARCHITECTURE, Eagle3Head

LAYER_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def vllm_layer_ids(target: ModelConfig) -> list[int]:
    """The target layers vLLM taps for a head trained on adaptree's features of ``target`` (vLLM's indexing)."""
    return [layer + 1 for layer in target.feature_layers]


def target_folder(model: str | os.PathLike | None = None, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The Hugging Face folder vLLM loads for ``model``: a registered name's or a GGUF file's cached float form
    (converted on first use), or the folder itself."""
    from adaptree.models.assets import is_gguf_model, resolve_model
    from adaptree.models.loader import float_cache_folder

    if is_gguf_model(model):
        return float_cache_folder(model, dtype)
    path = Path(resolve_model(model))
    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").is_file():
        raise ValueError(f"model {str(model)!r}: no config.json in {folder}; vLLM loads a Hugging Face folder or, "
                         "through adaptree, a GGUF file's converted form")
    return folder


def target_config(folder: str | os.PathLike) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face folder's ``config.json``."""
    path = Path(folder) / "config.json"
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text(encoding="utf-8")))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def export_head(head: str | os.PathLike, target: ModelConfig, out: str | os.PathLike,
                dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the head folder ``head`` (adaptree's, a released or a SpecForge one) as a vLLM EAGLE-3 drafter in
    ``out``, for ``target``; returns ``out``. The head is read with :meth:`Eagle3Head.read_checked` (the loader's
    strict checks) and must fit the target (hidden size, vocabulary); a head whose config already names feature
    layers must name the ones adaptree's target features come from."""
    if dtype not in EXPORT_DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype}")
    from safetensors.torch import save_file

    cfg, sd = Eagle3Head.read_checked(head)
    if cfg.target_hidden_size != target.hidden_size:
        raise ValueError(f"the head in {head} reads target features of width {cfg.target_hidden_size}; the target's "
                         f"hidden_size is {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"the head in {head} has vocab_size {cfg.vocab_size}; the target's is {target.vocab_size}")
    ids = vllm_layer_ids(target)
    named = (cfg.eagle_config or {}).get(LAYER_IDS_KEY)
    if named is not None and list(named) != ids:
        raise ValueError(f"the head in {head} names feature layers {list(named)} (vLLM's indexing); adaptree's "
                         f"features of this target are vLLM's {ids}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items() if k != "t2d"}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    hf = cfg.to_hf_dict()
    hf.update({
        "architectures": [ARCHITECTURE],
        "target_hidden_size": cfg.target_hidden_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        LAYER_IDS_KEY: ids,
        "eagle_config": {**(cfg.eagle_config or {}), LAYER_IDS_KEY: ids, "use_aux_hidden_state": True},
        "torch_dtype": str(dtype).removeprefix("torch."),
    })
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    return out


def export_for_vllm(out: str | os.PathLike, model: str | os.PathLike | None = None,
                    head: str | os.PathLike = "auto", dtype: torch.dtype = torch.bfloat16) -> tuple[Path, Path]:
    """``adaptree export-head``: the drafter folder ``out`` for ``model``'s head (``"auto"``: the one adaptree
    ships for a registered model) and the target folder vLLM loads next to it (converted on first use for a GGUF
    model). Returns ``(out, target folder)``."""
    head = resolve_head(model, head)
    folder = target_folder(model, dtype)
    return export_head(head, target_config(folder), out, dtype), folder


def resolve_head(model: str | os.PathLike | None, head: str | os.PathLike) -> Path:
    """``head``, or for ``"auto"`` the head adaptree ships for ``model`` (a ValueError naming the model if none)."""
    from adaptree.models.assets import shipped_head

    if head != "auto":
        return Path(head)
    found = shipped_head(model)
    if found is None:
        raise ValueError(f"adaptree ships no head for model {str(model)!r}; pass --head FOLDER "
                         "(adaptree train-head trains one)")
    return found
