"""Host time per cycle: the part of a cycle's wall time that is not a model forward (the engine's and the
controller's own Python: tree building, the acceptance walk, cache compaction, the policies, the records).

:class:`ForwardClock` times every forward of the target and of the draft head while active (forward hooks, with
the device synchronised at both ends, so on a GPU a forward's time is its queue's too); what a generation spent
outside them is host time. The cycle records split it further (``policy_s``: the controller's calls, ``other_s``:
the loop's bookkeeping after the verification), and the draft and verify seconds minus their forwards give the
draft loop's and the verification's own bookkeeping.

    with ForwardClock(pipeline.target, pipeline.head) as clock:
        g = pipeline.generate(prompt, "hybrid", max_new_tokens=64)
    split = host_split([g], clock)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from adaptree.core.engine import synchronize
from adaptree.core.records import GenerationResult


class ForwardClock:
    """Seconds spent in forwards of each given module (``target``, ``head``) while active; the device is
    synchronised before a forward starts and after it ends. The target's forwards on an empty cache (prefills, which
    a generation's ``prefill_s`` covers) are not counted; the head's first forward of a generation (over the
    prompt's features, inside the first cycle) is."""

    def __init__(self, target: torch.nn.Module, head: torch.nn.Module | None = None) -> None:
        self.modules = {"target": target, **({"head": head} if head is not None else {})}
        self.seconds = dict.fromkeys(self.modules, 0.0)
        self.calls = dict.fromkeys(self.modules, 0)
        self._started: dict[str, float] = {}
        self._hooks: list = []

    def _pre(self, name: str, device: torch.device):
        def hook(module, args, kwargs):
            cache = kwargs.get("cache")
            if name == "target" and cache is not None and cache.length == 0:
                return
            synchronize(device)
            self._started[name] = time.perf_counter()
        return hook

    def _post(self, name: str, device: torch.device):
        def hook(module, args, kwargs, output):
            if name not in self._started:
                return
            synchronize(device)
            self.seconds[name] += time.perf_counter() - self._started.pop(name)
            self.calls[name] += 1
        return hook

    def __enter__(self) -> ForwardClock:
        for name, m in self.modules.items():
            dev = next(m.parameters()).device
            self._hooks.append(m.register_forward_pre_hook(self._pre(name, dev), with_kwargs=True))
            self._hooks.append(m.register_forward_hook(self._post(name, dev), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def host_split(gens: Sequence[GenerationResult], clock: ForwardClock) -> dict[str, float]:
    """Per-cycle milliseconds of ``gens`` (generated while ``clock`` ran and nothing else did): ``cycle`` (the
    wall time after the prefill), ``target``/``head`` (their forwards, the prefill's left out), ``host`` (the rest),
    and the host time's parts: ``policy`` (the controller), ``other`` (the loop after the verification),
    ``draft_loop`` (drafting minus the head's forwards) and ``verify_host`` (the verification minus the target's
    forward: tree assembly, mask, acceptance walk, cache compaction)."""
    cycles = [c for g in gens for c in g.cycles]
    n = len(cycles)
    if not n:
        raise ValueError("no cycles to split (every generation stopped at its prefill)")
    target, head = clock.seconds["target"], clock.seconds.get("head", 0.0)
    cycle = sum(g.wall_time_s - g.prefill_s for g in gens)
    draft = sum(c.draft_s for c in cycles)
    verify = sum(c.verify_s for c in cycles)
    ms = 1000.0 / n
    return {"cycles": n, "tokens_per_cycle": sum(c.emitted for c in cycles) / n,
            "cycle": cycle * ms, "target": target * ms, "head": head * ms,
            "host": (cycle - target - head) * ms,
            "policy": sum(c.policy_s for c in cycles) * ms, "other": sum(c.other_s for c in cycles) * ms,
            "draft_loop": max(0.0, draft - head) * ms, "verify_host": max(0.0, verify - target) * ms}
