"""The execution mode: the dtype and how the weights run (``"bfloat16"``, ``"float32"``, ``"bfloat16+int4"``),
given or chosen by measurement (:func:`choose_execution`: ``dtype="auto"`` / ``weights="auto"`` of
:func:`adaptree.load`), and the names :func:`adaptree.load` takes for them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch

from adaptree.adapt.cache import digest, machine_fields, machines_dir, measure_lock, read_entry, say
from adaptree.adapt.setup import AdaptConfig, AdaptError, adapt
from adaptree.core.engine import synchronize
from adaptree.core.pipeline import PipelineLike
from adaptree.models.cache import DTYPES  # adaptree.load takes these names and "auto" (measured)
from adaptree.models.loader import WEIGHT_KINDS

AUTO_GGML = ("ggml", "ggml-q4_0")
"""The llama.cpp modes ``weights="auto"`` measures: the file's own types and Q4_0, whose repacked GEMM ran every row
count fastest on the machines measured (docs/ggml.md); ``ggml-q8_0`` on request."""

WEIGHTS = WEIGHT_KINDS
"""How :func:`adaptree.load` runs the weights: ``float`` (dequantised to the dtype), ``int4`` (a GGUF model's own
4-bit blocks run by PyTorch's int4 CPU kernel, :mod:`adaptree.models.quant`) or ``ggml`` (the GGUF file run by
llama.cpp's kernels, :mod:`adaptree.models.ggml`; ``ggml-q4_0`` / ``ggml-q8_0``: requantized by llama.cpp first; the
dtype is then the draft head's); ``"auto"``: chosen by measurement."""


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
    activations (its float32 kernel is a slow reference); so are :data:`AUTO_GGML` where llama.cpp runs here, with
    the head in the dtype this CPU runs natively."""
    from adaptree.models import ggml
    from adaptree.models.assets import is_gguf_model

    dtypes = dtype_candidates(device) if dtype == "auto" else (dtype,)
    if weights == "auto":
        packable = torch.device(device).type == "cpu" and is_gguf_model(model)
        kinds = ("float", "int4") if packable else ("float",)
        if packable and ggml.ggml_available() is None:  # None: llama.cpp runs here
            kinds += AUTO_GGML
    else:
        kinds = (weights,)
    native = fallback_dtype(device)
    out = []
    for dt in dtypes:
        for w in kinds:
            if w == "int4" and dt == "float32" and "auto" in (dtype, weights):
                continue  # the int4 kernel's float32 path is a slow reference: only on request
            if w.startswith("ggml") and dtype == "auto" and dt != native:
                continue  # the dtype is only the draft head's there: the one this CPU runs natively
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
                     message: Callable[[str], None] = say, compile: str = "off") -> PipelineLike:
    """``dtype="auto"`` / ``weights="auto"``: the execution mode of ``candidates`` whose default method models
    fastest here, chosen by measurement (:func:`_choose`) and cached per machine, model, head and candidate set (one
    process measures, others wait for its choice). ``load(mode)`` returns a pipeline in that mode, neither adapted
    nor compiled; ``compile`` (:func:`~adaptree.adapt.compile.compile_tokens`'s mode) is measured and applied for the
    mode kept. Returns the chosen pipeline, adapted."""
    if not candidates:
        raise ValueError("no execution mode to choose from")
    cfg = cfg or AdaptConfig()
    known = None if force else cached_execution(candidates, model, head, device, max_seq_len)
    if known is None and len(candidates) > 1:
        path = _execution_file(model, head, device, max_seq_len, candidates)
        with measure_lock(path):
            known = None if force else cached_execution(candidates, model, head, device, max_seq_len)
            if known is None:  # not chosen by another process while this one waited either
                return _choose(load, candidates, path, cfg, force, progress, message, compile)
    return _set_up(load(known or candidates[0]), cfg, force, progress, message, compile)


def _set_up(pipeline: PipelineLike, cfg: AdaptConfig, force: bool, progress: bool, message: Callable[[str], None],
            compile: str, traces: Path | None = None, choice: dict | None = None) -> PipelineLike:
    """Measure (or take the cached) compile choice and machine setup of ``pipeline``'s mode; returns it adapted."""
    from adaptree.adapt.compile import compile_tokens

    pipeline.target.compile(compile_tokens(pipeline.target, True, compile, message))
    if pipeline.head is not None:
        pipeline.machine = adapt(pipeline, cfg, force=force, progress=progress, message=message, traces=traces,
                                 choice=choice)
    return pipeline


def _choose(load: Callable[[str], PipelineLike], candidates: Sequence[str], path: Path, cfg: AdaptConfig,
            force: bool, progress: bool, message: Callable[[str], None], compile: str) -> PipelineLike:
    """Probe every mode of ``candidates`` (:func:`~adaptree.adapt.probe.probe`: a few shapes timed once, every method
    replayed on traces recorded once) and make the full setup of the best-probed one only; a runner-up gets its full
    setup too only while its probe beats the probe's rate of the default that the set-up modes' live checks kept (a
    live check that keeps ``ar`` where the probe counted on a tree). Of the modes set up, the one whose default models
    fastest is kept; the probes and the choice are written to ``path``. Without a head: the fastest AR step."""
    from adaptree.adapt.probe import choice_estimate_s, next_to_set_up, probe, probe_latency, setup_estimate_s
    from adaptree.adapt.setup import tuning_prompt_ids, tuning_traces
    from adaptree.offline.runs import write_json

    first = load(candidates[0])
    if first.head is None:
        return _choose_ar(load, candidates, first, path, message, compile)
    t0 = time.perf_counter()
    try:
        tuning = tuning_prompt_ids(first, cfg.prompts)
        latency = probe_latency(first, cfg, progress)  # first: it prices what follows
        est = choice_estimate_s(latency, cfg, len(candidates), first.engine.max_len,
                                round(sum(len(ids) for _, ids in tuning) / len(tuning)))
        message(f"choosing the execution mode by measurement among {', '.join(candidates)} (once per machine): greedy "
                f"traces of {cfg.prompts} tuning prompts and their chain calibration (about {est['traces']:.0f} + "
                f"{est['chain']:.0f} s, once per model and head), a short probe of each mode on them (about "
                f"{est['probes'] + latency.meta['took_s']:.0f} s), then the full setup of the fastest only (about "
                f"{est['setup']:.0f} s" + (" plus compiling)" if compile == "auto" else ")"))
        folder, traces, acceptance = tuning_traces(first, cfg, tuning, progress=progress, message=message)
    except (ValueError, RuntimeError) as e:
        raise AdaptError(str(e)) from e
    loaded = {candidates[0]: first}
    del first
    probes, best = {}, None  # best: (name, pipeline) of the best probe so far, kept loaded for its full setup
    for name in candidates:
        p = loaded.pop(name, None) or load(name)
        try:
            probes[name] = probe(p, cfg, traces, acceptance, progress, latency if name == candidates[0] else None)
        except (ValueError, RuntimeError) as e:
            raise AdaptError(f"probing {name}: {e}") from e
        message(f"probe {name}: {probes[name].method} {probes[name].tokens_per_s:.1f} tok/s modelled (AR step "
                f"{probes[name].ar_step_ms:.1f} ms; probed in {probes[name].took_s:.0f} s)")
        if best is None or probes[name].tokens_per_s > probes[best[0]].tokens_per_s:
            best = (name, p)
        del p
    record = {"candidates": list(candidates), "chosen_by": "probe",
              "probes": {name: pr.to_dict() for name, pr in probes.items()}}
    done: dict[str, PipelineLike] = {}
    while (name := next_to_set_up(probes, {n: q.default_method for n, q in done.items()})) is not None:
        p = best[1] if best is not None and best[0] == name else load(name)
        best = None
        checks = "torch.compile's check, " if compile == "auto" else ""
        message(f"full setup of {name}: {checks}the latency calibration, the tree and the live check of the default "
                f"(about {setup_estimate_s(probes[name], cfg, p.engine.max_len):.0f} s"
                + (" plus compiling)" if checks else ")"))
        done[name] = _set_up(p, cfg, force, progress, message, compile, folder, record)
    scores = {n: {"method": q.default_method, "tokens_per_s": q.machine.modelled_tokens_per_s()}
              for n, q in done.items()}
    chosen = max(scores, key=lambda n: scores[n]["tokens_per_s"])
    write_json({"execution": chosen, **record, "set_up": list(done), "scores": scores,
                "took_s": time.perf_counter() - t0, "machine": machine_fields()}, path)
    probed = ", ".join(f"{n} {pr.method} {pr.tokens_per_s:.1f}" for n, pr in probes.items())
    set_up = ", ".join(f"{n} {v['method']} {v['tokens_per_s']:.1f}" for n, v in scores.items())
    message(f"execution {chosen} (probes: {probed} tok/s modelled; set up: {set_up}; chosen in "
            f"{time.perf_counter() - t0:.0f} s)")
    return done[chosen]


def _choose_ar(load: Callable[[str], PipelineLike], candidates: Sequence[str], first: PipelineLike, path: Path,
               message: Callable[[str], None], compile: str) -> PipelineLike:
    """With no head the only method is AR: keep the mode with the fastest decode step."""
    from adaptree.adapt.compile import compile_tokens
    from adaptree.offline.runs import write_json

    message(f"choosing the execution mode by its decode step among {', '.join(candidates)} (once per machine)")
    scores, best, best_score = {}, None, -1.0
    loaded = {candidates[0]: first}
    del first
    for name in candidates:
        p = loaded.pop(name, None) or load(name)
        score = 1.0 / _ar_step_s(p)
        scores[name] = {"method": "ar", "tokens_per_s": score}
        if score > best_score:
            best, best_score = p, score
        del p
    write_json({"execution": best.execution, "chosen_by": "decode step", "scores": scores,
                "machine": machine_fields()}, path)
    message("execution " + best.execution + " (" + ", ".join(
        f"{k}: ar {v['tokens_per_s']:.1f} tok/s" for k, v in scores.items()) + ")")
    best.target.compile(compile_tokens(best.target, True, compile, message))
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
