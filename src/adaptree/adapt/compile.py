"""Whether ``torch.compile`` pays for decode steps and small trees on this machine (:func:`compile_tokens`): up
to how many new tokens a target's forwards run compiled, timed against eager ones once per machine and model."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from adaptree.adapt.cache import digest, machine_fields, machines_dir, measure_lock, read_field, say
from adaptree.core.engine import synchronize

COMPILE_MODES = ("auto", "on", "off")
"""``compile`` of :func:`adaptree.load`: ``auto`` (measured, :func:`compile_tokens`), ``on`` (every decode step and
tree), ``off`` (eager)."""

COMPILE_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""New-token counts (a decode step, then trees) at which :func:`compile_tokens` times eager and compiled forwards."""


@torch.inference_mode()
def _time_compiled(target, sizes: Sequence[int], context: int = 256, repeats: int = 9):
    """Compile ``target`` for ``sizes`` and time eager and compiled forwards over a random tree of each size after
    ``context`` cached tokens, interleaved (eager, compiled, next size, ... ``repeats`` rounds: a shared machine's
    drift hits both alike). Returns the compile seconds and the median seconds ``{mode: {size: s}}``."""
    from adaptree.offline.latency import random_tree

    cache = target.new_cache(context + max(sizes) + 1)
    gen = torch.Generator().manual_seed(0)
    sync = partial(synchronize, target.device)
    steps = {}
    for n in sizes:
        depth, mask = random_tree(n, gen, target.device)
        ids = torch.zeros(1, n, dtype=torch.long, device=target.device)
        steps[n] = (ids, (depth + context).to(target.device), mask)

    outputs: dict[tuple[str, int], torch.Tensor] = {}

    def run(n: int, mode: str = "compiled") -> float:
        ids, pos, mask = steps[n]
        cache.length = context
        t0 = time.perf_counter()
        outputs[mode, n] = target(ids, position_ids=pos, cache=cache, tree_mask=mask, features=True).logits
        sync()
        return time.perf_counter() - t0

    target.compile(max(sizes))
    t0 = time.perf_counter()
    for n in sizes[:2]:  # the decode-step graph and the tree graph
        run(n)
    compile_s = time.perf_counter() - t0
    times: dict[str, dict[int, list[float]]] = {"eager": {n: [] for n in sizes}, "compiled": {n: [] for n in sizes}}
    for _ in range(repeats + 1):  # the first round warms up
        for n in sizes:
            for mode in times:
                target.compile_tokens = max(sizes) if mode == "compiled" else 0
                times[mode][n].append(run(n, mode))
    agree = all(_agree(outputs["compiled", n], outputs["eager", n]) for n in sizes)
    return compile_s, {mode: {n: statistics.median(v[1:]) for n, v in per.items()} for mode, per in times.items()}, agree


def _agree(compiled: torch.Tensor, eager: torch.Tensor) -> bool:
    """Compiled logits are finite and within 5% of the eager logits' range of them (bfloat16 rounding moves
    SmolLM2's logits by up to 0.44 of about 30): a compiled path that computes something else is never used."""
    scale = float(eager.float().abs().max()) or 1.0
    return bool(torch.isfinite(compiled).all()) and float((compiled.float() - eager.float()).abs().max()) <= 0.05 * scale


def compile_tokens(target, measure: bool = True, mode: str = "auto", message: Callable[[str], None] = say) -> int:
    """Up to how many new tokens ``target``'s forwards run compiled on this machine (``Transformer.compile``).

    ``on``: every decode step and tree (up to the largest size timed, then eager); ``off``: 0. ``auto``: eager and
    compiled forwards are timed at :data:`COMPILE_SIZES` (decode step and trees after 256 cached tokens), and
    compiled runs up to the largest size at which it is at least 3% faster at that size and every smaller one (0
    when not even a decode step gains); measured once per machine, model shape, dtype, weights and attention
    dtype, cached in ``$ADAPTREE_CACHE/machines`` with the times and the compile seconds. Without measuring
    (``measure=False`` and nothing cached): 0, on a GPU always 0 (not measured there)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile {mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if mode == "off" or target.device.type != "cpu" or getattr(target, "backend", "torch") != "torch":
        return 0
    if mode == "on":
        return max(COMPILE_SIZES)
    from adaptree.models.cache import dtype_name
    from adaptree.offline.store import model_fingerprint

    key = digest({**machine_fields(), "device": str(target.device), "model": model_fingerprint(target),
                  "attention": dtype_name(target.attn_dtype), "torch": torch.__version__,
                  "calls": "direct"})  # measured with llama.DirectLayerCall (choices made before it are re-measured)
    path = machines_dir() / f"compile-{key}.json"
    found = _cached(path)
    if found is not None:
        return found
    if not measure:
        return 0
    with measure_lock(path):
        found = _cached(path)  # measured by another process while this one waited
        return found if found is not None else _measure(target, path, message)


def _cached(path) -> int | None:
    return read_field(path, "compile_tokens", int)


def _measure(target, path, message: Callable[[str], None]) -> int:
    """Time eager and compiled forwards of ``target`` (:func:`compile_tokens`), compile it for the sizes where it
    pays and write the entry at ``path``."""
    from adaptree.offline.runs import write_json

    message("measuring whether torch.compile pays for decode steps and small trees here (once per machine)")
    sizes = [n for n in COMPILE_SIZES if n + 3 <= target.max_seq_len]  # a short context limit: smaller trees
    compile_s, t, agree = _time_compiled(target, sizes, context=min(256, target.max_seq_len - max(sizes) - 1))
    eager, compiled = t["eager"], t["compiled"]
    best = 0
    for n in sizes:
        if not agree or compiled[n] > 0.97 * eager[n]:
            break
        best = n
    target.compile(best)
    if not agree:
        message("warning: torch.compile's forwards disagree with eager ones on this machine: eager")
    write_json({"compile_tokens": best, "compile_s": compile_s, "agrees_with_eager": agree,
                "eager_ms": {str(n): 1e3 * s for n, s in eager.items()},
                "compiled_ms": {str(n): 1e3 * s for n, s in compiled.items()}, "machine": machine_fields()}, path)
    message(f"torch.compile for forwards of up to {best} new tokens (compiled in {compile_s:.0f} s; decode step "
            f"{1e3 * eager[1]:.1f} -> {1e3 * compiled[1]:.1f} ms)" if best else
            f"torch.compile does not pay here (decode step {1e3 * eager[1]:.1f} ms eager, {1e3 * compiled[1]:.1f} "
            "compiled): eager")
    return best
