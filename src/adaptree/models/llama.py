"""A compact Llama-family decoder (Llama 2/3.x, Qwen2/2.5, Qwen3, SmolLM2) for speculative decoding.

What it offers beyond a plain causal LM:
- a preallocated :class:`KVCache` with in-place compaction (keep only accepted tree nodes),
- a forward over an arbitrary set of new positions with explicit position ids and an explicit
  boolean attention mask among the new tokens (tree attention); the cached prefix is always visible,
- EAGLE-3's low/mid/high features (outputs of decoder layers 1, L//2-1, L-4) on request,
- logits for a chosen subset of the new positions only (a prefill needs just the last one).

Module and parameter names follow Hugging Face's checkpoints (``model.layers.N.self_attn.q_proj``...),
so state dicts load with ``strict=True``.
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from adaptree.models.config import ModelConfig
from adaptree.models.quant import dense_weights


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def _fuse_linears(module: nn.Module, parts: tuple[str, ...], fused: str) -> None:
    """Keep ``fused`` (one Linear whose rows are ``parts`` stacked) behind the checkpoints' key names.

    One matmul instead of several cuts per-layer overhead, which dominates small models on CPU.
    Loading merges ``prefix + part + '.weight'/'.bias'`` into the fused tensor (only when every part is
    present, so strict loading still names what is missing); ``state_dict()`` splits it back.
    """

    def merge(state_dict, prefix, *args, **kwargs):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{p}.{kind}" for p in parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])

    def split(mod, state_dict, prefix, local_metadata):
        sizes = mod._fused_sizes[fused]
        for kind in ("weight", "bias"):
            key = f"{prefix}{fused}.{kind}"
            if key in state_dict:
                for part, tensor in zip(parts, state_dict.pop(key).split(sizes)):
                    state_dict[f"{prefix}{part}.{kind}"] = tensor.clone()  # no shared storage (safetensors)
        return state_dict

    module._register_load_state_dict_pre_hook(merge)
    module._register_state_dict_hook(split)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with Llama-3 or linear scaling when configured."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


class Rotary(nn.Module):
    """cos/sin tables for every position up to ``max_len``, indexed by explicit position ids."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_len: int) -> None:
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        # rotate_half(x) * sin == roll(x, half) * [-sin_lo, sin_hi]: fold the sign into the table.
        sin = emb.sin()
        sin[:, : head_dim // 2] *= -1
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [B, T] -> [B, 1, T, head_dim]; the sine carries the rotate-half sign.
        return self.cos[position_ids].unsqueeze(1).to(dtype), self.sin[position_ids].unsqueeze(1).to(dtype)


def cpu_max(t: torch.Tensor) -> int | None:
    """The largest value of ``t`` where reading it is free (the CPU), None on an accelerator, where it would wait
    for the device (:mod:`adaptree.bench.host_reads` leaves these reads out of its accelerator count)."""
    return int(t.max()) if t.device.type == "cpu" else None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with :class:`Rotary`'s sign-folded sine (equal to HF's rotate_half form)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class KVCache:
    """Preallocated keys/values for every layer: ``[layers, B, kv_heads, max_len, head_dim]``.

    Slots ``[0, length)`` hold the committed context. A forward writes its new tokens at
    ``[length, length + T)`` and advances ``length``; :meth:`compact` then keeps only chosen slots
    (the accepted tree path) and :meth:`truncate` drops throw-away entries.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", batch: int = 1) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} cached + {n} new > capacity {self.max_len}")

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Move slots ``start + keep[i]`` to ``start + i`` (``keep`` ascending) and set length to ``start + len(keep)``."""
        n = int(keep.numel())
        if n:
            src = keep.to(self.k.device) + start
            self.k[:, :, :, start:start + n] = self.k[:, :, :, src]
            self.v[:, :, :, start:start + n] = self.v[:, :, :, src]
        self.length = start + n

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    def layers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer views of the key and value buffers (``[B, kv_heads, max_len, head_dim]`` each)."""
        return list(self.k.unbind(0)), list(self.v.unbind(0))


def build_attn_mask(cache_len: int, tree_mask: torch.Tensor | None, t: int, device) -> torch.Tensor | None:
    """Boolean ``[T, cache_len + T]`` attention mask for ``T`` new tokens after ``cache_len`` cached ones.

    ``tree_mask`` is ``[T, K]`` with ``T <= K <= cache_len + T`` and covers the LAST ``K`` key slots
    (the new tokens are the last ``T``); every slot before them is visible to every new token.
    ``K = T`` is plain tree attention among the new tokens; a larger ``K`` also masks throw-away
    cache entries (the draft head's earlier tree levels). None means causal. A ``[B, T, K]`` mask
    (one per batch row: padded batches) gives ``[B, 1, T, cache_len + T]``.
    """
    if tree_mask is None:
        if t == 1:
            return None
        tree_mask = torch.ones(t, t, dtype=torch.bool, device=device).tril_()
    k = tree_mask.shape[-1]
    if tree_mask.dim() not in (2, 3) or tree_mask.shape[-2] != t or not t <= k <= cache_len + t:
        raise ValueError(f"tree_mask of shape {tuple(tree_mask.shape)} does not fit {t} new tokens "
                         f"after {cache_len} cached ones")
    tree_mask = tree_mask.to(device=device, dtype=torch.bool)
    if k < cache_len + t:
        prefix = torch.ones(*tree_mask.shape[:-1], cache_len + t - k, dtype=torch.bool, device=device)
        tree_mask = torch.cat([prefix, tree_mask], dim=-1)
    return tree_mask.unsqueeze(1) if tree_mask.dim() == 3 else tree_mask


class Attention(nn.Module):
    """GQA self-attention with one fused q/k/v projection (checkpoint keys stay q_proj/k_proj/v_proj)."""

    def __init__(self, cfg: ModelConfig, in_dim: int | None = None) -> None:
        super().__init__()
        hd = cfg.head_dim
        in_dim = in_dim or cfg.hidden_size
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        sizes = [self.n_heads * hd, self.n_kv * hd, self.n_kv * hd]
        self._fused_sizes = {"qkv_proj": sizes}
        self.qkv_proj = nn.Linear(in_dim, sum(sizes), bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=False)
        _fuse_linears(self, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn_dtype: torch.dtype | None = None
        """The dtype of rotary, the KV cache and attention (None: the projections' own); see
        :func:`set_attention_dtype`."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor] | None, start: int | torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """``kv_cache``: this layer's key and value buffers ``[B, kv_heads, max_len, head_dim]`` (one layer of a
        :class:`KVCache`, :meth:`KVCache.layers`); the new keys and values are written at ``start``. ``start`` a
        tensor: the slots of the new tokens on the device, and ``mask`` covers the whole buffer (a fixed-shape
        step, :meth:`Transformer.step_fixed`)."""
        b, t, _ = x.shape
        h, kv = self.n_heads, self.n_kv
        qkv = self.qkv_proj(x)
        if self.attn_dtype is not None and qkv.dtype != self.attn_dtype:
            qkv = qkv.to(self.attn_dtype)  # rotary, cache and attention in the attention dtype
        qkv = qkv.view(b, t, h + 2 * kv, self.head_dim).transpose(1, 2)
        if self.q_norm is None:
            qk = apply_rope(qkv[:, : h + kv], cos, sin)  # q and k heads rotated together
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = apply_rope(self.q_norm(qkv[:, :h]), cos, sin)
            k = apply_rope(self.k_norm(qkv[:, h:h + kv]), cos, sin)
        v = qkv[:, h + kv:]
        grouped = False
        if isinstance(start, torch.Tensor):  # a fixed-shape step (Transformer.step_fixed): slots on the device
            k_buf, v_buf = kv_cache
            k_buf[:b].index_copy_(2, start, k)
            v_buf[:b].index_copy_(2, start, v)
            out = F.scaled_dot_product_attention(q, k_buf[:b], v_buf[:b], attn_mask=mask, enable_gqa=kv != h)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, h * self.head_dim).to(x.dtype))
        if kv_cache is not None:
            k_buf, v_buf = kv_cache
            k_buf[:b, :, start:start + t] = k
            v_buf[:b, :, start:start + t] = v
            grouped = (t == 1 and b == k_buf.shape[0] > 1 and q.dtype in _GROUPED_DECODE_DTYPES
                       and q.device.type == "cpu")
            k = k_buf[:b, :, :start + t]
            v = v_buf[:b, :, :start + t]
        gqa = kv != h
        if grouped:
            out = grouped_decode_attention(q, k_buf, v_buf, start + t, mask)
        elif mask is None and t > 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, h * self.head_dim).to(x.dtype))


_GROUPED_DECODE_DTYPES = (torch.bfloat16, torch.float16)


def grouped_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, length: int,
                             mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of one query per row over the first ``length`` slots of a cache layer, as two grouped matmuls:
    ``q [B, H, 1, D]``, ``k_buf``/``v_buf`` the layer's whole buffers ``[B, KV, max_len, D]``, ``mask`` None or
    boolean ``[B, 1, 1, length]``; returns ``[B, H, 1, D]``.

    The ``H / KV`` query heads that share a key head are the rows of one small matmul, so keys and values are
    read once per group and never expanded; the matmuls run over the whole (contiguous) buffers and the slots
    from ``length`` on are masked out, because a strided ``[:length]`` view makes the half-precision batched
    matmul copy its operand first (several times slower). Scores are softmaxed in float32. On a CPU, torch's
    fused kernel for half-precision inputs is an order of magnitude slower for this shape (one query per row,
    hundreds of keys; docs/head-training.md has the timings). Used by
    :func:`adaptree.core.batched.batched_decode`'s steps (``T == 1``, ``B > 1``, bf16/fp16, CPU)."""
    b, h, _, d = q.shape
    kv, cap = k_buf.shape[1], k_buf.shape[2]
    scores = torch.matmul(q.reshape(b, kv, h // kv, d), k_buf.transpose(-1, -2)).float().mul_(d ** -0.5)
    if mask is not None or length < cap:
        keep = torch.zeros(b, cap, dtype=torch.bool, device=q.device)
        keep[:, :length] = True if mask is None else mask.reshape(b, length)
        scores.masked_fill_(~keep[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v_buf.dtype)
    return torch.matmul(probs, v_buf).reshape(b, h, 1, d)


def set_attention_dtype(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Run rotary, the KV cache and attention of every :class:`Attention` in ``module`` in ``dtype`` (None: the
    projections' dtype), with the projections staying in theirs.

    On a CPU, bfloat16 attention over a KV cache can be several times slower than float32 for the one query of
    a decode step, and about as fast for a tree of 16 (docs/performance.md has the timings). Which dtype is
    faster is measured per machine (:func:`adaptree.adapt.attention_dtype`); a model's caches follow it
    (``new_cache``), so a cache must be made after this is set.
    """
    for m in module.modules():
        if isinstance(m, Attention):
            m.attn_dtype = dtype


class MLP(nn.Module):
    """SwiGLU MLP with one fused gate/up projection (checkpoint keys stay gate_proj/up_proj)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self._fused_sizes = {"gate_up_proj": [inter, inter]}
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        _fuse_linears(self, ("gate_proj", "up_proj"), "gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv_cache, start, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, start, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


RECOMPILE_LIMIT = 64
"""Graphs Dynamo keeps for :func:`call_layer` (its default 8 is raised to this by :meth:`Transformer.compile`)."""


def _allow_recompiles() -> None:
    """Every compiled :class:`Transformer` compiles the same function (:func:`call_layer`), so the graphs of every
    model in the process (per dtype, weights, decode step and tree) share one code object's cache. Dynamo's default
    limit of 8 graphs per code object sent further shapes silently back to eager when one process compiled three
    models (``adaptree.load``'s execution choice: bf16, bf16+int4, fp32), which made compiling look slower than
    eager for the third."""
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.recompile_limit = max(int(cfg.recompile_limit), RECOMPILE_LIMIT)


def call_layer(layer: DecoderLayer, x, cos, sin, kv_cache, start, mask):
    """One decoder layer; :meth:`Transformer.compile` compiles this function, so that the layers of a model share
    one graph (their weights are its inputs): compiling the whole stack as one graph saved little more of a decode
    step and took several times longer to compile, every process (docs/performance.md)."""
    return layer(x, cos, sin, kv_cache, start, mask)


class DirectLayerCall:
    """:func:`call_layer` through ``torch.compile``, minus Dynamo's per-call frame evaluation.

    Every call of a compiled function goes through Dynamo's frame hook, which cost 74-110 µs per layer call on a
    2-core Xeon: 2-3.5 ms of a 17 ms int4 decode step of SmolLM2, for 30 calls per step. Once Dynamo has compiled
    a graph, its cache entry holds the code it runs (the call of the compiled graph) and the guards that say when
    that code is valid. This calls the code of the first entry whose guards pass for the call's arguments (checking
    them costs about 20 µs). A call that no entry takes goes through ``torch.compile`` (compiling where it must),
    and the entries are read again. The outputs are the compiled function's own (``tests/test_compile.py``).

    The cache entries are a private torch API (``torch._dynamo.eval_frame._debug_get_cache_entry_list``); where it
    is missing, every call goes through ``torch.compile``.
    """

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self._entries: list[tuple] = []  # (code as a function, guard manager) per cache entry, Dynamo's order

    def _refresh(self) -> None:
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            found = _debug_get_cache_entry_list(call_layer.__code__)
            self._entries = [(types.FunctionType(e.code, call_layer.__globals__, "call_layer"), e.guard_manager)
                             for e in found]
        except (ImportError, AttributeError, TypeError):
            self._entries = []

    def __call__(self, layer, x, cos, sin, kv_cache, start, mask):
        args = {"layer": layer, "x": x, "cos": cos, "sin": sin, "kv_cache": kv_cache, "start": start, "mask": mask}
        for fn, guards in self._entries:  # a list replaced whole, never changed in place: safe across threads
            if guards.check(args):
                return fn(layer, x, cos, sin, kv_cache, start, mask)
        out = self.compiled(layer, x, cos, sin, kv_cache, start, mask)
        self._refresh()
        return out


class _Body(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.taps = tuple(cfg.feature_layers)
        """EAGLE-3's feature layers (low, mid, high)."""

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ks: list[torch.Tensor] | None,
            vs: list[torch.Tensor] | None, start: int, mask: torch.Tensor | None, features: bool,
            call=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder layers over ``x``: the last hidden state and (``features``) the outputs of the layers in
        :attr:`taps`, in that order. ``ks``/``vs``: the cache's per-layer buffers (None: no cache). ``call``: how a
        layer is run (default :func:`call_layer`; :meth:`Transformer.compile` passes it compiled)."""
        call = call or call_layer
        tapped = {}
        for i, layer in enumerate(self.layers):
            x = call(layer, x, cos, sin, (ks[i], vs[i]) if ks is not None else None, start, mask)
            if features and i in self.taps:
                tapped[i] = x
        return x, [tapped[i] for i in self.taps] if features else []


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None
    """``[B, T', vocab]`` for the requested positions (``T' = T`` unless ``logits_at`` was given)."""
    features: torch.Tensor | None
    """``[B, T, 3*hidden]``: outputs of layers (1, L//2-1, L-4) concatenated, when requested."""


def _use_inductor_cache() -> None:
    """Point Inductor's on-disk cache at ``$ADAPTREE_CACHE/inductor/<torch version>-<CPU kernel level>``, unless
    ``$TORCHINDUCTOR_CACHE_DIR`` names a folder other than torch's default (which torch itself writes into the
    environment on first use). Inductor's cache key leaves ``ATEN_CPU_CAPABILITY`` out: kernels cached under
    AVX-512 gave NaN logits when reused under ``ATEN_CPU_CAPABILITY=avx2``."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from adaptree.models.cache import cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        level = str(torch.backends.cpu.get_cpu_capability())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor" / f"{torch.__version__}-{level}")


class ContextLimitError(ValueError):
    """A context limit the model cannot take (a bad value given, not a broken model file)."""


def context_limit(cfg: ModelConfig, max_seq_len: int | None = None) -> int:
    """``max_seq_len``, or the model's own context capped at 8192; a :class:`ContextLimitError` naming the value when
    it is not in 2..``max_position_embeddings`` (the rotary tables and caches are sized by it: a huge value would
    try to allocate terabytes, and positions past the trained ones are not the model's)."""
    if max_seq_len is None:
        return min(cfg.max_position_embeddings, 8192)
    try:
        n = operator.index(max_seq_len)  # ints and numpy integers, not floats or bools
    except TypeError:
        n = None
    if n is None or isinstance(max_seq_len, bool) or not 2 <= n <= cfg.max_position_embeddings:
        raise ContextLimitError(f"max_seq_len must be in 2..{cfg.max_position_embeddings} (this model's context, "
                                f"max_position_embeddings), got {max_seq_len!r}")
    return n


class Transformer(nn.Module):
    """Llama-family causal LM with tree attention and EAGLE-3 feature taps."""

    backend = "torch"
    """Whose kernels run it (:class:`adaptree.models.ggml.GgmlTarget` is the other target: ``"ggml"``)."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # The context limit; by default the model's own, capped at 8192 to keep the rotary tables and the
        # preallocated caches small on CPU (pass max_seq_len to go further).
        self.max_seq_len = context_limit(cfg, max_seq_len)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, self.max_seq_len)
        self.dense_prefill_rows = 0
        """Prefills (an empty cache) of at least this many tokens (batch rows times tokens) run the int4 layers on
        their dense weights (:func:`adaptree.models.quant.dense_weights`); 0: never
        (:func:`adaptree.adapt.prefill.dense_prefill_rows` measures it)."""
        self._compiled = None
        self.compile_tokens = 0
        """Forwards of at most this many new tokens (batch 1, after a cached prefix) run the decoder layers
        through ``torch.compile``; 0: none (:meth:`compile`)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype  # the activations' dtype (the lm_head may hold packed weights)

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def attn_dtype(self) -> torch.dtype:
        """The dtype of rotary, the KV cache and attention (:func:`set_attention_dtype`; default: :attr:`dtype`)."""
        return self.model.layers[0].self_attn.attn_dtype or self.dtype

    def compile(self, max_tokens: int) -> Transformer:
        """Run the decoder layers of forwards of up to ``max_tokens`` new tokens (batch 1, after a cached prefix:
        decode steps and small trees) through ``torch.compile`` (Inductor, dynamic shapes: one graph for every
        decode step and one for every tree, whatever the cache length or tree size; each compiles on its first
        use). Larger forwards and prefills stay eager; ``max_tokens=0`` turns compiling off.

        Where it pays is measured per machine (:func:`adaptree.adapt.compile.compile_tokens`): what it removes is
        per-op dispatch, most of a small model's decode step on a CPU, less of a tree's (docs/performance.md has
        the timings). Inductor keeps the kernels it built under
        ``$ADAPTREE_CACHE/inductor/<torch version>-<CPU kernel level>`` (unless ``$TORCHINDUCTOR_CACHE_DIR`` says
        otherwise)."""
        if int(max_tokens) < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.compile_tokens = int(max_tokens)
        if self.compile_tokens and self._compiled is None:
            _use_inductor_cache()
            _allow_recompiles()
            self._compiled = DirectLayerCall(torch.compile(call_layer, dynamic=True))
        elif not self.compile_tokens:
            self._compiled = None
        return self

    def step_fixed(self, input_ids: torch.Tensor, position_ids: torch.Tensor, slots: torch.Tensor,
                   mask: torch.Tensor, cache: KVCache) -> ForwardOutput:
        """A forward whose shapes depend on nothing but its inputs' (so that a CUDA graph can replay it,
        :class:`adaptree.core.graphs.StepGraphs`): ``input_ids [1, T]`` at rotary ``position_ids [T]``, their keys
        and values written at cache ``slots [T]`` (device tensors), attention over the cache's whole buffer under
        the boolean ``mask [T, cache.max_len]``; nothing is read back to the host and ``cache.length`` is left
        alone. Returns logits and EAGLE-3 features for all T tokens."""
        cos, sin = self.rotary(position_ids[None], self.attn_dtype)
        x = self.model.embed_tokens(input_ids)
        ks, vs = cache.layers()
        x, tapped = self.model.run(x, cos, sin, ks, vs, slots, mask[None, None], True)
        return ForwardOutput(self.lm_head(self.model.norm(x)), torch.cat(tapped, dim=-1))

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                       max_len or self.max_seq_len, self.attn_dtype, self.device, batch)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, tree_mask: torch.Tensor | None = None,
                features: bool = False, logits_at: torch.Tensor | slice | None = None,
                logits: bool = True) -> ForwardOutput:
        """Run the new tokens ``input_ids [B, T]``.

        :param position_ids: ``[T]`` or ``[B, T]`` rotary positions; default: consecutive after the cache.
        :param cache: KV cache; the new tokens are appended at ``cache.length`` and see the whole prefix.
        :param tree_mask: boolean ``[T, K]`` over the last K key slots (see :func:`build_attn_mask`);
            with ``K = T`` entry (i, j) lets new token i attend new token j. None means causal.
            ``[B, T, K]``: one mask per batch row (left-padded batches).
        :param features: also return EAGLE-3's low/mid/high features for all new positions.
        :param logits_at: index or slice into the T new positions; logits only there.
        """
        b, t = input_ids.shape
        past = cache.length if cache is not None else 0
        if cache is not None:
            cache.check_room(t)
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=input_ids.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        top = cpu_max(position_ids)
        if top is not None:
            if top >= self.max_seq_len:
                raise ValueError(f"position {top} exceeds the model's context limit {self.max_seq_len}")
        elif past + t > self.max_seq_len:  # the engine's positions lie in past .. past + t - 1 (a tree: past + depth)
            raise ValueError(f"{past} cached + {t} new tokens exceed the model's context limit {self.max_seq_len}")
        cos, sin = self.rotary(position_ids, self.attn_dtype)
        mask = build_attn_mask(past, tree_mask, t, input_ids.device)
        x = self.model.embed_tokens(input_ids)
        ks, vs = cache.layers() if cache is not None else (None, None)
        # compiled: decode steps and small trees after a cached prefix (one graph per kind, shared by every layer)
        compiled = cache is not None and b == 1 and past >= 2 and t <= self.compile_tokens
        dense = self.dense_prefill_rows and past == 0 and b * t >= self.dense_prefill_rows
        with dense_weights() if dense else contextlib.nullcontext():
            x, tapped = self.model.run(x, cos, sin, ks, vs, past, mask, features,
                                       call=self._compiled if compiled else None)
        if cache is not None:
            cache.length = past + t
        feats = torch.cat(tapped, dim=-1) if features else None
        out_logits = None
        if logits:
            h = x if logits_at is None else x[:, logits_at]
            out_logits = self.lm_head(self.model.norm(h))
        return ForwardOutput(out_logits, feats)
