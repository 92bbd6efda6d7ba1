"""LTD end to end from a loaded :class:`~adaptree.api.Pipeline` (what ``adaptree train ltd`` runs): greedy traces of
the training prompts, then PPO (:func:`~adaptree.methods.ltd.train.train_ltd`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptree.methods.ltd.train import LTDTrainConfig, train_ltd
from adaptree.offline.recording import TrainingPrompts, training_traces
from adaptree.offline.runs import TrainingResult

if TYPE_CHECKING:
    from adaptree.offline.latency import LatencyModel


def train_ltd_for(pipeline, cfg: LTDTrainConfig, latency: LatencyModel,
                  prompts: TrainingPrompts = TrainingPrompts(), *, live: bool = False, progress: bool = True) -> TrainingResult:
    """Train LTD's policies for ``pipeline``'s target and head: the greedy traces of ``prompts`` (recorded into
    ``prompts.traces`` or ``cfg.out``/traces when missing), then :func:`~adaptree.methods.ltd.train.train_ltd` on
    the simulator with ``latency``, or on the live engine with wall-clock rewards when ``live`` (validation stays on
    the simulator). Returns the run folder, the exported pair and the training summary."""
    chosen = prompts.prompts()
    traces = training_traces(pipeline, prompts.trace_folder(cfg.out), chosen, prompts.max_new_tokens, (cfg.width,),
                             cfg.max_depth, progress=progress)
    live_source = None
    if live:
        from adaptree.offline.envs import LiveSource

        live_source = LiveSource(pipeline.engine, [pipeline.encode(p.turns[0]) for p in chosen],
                                 max_new_tokens=prompts.max_new_tokens)
    return train_ltd(cfg, traces, latency, progress=progress, live_source=live_source)
