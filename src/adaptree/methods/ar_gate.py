"""An AR fallback for learned tree policies (issue 16): autoregressive steps while drafted cycles earn fewer
tokens per modelled second than autoregressive steps would on this machine.

A learned depth/V policy always drafts and verifies a tree; on a machine where no tree pays (a CPU where a
verified node costs nearly a whole step, a weak head) it is slower than plain decoding whatever it chooses. The
gate watches the cycles the policy drafts: the exponential moving averages (weight ``smoothing``) of their
emitted tokens and of their modelled seconds (the latency model's time of the cycle's W, depth, V and context,
as :mod:`~adaptree.methods.costaware` does: deterministic, the same live and in replay) give the policy's
throughput; once ``min_cycles`` drafted cycles put it below the autoregressive rate ``1 / (verify(0, L) +
other_s)``, cycles become AR steps, except every ``probe_every``-th, which lets the policy draft again; the
probes enter the averages, and AR mode ends when they lift the policy's throughput back over the AR rate.
Without a latency model the gate never closes.
"""

from __future__ import annotations

from adaptree.core.records import CycleRecord


class ARGate:
    """See the module docstring."""

    def __init__(self, probe_every: int = 8, smoothing: float = 0.1, min_cycles: int = 4) -> None:
        if probe_every < 1 or min_cycles < 1 or not 0.0 < smoothing <= 1.0:
            raise ValueError(f"need probe_every >= 1, min_cycles >= 1 and smoothing in (0, 1], got {probe_every}, "
                             f"{min_cycles}, {smoothing}")
        self.probe_every, self.smoothing, self.min_cycles = int(probe_every), float(smoothing), int(min_cycles)
        self.latency = None
        self.reset()

    def reset(self) -> None:
        self.tokens = self.seconds = 0.0
        self.drafted = 0  # drafted cycles in the averages
        self.ar_mode = False
        self.ar_cycles = 0

    def ar_step(self) -> bool:
        """At the start of a cycle: take an AR step instead of the policy's tree?"""
        if not self.ar_mode:
            return False
        self.ar_cycles += 1
        return self.ar_cycles % self.probe_every != 0

    def record(self, rec: CycleRecord) -> None:
        """After a cycle: update the averages with a drafted cycle, decide on AR mode."""
        lat = self.latency
        if lat is None or rec.depth == 0:
            return
        t = lat.cycle_time(rec.width, rec.depth, rec.size, rec.context_len)
        ar_rate = 1.0 / max(lat.verify_time(0, rec.context_len) + lat.other_s, 1e-12)
        a = self.smoothing if self.drafted else 1.0
        self.tokens += a * (rec.accepted + 1 - self.tokens)
        self.seconds += a * (t - self.seconds)
        self.drafted += 1
        slower = self.tokens < ar_rate * self.seconds
        if self.ar_mode and not slower:  # a probe lifted the average back over the AR rate
            self.ar_mode = False
        elif not self.ar_mode and slower and self.drafted >= self.min_cycles:
            self.ar_mode, self.ar_cycles = True, 0
