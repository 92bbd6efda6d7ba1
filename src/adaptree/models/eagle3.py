"""The EAGLE-3 draft head, checkpoint-compatible with the released heads and SpecForge exports.

A released head (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, or a SpecForge ``LlamaForCausalLMEagle3``
export) is a folder with a Llama-style ``config.json`` (``num_hidden_layers: 1`` plus ``draft_vocab_size``
and, where the head is narrower or wider than the target, ``target_hidden_size``) and one weight file
(``model.safetensors`` or ``pytorch_model.bin``) holding::

    embed_tokens.weight                    [vocab, H]        optional: else the target's embeddings
    fc.weight                              [H, 3*H_t]        fuses the target's low/mid/high features
    midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]           attention reads [emb ; hidden], 2H wide
    midlayer.self_attn.o_proj.weight       [H, heads*hd]
    midlayer.mlp.{gate,up,down}_proj.weight
    midlayer.{hidden_norm,input_layernorm,post_attention_layernorm}.weight
    norm.weight, lm_head.weight            [draft_vocab, H]
    d2t  int64 [draft_vocab]   target_id = draft_id + d2t[draft_id]
    t2d  bool  [vocab]         True for target ids that are in the draft vocabulary

The decoder layer, as the public code has it (SafeAILab/EAGLE ``eagle/model/cnets.py``,
``LlamaDecoderLayeremb.forward``, and SpecForge ``specforge/modeling/draft/llama3_eagle.py``,
``LlamaDecoderLayer.forward``; both read via the search tool)::

    residual = h                                            # the UN-normed hidden (after fc)
    x = cat([input_layernorm(emb), hidden_norm(h)], -1)     # EMBEDDINGS FIRST, then the hidden
    h = residual + o_proj(attn(x))
    h = h + mlp(post_attention_layernorm(h))

SPEC.md §1 writes the concatenation as ``[hidden_norm(h) ; input_layernorm(emb)]``; the released code
concatenates the embeddings first, and that order is what the checkpoints' q/k/v columns were trained
with, so it is the order used here (``tests/test_eagle3.py`` pins it against a hand-written reference).
The output fed back as the next draft step's ``hidden`` is the pre-final-norm output of the layer;
logits are ``lm_head(norm(out))``. ``fc`` is applied only when the input is the target's 3*H_t wide
features (the released code applies it whenever the width differs from the embeddings').

Rotary positions follow the config's ``rope_theta`` (10000 when absent, as in the released
EAGLE-3 LLaMA-3.1 head) and ``rope_scaling`` (default, linear or llama3).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adaptree.models.llama import (
    MLP,
    Attention,
    KVCache,
    RMSNorm,
    Rotary,
    Transformer,
    build_attn_mask,
    cpu_max,
    rope_inv_freq,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"
_ACCEPTED_ARCHITECTURES = (ARCHITECTURE, "LlamaForCausalLM")  # the latter: EAGLE's own training config
_EMBED_KEY = "embed_tokens.weight"


# --------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------


@dataclass
class Eagle3Config:
    """Shape and numerics of an EAGLE-3 draft head; converts to/from the released ``config.json``."""

    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    """Per-head width; ``hidden_size // num_attention_heads`` when None."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """None, or ``{"rope_type": "linear" | "llama3", ...}`` as in Hugging Face configs."""
    max_position_embeddings: int = 2048
    """Informational (the released heads say 2048 and run at longer contexts); rotary tables grow on demand."""
    vocab_size: int = 128256
    """The TARGET's vocabulary size (length of ``t2d``, rows of ``embed_tokens``)."""
    draft_vocab_size: int = 32000
    """Rows of ``lm_head`` (length of ``d2t``)."""
    target_hidden_size: int | None = None
    """Hidden size of the target model; ``fc`` reads ``3 * target_hidden_size``. Defaults to ``hidden_size``."""
    eagle_config: dict[str, Any] | None = field(default=None, compare=False)
    """Optional ``eagle_config`` block of SpecForge/sglang configs, kept verbatim for round trips. Its
    ``eagle_aux_hidden_state_layer_ids`` (if any) name the target layers the head was trained on, in the
    serving engine's convention; this module does not interpret them."""

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Eagle3Config.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Eagle3Config.num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"Eagle3Config.hidden_size ({self.hidden_size}) is not divisible by "
                                 f"num_attention_heads ({self.num_attention_heads}); set head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0 \
                or self.head_dim % 2:
            raise ValueError(f"Eagle3Config.head_dim must be a positive even integer, got {self.head_dim!r}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"Eagle3Config.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"Eagle3Config.rope_theta must be > 0, got {self.rope_theta!r}")
        self.rope_theta = float(self.rope_theta)
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ValueError(f"Eagle3Config.rope_scaling must be a dict or None, got {self.rope_scaling!r}")
            try:
                rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
            except (KeyError, TypeError) as exc:
                raise ValueError(f"Eagle3Config.rope_scaling {self.rope_scaling!r} is incomplete: "
                                 f"missing or bad field {exc}") from None
            except ValueError as exc:
                raise ValueError(f"Eagle3Config.rope_scaling: {exc}") from None
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"Eagle3Config.draft_vocab_size ({self.draft_vocab_size}) exceeds "
                             f"vocab_size ({self.vocab_size})")
        if 3 * self.target_hidden_size == self.hidden_size:
            # forward() tells target features (3*H_t wide) from its own output (H wide) by width.
            raise ValueError(f"Eagle3Config: 3 * target_hidden_size ({self.target_hidden_size}) equals "
                             f"hidden_size ({self.hidden_size}); the two inputs of forward() would be ambiguous")
        if self.eagle_config is not None:
            if not isinstance(self.eagle_config, dict):
                raise ValueError(f"Eagle3Config.eagle_config must be a dict, got {self.eagle_config!r}")
            ids = self.eagle_config.get("eagle_aux_hidden_state_layer_ids")
            if ids is not None and len(ids) != 3:
                raise ValueError(f"Eagle3Config.eagle_config.eagle_aux_hidden_state_layer_ids has {len(ids)} "
                                 f"entries ({ids!r}); this head fuses exactly 3 target layers")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "Eagle3Config":
        """Build from a released / SpecForge ``config.json`` dictionary (a LlamaConfig plus draft fields)."""
        if not isinstance(cfg, dict):
            raise ValueError(f"an EAGLE-3 config must be a JSON object, got {type(cfg).__name__} {cfg!r:.80}")
        if "speculators_config" in cfg or "transformer_layer_config" in cfg:
            raise ValueError("this is a 'speculators' (Eagle3Speculator) config; only the EAGLE/SpecForge "
                             f"{ARCHITECTURE} layout is supported")
        archs = cfg.get("architectures") or []
        if archs and not any(a in _ACCEPTED_ARCHITECTURES for a in archs):
            raise ValueError(f"unsupported draft architecture {archs!r}; expected {ARCHITECTURE}")
        model_type = cfg.get("model_type", "llama")
        if model_type != "llama":
            raise ValueError(f"unsupported draft model_type {model_type!r}; expected 'llama'")
        layers = cfg.get("num_hidden_layers", 1)
        if layers != 1:
            raise ValueError(f"num_hidden_layers={layers!r}: an EAGLE-3 head has exactly 1 decoder layer")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ValueError(f"{flag}=true is not supported by the EAGLE-3 head layout")
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # transformers >= 5 layout
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", rope_params.get("type", "default")) != "default":
                rope_scaling = rope_params
        if isinstance(rope_scaling, dict) and \
                rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
            rope_scaling = None
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if name not in cfg:
                raise ValueError(f"EAGLE-3 config.json lacks required field {name!r}")
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim"),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta) if rope_theta is not None else 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size"),
            eagle_config=cfg.get("eagle_config"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The released ``config.json`` form (loadable by EAGLE, SpecForge and transformers' LlamaConfig)."""
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "tie_word_embeddings": False,
            "pretraining_tp": 1,
            "use_cache": True,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
        }
        # EAGLE's loader treats the mere presence of target_hidden_size as "embeddings are in the
        # checkpoint", so it is written only when the head's width differs from the target's.
        if self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.eagle_config is not None:
            out["eagle_config"] = dict(self.eagle_config)
        return out


# --------------------------------------------------------------------------------------------------
# vocabulary mapping
# --------------------------------------------------------------------------------------------------


def _read_config(path: str) -> dict[str, Any]:
    """A head's ``config.json``; a ValueError naming the file when it is not a JSON object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (the head's config), got {type(data).__name__} "
                         f"{data!r:.80}")
    return data


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced draft vocabulary from target-token frequency counts.

    Keeps the ``draft_vocab_size`` most frequent target ids (ties and never-seen ids: lower id first),
    sorted ascending by id. Returns ``(d2t, t2d)``: ``d2t`` int64 ``[draft_vocab_size]`` offsets with
    ``target_id = draft_id + d2t[draft_id]``, ``t2d`` bool ``[len(counts)]`` marking the kept ids.
    """
    counts = torch.as_tensor(counts).detach().to("cpu")
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts must be a non-empty 1-D tensor over the target vocabulary, "
                         f"got shape {tuple(counts.shape)}")
    if counts.is_floating_point() and not bool(torch.isfinite(counts).all()):
        raise ValueError("counts contains non-finite values")
    if bool((counts < 0).any()):
        raise ValueError("counts contains negative values")
    vocab = counts.numel()
    if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, int) \
            or not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be an integer in [1, {vocab}], got {draft_vocab_size!r}")
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = torch.sort(order[:draft_vocab_size]).values.to(torch.int64)
    d2t = chosen - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


# --------------------------------------------------------------------------------------------------
# the head
# --------------------------------------------------------------------------------------------------


class Eagle3DecoderLayer(nn.Module):
    """The head's single decoder layer; attention reads ``[input_layernorm(emb) ; hidden_norm(h)]``."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        # llama.py's Attention reads only these fields of its config.
        attn_cfg = SimpleNamespace(hidden_size=cfg.hidden_size, head_dim=cfg.head_dim,
                                   num_attention_heads=cfg.num_attention_heads,
                                   num_key_value_heads=cfg.num_key_value_heads,
                                   attention_bias=False, qk_norm=False, rms_norm_eps=cfg.rms_norm_eps)
        self.self_attn = Attention(attn_cfg, in_dim=2 * cfg.hidden_size)  # type: ignore[arg-type]
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, emb: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """``slots``: the new positions' cache slots on the device, ``mask`` then covering the cache's whole buffer
        (a fixed-shape step, :meth:`Eagle3Head.step_fixed`); default: written at ``cache.length``."""
        # Order verified against SafeAILab/EAGLE cnets.py and SpecForge llama3_eagle.py: embeddings first;
        # the residual is the un-normed h.
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)
        kv = (cache.k[0], cache.v[0]) if cache is not None else None
        start = slots if slots is not None else cache.length if cache is not None else 0
        h = h + self.self_attn(x, cos, sin, kv, start, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """EAGLE-3 draft head with the released checkpoints' parameter names.

    Embeddings are either the head's own (``embed_tokens``, registered, saved, frozen) or borrowed from the
    target with :meth:`attach_embeddings`: a borrowed weight is not a parameter or buffer of the head, so
    ``state_dict()``, ``parameters()`` and ``.to()`` leave the target's tensor alone.
    """

    def __init__(self, config: Eagle3Config, with_embeddings: bool = True, max_seq_len: int | None = None) -> None:
        super().__init__()
        cfg = config
        self.config = cfg
        if with_embeddings:
            self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens.weight.requires_grad_(False)
        else:
            self.register_module("embed_tokens", None)
        self._borrowed_embedding: torch.Tensor | None = None
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Default map: the first draft_vocab_size target ids (what build_vocab_map gives for flat counts).
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)
        # Rotary tables start at this length and grow on demand (the released heads claim 2048 positions).
        self._rope_len = max_seq_len or max(2048, min(cfg.max_position_embeddings, 8192))
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, self._rope_len)

    # ---- properties -------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def attn_dtype(self) -> torch.dtype:
        """The dtype of rotary, the KV cache and attention (``llama.set_attention_dtype``; default: :attr:`dtype`)."""
        return self.midlayer.self_attn.attn_dtype or self.dtype

    @property
    def embedding_weight(self) -> torch.Tensor | None:
        """The ``[vocab, H]`` embedding table in use (own or borrowed), None when there is none."""
        if self.embed_tokens is not None:
            return self.embed_tokens.weight
        return self._borrowed_embedding

    @property
    def has_own_embeddings(self) -> bool:
        return self.embed_tokens is not None

    # ---- embeddings -------------------------------------------------------------------------------

    def attach_embeddings(self, weight: torch.Tensor) -> None:
        """Use ``weight`` (``[vocab_size, hidden_size]``, usually the target's ``embed_tokens.weight``).

        The tensor is borrowed, not copied: it stays where it is (device and dtype) and is not part of the
        head's state. Replaces the head's own embeddings, if it had any.
        """
        cfg = self.config
        if weight.dim() != 2 or tuple(weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"embeddings of shape {tuple(weight.shape)} do not fit the head: expected "
                             f"[vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}]")
        if self.embed_tokens is not None:
            self.embed_tokens = None
        # object.__setattr__: nn.Module would register a Parameter assigned as an attribute.
        object.__setattr__(self, "_borrowed_embedding", weight)

    def _embed(self, input_ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            emb = self.embed_tokens(input_ids)
        elif self._borrowed_embedding is not None:
            w = self._borrowed_embedding
            emb = F.embedding(input_ids.to(w.device), w)
        else:
            raise ValueError("the EAGLE-3 head has no embeddings: load them from a checkpoint or call "
                             "attach_embeddings(target.model.embed_tokens.weight)")
        return emb.to(device=like.device, dtype=like.dtype)

    # ---- rotary -----------------------------------------------------------------------------------

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin at ``position_ids``, the table grown past the largest: read on the CPU; on an accelerator (reading
        it would wait for the device every draft step) ``bound``, the cache's length plus the new positions, which
        bounds every position the engine and the trainer pass (a tree level's positions are L + depth)."""
        top = cpu_max(position_ids)
        need = top + 1 if top is not None else bound
        cos = self.rotary.cos
        if cos.is_meta or need > self._rope_len or cos.device != position_ids.device or cos.dtype != torch.float32:
            if need > self._rope_len:
                self._rope_len = 1 << (need - 1).bit_length()
            cfg = self.config
            self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                 self._rope_len).to(position_ids.device)
        return self.rotary(position_ids, dtype)

    # ---- forward ----------------------------------------------------------------------------------

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """A one-layer KV cache for ``max_len`` positions in the head's dtype/device."""
        cfg = self.config
        return KVCache(1, cfg.num_key_value_heads, cfg.head_dim, max_len, self.attn_dtype, self.device, batch)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, tree_mask: torch.Tensor | None = None,
                logits_at: torch.Tensor | slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over ``T`` new positions.

        :param hidden: ``[B, T, 3*target_hidden]`` target features (``fc`` is applied) or ``[B, T, H]``,
            the head's own previous ``out_hidden`` (no ``fc``).
        :param input_ids: ``[B, T]`` target-vocabulary token ids (the token after each feature position).
        :param position_ids: ``[T]`` or ``[B, T]``; default consecutive after the cache.
        :param cache: the head's KV cache; the new keys are written at ``cache.length`` and it advances.
        :param tree_mask: bool ``[T, K]`` over the last K key slots (see ``llama.build_attn_mask``);
            None means causal among the new positions.
        :param logits_at: index or slice into the T positions; logits only there (default: all).
        :returns: ``(out_hidden [B, T, H], logits [B, T', draft_vocab])``; ``out_hidden`` is the pre-norm
            output to feed back as the next step's ``hidden``.
        """
        cfg = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (b, t):
            raise ValueError(f"hidden of shape {tuple(hidden.shape)} does not match input_ids [B={b}, T={t}]")
        width = hidden.shape[-1]
        hidden = hidden.to(device=self.device, dtype=self.dtype)
        if width == self.fc.in_features:
            h = self.fc(hidden)
        elif width == cfg.hidden_size:
            h = hidden
        else:
            raise ValueError(f"hidden width {width} is neither 3*target_hidden_size ({self.fc.in_features}) "
                             f"nor hidden_size ({cfg.hidden_size})")
        past = cache.length if cache is not None else 0
        if cache is not None:
            cache.check_room(t)
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=h.device)
        position_ids = position_ids.to(h.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        cos, sin = self._rope(position_ids, self.attn_dtype, past + t)
        mask = build_attn_mask(past, tree_mask, t, h.device)
        emb = self._embed(input_ids, h)
        out = self.midlayer(emb, h, cos, sin, cache, mask)
        if cache is not None:
            cache.length = past + t
        sel = out if logits_at is None else out[:, logits_at]
        return out, self.lm_head(self.norm(sel))

    def step_fixed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, slots: torch.Tensor,
                   mask: torch.Tensor, cache: KVCache, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with shapes that depend on nothing but its inputs' (a CUDA graph can replay it,
        :class:`adaptree.core.graphs.StepGraphs`): ``hidden [1, T, 3H or H]`` and ``input_ids [1, T]`` at rotary
        ``position_ids [T]``, keys and values written at cache ``slots [T]``, attention over the cache's whole
        buffer under the boolean ``mask [T, cache.max_len]``; ``cache.length`` is left alone, and the rotary table
        must already hold every position (:meth:`reserve_positions`). Returns ``(out_hidden, logits)`` for all T."""
        h = self.fc(hidden) if hidden.shape[-1] == self.fc.in_features else hidden
        cos, sin = self.rotary(position_ids[None], self.attn_dtype)
        out = self.midlayer(self._embed(input_ids, h), h, cos, sin, cache, mask[None, None], slots)
        return out, self.lm_head(self.norm(out))

    def reserve_positions(self, n: int) -> None:
        """Grow the rotary table to hold positions ``0 .. n-1`` now (a captured step must not replace it)."""
        self._rope(torch.full((1, 1), n - 1, dtype=torch.long, device=self.device), self.attn_dtype, n)

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids (``id + d2t[id]``)."""
        return ids + self.d2t[ids]

    # ---- construction -----------------------------------------------------------------------------

    @classmethod
    def init_for_target(cls, target: Transformer, draft_vocab_size: int, token_counts: torch.Tensor | None = None,
                        *, hidden_size: int | None = None, intermediate_size: int | None = None,
                        num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                        head_dim: int | None = None, init_std: float = 0.02, seed: int | None = None,
                        dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "Eagle3Head":
        """A freshly initialised head for ``target``.

        Shapes default to the target's (hidden size, heads, KV heads, head_dim, intermediate size); rotary
        settings and norm eps are the target's. The embeddings are borrowed from the target when the widths
        match (otherwise the head gets its own, randomly initialised). ``d2t``/``t2d`` come from
        :func:`build_vocab_map` over ``token_counts`` (first ids when None). Linear weights are drawn from
        N(0, ``init_std``), norms are ones (Hugging Face's Llama initialisation).
        """
        tc = target.config
        hidden = hidden_size or tc.hidden_size
        if head_dim is None and hidden_size is None and num_attention_heads is None:
            head_dim = tc.head_dim
        cfg = Eagle3Config(
            hidden_size=hidden,
            intermediate_size=intermediate_size or tc.intermediate_size,
            num_attention_heads=num_attention_heads or tc.num_attention_heads,
            num_key_value_heads=num_key_value_heads or tc.num_key_value_heads,
            head_dim=head_dim,
            rms_norm_eps=tc.rms_norm_eps,
            rope_theta=tc.rope_theta,
            rope_scaling=tc.rope_scaling,
            max_position_embeddings=tc.max_position_embeddings,
            vocab_size=tc.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=tc.hidden_size,
        )
        if token_counts is not None and torch.as_tensor(token_counts).numel() != tc.vocab_size:
            raise ValueError(f"token_counts has {torch.as_tensor(token_counts).numel()} entries, "
                             f"the target vocabulary {tc.vocab_size}")
        counts = torch.zeros(tc.vocab_size) if token_counts is None else token_counts
        d2t, t2d = build_vocab_map(counts, draft_vocab_size)
        share = hidden == tc.hidden_size
        head = cls(cfg, with_embeddings=not share)
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for module in head.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, init_std, generator=gen)
                elif isinstance(module, nn.Embedding):
                    module.weight.normal_(0.0, init_std, generator=gen)
                elif isinstance(module, RMSNorm):
                    module.weight.fill_(1.0)
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
        head.to(device=device if device is not None else target.device,
                dtype=dtype if dtype is not None else target.dtype)
        if share:
            head.attach_embeddings(target.model.embed_tokens.weight)
        return head

    # ---- loading ----------------------------------------------------------------------------------

    @staticmethod
    def _read_weights(folder: str) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors; a truncated or corrupt file is a ValueError naming it."""
        st = os.path.join(folder, "model.safetensors")
        st_index = os.path.join(folder, "model.safetensors.index.json")
        pt = os.path.join(folder, "pytorch_model.bin")
        if os.path.isfile(st) or os.path.isfile(st_index):
            from adaptree.models.hf import read_safetensors_state_dict

            return read_safetensors_state_dict(folder)
        if os.path.isfile(pt):
            # weights_only: torch's restricted unpickler, which builds tensors and containers only (a full
            # unpickle would run whatever code the file names)
            try:
                sd = torch.load(pt, map_location="cpu", weights_only=True)
            except Exception as exc:  # UnpicklingError, a bad zip: torch's own text would suggest weights_only=False
                raise ValueError(f"{pt}: not a weights-only PyTorch checkpoint ({type(exc).__name__}): the file is "
                                 "corrupt or its pickle holds more than tensors, and adaptree does not run pickles; "
                                 "convert the head to model.safetensors") from None
            if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
                raise ValueError(f"{pt} does not hold a state dict (a mapping of names to tensors)")
            return sd
        raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin "
                                f"in {folder}")

    @classmethod
    def read_checked(cls, folder: str | os.PathLike) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
        """A head folder's config and float state dict (int8 rows dequantized), checked as strictly as
        :meth:`from_pretrained` checks them: the layout's keys and shapes, ``d2t`` in range (int64), ``t2d``
        (bool). Needs no target: what :func:`adaptree.vllm_plugin.export.export_head` converts from."""
        folder = os.fspath(folder)
        cfg_path = os.path.join(folder, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {folder}")
        try:
            cfg = Eagle3Config.from_hf_dict(_read_config(cfg_path))
        except (TypeError, AttributeError) as exc:  # a field of the wrong JSON type (a list for a number, ...)
            raise ValueError(f"{cfg_path}: a field has the wrong type ({exc})") from None
        sd = dequantize_rows(cls._read_weights(folder), folder)
        if "t2d" not in sd and "d2t" in sd and not sd["d2t"].is_floating_point():
            # vLLM's and SGLang's loaders skip t2d, and exports for them (adaptree export-head) leave it out: it is
            # d2t's image, rebuilt here
            mapped = torch.arange(sd["d2t"].numel()) + sd["d2t"].to(torch.int64)
            if int(mapped.min()) >= 0 and int(mapped.max()) < cfg.vocab_size:  # else the range check below names it
                sd["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool).index_fill_(0, mapped, True)
        with torch.device("meta"):
            expected = cls(cfg, with_embeddings=_EMBED_KEY in sd).state_dict()
        missing = sorted(set(expected) - set(sd))
        unexpected = sorted(set(sd) - set(expected))
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if unexpected:
                parts.append(f"unexpected keys {unexpected}")
            raise ValueError(f"checkpoint in {folder} does not match the EAGLE-3 head layout: " + "; ".join(parts))
        bad = [f"{k}: checkpoint {tuple(sd[k].shape)} vs expected {tuple(v.shape)}"
               for k, v in expected.items() if tuple(sd[k].shape) != tuple(v.shape)]
        if bad:
            hint = ""
            if "lm_head.weight" in {b.split(":")[0] for b in bad}:
                rows = sd["lm_head.weight"].shape[0]
                hint = f" (config draft_vocab_size={cfg.draft_vocab_size}, lm_head has {rows} rows)"
            raise ValueError("shape mismatch between checkpoint and config: " + "; ".join(bad) + hint)
        for k in ("d2t", "t2d"):
            if sd[k].is_floating_point() or sd[k].is_complex():
                raise ValueError(f"{k} has dtype {sd[k].dtype}; expected an integer/bool buffer")
        d2t = sd["d2t"].to(torch.int64)
        t2d = sd["t2d"].to(torch.bool)
        mapped = torch.arange(cfg.draft_vocab_size, dtype=torch.int64) + d2t
        out_of_range = (mapped < 0) | (mapped >= cfg.vocab_size)
        if bool(out_of_range.any()):
            first = int(out_of_range.nonzero()[0, 0])
            raise ValueError(f"d2t maps draft id {first} to target id {int(mapped[first])}, outside "
                             f"[0, vocab_size={cfg.vocab_size}) ({int(out_of_range.sum())} draft ids out of range)")
        if cfg.draft_vocab_size < cfg.vocab_size and not bool(t2d[mapped].all()):
            warnings.warn("the checkpoint's t2d does not mark every target id that d2t maps to; forward() does "
                          "not use t2d, but training code mapping target ids to draft ids would", stacklevel=2)
        sd["d2t"], sd["t2d"] = d2t, t2d
        return cfg, sd

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, target: Transformer | None = None,
                        dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> "Eagle3Head":
        """Load a released / SpecForge / :meth:`save_pretrained` head with strict checks.

        ``dtype``/``device`` default to the target's, else the checkpoint's dtype on CPU. Without
        ``embed_tokens`` in the checkpoint the target's embeddings are borrowed (a target is then required);
        with them, the checkpoint's are kept even when a target is given.
        """
        folder = os.fspath(folder)
        cfg, sd = cls.read_checked(folder)
        if target is not None:
            tc = target.config
            if cfg.target_hidden_size != tc.hidden_size:
                raise ValueError(f"the head's target_hidden_size ({cfg.target_hidden_size}) does not match the "
                                 f"target's hidden_size ({tc.hidden_size})")
            if cfg.vocab_size != tc.vocab_size:
                raise ValueError(f"the head's vocab_size ({cfg.vocab_size}) does not match the target's "
                                 f"vocab_size ({tc.vocab_size})")
        has_emb = _EMBED_KEY in sd
        if not has_emb and target is None:
            raise ValueError(f"the checkpoint in {folder} has no {_EMBED_KEY} and no target was given to "
                             f"take the embeddings from")
        with torch.device("meta"):
            head = cls(cfg, with_embeddings=has_emb)
        if dtype is None:
            dtype = target.dtype if target is not None else sd["fc.weight"].dtype
        if device is None:
            device = target.device if target is not None else torch.device("cpu")
        tensors: dict[str, torch.Tensor] = {}
        for k, v in sd.items():
            if v.is_floating_point():  # d2t (int64) and t2d (bool) as read_checked made them
                v = v.to(dtype)
            tensors[k] = v.to(device).contiguous()
        head.load_state_dict(tensors, strict=True, assign=True)
        if head.embed_tokens is not None:
            head.embed_tokens.weight.requires_grad_(False)
        for name, p in head.named_parameters():
            if name != _EMBED_KEY:
                p.requires_grad_(True)
        head._rope_len = max(2048, min(cfg.max_position_embeddings, 8192))
        head.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, head._rope_len).to(device)
        if not has_emb:
            head.attach_embeddings(target.model.embed_tokens.weight)  # type: ignore[union-attr]
        return head

    # ---- saving -----------------------------------------------------------------------------------

    def save_pretrained(self, folder: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                        include_embeddings: bool = False) -> None:
        """Write ``config.json`` + ``model.safetensors`` in the released layout (no pickles).

        Floating tensors are stored in ``dtype``; ``d2t`` int64, ``t2d`` bool. ``embed_tokens.weight`` is
        written only with ``include_embeddings=True`` (own or borrowed embeddings). ``dtype=torch.int8`` stores
        every matrix as int8 rows with a float32 scale per row (:func:`quantize_rows`; vectors in bfloat16): half
        the bytes of bfloat16, for a head shipped in the repository, which other EAGLE-3 loaders cannot read.
        """
        from safetensors.torch import save_file

        folder = os.fspath(folder)
        os.makedirs(folder, exist_ok=True)
        state = {k: v for k, v in self.state_dict().items() if k != _EMBED_KEY}
        if include_embeddings:
            w = self.embedding_weight
            if w is None:
                raise ValueError("include_embeddings=True but the head has no embeddings")
            state[_EMBED_KEY] = w
        elif self.config.target_hidden_size != self.config.hidden_size:
            warnings.warn("saving without embeddings a head whose hidden_size differs from target_hidden_size: "
                          "the target's embeddings will not fit it when loading", stacklevel=2)
        tensors: dict[str, torch.Tensor] = {}
        for k, v in state.items():
            v = v.detach().to("cpu")
            if k == "d2t":
                v = v.to(torch.int64)
            elif k == "t2d":
                v = v.to(torch.bool)
            elif v.is_floating_point() and dtype == torch.int8:
                if v.dim() == 2:
                    v, tensors[k + SCALE_SUFFIX] = quantize_rows(v)
                else:
                    v = v.to(torch.bfloat16)
            elif v.is_floating_point():
                v = v.to(dtype)
            tensors[k] = v.contiguous().clone()
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        cfg = self.config.to_hf_dict()
        cfg["torch_dtype"] = str(dtype).removeprefix("torch.") if dtype != torch.int8 else "bfloat16"
        if dtype == torch.int8:
            cfg["adaptree_storage"] = "int8 rows"
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")


SCALE_SUFFIX = "_scale"
"""``<matrix>_scale``: the float32 per-row scales of a matrix stored as int8 rows."""


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[rows, cols]`` as symmetric int8 rows and their float32 scales: ``w ~ q * scale[:, None]``, each
    row's largest magnitude at 127 (an error of at most half a step, 0.4% of the row's largest weight)."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def dequantize_rows(sd: dict[str, torch.Tensor], where: str = "the checkpoint") -> dict[str, torch.Tensor]:
    """``sd`` with every int8 matrix that has a ``_scale`` entry back in float32 (other tensors as they are); a
    scale without its matrix, or of the wrong length, is a ValueError naming it."""
    out = dict(sd)
    for key in [k for k in sd if k.endswith(SCALE_SUFFIX)]:
        name = key[: -len(SCALE_SUFFIX)]
        q, scale = out.pop(name, None), out.pop(key)
        if q is None or q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            shape = None if q is None else (tuple(q.shape), q.dtype)
            raise ValueError(f"{where}: {key} {tuple(scale.shape)} does not scale the rows of an int8 matrix "
                             f"{name} (found {shape})")
        out[name] = q.float() * scale.float()[:, None]
    bare = sorted(k for k, v in out.items() if v.dtype == torch.int8)
    if bare:
        raise ValueError(f"{where}: int8 tensors without a {SCALE_SUFFIX} entry: {bare}")
    return out


__all__ = ["ARCHITECTURE", "Eagle3Config", "Eagle3DecoderLayer", "Eagle3Head", "build_vocab_map", "quantize_rows",
           "dequantize_rows"]
