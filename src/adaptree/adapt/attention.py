"""The dtype of attention, rotary and the KV cache on this machine (:func:`attention_dtype`): the model's dtype or
float32, whichever attention runs faster in, timed once per machine, dtype and attention shape."""

from __future__ import annotations

from functools import partial

import torch

from adaptree.adapt.cache import digest, machine_fields, machines_dir, measure_lock, read_field
from adaptree.core.engine import synchronize


def _time_attention(target, dtype: torch.dtype, queries: int, context: int = 256, repeats: int = 30) -> float:
    """Median seconds of one attention call of ``target``'s shape (its heads and head size) in ``dtype``: ``queries``
    new positions over ``context`` cached keys (timed like the calibration's shapes)."""
    import torch.nn.functional as F

    from adaptree.offline.latency import median_seconds

    cfg = target.config
    dev = target.device
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, cfg.num_attention_heads, queries, cfg.head_dim, generator=gen).to(dev, dtype)
    k = torch.randn(1, cfg.num_key_value_heads, context + queries, cfg.head_dim, generator=gen).to(dev, dtype)
    mask = torch.ones(queries, context + queries, dtype=torch.bool, device=dev) if queries > 1 else None
    gqa = cfg.num_key_value_heads != cfg.num_attention_heads
    sync = partial(synchronize, dev)
    return median_seconds(lambda: F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=gqa), repeats,
                          sync)


def _cached(path) -> torch.dtype | None:
    return read_field(path, "attention", lambda name: getattr(torch, name))


def attention_dtype(target, measure: bool = True) -> torch.dtype:
    """The dtype of rotary, KV cache and attention for ``target`` on this machine (``llama.set_attention_dtype``):
    float32 for a float32 model; otherwise the faster of the model's dtype and float32 for one decode query and
    a 16-node tree over 256 cached keys (the sum of both), measured once per machine, dtype and attention shape
    and cached in ``$ADAPTREE_CACHE/machines``. Without measuring (``measure=False`` and nothing cached): float32
    on a CPU (bfloat16 attention was several times slower for one query on both AVX-512-bf16 and AVX2 kernels:
    docs/performance.md), the model's dtype on a GPU."""
    if target.dtype == torch.float32:
        return torch.float32
    cfg = target.config
    key = digest({**machine_fields(), "device": str(target.device), "dtype": str(target.dtype),
                  "shape": [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim]})
    path = machines_dir() / f"attention-{key}.json"
    found = _cached(path)
    if found is not None:
        return found
    if not measure:
        return torch.float32 if target.device.type == "cpu" else target.dtype
    from adaptree.models.cache import dtype_name
    from adaptree.offline.runs import write_json

    with measure_lock(path):
        found = _cached(path)  # measured by another process while this one waited
        if found is not None:
            return found
        times = {dtype_name(dt): sum(_time_attention(target, dt, n) for n in (1, 16))
                 for dt in (target.dtype, torch.float32)}
        best = min(times, key=times.get)
        write_json({"attention": best, "seconds": times, "machine": machine_fields()}, path)
    return getattr(torch, best)
