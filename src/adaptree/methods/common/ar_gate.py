"""An AR fallback for learned tree policies: autoregressive steps while drafted cycles earn fewer tokens per
modelled second than autoregressive steps would on this machine.

A learned depth/V policy always drafts and verifies a tree; on a machine where no tree pays (a CPU where a
verified node costs nearly a whole step, a weak head) it is slower than plain decoding whatever it chooses. The
gate watches the cycles the policy drafts:

* **Estimate.** Moving averages of their emitted tokens and of their modelled seconds (the latency model's time
  of the cycle's W, depth, V and context, as :mod:`~adaptree.methods.costaware` does: deterministic, the same live
  and in replay; a plain mean over the first ``1/smoothing`` cycles, then weight ``smoothing``) give the policy's
  throughput.
* **Closing.** Once ``min_cycles`` drafted cycles put it below the autoregressive rate ``1 / (verify(0, L) +
  other_s)``, cycles become AR steps.
* **Probes.** After ``interval`` AR steps the policy drafts one cycle again. Probes are judged on their own: AR
  mode ends when the latest ``probe_window`` probes (since closing) earn at least the AR rate, and the averages then
  start from them; each probe that does not doubles the interval. (Probes entering the long averages with weight
  ``smoothing`` instead could not lift them after a bad stretch: on the H100 member, where trees pay 2x, that kept
  generations in AR mode at the longest interval; judging the probes alone moved LTD there from 2.14x to 2.18x
  modelled, docs/adapting.md.)
  Intervals are counted in units of the probe's price: ``probe_every`` (up to ``max_probe_every``) times the cost of
  the policy's smallest tree in AR steps, so a probe never costs more than about ``1/probe_every`` of the time.
* **Hopeless machines.** A generation starts in AR mode, at the longest interval, where no tree from the policy's
  smallest up to 256 nodes can pay at any depth (:meth:`ARGate.hopeless`: its path accepted level after level with
  probability ``optimistic`` earns less than AR steps).

Without a latency model the gate never closes.
"""

from __future__ import annotations

from adaptree.core.records import CycleRecord

LARGEST_TREE = 256
"""The most nodes :meth:`ARGate.hopeless` considers (LTD's and EAGLE-3's largest V is 240)."""


class Meter:
    """The estimate of the module docstring: moving averages of drafted cycles' tokens and modelled seconds (a plain
    mean over the first ``1/smoothing`` cycles, then weight ``smoothing``); a throughput after ``min_cycles``."""

    def __init__(self, smoothing: float = 0.05, min_cycles: int = 8) -> None:
        self.smoothing, self.min_cycles = float(smoothing), int(min_cycles)
        Meter.reset(self)

    def reset(self) -> None:
        self.tokens = self.seconds = 0.0
        self.drafted = 0  # drafted cycles in the averages

    def add(self, tokens: float, seconds: float) -> None:
        a = max(self.smoothing, 1.0 / (self.drafted + 1))
        self.tokens += a * (tokens - self.tokens)
        self.seconds += a * (seconds - self.seconds)
        self.drafted += 1

    def throughput(self) -> float | None:
        """The drafted cycles' modelled tokens per second (the moving averages), or None before ``min_cycles`` of
        them."""
        if self.drafted < self.min_cycles or self.seconds <= 0.0:
            return None
        return self.tokens / self.seconds

    @staticmethod
    def sample(rec: CycleRecord, lat) -> tuple[float, float] | None:
        """(emitted tokens, modelled seconds) of a drafted cycle on latency model ``lat``; None for an AR step or
        without a latency model (nothing to measure)."""
        if lat is None or rec.depth == 0:
            return None
        return rec.accepted + 1, lat.cycle_time(rec.width, rec.depth, rec.size + rec.chain_nodes, rec.context_len)


class ARGate(Meter):
    """See the module docstring."""

    def __init__(self, probe_every: int = 8, smoothing: float = 0.05, min_cycles: int = 8,
                 max_probe_every: int = 64, optimistic: float = 0.8, probe_window: int = 2) -> None:
        if probe_every < 1 or min_cycles < 1 or not 0.0 < smoothing <= 1.0 or max_probe_every < probe_every:
            raise ValueError(f"need probe_every >= 1, min_cycles >= 1, smoothing in (0, 1] and max_probe_every >= "
                             f"probe_every, got {probe_every}, {min_cycles}, {smoothing}, {max_probe_every}")
        if not 0.0 <= optimistic <= 1.0:
            raise ValueError(f"optimistic must be a probability in [0, 1], got {optimistic}")
        self.probe_every = int(probe_every)
        super().__init__(smoothing, min_cycles)
        self.max_probe_every, self.optimistic = int(max_probe_every), float(optimistic)
        if probe_window < 1:
            raise ValueError(f"probe_window must be >= 1, got {probe_window}")
        self.probe_window = int(probe_window)
        self.latency = None
        self.reset()

    @classmethod
    def of(cls, config) -> "ARGate | None":
        """The gate a method's config asks for (its ``ar_fallback`` and ``probe_every``; probes at most 8x further
        apart), or None with the fallback off."""
        return cls(config.probe_every, max_probe_every=8 * config.probe_every) if config.ar_fallback else None

    def reset(self) -> None:
        """A new generation: the averages start again."""
        super().reset()
        self.ar_mode = False
        self.ar_cycles = 0
        self.probes: list[tuple[float, float]] = []  # (tokens, seconds) of the latest probes
        self.price = 1.0  # AR steps one probe costs (the smallest tree's cycle time over an AR step)
        self.interval = float(self.probe_every)  # AR steps between probes
        self.first = True

    def _ratio(self, width: int, depth: int, size: int, context_len: int) -> float:
        """A tree's cycle time (``depth`` draft steps, ``size`` nodes) over one AR step."""
        lat = self.latency
        return lat.cycle_time(width, depth, size, context_len) / max(lat.ar_step(context_len), 1e-12)

    def hopeless(self, width: int, size: int, max_depth: int, context_len: int) -> bool:
        """No tree of ``size`` to :data:`LARGEST_TREE` nodes (doubling) and depth 1..``max_depth`` pays even if its path
        is accepted level after level with probability ``optimistic`` each (expected tokens ``1 + o + o^2 + ...`` up
        to min(depth, V) levels); False without a latency model. Larger trees count: where the step from one row to
        several costs most of a forward, a tree of one node cannot pay and one of a few can (on the family's
        member with that step, 0.8 of a forward, LTD modelled 1.31x with the smallest tree alone judged, 1.81x with
        this)."""
        if self.latency is None:
            return False
        v = max(1, int(size))
        while True:
            gain = 1.0
            for d in range(1, max_depth + 1):
                if d <= v:
                    gain += self.optimistic ** d
                if gain > self._ratio(width, d, v, context_len):
                    return False
            if v >= LARGEST_TREE:
                return True
            v = min(2 * v, LARGEST_TREE)

    def ar_step(self, width: int, size: int, max_depth: int, context_len: int) -> bool:
        """At the start of a cycle whose smallest tree has width ``width``, ``size`` nodes and at most ``max_depth``
        levels: an AR step instead of the policy's tree?"""
        if self.first:
            self.first = False
            if self.latency is not None:
                self.price = max(1.0, self._ratio(width, 1, size, context_len))
                self.interval = self.probe_every * self.price
                if self.hopeless(width, size, max_depth, context_len):
                    self.ar_mode, self.interval = True, self.max_probe_every * self.price
        if not self.ar_mode:
            return False
        self.ar_cycles += 1
        if self.ar_cycles < self.interval:
            return True
        self.ar_cycles = 0
        return False

    def record(self, rec: CycleRecord) -> None:
        """After a cycle: update the averages with a drafted cycle, decide on AR mode."""
        lat = self.latency
        drafted = self.sample(rec, lat)
        if drafted is None:
            return
        tokens, t = drafted
        ar_rate = 1.0 / max(lat.ar_step(rec.context_len), 1e-12)
        if self.ar_mode:  # a probe: the latest probes earn the AR rate, or the next one waits longer
            self.probes = (self.probes + [(tokens, t)])[-self.probe_window:]
            probe_tokens, probe_seconds = (sum(x) / len(self.probes) for x in zip(*self.probes))
            if probe_tokens < ar_rate * probe_seconds:
                self.interval = min(2 * self.interval, self.max_probe_every * self.price)
                return
            self.ar_mode, self.interval = False, self.probe_every * self.price
            self.tokens, self.seconds = probe_tokens, probe_seconds
            return
        self.add(tokens, t)
        if self.tokens < ar_rate * self.seconds and self.drafted >= self.min_cycles:
            self.ar_mode, self.ar_cycles, self.probes = True, 0, []
