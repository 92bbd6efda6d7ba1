"""Hugging Face checkpoint folders (``config.json`` + safetensors) and strict state-dict loading.

Every model, whatever its file format, is built here: an uninitialised
:class:`~adaptree.models.llama.Transformer` whose state dict is then loaded with ``strict=True`` after
the names and shapes were checked against the Hugging Face layout (:func:`hf_param_shapes`). A tied
``lm_head.weight`` is the only key a checkpoint may leave out. Every problem is a ``ValueError`` that
names the file or the keys at fault (a folder without ``config.json``, a truncated or corrupt
safetensors file, missing/unexpected/misshapen tensors) rather than surfacing later inside a tensor op.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from adaptree.models.config import ModelConfig
from adaptree.models.llama import Transformer
from adaptree.models.tokenizer import TokenizerBundle, unique_ids

__all__ = [
    "check_state_dict",
    "hf_param_shapes",
    "load_hf_folder",
    "load_state_dict_strict",
    "model_from_state_dict",
    "read_safetensors_state_dict",
]

# Checkpoint keys that carry no weights of ours (recomputed buffers some exporters still save).
_IGNORED_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the Hugging Face checkpoint layout for ``cfg``, with its shape.

    This is the schema checkpoints are checked against (independent of how our modules store them);
    ``lm_head.weight`` is listed even for tied models.
    """
    h, hd, inter, vocab = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nq, h), p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h), p + "self_attn.o_proj.weight": (h, nq),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (nq,), p + "self_attn.k_proj.bias": (nkv,),
                           p + "self_attn.v_proj.bias": (nkv,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def _fmt_keys(keys, limit: int = 5) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def check_state_dict(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face-layout ``state_dict`` that the model built from ``cfg`` takes, after
    checking their names, shapes and float dtypes.

    ``ValueError`` (prefixed ``source``) names the missing, unexpected and misshapen keys. A tied model may
    omit ``lm_head.weight`` (and one that is there is dropped); ``rotary_emb.inv_freq`` buffers are dropped.
    """
    sd = {k: v for k, v in state_dict.items() if not _IGNORED_KEYS.search(k)}
    expected = hf_param_shapes(cfg)
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        sd.pop("lm_head.weight", None)  # tied: the embedding is the output projection (as in transformers)
    missing = set(expected) - set(sd)
    unexpected = set(sd) - set(expected)
    mismatched = [f"{k} (checkpoint {tuple(sd[k].shape)} vs model {expected[k]})"
                  for k in sorted(set(expected) & set(sd)) if tuple(sd[k].shape) != expected[k]]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s): {_fmt_keys(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {_fmt_keys(unexpected)}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es): {_fmt_keys(mismatched, 3)}")
        raise ValueError(f"{source}: weights do not match the {cfg.arch} model built from its config: "
                         + "; ".join(parts))
    for k, v in sd.items():
        if not torch.is_floating_point(v):
            raise ValueError(f"{source}: tensor {k} has non-float dtype {v.dtype}")
    return sd


def load_state_dict_strict(model: Transformer, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Load a Hugging Face-layout ``state_dict`` into ``model`` after :func:`check_state_dict`.

    The tensors are adopted (``load_state_dict(assign=True)``), not copied, after a cast to the model's
    dtype and device.
    """
    cfg = model.config
    sd = check_state_dict(cfg, state_dict, source)
    dtype, device = model.dtype, model.device
    for k, v in sd.items():
        sd[k] = v.to(device=device, dtype=dtype).contiguous()
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    # assign=True adopts the (fresh, contiguous) tensors instead of copying them into the empty ones.
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:  # the checkpoint matched the HF layout, so this is our module layout's fault
        raise ValueError(f"{source}: internal error, the model's modules do not accept the Hugging Face "
                         f"layout: {e}") from e
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def _noop_reset(self) -> None:  # replaces nn.Linear/nn.Embedding.reset_parameters while building
    return None


@contextmanager
def _skip_param_init() -> Iterator[None]:
    """Build modules with uninitialized (torch.empty) weights: a random init is a large share of building a
    model on a small CPU (docs/performance.md, "Loading a model") and is overwritten by the checkpoint anyway.
    Strict loading guarantees that every parameter is then written."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = _noop_reset  # type: ignore[method-assign]
    nn.Embedding.reset_parameters = _noop_reset  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def model_from_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor], source: str,
                          max_seq_len: int | None, dtype: torch.dtype) -> Transformer:
    """Build an uninitialised model, load ``sd`` strictly (errors name ``source``), return it in eval
    mode without gradients."""
    with _skip_param_init():
        model = Transformer(cfg, max_seq_len)
    if dtype != torch.float32:
        model = model.to(dtype)
    if cfg.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_state_dict_strict(model, sd, source)
    model.eval()
    model.requires_grad_(False)
    return model


def read_safetensors_state_dict(folder: str | Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``.

    Tensors are cast to ``dtype`` one by one when given. A truncated or corrupt file raises
    ``ValueError`` naming it.
    """
    from safetensors import safe_open

    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} lists shard(s) that are not in the folder: {_fmt_keys(absent)}")
    else:
        others = sorted(p.name for p in folder.glob("*.safetensors")) + sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found: {', '.join(others[:5])})" if others else ""
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json{hint}; "
                         "only safetensors checkpoints are supported")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    if k in out:
                        raise ValueError(f"{f}: tensor {k} appears in more than one shard")
                    t = st.get_tensor(k)
                    out[k] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        except ValueError:
            raise
        except Exception as e:  # safetensors raises SafetensorError / OSError on a bad file
            raise ValueError(f"{f}: cannot read this safetensors file, it looks truncated or corrupt ({e})") from e
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def load_hf_folder(folder: str | Path, dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
                   with_tokenizer: bool = True) -> tuple[Transformer, TokenizerBundle | None]:
    """Load a Hugging Face checkpoint folder (``config.json`` + safetensors) strictly."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        hint = f"; to load a GGUF file pass its path ({', '.join(ggufs[:3])})" if ggufs else ""
        raise ValueError(f"{folder}: no config.json, not a Hugging Face checkpoint folder{hint}")
    hf_cfg = _read_json(cfg_path)
    try:
        cfg = ModelConfig.from_hf_dict(hf_cfg)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{cfg_path}: incomplete config ({e!r})") from e
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from e
    gen_path = folder / "generation_config.json"
    gen_cfg = _read_json(gen_path) if gen_path.is_file() else {}
    sd = read_safetensors_state_dict(folder, dtype=dtype)
    model = model_from_state_dict(cfg, sd, str(folder), max_seq_len, dtype)
    del sd
    if not with_tokenizer:
        return model, None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ValueError(f"{folder}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
    eos = unique_ids(gen_cfg.get("eos_token_id"), cfg.eos_token_id, getattr(tok, "eos_token_id", None))
    bundle = TokenizerBundle(tok, getattr(tok, "chat_template", None) or None, eos)
    return model, bundle
