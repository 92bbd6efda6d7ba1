"""One batched autoregressive decoder: several prompts at once through the model's own forward.

It serves the greedy outputs of trace recording (:mod:`adaptree.offline.traces`) and the self-distilled
corpora of head training (:mod:`adaptree.head_training.corpus`). On a CPU a batch-1 decode step reads
every weight for one token; a batch of 8-64 rows costs little more per step.

How: the prompts are left-padded into one batch and run through
:meth:`Transformer.forward <adaptree.models.llama.Transformer.forward>` with one attention mask per row
(``tree_mask [B, T, K]``: padding masked out of every row, true positions for the rotary embedding);
a padding query sees itself, so no attention row is empty (no NaN in the cache). Each step appends one
token per live row; a row leaves the batch (and the cache) once it has all its tokens.

Stops mirror :meth:`Engine.generate <adaptree.core.engine.Engine.generate>`: after an EOS (kept), after
``max_new_tokens``, or at the context limit (a row of ``n`` prompt tokens emits at most
``max_len - n + 1``), checked in that order. ``lookahead`` more tokens may follow the stop (no EOS
stop, while the context has room): what the target would say next (trace recording needs it).

Batch shapes round differently from batch 1, so on a near-tie a row could take another token than the
engine would (greedy); tests compare the outputs with the engine's on tiny and real models.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch

from adaptree.core.verify import greedy_tokens


class Decoded(NamedTuple):
    """One prompt's result of :func:`batched_decode`."""

    tokens: list[int]
    """The new tokens: ``tokens[:end]`` what the engine emits, then the look-ahead."""
    end: int
    """Tokens up to the stop (included); ``len(tokens)`` for a row left unfinished (``min_live``)."""
    stop_reason: str
    """``"eos"``, ``"max_new_tokens"`` or ``"context_limit"``; ``""`` for a row left unfinished."""


@torch.inference_mode()
def batched_decode(target, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                   eos_token_ids: Iterable[int] = (), max_len: int | None = None, lookahead: int = 0, *,
                   temperature: float = 0.0, generator: torch.Generator | None = None,
                   min_live: int = 1) -> list[Decoded]:
    """Decode every prompt at once (see the module docstring); one :class:`Decoded` per prompt.

    :param max_new_tokens: the token limit, one for all prompts or one per prompt.
    :param max_len: the context limit (prompt + generated); None = the target's.
    :param lookahead: tokens to add after each row's stop (greedy traces' look-ahead).
    :param temperature: 0 = greedy (:func:`~adaptree.core.verify.greedy_tokens`), else plain sampling of
        ``softmax(logits / temperature)`` with ``generator``, one draw per live row and step.
    :param min_live: stop the whole batch as soon as fewer rows than this are left; the unfinished rows
        come back with ``stop_reason == ""`` (a caller continues them in a fuller batch).
    """
    dev = target.device
    max_len = min(max_len or target.max_seq_len, target.max_seq_len)
    b = len(prompts)
    lens = [len(p) for p in prompts]
    if not prompts or min(lens) == 0:
        raise ValueError("every prompt needs at least one token")
    if max(lens) >= max_len:
        raise ValueError(f"a prompt has {max(lens)} tokens; the context limit is {max_len}, leaving no room")
    new = [int(max_new_tokens)] * b if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    if len(new) != b or min(new) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, one for all prompts or one per prompt; got {max_new_tokens!r}")
    eos = frozenset(int(t) for t in eos_token_ids)
    limit = [min(m, max_len - n + 1) for m, n in zip(new, lens)]  # tokens a row may emit (context limit)
    width = max(lens)
    cap = width + max(min(m + lookahead, max_len - n + 1) for m, n in zip(new, lens))

    pad = torch.tensor([width - n for n in lens], device=dev)
    ids = torch.zeros(b, width, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, width - lens[i]:] = torch.tensor([int(t) for t in p], dtype=torch.long, device=dev)
    key_ok = torch.arange(cap, device=dev)[None] >= pad[:, None]  # [B, cap]: key slots a row may see
    mask = torch.ones(width, width, dtype=torch.bool, device=dev).tril_() & key_ok[:, None, :width]
    mask |= torch.eye(width, dtype=torch.bool, device=dev)  # padding rows see themselves (no NaN rows)
    pos = (torch.arange(width, device=dev)[None] - pad[:, None]).clamp_(min=0)
    cache = target.new_cache(cap, batch=b)
    logits = target(ids, position_ids=pos, cache=cache, tree_mask=mask, logits_at=slice(-1, None)).logits[:, -1]

    rows = list(range(b))  # prompt index of each live row
    tokens: list[list[int]] = [[] for _ in range(b)]
    ends: list[int | None] = [None] * b
    stops = [""] * b
    want = [cap] * b  # tokens a row needs: known once its end is
    next_pos = torch.tensor(lens, device=dev)
    while True:
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            nxt = greedy_tokens(logits)
        keep = []
        for r, t in enumerate(nxt.tolist()):
            i = rows[r]
            tokens[i].append(t)
            k = len(tokens[i])
            if ends[i] is None:
                stop = "eos" if t in eos else "max_new_tokens" if k >= new[i] else \
                    "context_limit" if k >= limit[i] else ""
                if stop:
                    ends[i], stops[i] = k, stop
                    room = lens[i] + k < max_len
                    want[i] = k + (min(lookahead, max_len - lens[i] - k + 1) if room else 0)
            if k < want[i]:
                keep.append(r)
        if len(keep) < min_live:
            break
        if len(keep) < len(rows):  # finished rows leave the batch and the cache
            sel = torch.tensor(keep, device=dev)
            cache.k, cache.v = cache.k[:, sel], cache.v[:, sel]
            key_ok, next_pos, nxt = key_ok[sel], next_pos[sel], nxt[sel]
            rows = [rows[r] for r in keep]
        logits = target(nxt[:, None], position_ids=next_pos[:, None], cache=cache,
                        tree_mask=key_ok[:, None, :cache.length + 1]).logits[:, -1]
        next_pos = next_pos + 1
    return [Decoded(t, len(t) if e is None else e, s) for t, e, s in zip(tokens, ends, stops)]


def batched_generate(target, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                     eos_token_ids: Iterable[int] = (), temperature: float = 0.0,
                     generator: torch.Generator | None = None, min_live: int = 1) -> list[list[int]]:
    """The new ids of each prompt from :func:`batched_decode` (no look-ahead): greedy, or sampled at
    ``temperature``; a row stops after an EOS (kept), its ``max_new_tokens`` or the context limit."""
    return [d.tokens for d in batched_decode(target, prompts, max_new_tokens, eos_token_ids,
                                             temperature=temperature, generator=generator, min_live=min_live)]


__all__ = ["Decoded", "batched_decode", "batched_generate"]
