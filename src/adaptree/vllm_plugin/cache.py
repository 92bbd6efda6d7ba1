"""What vLLM reads, prepared once into adaptree's cache: the head exported as vLLM's EAGLE-3 drafter
(:func:`prepared_head`) and vLLM's step costs on this machine (:func:`prepared_step_costs`), for ``adaptree serve
--engine vllm`` and the bench's vLLM arms."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_digest(folder: Path) -> str:
    from adaptree.models.cache import file_sha256  # remembered per file: an unchanged head is hashed once

    return _digest(*(file_sha256(folder / name) for name in ("config.json", "model.safetensors")))


def prepared_head(model: str | None, head: str, dtype: str) -> Path:
    """The head exported for vLLM in adaptree's cache (written on first use, keyed by the head's files)."""
    import torch

    from adaptree.models.cache import cache_dir
    from adaptree.vllm_plugin.export import export_head, resolve_head, target_config, target_folder

    source = resolve_head(model, head)
    if not (source / "config.json").is_file() or not (source / "model.safetensors").is_file():
        raise ValueError(f"head {str(source)!r}: needs config.json and model.safetensors")
    out = cache_dir() / "vllm" / f"head-{_file_digest(source)}-{dtype}"
    if not (out / "config.json").is_file():
        folder = target_folder(model, getattr(torch, dtype))
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        export_head(source, target_config(folder), tmp, getattr(torch, dtype))
        if out.exists():  # another process exported it meanwhile: the same files
            shutil.rmtree(tmp)
        else:
            tmp.replace(out)
    return out


def prepared_step_costs(model: str | None, head: Path, dtype: str, k_max: int, threads: int | None,
                        progress: Callable[[int, int], None] | None = None) -> Path:
    """vLLM's step costs on this machine for the target, head, dtype and threads, in adaptree's cache (measured on
    first use: a few minutes; :func:`adaptree.vllm_plugin.engine.measure_step_costs`)."""
    import torch

    from adaptree.core.machine import machine_profile
    from adaptree.data.prompts import load_prompt_sets
    from adaptree.models import load_model
    from adaptree.models.cache import cache_dir
    from adaptree.vllm_plugin.engine import measure_step_costs_to
    from adaptree.vllm_plugin.export import target_folder

    target = target_folder(model, getattr(torch, dtype))
    # what the measurement records and how it runs: files measured before the grid search (static-gs's tokens per
    # second) or with vLLM's EAGLE prefix-cache block drop are not reused
    key = _digest(machine_profile(), str(target), head.name, dtype, k_max, threads, "grid", "kept blocks")
    path = cache_dir() / "vllm" / f"step-costs-{key}.json"
    if path.is_file():
        return path
    _, tok = load_model(model, getattr(torch, dtype))
    prompts = [tok.apply_chat([{"role": "user", "content": p.turns[0]}])
               for _, ps in load_prompt_sets(("mt_bench", "humaneval"), limit=3) for p in ps]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    measure_step_costs_to(tmp, target, head, prompts, k_max=k_max, dtype=dtype, threads=threads, progress=progress)
    tmp.replace(path)
    return path
