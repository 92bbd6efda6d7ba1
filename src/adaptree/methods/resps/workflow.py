"""Re-SpS end to end from a loaded :class:`~adaptree.api.Pipeline` (what ``adaptree train resps`` runs): split the
training prompts, record the traces the simulator needs, then PPO (:func:`~adaptree.methods.resps.train.train_resps`)
on the simulator or the live engine, validated on either.

An existing trace folder (``--traces``) is used as it was recorded whenever it holds what the action set needs (every
k as a recorded width, trees at least as deep as the largest d, the target's features): recording those prompts
again with the run's own widths and depth would only cost time. Prompts missing from it are recorded with the
folder's settings; a folder that lacks something is refused with what it lacks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from adaptree.methods.resps.controller import action_widths
from adaptree.methods.resps.train import (
    LiveValidator,
    ReSpSTrainConfig,
    SimValidator,
    split_prompts,
    train_resps,
)
from adaptree.offline.recording import TrainingPrompts, require_head, training_traces
from adaptree.offline.runs import TrainingResult

if TYPE_CHECKING:
    from adaptree.offline.latency import LatencyModel

VALIDATION = ("sim", "live")
"""Where the held-out prompts are validated: in the simulator or on the live engine (tokens/s)."""


def trace_settings_for(cfg: ReSpSTrainConfig, folder: str | os.PathLike, feature_dtype: str) -> tuple:
    """``(widths, max_depth, feature_dtype)`` to record into ``folder``: the run's own (:meth:`ReSpSTrainConfig.
    trace_widths`, :meth:`~ReSpSTrainConfig.trace_depth`) for a new folder, the folder's where it already holds what
    the action set needs (a ValueError naming what it lacks otherwise). The static EAGLE-3 baseline (W=10, depth 8)
    is not needed: the summary leaves it out when the traces cannot replay it."""
    from pathlib import Path

    from adaptree.offline.traces import TraceStore

    if not (Path(folder) / "manifest.json").exists():
        return cfg.trace_widths(), cfg.trace_depth(), feature_dtype
    s = TraceStore(folder).settings
    lacks = []
    widths = sorted(set(cfg.trace_widths() if cfg.machine_tree else action_widths(cfg.actions())) - set(s.widths))
    if widths:
        lacks.append(f"widths {widths} (it has {list(s.widths)})")
    depth = cfg.trace_depth() if cfg.machine_tree else max(d for _, d, _ in cfg.actions())
    if s.max_depth < depth:
        lacks.append(f"depth {depth} (it has max_depth {s.max_depth})")
    if cfg.state != "embedding" and s.feature_dtype == "none":
        lacks.append("the target features (it was recorded with feature_dtype none)")
    if lacks:
        raise ValueError(f"the trace folder {folder} lacks what this action set needs: {'; '.join(lacks)}. Record "
                         f"into another folder (--traces), or choose --topks/--depths it covers")
    return s.widths, s.max_depth, s.feature_dtype


def train_resps_for(pipeline, cfg: ReSpSTrainConfig, latency: LatencyModel | None,
                    prompts: TrainingPrompts = TrainingPrompts(train_code=0, train_chat=64), *, live: bool = False,
                    validation: str = "sim", feature_dtype: str = "float16",
                    progress: bool = True) -> tuple[TrainingResult, list[str], list[str]]:
    """Train a Re-SpS policy for ``pipeline``'s target and head.

    :param latency: the simulator's latency model; needed unless both training (``live``) and ``validation`` are
        live.
    :param live: train online on the live engine with wall-clock rewards (the paper's mode) instead of the simulator.
    :param validation: ``sim`` or ``live``.
    :param feature_dtype: stored target features of the traces (the state is built from them; an existing folder's
        own, when it has features).
    :returns: the training summary, the training prompts' keys and the held-out ones.
    """
    if validation not in VALIDATION:
        raise ValueError(f"validation must be one of {', '.join(VALIDATION)}, got {validation!r}")
    sim_train, sim_val = not live, validation == "sim"
    if (sim_train or sim_val) and latency is None:
        raise ValueError("the simulator needs a latency model: pass --latency FILE (`adaptree calibrate`)")
    require_head(pipeline, "Re-SpS training")
    target, head = pipeline.target, pipeline.head
    if (cfg.family or cfg.spread != 1.0) and not (sim_train or sim_val):
        raise ValueError("--family/--spread are latency models for the simulator: they need simulator training or "
                         "validation (drop --live or --val live)")
    family = cfg.latency_family(latency) if sim_train or sim_val else None
    keyed = {f"{p.dataset}/{p.id}": p for p in prompts.prompts()}
    train_keys, val_keys = split_prompts(list(keyed), cfg.val_fraction, cfg.seed)
    traces = {}
    if sim_train or sim_val or cfg.match:  # live training, sim validation: the held-out prompts' traces only
        need = list(keyed) if sim_train or cfg.match else val_keys
        folder = prompts.trace_folder(cfg.out)
        widths, depth, dtype = trace_settings_for(cfg, folder, feature_dtype)
        for t in training_traces(pipeline, folder, [keyed[k] for k in need], prompts.max_new_tokens,
                                 widths, depth, feature_dtype=dtype, progress=progress):
            traces[t.key] = t
        if cfg.state != "embedding" and any(t.features is None for t in traces.values()):
            raise ValueError(f"the traces in {folder} hold no target features (recorded with --feature-dtype none); "
                             f"Re-SpS's state needs them: record into another folder")

    def encoded(keys):
        return [(k, pipeline.encode(keyed[k].turns[0])) for k in keys]

    if cfg.machine_tree and (family is not None or latency is not None):
        from adaptree.methods.common.machine_tree import attach

        # each machine's static tree, fitted on the training prompts
        attach(family.bases if family is not None else [latency], [traces[k] for k in train_keys], progress=progress)
    if sim_train:
        from adaptree.offline.envs import SimSource

        source = SimSource([traces[k] for k in train_keys], latency, family=family)
    else:
        from adaptree.offline.envs import LiveSource

        source = LiveSource(pipeline.engine, [ids for _, ids in encoded(train_keys)],
                            max_new_tokens=prompts.max_new_tokens, latency=latency if cfg.costs else None)
    if sim_val:
        val_traces = [traces[k] for k in val_keys]
        validator = (SimValidator.of_family(val_traces, family) if family is not None
                     else SimValidator(val_traces, latency))
    else:
        validator = LiveValidator(pipeline.engine, encoded(val_keys), prompts.max_new_tokens,
                                  latency=latency if cfg.costs else None)
    from adaptree.offline.traces import head_fingerprint, model_fingerprint

    facts = {"model": pipeline.model_label, "dtype": pipeline.dtype_name,
             "max_new_tokens": prompts.max_new_tokens, "model_sha256": model_fingerprint(target),
             "head_sha256": head_fingerprint(head), "train_prompts": train_keys}
    chain_cal = None
    if cfg.match:  # the chain rates of the training prompts (the context chains' acceptance)
        from adaptree.methods.common import ChainCalibration

        chain_cal = ChainCalibration.fit([traces[k] for k in train_keys])
    summary = train_resps(cfg, source, validator, hidden=target.config.hidden_size, progress=progress, facts=facts,
                          tokenizer=pipeline.tokenizer, chain_calibration=chain_cal, family=family)
    return summary, train_keys, val_keys
