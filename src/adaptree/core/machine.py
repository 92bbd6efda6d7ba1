"""What a result was measured on: the machine profile recorded with every benchmark, latency model, tuned
tree and trained head.

Timings on a CPU depend less on the CPU's name than on which kernels run: PyTorch picks its vectorised kernels
by the CPU's instruction sets (``torch.backends.cpu.get_cpu_capability()``: ``AVX512``, ``AVX2`` or
``DEFAULT``; ``ATEN_CPU_CAPABILITY`` lowers it), oneDNN its own (``ONEDNN_MAX_CPU_ISA``), and bfloat16 is fast
only with native support (``avx512_bf16``, ``amx_bf16``). :func:`machine_profile` records all of them, so two
machines (or two kernel settings on one machine) that time differently never look alike.
"""

from __future__ import annotations

import os
import platform

import torch

CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile",
             "amx_bf16", "amx_int8", "neon", "asimd", "sve")
"""The instruction-set flags that decide which matmul / bf16 kernels a CPU runs (x86 and Arm names)."""


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break
                    continue
                key, _, value = line.partition(":")
                out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


def cpu_model() -> str:
    info = _cpuinfo()
    return info.get("model name") or info.get("Model") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The :data:`CPU_FLAGS` this CPU has, in that order (empty where ``/proc/cpuinfo`` says nothing)."""
    info = _cpuinfo()
    have = set((info.get("flags") or info.get("Features") or "").split())
    return [f for f in CPU_FLAGS if f in have]


def kernel_level() -> str:
    """The CPU kernels PyTorch runs here: ``AVX512``, ``AVX2``, ``DEFAULT`` (x86) or its Arm levels; after
    ``ATEN_CPU_CAPABILITY``, which can lower it."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # an old torch
        return "unknown"


def onednn_max_isa() -> str:
    """oneDNN's ISA limit (``ONEDNN_MAX_CPU_ISA``, or its older name ``DNNL_MAX_CPU_ISA``); ``default`` when unset."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "default"


def machine_profile() -> dict:
    """The fingerprint of this machine for timings: CPU model, its kernel-relevant flags, PyTorch's and oneDNN's
    kernel levels, cores, torch threads and version, platform, and the GPU when there is one."""
    info = {
        "cpu": cpu_model(), "cpu_flags": cpu_flags(), "cpu_capability": kernel_level(),
        "onednn_max_isa": onednn_max_isa(),
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_info() -> dict:
    """:func:`machine_profile` plus the Python and transformers versions (what a results file records)."""
    import transformers

    return {**machine_profile(), "python": platform.python_version(), "transformers": transformers.__version__}


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve every allocation from its heap and never hand freed memory back to the
    system (``mallopt``: no mmap'd chunks, a 1 GiB trim threshold), for the rest of the process.

    By default every allocation over 128 KiB-32 MiB is a fresh ``mmap`` that the kernel must fault in page by
    page and an ``munmap`` when freed, and the head-training loop frees and reallocates its large activations
    (``[rows, draft_vocab]`` logits, ~100 MB) every step, so the kernel's page faults become a visible share of
    a training step (docs/head-training.md, "The data pipeline on 2 cores", has the rates). The process keeps
    its peak memory. Returns False where the C library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False
