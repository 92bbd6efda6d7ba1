"""Whether prefills of an int4 model run on dense weights on this machine (:func:`dense_prefill_rows`): from how many
prompt tokens on, timed once per machine and model.

PyTorch's CPU int4 kernel does no GEMM blocking: a forward over T tokens costs about T decode steps' matmuls (a
300-token prefill of SmolLM2 took 790-980 ms on an AMX Xeon). A dense bfloat16 GEMM over many rows costs little more
than one pass over the weights there (270-290 ms), but with AVX2 kernels, where bfloat16 is emulated, it is 2-2.4x
slower than the int4 kernel at every size. So it is measured: :class:`~adaptree.models.quant.PackedLinear` keeps
the dense weight it executes, prefills from the measured size on multiply by it, and where dense never pays the
dense copies are dropped (no memory spent on them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from adaptree.adapt.cache import digest, machine_fields, machines_dir, measure_lock, read_field, say

PREFILL_SIZES = (16, 64, 256)
"""Prompt lengths at which :func:`dense_prefill_rows` times int4 and dense prefills."""


def _packed(target) -> list:
    from adaptree.models.quant import PackedLinear

    return [m for m in target.modules() if isinstance(m, PackedLinear) and m.dense is not None]


def drop_dense(target) -> None:
    """Free the dense copies of ``target``'s packed layers (prefills then run the int4 kernel)."""
    for m in _packed(target):
        m.dense = None


@torch.inference_mode()
def _time_prefills(target, sizes: Sequence[int], repeats: int = 3) -> dict[str, dict[int, float]]:
    """Median seconds of a prefill (features on, logits at the last position, as the engine's) of each size with
    int4 and with dense weights, interleaved (a shared machine's drift hits both alike); the first round warms up."""
    gen = torch.Generator().manual_seed(0)
    times: dict[str, dict[int, list[float]]] = {"int4": {n: [] for n in sizes}, "dense": {n: [] for n in sizes}}
    cache = target.new_cache(max(sizes))
    rule, target.dense_prefill_rows = target.dense_prefill_rows, 0  # the context below decides, not the rule
    try:
        _time_rounds(target, sizes, repeats, gen, cache, times)
    finally:
        target.dense_prefill_rows = rule
    return {mode: {n: statistics.median(v[1:]) for n, v in per.items()} for mode, per in times.items()}


def _time_rounds(target, sizes, repeats, gen, cache, times) -> None:
    from adaptree.models.quant import dense_weights

    for _ in range(repeats + 1):
        for n in sizes:
            ids = torch.randint(0, target.config.vocab_size, (1, n), generator=gen)
            for mode in times:
                cache.reset()
                t0 = time.perf_counter()
                with dense_weights(mode == "dense"):
                    target(ids, cache=cache, features=True, logits_at=slice(-1, None))
                times[mode][n].append(time.perf_counter() - t0)


def dense_prefill_rows(target, measure: bool = True, message: Callable[[str], None] = say) -> int:
    """From how many prompt tokens ``target``'s prefills run on its packed layers' dense weights here (0: never,
    and the dense copies are dropped). Only int4 models have a choice (0 for others, unmeasured). ``auto`` rule:
    the smallest of :data:`PREFILL_SIZES` from which dense is at least 3% faster at that size and every larger one,
    measured once per machine, model shape, dtype and attention dtype, cached in ``$ADAPTREE_CACHE/machines`` with
    the times. Without measuring (``measure=False`` and nothing cached): 0."""
    if not _packed(target):
        return 0
    from adaptree.models.cache import dtype_name
    from adaptree.offline.store import model_fingerprint

    key = digest({**machine_fields(), "device": str(target.device), "model": model_fingerprint(target),
                  "attention": dtype_name(target.attn_dtype), "torch": torch.__version__})
    path = machines_dir() / f"prefill-{key}.json"
    found = _cached(path)
    if found is None and measure:
        with measure_lock(path):
            found = _cached(path)  # measured by another process while this one waited
            if found is None:
                found = _measure(target, path, message)
    rows = found or 0
    if not rows:
        drop_dense(target)
    return rows


def _cached(path) -> int | None:
    return read_field(path, "dense_prefill_rows", int)


def _measure(target, path, message: Callable[[str], None]) -> int:
    from adaptree.offline.runs import write_json

    sizes = [n for n in PREFILL_SIZES if n <= target.max_seq_len]
    if not sizes:
        return 0
    message("measuring whether int4 prefills pay on dense weights here (once per machine)")
    t = _time_prefills(target, sizes)
    rows = 0
    for n in reversed(sizes):  # the smallest size from which dense wins at every larger one
        if t["dense"][n] > 0.97 * t["int4"][n]:
            break
        rows = n
    write_json({"dense_prefill_rows": rows, "int4_ms": {str(n): 1e3 * s for n, s in t["int4"].items()},
                "dense_ms": {str(n): 1e3 * s for n, s in t["dense"].items()}, "machine": machine_fields()}, path)
    top = sizes[-1]
    message(f"int4 prefills of {rows}+ tokens run on dense weights ({top} tokens: {1e3 * t['int4'][top]:.0f} -> "
            f"{1e3 * t['dense'][top]:.0f} ms)" if rows else
            f"dense weights do not pay for int4 prefills here ({top} tokens: {1e3 * t['int4'][top]:.0f} ms int4, "
            f"{1e3 * t['dense'][top]:.0f} ms dense): dropped")
    return rows
