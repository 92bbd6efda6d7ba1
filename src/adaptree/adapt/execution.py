"""The execution mode: the dtype and how the weights run (``"bfloat16"``, ``"float32"``, ``"bfloat16+int4"``),
given or chosen by measurement (:func:`choose_execution`: ``dtype="auto"`` / ``weights="auto"`` of
:func:`adaptree.load`), and the names :func:`adaptree.load` takes for them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from adaptree.adapt.cache import digest, machine_fields, machines_dir, measure_lock, read_entry, say
from adaptree.adapt.setup import AdaptConfig, adapt
from adaptree.core.engine import synchronize
from adaptree.core.pipeline import PipelineLike
from adaptree.models.cache import DTYPES  # adaptree.load takes these names and "auto" (measured)

WEIGHTS = ("float", "int4")
"""How :func:`adaptree.load` runs the weights: ``float`` (dequantised to the dtype) or ``int4`` (a GGUF model's own
4-bit blocks run by PyTorch's int4 CPU kernel, :mod:`adaptree.models.quant`); ``"auto"``: chosen by measurement."""


def execution_name(dtype: str, weights: str = "float") -> str:
    """An execution mode's name: the dtype, with ``+int4`` when the weights run packed (``"bfloat16+int4"``)."""
    return dtype if weights == "float" else f"{dtype}+{weights}"


def parse_execution(name: str) -> tuple[str, str]:
    """``"bfloat16+int4"`` -> ``("bfloat16", "int4")``; a ValueError names a bad mode."""
    dtype, _, weights = name.partition("+")
    weights = weights or "float"
    if dtype not in DTYPES or weights not in WEIGHTS:
        raise ValueError(f"execution mode {name!r} is not one of dtype[+weights] with dtype in {', '.join(DTYPES)} "
                         f"and weights in {', '.join(WEIGHTS)}")
    return dtype, weights


def dtype_of(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or a torch dtype) -> the torch dtype; a ValueError names a bad one."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; use one of {', '.join(DTYPES)}")
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}") from None


def dtype_candidates(device: str | torch.device = "cpu") -> tuple[str, ...]:
    """The dtypes ``dtype="auto"`` chooses from: bfloat16 and float32 on a CPU (float16 matmuls have no fast CPU
    kernels), bfloat16 and float16 on a GPU."""
    return ("bfloat16", "float16") if torch.device(device).type == "cuda" else ("bfloat16", "float32")


def execution_candidates(model, device: str | torch.device = "cpu", dtype: str = "auto",
                         weights: str = "auto") -> tuple[str, ...]:
    """The execution modes (:func:`execution_name`: ``"bfloat16"``, ``"float32"``,
    ``"bfloat16+int4"``) that ``dtype``/``weights`` leave to choose, ``"auto"`` meaning any. ``int4`` (the GGUF's
    4-bit blocks run by PyTorch's int4 kernel) is a candidate on a CPU for a GGUF model, with bfloat16 or float16
    activations (its float32 kernel is a slow reference)."""
    from adaptree.models.assets import is_gguf_model

    dtypes = dtype_candidates(device) if dtype == "auto" else (dtype,)
    if weights == "auto":
        packable = torch.device(device).type == "cpu" and is_gguf_model(model)
        kinds = ("float", "int4") if packable else ("float",)
    else:
        kinds = (weights,)
    out = []
    for dt in dtypes:
        for w in kinds:
            if w == "int4" and dt == "float32" and "auto" in (dtype, weights):
                continue  # the int4 kernel's float32 path is a slow reference: only on request
            out.append(execution_name(dt, w))
    return tuple(out)


def fallback_dtype(device: str | torch.device = "cpu") -> str:
    """The dtype ``auto`` takes when told not to measure: bfloat16 on a GPU or where the CPU has native bfloat16
    (avx512_bf16, amx_bf16) and the kernels may use it (PyTorch at AVX512, oneDNN not limited below AVX-512),
    else float32. A guess, not a measurement (``adaptree adapt`` measures)."""
    from adaptree.core.machine import cpu_flags, kernel_level, onednn_max_isa

    if torch.device(device).type == "cuda":
        return "bfloat16"
    isa = onednn_max_isa().upper()
    native = {"avx512_bf16", "amx_bf16"} & set(cpu_flags())
    limited = kernel_level().upper() != "AVX512" or not (isa in ("DEFAULT", "ALL") or "AVX512" in isa or "AMX" in isa)
    return "bfloat16" if native and not limited else "float32"


def fallback_execution(candidates: Sequence[str], device: str | torch.device = "cpu") -> str:
    """The mode ``auto`` takes when told not to measure: float weights in :func:`fallback_dtype` when that is a
    candidate, else the first candidate."""
    want = fallback_dtype(device)
    return want if want in candidates else candidates[0]


def _execution_file(model, head, device, max_seq_len, candidates: Sequence[str]) -> Path:
    key = digest({**machine_fields(), "device": str(torch.device(device)), "model": str(model),
                  "head": str(head), "max_seq_len": max_seq_len, "model_files": _files_digest(model, head),
                  "candidates": list(candidates)})
    return machines_dir() / f"execution-{key}.json"


def _files_digest(model, head) -> list:
    from adaptree.models import model_sha256, sha256_file

    out = [model_sha256(model)]
    if head not in (None, "none", "auto"):
        f = Path(head) / "model.safetensors"
        out.append(sha256_file(f) if f.is_file() else str(head))
    return out


def cached_execution(candidates: Sequence[str], model, head, device="cpu", max_seq_len=None) -> str | None:
    """The mode ``auto`` chose among ``candidates`` on this machine for this model and head before (None: never
    measured)."""
    entry = read_entry(_execution_file(model, head, device, max_seq_len, candidates))
    found = entry.get("execution") if entry is not None else None
    return found if isinstance(found, str) and found in candidates else None


def choose_execution(load: Callable[[str], PipelineLike], candidates: Sequence[str], model, head, device="cpu",
                     max_seq_len=None, cfg: AdaptConfig | None = None, *, force: bool = False, progress: bool = True,
                     message: Callable[[str], None] = say) -> PipelineLike:
    """``dtype="auto"`` / ``weights="auto"``: adapt a pipeline in each of ``candidates`` (execution modes) and keep
    the one whose default method models fastest (with no head: the faster AR step); cached per machine, model,
    head and candidate set (one process measures, others wait for its choice). ``load(mode)`` returns a pipeline
    without adapting. Returns the chosen pipeline, adapted."""
    if not candidates:
        raise ValueError("no execution mode to choose from")
    known = None if force else cached_execution(candidates, model, head, device, max_seq_len)
    if known is None and len(candidates) > 1:
        path = _execution_file(model, head, device, max_seq_len, candidates)
        with measure_lock(path):
            known = None if force else cached_execution(candidates, model, head, device, max_seq_len)
            if known is None:  # not chosen by another process while this one waited either
                return _choose(load, candidates, path, cfg, force, progress, message)
    p = load(known or candidates[0])
    if p.head is not None:
        p.machine = adapt(p, cfg, force=force, progress=progress, message=message)
    return p


def _choose(load: Callable[[str], PipelineLike], candidates: Sequence[str], path: Path, cfg: AdaptConfig | None,
            force: bool, progress: bool, message: Callable[[str], None]) -> PipelineLike:
    """Adapt a pipeline in each of ``candidates``, write the choice to ``path`` and return the best pipeline."""
    from adaptree.offline.runs import write_json

    message(f"choosing the execution mode by measurement among {', '.join(candidates)} (once per machine)")
    scores, best, best_score, traces = {}, None, -1.0, None
    for name in candidates:
        p = load(name)
        if p.head is not None:
            p.machine = adapt(p, cfg, force=force, progress=progress, message=message, traces=traces)
            traces = traces or p.machine.traces  # acceptance does not depend on the mode: trace once
            score = p.machine.modelled_tokens_per_s()
            scores[name] = {"method": p.machine.default_method, "tokens_per_s": score}
        else:
            score = 1.0 / _ar_step_s(p)
            scores[name] = {"method": "ar", "tokens_per_s": score}
        if score > best_score:
            best, best_score = p, score
        else:
            del p
    write_json({"execution": best.execution, "scores": scores, "machine": machine_fields()}, path)
    message("execution " + best.execution + " (" + ", ".join(
        f"{k}: {v['method']} {v['tokens_per_s']:.1f} tok/s modelled" for k, v in scores.items()) + ")")
    return best


@torch.inference_mode()
def _ar_step_s(pipeline: PipelineLike, context: int = 256, steps: int = 8) -> float:
    """Median seconds of one decode step at ``context`` tokens (the no-head dtype choice), timed like the
    calibration's shapes."""
    from adaptree.offline.latency import median_seconds

    target = pipeline.target
    cache = target.new_cache(context + 2)
    tok = torch.zeros(1, 1, dtype=torch.long, device=target.device)
    pos = torch.tensor([context], device=target.device)

    def step():
        cache.length = context
        target(tok, position_ids=pos, cache=cache)

    sync = partial(synchronize, target.device)
    return median_seconds(step, steps, sync)
