"""Weight-only 4-bit execution of a GGUF model's own quantized blocks (``weights="int4"``).

A GGUF model *is* a block-quantized checkpoint: SmolLM2's file stores every decoder projection as Q4_1 and
the (tied) embedding as Q8_0. Dequantising it to bfloat16 multiplies the bytes every decode step streams from
memory (docs/performance.md, "int4: the file's own blocks", has the sizes and the timings), and on a CPU a
decode step is bound by that traffic. Here the blocks are run as they are, with PyTorch's CPU int4 weight-only
matmul (``aten::_weight_int4pack_mm_for_cpu``: 4-bit weights in groups of 32 along the input dimension, one
scale and one zero per group, ``w = (q - 8) * scale + zero``), which takes them without loss:

- Q4_0 (``w = d * (q - 8)``): ``scale = d``, ``zero = 0``;
- Q4_1 (``w = d * q + m``): ``scale = d``, ``zero = m + 8 d``;
- Q4_K (``w = d * sc_j * q - dmin * m_j`` per 32-weight sub-block ``j``): ``scale = d sc_j``,
  ``zero = 8 d sc_j - dmin m_j``;
- Q8_0 (``w = d * q8``, ``q8`` in -128..127) as two 4-bit planes in one matmul over the input repeated
  twice: ``q8 = 16 hi + lo`` with ``hi`` in -8..7 and ``lo`` in 0..15, so ``w = 16 d (hi + 8 - 8) +
  (d (lo - 8) + 8 d)``.

The integers, scales and zeros are read with the ``gguf`` package's own dequantiser (no hand-written
bit layout): dequantising a copy of the blocks with ``d = 1, m = 0`` gives ``q``; the other fields come
the same way (:func:`int4_groups`). Other block types (Q5_0, Q6_K, ...) and float tensors stay dense float
layers (dequantised as for ``weights="float"``).

What runs, exactly: the scales and zeros are stored in the activation dtype. In float32 the executed
weight ``(q - 8) * scale + zero`` equals the file's dequantised weight up to float32 rounding of that
expression (tested against the file's dequantised weights); in bfloat16 the scale and zero are rounded to
bfloat16 (the dense bfloat16 model rounds every weight instead), so int4-bfloat16 and float-bfloat16 are two
different approximations of the file's float32 weights, each measured against it (:func:`weight_error`). The
PyTorch kernel is fast for bfloat16 activations and slow for float32 (a reference loop, slower than the dense
float32 matmul), so ``int4`` is an execution mode for bfloat16 (and float16); float32 with ``int4`` exists for
exactness tests on tiny models. Greedy losslessness is a property of one execution mode: speculative
output equals autoregressive output of the same mode.
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GROUP", "PACKABLE", "PackedLinear", "int4_groups", "pack_model", "pack_dense", "rtn_groups",
           "weight_error"]

GROUP = 32
"""Weights per scale/zero group along the input dimension (every packable GGUF type uses 32-weight groups)."""

PACKABLE = ("Q4_0", "Q4_1", "Q4_K", "Q8_0")
"""GGUF block types run as 4-bit groups without loss (Q8_0 as two planes)."""


def _dequant(blocks: np.ndarray, kind) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(blocks, kind).astype(np.float32)


def _set_f16(blocks: np.ndarray, offset: int, value: float) -> np.ndarray:
    """A copy of ``blocks`` ``[rows, n_blocks, size]`` (uint8) with the fp16 field at ``offset`` set to ``value``."""
    out = blocks.copy()
    out[..., offset:offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return out


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at ``offset`` of every block as float32 ``[rows, n_blocks]``."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def int4_groups(data: np.ndarray, kind_name: str, shape: tuple[int, int]):
    """The 4-bit integers, scales and zeros of one GGUF tensor's raw blocks.

    :param data: the tensor's bytes as the reader gives them (uint8, ``[rows, bytes per row]``).
    :param kind_name: its block type (one of :data:`PACKABLE`).
    :param shape: ``(out, in)`` in PyTorch's row-major order.
    :returns: ``q`` (uint8 ``[out, in']`` in 0..15), ``scale`` and ``zero`` (float32 ``[out, in' / 32]``) with
        ``w = (q - 8) * scale + zero``; ``in' = in`` except Q8_0's two planes (``in' = 2 in``: the ``hi`` plane,
        then the ``lo`` plane).
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if kind_name not in PACKABLE:
        raise ValueError(f"GGUF type {kind_name} cannot run as 4-bit groups; packable: {', '.join(PACKABLE)}")
    kind = GGMLQuantizationType[kind_name]
    per_block, size = GGML_QUANT_SIZES[kind]
    rows, cols = shape
    if cols % per_block:
        raise ValueError(f"a {kind_name} tensor needs rows of whole {per_block}-weight blocks, got {cols}")
    blocks = np.asarray(data, dtype=np.uint8).reshape(rows, cols // per_block, size)
    groups = cols // GROUP

    def dq(b):
        return _dequant(b.reshape(rows, -1), kind).reshape(rows, cols)

    if kind_name == "Q4_0":
        q = dq(_set_f16(blocks, 0, 1.0)) + 8
        scale = _f16(blocks, 0)
        zero = np.zeros_like(scale)
    elif kind_name == "Q4_1":
        q = dq(_set_f16(_set_f16(blocks, 0, 1.0), 2, 0.0))
        scale = _f16(blocks, 0)
        zero = _f16(blocks, 2) + 8 * scale
    elif kind_name == "Q4_K":
        unit = _set_f16(_set_f16(blocks, 0, 1.0), 2, 0.0)
        scaled_q = dq(unit)  # sc_j * q
        ones = unit.copy()
        ones[..., size - per_block // 2:] = 0x11  # every nibble 1: sc_j
        sc = dq(ones).reshape(rows, groups, GROUP)[..., 0]
        mins = -dq(_set_f16(_set_f16(blocks, 0, 0.0), 2, 1.0)).reshape(rows, groups, GROUP)[..., 0]  # m_j
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(np.repeat(sc, GROUP, axis=1) > 0, scaled_q / np.repeat(np.maximum(sc, 1), GROUP, axis=1), 8)
        d = np.repeat(_f16(blocks, 0), per_block // GROUP, axis=1)
        dmin = np.repeat(_f16(blocks, 2), per_block // GROUP, axis=1)
        scale = d * sc
        zero = 8 * scale - dmin * mins
    else:  # Q8_0: two planes
        q8 = dq(_set_f16(blocks, 0, 1.0)).astype(np.int32)
        hi = np.floor_divide(q8, 16)
        lo = q8 - 16 * hi
        d = _f16(blocks, 0)
        q = np.concatenate([hi + 8, lo], axis=1)
        scale = np.concatenate([16 * d, d], axis=1)
        zero = np.concatenate([np.zeros_like(d), 8 * d], axis=1)
    q = np.rint(q)
    if q.min() < 0 or q.max() > 15:
        raise ValueError(f"{kind_name} blocks gave 4-bit values outside 0..15: the gguf package's layout is not "
                         f"the one this code reads")
    return q.astype(np.uint8), scale.astype(np.float32), zero.astype(np.float32)


_DENSE = contextvars.ContextVar("adaptree_dense_weights", default=False)


@contextlib.contextmanager
def dense_weights(on: bool = True):
    """While active (and ``on``), :class:`PackedLinear` layers that keep a dense copy multiply by it instead of
    running the int4 kernel: what a prefill does (:meth:`adaptree.models.llama.Transformer.forward`), because the
    kernel does no GEMM blocking and costs about its row count in decode steps, while a dense GEMM over many rows
    costs little more than one pass over the weights (docs/performance.md has the timings)."""
    token = _DENSE.set(bool(on))
    try:
        yield
    finally:
        _DENSE.reset(token)


class PackedLinear(nn.Module):
    """A bias-optional linear layer whose weight is 4-bit groups (see the module docstring).

    ``planes = 2`` (Q8_0) repeats the input along its last dimension so one matmul sums both planes. A one-plane
    layer also keeps the weight it executes as a dense matrix (``dense``: ``(q - 8) * scale + zero`` with the
    scale and zero as the kernel holds them, rounded to the layer's dtype), used for prefills
    (:func:`dense_weights`); it costs the dense model's memory for these layers again.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, in_features: int,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                 sources: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.sources = sources
        """The Hugging Face weight names whose rows this layer stacks (q/k/v of a fused projection, ...)."""
        out, k = q.shape
        if k % in_features or k // in_features not in (1, 2) or k % GROUP:
            raise ValueError(f"packed weight of shape {tuple(q.shape)} does not fit {in_features} inputs")
        self.in_features, self.out_features, self.planes = in_features, out, k // in_features
        dense = None
        if self.planes == 1:
            rep = (lambda a: a.to(dtype).float().repeat_interleave(GROUP, dim=1))  # noqa: E731
            dense = ((q.float() - 8) * rep(scale) + rep(zero)).to(dtype)
        self.register_buffer("dense", dense, persistent=False)
        pad = -out % 16  # the kernel packs rows in sixteens: zero rows (scale 0, zero 0) fill the last one
        if pad:
            q = torch.cat([q, torch.full((pad, k), 8, dtype=q.dtype)])
            scale, zero = (torch.cat([a, a.new_zeros(pad, a.shape[1])]) for a in (scale, zero))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.register_buffer("packed", packed)
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [groups, out + pad, 2]
        self.register_buffer("scales_zeros", sz.to(dtype))
        self.register_buffer("bias", None if bias is None else bias.to(dtype))

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.scales_zeros.dtype

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, in] @ W^T`` without the bias."""
        x = x.contiguous()  # the kernel takes contiguous rows only
        if self.planes == 2:
            x = torch.cat([x, x], dim=-1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
        return y[:, : self.out_features] if y.shape[-1] != self.out_features else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # compiled graphs (decode steps, small trees) never run dense, and Dynamo need not trace the context var
        if self.dense is not None and not torch.compiler.is_compiling() and _DENSE.get():
            return F.linear(x, self.dense, self.bias)
        lead = x.shape[:-1]
        y = self._matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The weight this layer executes, ``[out, in]`` in its dtype (each input unit run through it)."""
        eye = torch.eye(self.in_features, dtype=self.weight_dtype, device=self.packed.device)
        return self._matmul(eye).t().contiguous()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, planes={self.planes}, "
                f"dtype={self.weight_dtype}")


_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _gguf_tensors(reader) -> dict:
    """The reader's tensors by their Hugging Face weight name (``model.layers.0.self_attn.q_proj.weight``...)."""
    from adaptree.models.gguf_file import _hf_name

    out = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is not None:
            out[name] = t
    return out


def _tensor_groups(t, cfg, name: str):
    """``(q, scale, zero)`` torch tensors of one GGUF tensor, rows in Hugging Face order; None if not packable."""
    from adaptree.models.gguf_file import hf_rows

    kind = t.tensor_type.name
    if kind not in PACKABLE:
        return None
    shape = tuple(int(x) for x in reversed([int(d) for d in t.shape]))
    groups = int4_groups(np.asarray(t.data).view(np.ndarray), kind, shape)
    return tuple(hf_rows(torch.from_numpy(a), cfg, name) for a in groups)


def pack_model(model, reader, dtype: torch.dtype | None = None) -> dict[str, str]:
    """Replace ``model``'s linear layers whose GGUF tensors are :data:`PACKABLE` by :class:`PackedLinear`
    built from ``reader`` (the model's own GGUF file), in place. CPU only.

    A fused layer (q/k/v, gate/up) is packed only when all its parts are, with the same number of planes.
    Returns ``{layer name: what it runs}`` ("Q4_1", "Q8_0 (2 planes)", or "float: <reason>").
    """
    if model.device.type != "cpu":
        raise ValueError(f"weights='int4' runs on the CPU only (PyTorch's int4 CPU kernel); the model is on "
                         f"{model.device}")
    dtype = dtype or model.dtype
    cfg = model.config
    tensors = _gguf_tensors(reader)
    report: dict[str, str] = {}
    targets = []
    for i in range(cfg.num_hidden_layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            targets.append((f"model.layers.{i}.{name}", [f"model.layers.{i}.{p}" for p in _FUSED.get(name, (name,))]))
    head_source = "lm_head" if "lm_head.weight" in tensors else "model.embed_tokens"
    targets.append(("lm_head", [head_source]))
    for layer_name, parts in targets:
        layer = model.get_submodule(layer_name)
        found = [tensors.get(p + ".weight") for p in parts]
        if any(t is None for t in found):
            report[layer_name] = "float: not in the GGUF file"
            continue
        kinds = sorted({t.tensor_type.name for t in found})
        groups = [_tensor_groups(t, cfg, p + ".weight") for t, p in zip(found, parts)]
        if any(g is None for g in groups) or len({g[0].shape[1] for g in groups}) != 1:
            report[layer_name] = f"float: {'/'.join(kinds)} blocks"
            continue
        q, scale, zero = (torch.cat([g[j] for g in groups]) for j in range(3))
        bias = layer.bias.detach() if getattr(layer, "bias", None) is not None else None
        packed = PackedLinear(q, scale, zero, layer.in_features, bias, dtype, tuple(p + ".weight" for p in parts))
        if packed.out_features != layer.out_features:
            raise ValueError(f"{layer_name}: the GGUF tensors give {packed.out_features} outputs, the model has "
                             f"{layer.out_features}")
        parent, _, attr = layer_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, packed)
        report[layer_name] = "/".join(kinds) + (" (2 planes)" if packed.planes == 2 else "")
    return report


def rtn_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, zero)`` of a float weight ``[out, in]`` rounded to the nearest of 16 levels between each 32-weight
    group's minimum and maximum (``w ~ (q - 8) * scale + zero``, an error of at most half a level). Lossy, unlike
    :func:`int4_groups`: for a draft model, whose weights decide only what is proposed."""
    out, k = w.shape
    if k % GROUP:
        raise ValueError(f"a weight with {k} inputs does not split into {GROUP}-weight groups")
    g = w.detach().float().reshape(out, k // GROUP, GROUP)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(out, k)
    return q, scale, lo + 8 * scale


def pack_dense(model, dtype: torch.dtype | None = None) -> dict[str, str]:
    """Replace ``model``'s decoder projections and ``lm_head`` that are still dense float layers or two-plane
    (Q8_0) layers by one-plane :class:`PackedLinear` of their :func:`rtn_groups`, in place; returns
    ``{layer name: what it runs}``.

    For a draft model only: a GGUF file's 5- and 6-bit blocks (Qwen2.5-Coder-0.5B's Q5_0 projections) stay dense
    under ``weights="int4"`` and stream twice the bytes of 4 bits per step, which made its forward cost 0.6 of the
    1.5B target's. Rounding them to 4 bits changes which tokens the draft proposes, never what the target accepts.
    """
    if model.device.type != "cpu":
        raise ValueError(f"4-bit layers run on the CPU only; the model is on {model.device}")
    dtype = dtype or model.dtype
    report: dict[str, str] = {}
    names = [f"model.layers.{i}.{n}" for i in range(model.config.num_hidden_layers)
             for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    for name in [*names, "lm_head"]:
        layer = model.get_submodule(name)
        if isinstance(layer, PackedLinear) and layer.planes == 1:
            report[name] = "packed already"
            continue
        if layer.in_features % GROUP:
            report[name] = f"float: {layer.in_features} inputs"
            continue
        # a two-plane layer (Q8_0) costs two 4-bit matmuls: rounded to one plane too (Qwen's 151,936-row lm_head)
        weight = layer.dense_weight() if isinstance(layer, PackedLinear) else layer.weight
        q, scale, zero = rtn_groups(weight)
        bias = layer.bias.detach() if layer.bias is not None else None
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                PackedLinear(q, scale, zero, layer.in_features, bias, dtype))
        report[name] = "4-bit (rounded)"
    return report


def weight_error(model, reader) -> dict[str, float]:
    """The largest absolute difference between each packed layer's executed weight and the GGUF file's weight
    dequantised in float32 by the ``gguf`` package (``max_abs``), and the largest such weight (``max_weight``)."""
    from adaptree.models.gguf_file import dequantize_gguf_tensor, hf_rows

    tensors = _gguf_tensors(reader)
    worst, biggest = 0.0, 0.0
    for module in model.modules():
        if not isinstance(module, PackedLinear):
            continue
        ref = torch.cat([hf_rows(dequantize_gguf_tensor(tensors[n]), model.config, n) for n in module.sources])
        worst = max(worst, float((module.dense_weight().float() - ref).abs().max()))
        biggest = max(biggest, float(ref.abs().max()))
    return {"max_abs": worst, "max_weight": biggest}
