"""RADAR's dataset from a loaded :class:`~adaptree.api.Pipeline` (what ``adaptree radar dataset`` runs): the engine
at the dataset's sampling settings over ShareGPT training prompts, every cycle's beam scores and the exact
accepted-length distribution of every stop point (:class:`~adaptree.methods.radar.dataset.RadarStore`)."""

from __future__ import annotations

import os
from dataclasses import replace

from adaptree.methods.radar.dataset import RadarDataSettings, RadarStore
from adaptree.offline.recording import encoding_extra, require_head


def record_radar_dataset(pipeline, out: str | os.PathLike, settings: RadarDataSettings = RadarDataSettings(),
                         *, limit: int = 200, split_seed: int = 0, max_prompt_tokens: int = 1024,
                         chat: bool | None = None, progress: bool = True) -> tuple[RadarStore, dict]:
    """Record RADAR's dataset into ``out`` (prompts already there are skipped).

    :param settings: the tree and sampling settings; its EOS ids, context limit and encoding facts are set here
        from ``pipeline``.
    :param limit: ShareGPT training prompts (:func:`~adaptree.data.splits.policy_training_prompts`, split with
        ``split_seed``); those over ``max_prompt_tokens`` tokens are skipped.
    :param chat: apply the model's chat template (None: when the model has one).
    :returns: the store and the counts (``recorded``, ``skipped``, ``cycles``).
    """
    from adaptree.data.splits import policy_training_prompts
    from adaptree.offline.traces import head_fingerprint, model_fingerprint

    require_head(pipeline, "a RADAR dataset")
    chat = pipeline.use_chat(chat)
    settings = replace(settings, max_seq_len=pipeline.max_seq_len, eos_token_ids=tuple(pipeline.tokenizer.eos_token_ids),
                       extra=(*encoding_extra(pipeline, chat), ("split_seed", str(split_seed))))
    store = RadarStore(out, {"model": model_fingerprint(pipeline.target), "head": head_fingerprint(pipeline.head)},
                       settings)
    prompts = []
    for p in policy_training_prompts(0, limit, split_seed, max_chars=4000):
        ids = pipeline.encode(p.turns[0], chat)
        if len(ids) <= max_prompt_tokens:
            prompts.append((f"{p.dataset}/{p.id}", ids))
    return store, store.record(pipeline.engine, prompts, progress=progress)
