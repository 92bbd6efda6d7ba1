"""Deterministic train / validation / evaluation splits that never share a prompt.

An item's split is a pure function of (its key, the seed, the fractions): a sha256 of ``seed`` and the key
mapped to [0, 1) and cut at the cumulative fractions. So it does not depend on the order of the items,
on the other items, on the Python hash seed or on the process; adding items to a corpus never moves the
old ones; and two items with the same key always land in the same split.

The default key is the item's first user turn, whitespace-normalized (not its id): ShareGPT holds the
same opening prompt under several ids, and keying by text is what guarantees that a training prompt is
never also an evaluation prompt. Pass ``key="id"`` (or any callable) to split by id instead.
:func:`drop_overlap` removes from one collection (training prompts) everything whose key occurs in
another (an evaluation benchmark such as MT-bench or HumanEval).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from adaptree.data.prompts import Prompt

__all__ = ["DEFAULT_FRACTIONS", "prompt_key", "split_of", "split_ids", "drop_overlap"]

T = TypeVar("T")

DEFAULT_FRACTIONS: dict[str, float] = {"train": 0.9, "validation": 0.05, "eval": 0.05}

KeySpec = str | Callable[[Any], str]


def _normalize(text: str) -> str:
    return " ".join(text.split())


def _first_user_text(item: Any) -> str:
    if isinstance(item, Prompt):
        return item.turns[0] if item.turns else ""
    if isinstance(item, str):
        return item
    messages = getattr(item, "messages", item)  # ShareGPTConversation or a list of messages
    if isinstance(messages, Sequence):
        for m in messages:
            if isinstance(m, Mapping) and m.get("role") == "user":
                return str(m.get("content", ""))
    raise TypeError(f"cannot find a first user turn in {type(item).__name__}; pass key=callable")


def prompt_key(item: Any, key: KeySpec = "text") -> str:
    """The string an item is split by: ``"text"`` = its first user turn, whitespace-normalized (a
    :class:`Prompt`, a message list, a ``ShareGPTConversation`` or a plain string); ``"id"`` =
    ``dataset/id`` of a Prompt or the ``id`` attribute; or ``key(item)`` for a callable."""
    if callable(key):
        return str(key(item))
    if key == "text":
        return _normalize(_first_user_text(item))
    if key == "id":
        if isinstance(item, Prompt):
            return f"{item.dataset}/{item.id}"
        if hasattr(item, "id"):
            return str(item.id)
        raise TypeError(f"{type(item).__name__} has no id; use key='text' or a callable")
    raise ValueError(f"key must be 'text', 'id' or a callable, got {key!r}")


def _check_fractions(fractions: Mapping[str, float] | Sequence[float]) -> list[tuple[str, float]]:
    if not isinstance(fractions, Mapping):
        values = list(fractions)
        names = ["train", "validation", "eval"] if len(values) == 3 else ["train", "eval"] if len(values) == 2 else None
        if names is None:
            raise ValueError("fractions: give a {name: fraction} mapping, or 2 (train, eval) or 3 "
                             "(train, validation, eval) numbers")
        fractions = dict(zip(names, values))
    items = [(str(k), float(v)) for k, v in fractions.items()]
    if not items:
        raise ValueError("fractions: at least one split is needed")
    for name, v in items:
        if not (v >= 0.0 and math.isfinite(v)):
            raise ValueError(f"fractions: {name} = {v} is not a fraction >= 0")
    total = sum(v for _, v in items)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"fractions must sum to 1, got {total:g}")
    return items


def _unit(key: str, seed: int) -> float:
    digest = hashlib.sha256(f"adaptree-split\0{seed}\0{key}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _pick(u: float, spec: list[tuple[str, float]]) -> str:
    acc = 0.0
    for name, v in spec:
        acc += v
        if u < acc:
            return name
    return next(name for name, v in reversed(spec) if v > 0)  # u within rounding of 1.0


def split_of(key: str, fractions: Mapping[str, float] | Sequence[float] = DEFAULT_FRACTIONS, seed: int = 0) -> str:
    """The split (a name from ``fractions``) of one key string."""
    return _pick(_unit(key, seed), _check_fractions(fractions))


def split_ids(items: Iterable[T], fractions: Mapping[str, float] | Sequence[float] = DEFAULT_FRACTIONS,
              seed: int = 0, key: KeySpec = "text") -> dict[str, list[T]]:
    """Partition ``items`` into ``{split name: [items in input order]}`` (every name of ``fractions`` is
    present, possibly empty). See the module docstring for the guarantees."""
    spec = _check_fractions(fractions)
    out: dict[str, list[T]] = {name: [] for name, _ in spec}
    for item in items:
        out[_pick(_unit(prompt_key(item, key), seed), spec)].append(item)
    return out


def drop_overlap(items: Iterable[T], against: Iterable[Any], key: KeySpec = "text") -> list[T]:
    """``items`` without those whose key (default: normalized first user turn) is also a key of an item of
    ``against``; e.g. training prompts minus the evaluation benchmark's prompts."""
    banned = {prompt_key(a, key) for a in against}
    return [item for item in items if prompt_key(item, key) not in banned]


HUMANEVAL_EVAL = 82
"""Benchmarks take HumanEval's first ``--limit`` problems (80 per dataset in the papers); policies train on
problems from index 82 on, so no benchmark of at most 82 problems ever sees a training prompt."""


def policy_training_prompts(n_code: int, n_chat: int, seed: int = 0, max_chars: int = 2000) -> list[Prompt]:
    """Training prompts for the learned controllers (LTD, Re-SpS, RADAR): ``n_code`` HumanEval problems taken
    from index :data:`HUMANEVAL_EVAL` on (LTD trains on HumanEval) and ``n_chat`` ShareGPT first turns of the
    ``train`` split (Re-SpS and RADAR train on ShareGPT), minus anything whose text is an MT-bench or
    HumanEval prompt, 20..``max_chars`` characters; interleaved code/chat. Never an evaluation prompt."""
    from adaptree.data.prompts import humaneval, mt_bench, sharegpt

    he = humaneval()
    if not 0 <= n_code <= len(he) - HUMANEVAL_EVAL:
        raise ValueError(f"n_code must be in 0..{len(he) - HUMANEVAL_EVAL} (HumanEval problems {HUMANEVAL_EVAL}.. "
                         f"are for training), got {n_code}")
    if n_chat < 0:
        raise ValueError(f"n_chat must be >= 0, got {n_chat}")
    code = he[HUMANEVAL_EVAL:HUMANEVAL_EVAL + n_code]
    chat = []
    if n_chat:
        train = split_ids(sharegpt(), seed=seed)["train"]
        chat = [p for p in drop_overlap(train, mt_bench() + he) if 20 <= len(p.turns[0]) <= max_chars][:n_chat]
        if len(chat) < n_chat:
            raise ValueError(f"only {len(chat)} ShareGPT training prompts available, {n_chat} asked")
    out = [x for pair in zip(code, chat) for x in pair]
    return out + code[len(chat):] + chat[len(code):]
