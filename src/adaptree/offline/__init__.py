"""Method-agnostic offline machinery: what every learned method trains and is evaluated on.

- :mod:`.traces`: greedy traces (the output and every tree the head would grow) and their store
- :mod:`.store`: the fingerprinted store (traces, RADAR's dataset) pinned to the model, head and settings
- :mod:`.simulator`: exact replay of any controller over traces (the engine's own cycle loop)
- :mod:`.latency`: the calibrated latency model; :mod:`.calibration`: making and validating it
- :mod:`.oracle`: the DP schedule per cycle and the best static tree on the same traces
- :mod:`.envs`: gymnasium sources (simulator or live engine), the bridge controller, ``CycleEnv``
- :mod:`.policy`: the shipped policy format (safetensors + JSON, strict loading), the MLP actor
- :mod:`.runs`: run folders, checkpoints, splits, CSV logs and tables shared by every trainer
"""

from adaptree.offline.latency import LatencyModel, calibrate
from adaptree.offline.simulator import ReplayTree, SimResult, SimRun, simulate
from adaptree.offline.traces import (PromptTrace, TraceSettings, TraceStore, WidthTrace, acceptance_table,
                                     accepted_length, load_trace, match_mask, record_trace, save_trace)

__all__ = ["LatencyModel", "calibrate", "ReplayTree", "SimResult", "SimRun", "simulate", "PromptTrace",
           "TraceSettings", "TraceStore", "WidthTrace", "acceptance_table", "accepted_length", "load_trace",
           "match_mask", "record_trace", "save_trace"]
