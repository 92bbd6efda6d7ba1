"""One batched autoregressive decoder: several prompts at once through the model's own forward.

It serves the greedy outputs of trace recording (:mod:`adaptree.offline.traces`) and the self-distilled
corpora of head training (:mod:`adaptree.head_training.corpus`). On a CPU a batch-1 decode step reads
every weight for one token; a batch of 8-96 rows costs little more per step.

How: the prompts are left-padded into one batch and run through
:meth:`Transformer.forward <adaptree.models.llama.Transformer.forward>` with one attention mask per row
(``tree_mask [B, T, K]``: padding masked out of every row, true positions for the rotary embedding);
a padding query sees itself, so no attention row is empty (no NaN in the cache). Each step appends one
token per row at the cache's common end, so every row's context is a suffix ``[start_r, L)`` of the slots.

Continuous batching (``batch_size``): at most that many rows decode at once; when finished rows are a
sixteenth of the batch, waiting prompts take their places. They are prefilled together in a small batch of
their own, whose keys and values are copied into the freed rows right-aligned at the cache's end (their
masks hide the finished row's slots); positions are per row, so nothing else moves. When the cache buffer
is full, the rows' contexts move to a new one from the first slot any live row sees, with ``_SLACK`` free
slots after them (one copy every 64 steps).
Once nothing waits, finished rows leave the batch (and the cache) when they are an eighth of it: a
removal copies the cache (about one step), a finished row kept costs 1/B of a step. Every prompt thus
decodes in a full batch except at the very end, and is prefilled once.

Stops mirror :meth:`Engine.generate <adaptree.core.engine.Engine.generate>`: after an EOS (kept), after
``max_new_tokens``, or at the context limit (a row of ``n`` prompt tokens emits at most
``max_len - n + 1``), checked in that order. ``lookahead`` more tokens may follow the stop (no EOS
stop, while the context has room): what the target would say next (trace recording needs it).

A target that runs one sequence at a time (:class:`~adaptree.models.ggml.GgmlTarget`) decodes the prompts one after
another through the same stops.

Batch shapes round differently from batch 1, so on a near-tie a row could take another token than the
engine would (greedy); tests compare the outputs with the engine's on tiny and real models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch

from adaptree.core.verify import SamplingConfig, greedy_tokens


class Decoded(NamedTuple):
    """One prompt's result of :func:`batched_decode`."""

    tokens: list[int]
    """The new tokens: ``tokens[:end]`` what the engine emits, then the look-ahead."""
    end: int
    """Tokens up to the stop (included)."""
    stop_reason: str
    """``"eos"``, ``"max_new_tokens"`` or ``"context_limit"``."""


_SLACK = 64
"""Free cache slots after the contexts: the steps between two moves of the cache to a new buffer. The batched
decode step attends over the whole buffer (see :func:`~adaptree.models.llama.grouped_decode_attention`), so a
buffer just wider than the contexts keeps that cheap; a move costs about one step."""


def _prefill(target, prompts: list[list[int]], cap: int):
    """Left-padded prefill of ``prompts`` in a cache of ``cap`` slots: (cache, key_ok [B, cap], last logits)."""
    dev = target.device
    lens = [len(p) for p in prompts]
    width = max(lens)
    pad = torch.tensor([width - n for n in lens], device=dev)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, width - lens[i]:] = torch.tensor(p, dtype=torch.long, device=dev)
    key_ok = torch.arange(cap, device=dev)[None] >= pad[:, None]  # [B, cap]: key slots a row may see
    mask = torch.ones(width, width, dtype=torch.bool, device=dev).tril_() & key_ok[:, None, :width]
    mask |= torch.eye(width, dtype=torch.bool, device=dev)  # padding rows see themselves (no NaN rows)
    pos = (torch.arange(width, device=dev)[None] - pad[:, None]).clamp_(min=0)
    cache = target.new_cache(cap, batch=len(prompts))
    logits = target(ids, position_ids=pos, cache=cache, tree_mask=mask, logits_at=slice(-1, None)).logits[:, -1]
    return cache, key_ok, logits


@torch.inference_mode()
def batched_decode(target, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                   eos_token_ids: Iterable[int] = (), max_len: int | None = None, lookahead: int = 0, *,
                   temperature: float = 0.0, generator: torch.Generator | None = None,
                   batch_size: int | None = None,
                   on_done: Callable[[int, Decoded], None] | None = None) -> list[Decoded]:
    """Decode every prompt (see the module docstring); one :class:`Decoded` per prompt, in order.

    :param max_new_tokens: the token limit, one for all prompts or one per prompt.
    :param max_len: the context limit (prompt + generated); None = the target's.
    :param lookahead: tokens to add after each row's stop (greedy traces' look-ahead).
    :param temperature: 0 = greedy (:func:`~adaptree.core.verify.greedy_tokens`), else plain sampling of
        ``softmax(logits / temperature)`` with ``generator``, one draw per live row and step.
    :param batch_size: rows decoded at once (None: all prompts); the others wait for a free row and take
        one in the given order (a caller sorts them by length to save padding).
    :param on_done: called with (prompt index, result) as soon as a prompt is finished (a caller saves work).
    """
    dev = target.device
    max_len = min(max_len or target.max_seq_len, target.max_seq_len)
    n_prompts = len(prompts)
    lens = [len(p) for p in prompts]
    if not prompts or min(lens) == 0:
        raise ValueError("every prompt needs at least one token")
    if max(lens) >= max_len:
        raise ValueError(f"a prompt has {max(lens)} tokens; the context limit is {max_len}, leaving no room")
    new = [int(max_new_tokens)] * n_prompts if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    if len(new) != n_prompts or min(new) < 1:
        raise ValueError(f"max_new_tokens must be >= 1, one for all prompts or one per prompt; got {max_new_tokens!r}")
    if temperature != 0.0:
        SamplingConfig(temperature=temperature)  # its range: below MIN_TEMPERATURE softmax(logits / T) is NaN
    if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
    eos = frozenset(int(t) for t in eos_token_ids)
    limit = [min(m, max_len - n + 1) for m, n in zip(new, lens)]  # tokens a row may emit (context limit)
    longest = max(n + min(m + lookahead, max_len - n + 1) for m, n in zip(new, lens))  # a row's widest context
    b = min(batch_size or n_prompts, n_prompts)

    tokens: list[list[int]] = [[] for _ in range(n_prompts)]
    ends: list[int | None] = [None] * n_prompts
    stops = [""] * n_prompts
    want = [longest] * n_prompts  # tokens a row needs: known once its end is
    results: list[Decoded | None] = [None] * n_prompts

    def sample(logits: torch.Tensor) -> list[int]:
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            return torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()
        return greedy_tokens(logits).tolist()

    def take(i: int, t: int) -> bool:
        """Append token ``t`` to prompt ``i``; whether the prompt needs more."""
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
            return True
        results[i] = Decoded(tokens[i], ends[i], stops[i])
        if on_done is not None:
            on_done(i, results[i])
        return False

    if getattr(target, "backend", "torch") != "torch":  # one sequence at a time (llama.cpp): prompts in turn
        cache = target.new_cache(max_len)
        for i, prompt in enumerate(prompts):
            cache.reset()
            logits = target(torch.tensor([list(map(int, prompt))], device=dev), cache=cache,
                            logits_at=slice(-1, None)).logits[:, -1]
            while take(i, t := sample(logits)[0]):
                logits = target(torch.tensor([[t]], device=dev), cache=cache).logits[:, -1]
        return [r for r in results if r is not None]

    waiting = list(range(b, n_prompts))[::-1]  # popped from the end: in the given order
    first_batch = [list(map(int, prompts[i])) for i in range(b)]
    cache, key_ok, logits = _prefill(target, first_batch, max(map(len, first_batch)) + _SLACK)
    rows = list(range(b))  # prompt index of each batch row; -1: a finished row still in the batch
    next_pos = torch.tensor(lens[:b], device=dev)
    nxt = torch.tensor(sample(logits), device=dev)
    rows = [i if take(i, t) else -1 for i, t in zip(rows, nxt.tolist())]
    while True:
        free = [r for r, i in enumerate(rows) if i < 0]
        if waiting and len(free) >= max(1, len(rows) // 16):
            # seat waiting prompts in the finished rows: prefill them apart, copy their keys and values in
            seat = free[:len(waiting)]
            new_ids = [waiting.pop() for _ in seat]
            width = max(lens[i] for i in new_ids)
            end = cache.length
            if end < width or end + 1 > cache.max_len:  # no room before or after the end: a new buffer
                key_ok = _rebase(cache, key_ok, rows, width)
                end = cache.length
            small, small_ok, small_logits = _prefill(target, [list(map(int, prompts[i])) for i in new_ids], width)
            sel = torch.tensor(seat, device=dev)
            cache.k[:, sel, :, end - width:end] = small.k
            cache.v[:, sel, :, end - width:end] = small.v
            ok = torch.ones(len(seat), cache.max_len, dtype=torch.bool, device=dev)  # later slots: their own
            ok[:, :end] = False
            ok[:, end - width:end] = small_ok[:, :width]
            key_ok[sel] = ok
            next_pos[sel] = torch.tensor([lens[i] for i in new_ids], device=dev)
            first = sample(small_logits)
            nxt[sel] = torch.tensor(first, device=dev)
            for r, i, t in zip(seat, new_ids, first):
                rows[r] = i if take(i, t) else -1
            continue  # a seated prompt may already be finished (one token)
        live = [r for r, i in enumerate(rows) if i >= 0]
        if not live:
            break
        if not waiting and len(rows) - len(live) >= max(1, len(rows) // 8):
            # finished rows leave the batch and the cache once they are an eighth of it (nothing waits)
            sel = torch.tensor(live, device=dev)
            cache.k, cache.v = cache.k[:, sel], cache.v[:, sel]
            key_ok, next_pos, nxt = key_ok[sel], next_pos[sel], nxt[sel]
            rows = [rows[r] for r in live]
        if cache.length + 1 > cache.max_len:
            key_ok = _rebase(cache, key_ok, rows, 1)
        logits = target(nxt[:, None], position_ids=next_pos[:, None], cache=cache,
                        tree_mask=key_ok[:, None, :cache.length + 1]).logits[:, -1]
        next_pos = (next_pos + 1).clamp_(max=target.max_seq_len - 1)  # (a finished row's may run past)
        nxt = torch.tensor(sample(logits), device=dev)
        rows = [i if i >= 0 and take(i, t) else -1 for i, t in zip(rows, nxt.tolist())]
    return results  # type: ignore[return-value]  (every prompt is finished)


def _rebase(cache, key_ok: torch.Tensor, rows: list[int], need: int) -> torch.Tensor:
    """Move every row's context to a new cache buffer of ``_SLACK`` free slots after it, whose first slot is
    the first one any live row sees (or later, so that at least ``need`` slots precede the end); returns the
    new key mask. Finished rows' contexts are dropped (their masks cleared)."""
    end = cache.length
    key_ok[torch.tensor([i < 0 for i in rows], device=key_ok.device)] = False
    used = key_ok[:, :end].any(0)
    start = int(used.float().argmax()) if bool(used.any()) else end  # the first slot any live row sees
    new_end = max(end - start, need)
    src = max(end - new_end, 0)  # the old slot that becomes new slot ``dst``
    dst = new_end - (end - src)
    shape = list(cache.k.shape)
    shape[3] = new_end + _SLACK
    k, v = cache.k.new_zeros(shape), cache.v.new_zeros(shape)
    k[:, :, :, dst:new_end] = cache.k[:, :, :, src:end]
    v[:, :, :, dst:new_end] = cache.v[:, :, :, src:end]
    ok = torch.ones(key_ok.shape[0], shape[3], dtype=torch.bool, device=key_ok.device)  # coming tokens: seen
    ok[:, :new_end] = False
    ok[:, dst:new_end] = key_ok[:, src:end]
    cache.k, cache.v, cache.max_len, cache.length = k, v, shape[3], new_end
    return ok


def batched_generate(target, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
                     eos_token_ids: Iterable[int] = (), temperature: float = 0.0,
                     generator: torch.Generator | None = None, batch_size: int | None = None) -> list[list[int]]:
    """The new ids of each prompt from :func:`batched_decode` (no look-ahead): greedy, or sampled at
    ``temperature``; a row stops after an EOS (kept), its ``max_new_tokens`` or the context limit."""
    return [d.tokens for d in batched_decode(target, prompts, max_new_tokens, eos_token_ids,
                                             temperature=temperature, generator=generator, batch_size=batch_size)]


__all__ = ["Decoded", "batched_decode", "batched_generate"]
