"""Offline learning support: greedy traces, an exact replay simulator and a latency model (DESIGN.md)."""

from adaptree.offline.latency import LatencyModel, calibrate
from adaptree.offline.simulator import ReplayTree, SimResult, SimRun, simulate
from adaptree.offline.traces import (
                     PromptTrace,
                     TraceSettings,
                     TraceStore,
                     WidthTrace,
                     acceptance_table,
                     accepted_length,
                     load_trace,
                     match_mask,
                     record_trace,
                     save_trace,
)

__all__ = ["LatencyModel", "calibrate", "ReplayTree", "SimResult", "SimRun", "simulate", "PromptTrace",
           "TraceSettings", "TraceStore", "WidthTrace", "acceptance_table", "accepted_length", "load_trace",
           "match_mask", "record_trace", "save_trace"]
