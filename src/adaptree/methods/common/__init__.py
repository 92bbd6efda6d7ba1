"""What the learned methods (LTD, RADAR, Re-SpS) share at run time, and the chain seam the hybrid shares with them.

- :mod:`.runtime`: :class:`LearnedRuntime` (the config fields ``latency``, ``ar_fallback``, ``probe_every``,
  ``chain``, ``chain_tokens`` and their checks) and :class:`LearnedSeam` (the controller hooks they imply)
- :mod:`.chain`: :class:`ChainCalibration` (per match length and temperature, how often each chain token is
  accepted; plain JSON, strict loading), :class:`ChainRule` and :class:`ChainSeam` (a context chain next to a
  policy's tree), :data:`MATCH_FEATURES` (what a policy observes of the match)
- :mod:`.pricing`: the cost rule's decisions as functions (costaware's V and look-ahead, hybrid's joint split of head
  nodes and chain tokens), shared by costaware, hybrid and the rule's actions of the learned methods' policies
  (:meth:`ChainRule.priced_size`, :meth:`ChainRule.priced_continue`)
- :mod:`.ar_gate`: :class:`ARGate` (AR steps while the policies' trees do not pay on this machine) and its
  throughput :class:`~.ar_gate.Meter`
- :mod:`.machine_tree`: :class:`MachineTree` (the machine's best static tree and best V per depth, as policy inputs
  and as the scale of relative size actions)
- :mod:`.classifier`: the acceptance classifier SpecDec++ and C2T run (its file format, samples from traces, the
  supervised trainer); imported by those methods, not here
"""

from adaptree.methods.common.ar_gate import ARGate
from adaptree.methods.common.chain import (
    CHAIN_OPTIONS,
    DEFAULT_EDGES,
    MATCH_FEATURES,
    RULE,
    SAMPLED_TEMPERATURES,
    ChainCalibration,
    ChainRule,
    ChainSeam,
    match_values,
)
from adaptree.methods.common.machine_tree import SIZE_FACTORS, MachineTree
from adaptree.methods.common.pricing import Split, price_split, shared_ranks
from adaptree.methods.common.runtime import LearnedRuntime, LearnedSeam

__all__ = ["ARGate", "CHAIN_OPTIONS", "ChainCalibration", "ChainRule", "ChainSeam", "DEFAULT_EDGES", "LearnedRuntime",
           "LearnedSeam", "MATCH_FEATURES", "MachineTree", "RULE", "SAMPLED_TEMPERATURES", "SIZE_FACTORS",
           "Split", "match_values", "price_split", "shared_ranks"]
