"""Where a target forward spends its time: ``adaptree profile``.

One forward over ``T`` new tokens after ``context`` cached ones (``T = 1`` is an autoregressive decode step,
larger ``T`` a verification tree) is timed without a profiler (the median of ``repeats``), then run under
``torch.profiler`` with every decoder module labelled, and each operator's own CPU time is put in one part:

- ``matmul``: the projections of the decoder layers (float or quantized weights);
- ``attention``: scaled-dot-product attention (or the small-query path) with its softmax and masking;
- ``norm``: the RMSNorms;
- ``rope``: rotary embeddings, the q/k/v split and reshapes inside attention;
- ``kv cache``: writing the new keys/values and slicing the cache;
- ``mlp act``: SiLU and the gate product;
- ``lm_head``: the final norm and the output projection;
- ``other``: embedding, rotary tables, the mask, residual adds;
- ``dispatch``: the profiled forward's wall time not inside any operator (Python and the dispatcher).

The profiler slows every operator call a little; the split is reported as measured under it, and
``profiled_ms`` next to ``wall_ms`` says by how much. The parts are what to optimise, the wall time is the
number to quote.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial

import torch

from adaptree.core.engine import synchronize
from adaptree.core.pipeline import PipelineLike

__all__ = ["PARTS", "profile_forward", "profile_table", "run_profile"]

PARTS = ("matmul", "attention", "norm", "rope", "kv cache", "mlp act", "lm_head", "other", "dispatch")

_MATMUL = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::_weight_int4pack_mm",
           "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "aten::baddbmm")
_ATTENTION = ("aten::scaled_dot_product_attention", "adaptree::attend")
_LABEL = "adaptree::"


def _label_modules(model) -> list:
    """Forward pre/post hooks that open and close a ``record_function`` range named after each decoder module."""
    from adaptree.models.llama import MLP, Attention, RMSNorm

    handles = []
    for name, module in model.named_modules():
        kind = ("norm" if isinstance(module, RMSNorm) else "attn" if isinstance(module, Attention)
                else "mlp" if isinstance(module, MLP) else "lm_head" if name == "lm_head" else None)
        if kind is None:
            continue
        if kind == "norm" and name == "model.norm":
            kind = "lm_head"

        def enter(mod, args, _kind=kind):
            rf = torch.autograd.profiler.record_function(_LABEL + _kind)
            rf.__enter__()
            mod._adaptree_range = rf

        def leave(mod, args, out):
            mod._adaptree_range.__exit__(None, None, None)
            del mod._adaptree_range

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


def _part(event) -> str:
    """The part an operator's own time belongs to, from its own name and its enclosing ranges."""
    names = []
    e = event
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    module = next((n[len(_LABEL):] for n in names if n.startswith(_LABEL) and n != "adaptree::attend"), None)
    if module == "lm_head":
        return "lm_head"
    if module == "norm":
        return "norm"
    if any(n in _ATTENTION for n in names):
        return "attention"
    if any(n in _MATMUL for n in names):
        return "matmul"
    if module == "mlp":
        return "mlp act"
    if module == "attn":
        if any(n in ("aten::copy_", "aten::slice", "aten::select", "aten::index_put_") for n in names[:2]):
            return "kv cache"
        return "rope"
    return "other"


def _inputs(model, context: int, tokens: int, gen: torch.Generator):
    from adaptree.offline.latency import random_tree

    dev = model.device
    depth, mask = random_tree(tokens, gen, dev)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen).to(dev)
    return ids, (context + depth).to(dev), mask


@torch.inference_mode()
def profile_forward(model, context: int = 256, tokens: Sequence[int] = (1, 4, 16, 64), repeats: int = 20,
                    seed: int = 0) -> list[dict]:
    """Per ``T`` in ``tokens``: the median wall time of a forward over a random tree of ``T`` nodes after
    ``context`` cached positions, and the per-part split of one profiled forward (milliseconds)."""
    if context < 1 or any(t < 1 for t in tokens) or repeats < 1:
        raise ValueError(f"context, tokens and repeats must be >= 1, got {context}, {list(tokens)}, {repeats}")
    if context + max(tokens) + 1 > model.max_seq_len:
        raise ValueError(f"context {context} + {max(tokens)} tokens exceeds the model's context limit "
                         f"{model.max_seq_len}")
    from adaptree.offline.latency import median_seconds

    gen = torch.Generator().manual_seed(seed)
    cache = model.new_cache(context + max(tokens) + 1)
    sync = partial(synchronize, model.device)
    rows = []
    for t in tokens:
        ids, pos, mask = _inputs(model, context, t, gen)

        def step():
            cache.length = context
            model(ids, position_ids=pos, cache=cache, tree_mask=mask)

        wall = median_seconds(step, repeats, sync)
        handles = _label_modules(model)
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(5):
                    step()
                profiled = (time.perf_counter() - t0) / 5
        finally:
            for h in handles:
                h.remove()
        split = dict.fromkeys(PARTS, 0.0)
        for e in prof.events():
            if not e.name.startswith(_LABEL) or e.name == "adaptree::attend":
                split[_part(e)] += e.self_cpu_time_total / 1e3 / 5
        in_ops = sum(split.values())
        split["dispatch"] = max(0.0, profiled * 1e3 - in_ops)
        rows.append({"tokens": t, "context": context, "wall_ms": wall * 1e3,
                     "profiled_ms": profiled * 1e3, "split_ms": split})
    return rows


def profile_table(rows: list[dict]) -> str:
    """A markdown table: one row per ``T``, the wall time and the profiled split in milliseconds."""
    head = "| T | wall ms | profiled ms | " + " | ".join(PARTS) + " |"
    lines = [head, "|" + "---|" * (3 + len(PARTS))]
    for r in rows:
        parts = " | ".join(f"{r['split_ms'][p]:.2f}" for p in PARTS)
        lines.append(f"| {r['tokens']} | {r['wall_ms']:.2f} | {r['profiled_ms']:.2f} | {parts} |")
    return "\n".join(lines)


def run_profile(pipeline: PipelineLike, out, context: int = 256, tokens: Sequence[int] = (1, 4, 16, 64),
                repeats: int = 20, command: str = "") -> dict:
    """:func:`profile_forward` on ``pipeline``'s target; writes ``profile.json`` (rows, execution mode, machine
    profile) and ``profile.md`` (the table) to ``out`` and prints the table."""
    from pathlib import Path

    from adaptree.core.machine import machine_info
    from adaptree.offline.runs import check_out_dir, write_json

    folder = check_out_dir(out)
    rows = profile_forward(pipeline.target, context, tokens, repeats)
    result = {"command": command, "settings": pipeline.settings(), "execution": pipeline.execution,
              "machine": machine_info(), "rows": rows}
    write_json(result, Path(folder) / "profile.json")
    m = result["machine"]
    table = profile_table(rows)
    text = (f"# Forward profile: {pipeline.model_label}, {pipeline.execution} (attention in "
            f"{result['settings']['attention']}), {context} cached tokens\n\n"
            f"Machine: {m['cpu']}; PyTorch kernels {m['cpu_capability']}, oneDNN {m['onednn_max_isa']}, "
            f"{m['torch_threads']} torch threads, torch {m['torch']}.\n\n"
            f"Milliseconds per forward: `wall` is the median of {repeats} unprofiled forwards; the parts are operator "
            f"self-times under torch.profiler (which slows them: `profiled`).\n\n{table}\n")
    (Path(folder) / "profile.md").write_text(text)
    print(table)
    return result
