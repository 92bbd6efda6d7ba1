"""The runtime every learned method (LTD, RADAR, Re-SpS) runs its policies in, declared and wired once.

* :class:`LearnedRuntime`: the config fields they share (this machine's latency model, the AR fallback, the context
  chain) and their checks. A method's config lists it first among its bases, so the tree shape's fields keep their
  places (``Config(W, D, V)``); its fields are keyword-only.
* :class:`LearnedSeam`: the controller hooks that follow from them: the chain rule (:class:`~.chain.ChainSeam`) and
  the AR gate (:class:`~.ar_gate.ARGate`) get the latency model, the gate starts again with every generation and
  sees every cycle's record (the chain rule prices its tokens at the gate's throughput), and a cycle is the
  policies' plan with the context's chain, or an AR step.

Both are shared so that the three methods cannot drift apart in what a flag means or when the fallback acts: the
simulator's replay of one is then the replay of all.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptree.core.config import at_least, check_fields, positive
from adaptree.core.controller import AR_PLAN, CycleContext, TreePlan
from adaptree.core.records import CycleRecord
from adaptree.methods.common.ar_gate import ARGate
from adaptree.methods.common.chain import ChainCalibration, ChainRule, ChainSeam
from adaptree.methods.common.machine_tree import MachineTree


@dataclass(kw_only=True)
class LearnedRuntime:
    """The settings a learned method's policies run under (module docstring); checked on construction, then the
    next base's checks run."""

    latency: str | None = None
    """Latency model JSON of this machine: the AR fallback's costs and the cost features of policies that see them
    (filled from the machine setup; without one, no fallback and such policies' reference costs)."""
    ar_fallback: bool = True
    """Take AR steps while the policies' trees earn fewer tokens per modelled second than AR steps here, with probe
    cycles (adaptree.methods.common.ar_gate; needs a latency model)."""
    probe_every: int = positive(8, integer=True)
    """In AR mode, AR steps before a probe, counted in units of the cost of the policies' smallest tree (the interval
    doubles while probes fail, up to 8x)."""
    chain: str | None = None
    """Chain calibration JSON of this model (the machine setup's chain.json): for policies that observe the context
    match, and for chain_tokens."""
    chain_tokens: int | None = at_least(0, None, integer=True)
    """Longest context chain verified per cycle next to the policies' tree (adaptree.methods.common.ChainRule).
    Default: 16 with policies that observe the context match, else none (0)."""
    tuned: str | None = None
    """The machine's static tree (the machine setup's static_gs.json: its depth and best V per depth), for policies
    that observe it (adaptree.methods.common.machine_tree) and RADAR's V per depth; a latency model that carries one
    (a family member in training) wins."""

    def __post_init__(self) -> None:
        check_fields(self)  # the method's own fields too (adaptree.core.config)
        after = getattr(super(), "__post_init__", None)
        if after is not None:
            after()


class LearnedSeam(ChainSeam):
    """The controller hooks of a learned method's runtime (module docstring). Put it before
    :class:`~adaptree.core.controller.Controller` in the bases, call :meth:`start_runtime` in ``__init__`` and
    :meth:`load_latency` once the policies are set up; a controller that overrides a hook calls ``super()``'s.

    The default :meth:`begin_cycle` needs ``self.plan`` (the policies' largest tree), ``self.observes`` (whether the
    policies observe the context match: ``self.match`` then holds its features for the cycle) and
    ``self.smallest``.
    """

    gate: ARGate | None = None
    reads_features = False  # but Re-SpS's feature states
    smallest: tuple[int, int, int]
    """(width, size, max depth) of the policies' smallest tree: what the AR gate prices a probe at."""

    machine_tree: MachineTree | None = None
    """The machine's static tree (``tuned``, or the latency model's own), for policies that observe it."""

    def start_runtime(self, config: LearnedRuntime, chain_calibration: ChainCalibration | None,
                      observes: bool) -> None:
        """The chain rule, the AR gate and the machine tree ``config`` asks for (``chain_calibration``: a loaded one
        instead of ``config.chain``; ``observes``: the policies observe the context match)."""
        self.chain_rule = ChainRule.of(config, chain_calibration, observes, self.name)
        self.gate = ARGate.of(config)
        self.machine_tree = MachineTree.load(config.tuned) if config.tuned else None

    def load_latency(self, config: LearnedRuntime) -> None:
        """:meth:`use_latency` of ``config.latency`` (checked) when it names one."""
        if config.latency:
            from adaptree.offline.latency import load_checked

            self.use_latency(load_checked(config.latency, quiet=True))

    def use_latency(self, latency) -> None:
        tree = MachineTree.of(latency)
        if tree is not None:
            self.machine_tree = tree
        if self.gate is not None:
            self.gate.latency = latency
        if self.chain_rule is not None:
            self.chain_rule.latency = latency

    def reset(self) -> None:
        if self.gate is not None:
            self.gate.reset()
        if self.chain_rule is not None:
            self.chain_rule.reset()

    def end_cycle(self, record: CycleRecord) -> None:
        if self.gate is not None:
            self.gate.record(record)
        if self.chain_rule is not None:  # chain tokens are priced at what the method earns
            if self.gate is not None:
                self.chain_rule.rate = self.gate.throughput()
            else:
                self.chain_rule.record(record)

    def begin_chain(self, ctx: CycleContext) -> tuple[int, ...]:
        """The cycle's chain (empty without a chain rule or a match); :meth:`match_features` then describe it."""
        return self.chain_rule.begin(ctx) if self.chain_rule is not None else ()

    def require_tree(self) -> MachineTree:
        """The machine tree, for policies that observe it; a ValueError naming the flag without one."""
        if self.machine_tree is None:
            raise ValueError(f"this {self.name} policy observes the machine's static tree: give it the machine setup's "
                             f"static_gs.json (--{self.name.split('-')[0]}-tuned PATH; `adaptree adapt` makes one)")
        return self.machine_tree

    def match_features(self, observes: bool) -> list[float] | None:
        """The cycle's match features for policies that observe them (``observes``), else None."""
        return self.chain_rule.features() if observes and self.chain_rule is not None else None

    def ar_step(self, ctx: CycleContext) -> bool:
        """Does the AR gate make this cycle an AR step? (Never without a gate or a latency model.)"""
        gate = self.gate
        return gate is not None and gate.latency is not None and gate.ar_step(*self.smallest, ctx.context_len)

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        """The policies' plan, or an AR step, with the context's chain."""
        chain = self.begin_chain(ctx)
        self.match = self.match_features(self.observes)
        return (AR_PLAN if self.ar_step(ctx) else self.plan).with_chain(chain)


__all__ = ["LearnedRuntime", "LearnedSeam"]
