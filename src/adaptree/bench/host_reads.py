"""Where the host reads tensor values: each such read waits for an accelerator's queue to drain (a device-to-host
transfer), so a cycle should make as few as it can: at most one, or one per draft step where a decision needs it
(docs/performance.md has the counts).

:class:`HostReads` is a ``TorchFunctionMode`` that counts, while active, the calls that hand a tensor's values to
Python: ``item()``, ``tolist()``, ``int()``/``float()``/``bool()``/``__index__`` of a tensor, ``numpy()`` and
``cpu()``, each attributed to the first adaptree source line up the stack. On a CPU nothing waits, but the count
measures the code, not the machine: :attr:`HostReads.accelerator` leaves out the reads the code makes only on a
CPU (:data:`CPU_ONLY`), which gives what a GPU run reads. Run it with ``compile="off"`` (an active mode changes
what Dynamo traces). Implicit waits of data-dependent shapes (``nonzero``, boolean indexing) are not counted.

    with HostReads() as reads:
        g = pipeline.generate(prompt, "hybrid", max_new_tokens=64)
    reads.per_cycle(len(g.cycles)), reads.top(10)
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu"})
"""Tensor methods that hand values to the host."""

CPU_ONLY = ("(cpu_max)", "(is_chain)", "(greedy_tokens)")
"""Functions whose reads happen on the CPU only, where they are free: :func:`adaptree.models.llama.cpu_max` (the
context-limit check and the head's rotary table), :func:`adaptree.core.tree.is_chain` (the engine tells a chain
from a tree, to run it as causal attention, on the CPU only) and :func:`adaptree.core.verify.greedy_tokens` (numpy's
argmax of float32 logits on a CPU)."""

_ROOT = str(Path(__file__).resolve().parents[1])  # src/adaptree


def _site() -> str:
    """``module.py:line (function)`` of the innermost adaptree frame that is not this module."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_ROOT) and not name.endswith("host_reads.py"):
            return f"{name[len(_ROOT) + 1:]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "outside adaptree"


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values by call site (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.sites[_site()] += 1
            self.kinds[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    @property
    def accelerator(self) -> int:
        """The reads a run on an accelerator makes: all but those of :data:`CPU_ONLY`."""
        return sum(n for site, n in self.sites.items() if not site.endswith(CPU_ONLY))

    def per_cycle(self, cycles: int, accelerator: bool = False) -> float:
        if cycles < 1:
            raise ValueError(f"cycles must be >= 1, got {cycles}")
        return (self.accelerator if accelerator else self.total) / cycles

    def top(self, n: int = 10) -> list[tuple[str, int]]:
        return self.sites.most_common(n)


__all__ = ["CPU_ONLY", "READS", "HostReads"]
