"""Greedy traces of prompts for a loaded :class:`~adaptree.api.Pipeline`: what ``adaptree traces record`` and the
policy trainers (``adaptree train ltd``, ``train resps``) record before they replay.

A trace folder is pinned to the model, the head and its :class:`~adaptree.offline.traces.TraceSettings`; here the
settings also carry the tokenizer's digest and whether the chat template was applied, so a resumed folder never
mixes prompts that were turned into ids differently.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from adaptree.core.config import check_fields, positive
from adaptree.data.prompts import Prompt
from adaptree.offline.traces import (
    PromptTrace,
    TraceSettings,
    TraceStore,
    open_store_for,
)


def tokenizer_digest(tok) -> str:
    """sha256 of a tokenizer's vocabulary, chat template and EOS ids (what turns prompt text into ids)."""
    h = hashlib.sha256()
    vocab = tok.tokenizer.get_vocab() if hasattr(tok.tokenizer, "get_vocab") else {}
    h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    h.update((tok.chat_template or "").encode())
    h.update(json.dumps(list(tok.eos_token_ids)).encode())
    return h.hexdigest()


def encoding_extra(pipeline, chat: bool) -> tuple[tuple[str, str], ...]:
    """The ``extra`` settings of a store whose prompts ``pipeline`` encoded (tokenizer digest, chat template on)."""
    return ("tokenizer", tokenizer_digest(pipeline.tokenizer)), ("chat", str(chat))


def require_head(pipeline, what: str) -> None:
    """A ValueError saying that ``what`` needs a draft head when ``pipeline`` has none."""
    if pipeline.head is None:
        raise ValueError(f"{what} needs a draft head: pass --draft PATH (or use a model that ships one)")


def record_prompts(pipeline, folder: str | os.PathLike, prompts: Sequence[Prompt], *,
                   widths: Sequence[int] = (10,), max_depth: int = 12, max_new_tokens: int = 256,
                   feature_dtype: str = "float16", chat: bool | None = None, hidden_dtype: str = "none",
                   progress: bool = True) -> tuple[TraceStore, dict]:
    """Record the greedy trace of every prompt's first user turn into ``folder`` (keys ``dataset/id``; prompts
    already there are skipped). Returns the store and the counts (``recorded``, ``skipped``).

    :param chat: apply the model's chat template (None: when the model has one).
    """
    require_head(pipeline, "recording traces")
    chat = pipeline.use_chat(chat)
    settings = TraceSettings(widths=tuple(widths), max_depth=max_depth, max_new_tokens=max_new_tokens,
                             eos_token_ids=tuple(pipeline.tokenizer.eos_token_ids), max_seq_len=pipeline.max_seq_len,
                             feature_dtype=feature_dtype, hidden_dtype=hidden_dtype,
                             extra=encoding_extra(pipeline, chat))
    store = open_store_for(folder, pipeline.target, pipeline.head, settings)
    keyed = [(f"{p.dataset}/{p.id}", pipeline.encode(p.turns[0], chat)) for p in prompts]
    counts = store.record(pipeline.target, pipeline.head, keyed, progress=progress)
    return store, counts


@dataclass(frozen=True)
class TrainingPrompts:
    """Which prompts a policy trains on (:func:`~adaptree.data.splits.policy_training_prompts`, never an
    evaluation prompt) and where their greedy traces go."""

    train_code: int = 24
    """HumanEval training problems (index 82 on)."""
    train_chat: int = 24
    """ShareGPT train-split prompts."""
    split_seed: int = 0
    """Seed of the ShareGPT split."""
    max_new_tokens: int = positive(192)
    """Tokens per training prompt."""
    traces: str | None = None
    """Greedy traces of the training prompts (default OUT/traces; recorded there if missing)."""

    def __post_init__(self) -> None:
        check_fields(self)

    def prompts(self) -> list[Prompt]:
        from adaptree.data.splits import policy_training_prompts

        return policy_training_prompts(self.train_code, self.train_chat, self.split_seed)

    def trace_folder(self, out: str | os.PathLike) -> str | os.PathLike:
        return self.traces or os.path.join(out, "traces")


def training_traces(pipeline, folder: str | os.PathLike, prompts: Sequence[Prompt], max_new_tokens: int,
                    widths: Sequence[int] = (10,), max_depth: int = 12, feature_dtype: str = "none",
                    progress: bool = True, hidden_dtype: str = "none") -> list[PromptTrace]:
    """The greedy traces of the policy-training ``prompts``, recorded into ``folder`` if not there yet (with the
    chat template when the model has one); returns them loaded."""
    require_head(pipeline, "training a policy")
    keys = {f"{p.dataset}/{p.id}" for p in prompts}
    found = sufficient_traces(pipeline, folder, keys, widths, max_depth, max_new_tokens, feature_dtype, hidden_dtype)
    if found is not None:
        return found
    store, _ = record_prompts(pipeline, folder, prompts, widths=widths, max_depth=max_depth,
                              max_new_tokens=max_new_tokens, feature_dtype=feature_dtype, hidden_dtype=hidden_dtype,
                              progress=progress)
    return [t for t in store.load_all() if t.key in keys]


def sufficient_traces(pipeline, folder: str | os.PathLike, keys: set[str], widths: Sequence[int], max_depth: int,
                      max_new_tokens: int, feature_dtype: str, hidden_dtype: str = "none") -> list[PromptTrace] | None:
    """The traces of ``keys`` in ``folder`` when it already holds every one of them, recorded for this model and head
    with at least what a trainer asks for (its widths, ``max_depth`` levels or more, the same token limit, target
    features and draft hidden states when it needs them): one folder then serves every trainer (LTD's traces need no
    features, Re-SpS's do, SpecDec++'s need the hidden states). None when it does not (the caller records into it,
    which refuses settings that differ)."""
    from adaptree.offline.store import head_fingerprint, model_fingerprint

    if not (Path(folder) / "manifest.json").is_file():
        return None
    store = TraceStore(folder)
    s, fps = store.settings, store.fingerprints
    if (fps.get("model") != model_fingerprint(pipeline.target) or fps.get("head") != head_fingerprint(pipeline.head)
            or not set(widths) <= set(s.widths) or s.max_depth < max_depth or s.max_new_tokens != max_new_tokens
            or (feature_dtype != "none" and s.feature_dtype == "none")
            or (hidden_dtype != "none" and s.hidden_dtype == "none")):
        return None
    traces = [t for t in store.load_all() if t.key in keys]
    return traces if {t.key for t in traces} == set(keys) else None
