"""EAGLE-3's training-time test (TTT): K unrolled draft steps over whole sequences in one pass each.

Notation: a sequence ``x[0..L-1]`` with target features ``f[p]``; the target's distribution at position
``p`` predicts ``x[p+1]``. The head's query position ``q`` always takes the token ``x[q+1]`` and always
predicts the target's distribution at ``q+1`` (the token ``x[q+2]``). What changes with the step ``k``
is the hidden input and what the query may attend to:

- step 0: hidden = ``fc(f[q])``; attends causally to step-0 keys ``0..q``. This is the draft head's
  first forward over the accepted context at inference.
- step k >= 1: hidden = the head's own step-(k-1) output at ``q-1``; attends to step-0 keys at positions
  ``<= q-k`` and to the step-j keys at ``q-k+j`` for ``j = 1..k`` (itself for ``j = k``); rotary position
  ``q``. At inference this query is the depth-k node of a chain rooted after the last accepted position
  ``b = q-k``: ``DraftTree.step`` gives it position ``b + depth = q``, the committed draft cache
  ``0..b`` and its tree ancestors (one per earlier depth, at ``b+1..b+k-1``) plus itself. So training
  sees exactly what inference sees; ``tests/test_train_head.py`` checks it against ``DraftTree``-style
  sequential decoding with a KV cache and tree masks.

Positions ``q < k`` have no such chain (their base would be negative) and get no loss; they never feed a
valid position either (a valid query only reads keys whose own chain is valid).

The step-0 keys are attended with torch's fused causal attention kernel (a step-k query ``q`` sees keys
``<= q-k``: queries ``k..T-1`` against keys ``0..T-1-k`` is an ordinary causal pattern), and the k chain
keys of a step-k query, one per query, are dot products merged into the same softmax through the
log-sum-exps (:class:`_ChainAttention`): ``O(T^2 + k T)`` per step, not ``O(k T^2)``, and no ``[T, T]``
matrix in memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from adaptree.models.llama import apply_rope


def shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """``out[..., q, :] = x[..., q - n, :]`` along the second-to-last dim (zeros for ``q < n``)."""
    if n == 0:
        return x
    return F.pad(x, (0, 0, n, 0))[..., : x.shape[-2], :]


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _ChainAttention(torch.autograd.Function):
    """Attention of TTT step ``s``: query ``q`` sees the step-0 keys at positions ``<= q - s`` and its own ``s``
    chain keys, in one softmax; fp32, no ``[T, T]`` matrix in memory.

    ``q [B, H, T, D]``, ``k0``/``v0`` ``[B, H, T, D]`` (step-0 keys and values, already repeated to the query
    heads), ``ck``/``cv`` ``[B, KV, T, s, D]`` (query ``q``'s chain keys and values; the ``H / KV`` query heads
    of a group share them). The prefix part is torch's fused causal attention kernel (queries ``s..T-1``
    against keys ``0..T-1-s``: the offset mask is an ordinary causal one), and the chain part is merged through
    the log-sum-exps. Backward: the fused kernel's backward given the prefix share of the output gradient and
    the *merged* output (whose row sums ``D = dO . out`` the softmax gradient needs), plus the chain part by
    hand. Queries ``q < s`` see no prefix key; they carry no loss (see :func:`ttt_forward`)."""

    @staticmethod
    def forward(ctx, q, k0, v0, ck, cv, scale: float):
        b, h, t, d = q.shape
        s, kv = ck.shape[3], ck.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full((b, h, t), float("-inf"), dtype=q.dtype, device=q.device)
        if s < t:
            out[:, :, s:], lse[:, :, s:] = _flash(q[:, :, s:], k0[:, :, :t - s], v0[:, :, :t - s], 0.0, True,
                                                  scale=scale)
        pc = q.new_empty(0)
        total = lse
        if s:
            sc = (q.view(b, kv, h // kv, t, 1, d) * ck.unsqueeze(2)).sum(-1).view(b, h, t, s) * scale
            total = torch.logaddexp(lse, torch.logsumexp(sc, dim=-1))
            pc = torch.exp(sc - total.unsqueeze(-1))
            chain = (pc.view(b, kv, h // kv, t, s, 1) * cv.unsqueeze(2)).sum(-2).view(b, h, t, d)
            out = out * torch.exp(lse - total).unsqueeze(-1) + chain
        ctx.save_for_backward(q, k0, v0, ck, cv, out, lse, total, pc)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, ck, cv, out, lse, total, pc = ctx.saved_tensors
        b, h, t, d = q.shape
        s, kv = ck.shape[3], ck.shape[1]
        g = h // kv
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k0), torch.zeros_like(v0)
        if s < t:
            share = (dout * torch.exp(lse - total).unsqueeze(-1))[:, :, s:].contiguous()
            dq[:, :, s:], dk[:, :, :t - s], dv[:, :, :t - s] = _flash_backward(
                share, q[:, :, s:], k0[:, :, :t - s], v0[:, :, :t - s], out[:, :, s:].contiguous(),
                lse[:, :, s:].contiguous(), 0.0, True, scale=ctx.scale)
        dck = dcv = None
        if s:
            rows = (dout * out).sum(-1).view(b, kv, g, t, 1)
            do5 = dout.view(b, kv, g, t, 1, d)
            p5 = pc.view(b, kv, g, t, s)
            ds = p5 * ((do5 * cv.unsqueeze(2)).sum(-1) - rows) * ctx.scale  # [b, kv, g, t, s]
            dq = dq + (ds.unsqueeze(-1) * ck.unsqueeze(2)).sum(-2).view(b, h, t, d)
            dck = (ds.unsqueeze(-1) * q.view(b, kv, g, t, 1, d)).sum(2)
            dcv = (p5.unsqueeze(-1) * do5).sum(2)
        return dq, dk, dv, dck, dcv, None


def chain_attention_reference(q, k0, v0, ck, cv, scale: float) -> torch.Tensor:
    """What :class:`_ChainAttention` computes, with plain autograd and the ``[T, T + s]`` score matrix in
    memory: the path on devices without torch's CPU flash kernel, and the tests' reference."""
    b, h, t, d = q.shape
    s, kv = ck.shape[3], ck.shape[1]
    i = torch.arange(t, device=q.device)
    scores = (q @ k0.transpose(-1, -2) * scale).masked_fill(i[None, :] > i[:, None] - s, float("-inf"))
    if not s:
        return torch.softmax(scores, dim=-1) @ v0
    chain = (q.view(b, kv, h // kv, t, 1, d) * ck.unsqueeze(2)).sum(-1).view(b, h, t, s) * scale
    p0, pc = torch.softmax(torch.cat([scores, chain], dim=-1), dim=-1).split([t, s], dim=-1)
    return p0 @ v0 + (pc.view(b, kv, h // kv, t, s, 1) * cv.unsqueeze(2)).sum(-2).view(b, h, t, d)


def _ttt_attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
                   values: list[torch.Tensor], step: int) -> torch.Tensor:
    """The head's attention (``llama.Attention`` weights) for TTT step ``step``; appends this step's keys
    and values to ``keys``/``values`` (index = step).

    Rotary, scores, softmax and the weighted sum run in fp32 even under autocast (:class:`_ChainAttention`)."""
    b, t, _ = x.shape
    h, kv, hd = attn.n_heads, attn.n_kv, attn.head_dim
    qkv = attn.qkv_proj(x).view(b, t, h + 2 * kv, hd).transpose(1, 2)
    with torch.autocast(x.device.type, enabled=False):
        qk = apply_rope(qkv[:, : h + kv].float(), cos.float(), sin.float())
        q = qk[:, :h]
        keys.append(qk[:, h:])
        values.append(qkv[:, h + kv:].float())
        # chain keys and values of query q: step j's at q - step + j, j = 1..step (the last is its own)
        ck = torch.stack([shift_right(keys[j], step - j) for j in range(1, step + 1)], dim=3) if step else \
            q.new_zeros(b, kv, t, 0, hd)
        cv = torch.stack([shift_right(values[j], step - j) for j in range(1, step + 1)], dim=3) if step else ck
        attend = _ChainAttention.apply if q.device.type == "cpu" else chain_attention_reference
        out = attend(q.contiguous(), keys[0].repeat_interleave(h // kv, 1), values[0].repeat_interleave(h // kv, 1),
                     ck, cv, 1.0 / math.sqrt(hd))
        out = out.transpose(1, 2).reshape(b, t, h * hd)
    return attn.o_proj(out.to(x.dtype))


def ttt_forward(head, feats: torch.Tensor, input_ids: torch.Tensor, steps: int,
                logits_rows: list[torch.Tensor] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Run ``steps`` TTT steps of an :class:`~adaptree.models.eagle3.Eagle3Head`.

    :param feats: ``[B, T, 3*H_t]`` target features at positions ``0..T-1``.
    :param input_ids: ``[B, T]`` the token after each position (``x[q+1]``).
    :param logits_rows: per step a bool ``[B, T]`` mask: logits only for those positions (the lm_head is
        the largest matmul of the head; prompt and padding positions need none). Default: all positions.
    :returns: per step ``(out_hidden [B, T, H], logits)``; logits are ``[B, T, draft_vocab]``, or
        ``[rows, draft_vocab]`` in row-major order of the mask. Step k's position ``q`` is the prediction
        for the target's distribution at ``q+1`` (valid for ``q >= k``).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    b, t, _ = feats.shape
    layer = head.midlayer
    # The residual stream stays in the head's dtype (fp32 in training) while autocast runs the matmuls in
    # bf16: the norms then see their weights' dtype (fused kernels) and the sums keep full precision.
    h = head.fc(feats.to(device=head.device, dtype=head.dtype)).to(head.dtype)
    pos = torch.arange(t, device=h.device)[None]
    cos, sin = head._rope(pos, head.dtype, t)
    emb = layer.input_layernorm(head._embed(input_ids.to(h.device), h))  # the same tokens at every step
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for k in range(steps):
        if k:
            h = shift_right(outs[-1][0], 1)
        x = torch.cat([emb, layer.hidden_norm(h)], dim=-1)
        o = h + _ttt_attention(layer.self_attn, x, cos, sin, keys, values, k).to(h.dtype)
        o = o + layer.mlp(layer.post_attention_layernorm(o)).to(h.dtype)
        sel = o if logits_rows is None else o[logits_rows[k]]
        outs.append((o, head.lm_head(head.norm(sel))))
    return outs


class _SoftCrossEntropy(torch.autograd.Function):
    """``sum_i w_i * CE(target_i, softmax(logits_i))`` for target rows that sum to 1, computed as
    ``w_i * (logsumexp(logits_i) - target_i . logits_i)`` (no ``[rows, V]`` log-probabilities kept), with the
    gradient ``(softmax - target) * w`` written in one buffer."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = logits.float()
        lse = torch.logsumexp(x, dim=-1)
        # the row dot products as a batched matmul (no [rows, V] product); autocast is off for it
        with torch.autocast(x.device.type, enabled=False):
            dots = torch.bmm(target.unsqueeze(1), x.unsqueeze(2)).view(-1)
        loss = ((lse - dots) * w).sum()
        ctx.save_for_backward(logits, lse, target, w)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, target, w = ctx.saved_tensors
        g = torch.sub(logits.float(), lse[:, None]).exp_().sub_(target).mul_((w * grad)[:, None])  # a new buffer
        return g.to(logits.dtype), None, None


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over rows of the cross-entropy between ``target`` (probabilities) and ``logits``."""
    return _SoftCrossEntropy.apply(logits, target, weights.float())


def collate(seqs: list[dict[str, torch.Tensor]], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded training tensors from stored sequences (:class:`~adaptree.head_training.features.FeatureStore`).

    Query positions ``q = 0..L-2``: ``feats = f[q]``, ``input_ids = x[q+1]``, target ``hidden`` and
    ``argmax`` at ``q+1``, and ``weight[q] = 1`` iff ``x[q+2]`` exists and is a response token (the target
    distribution at ``q+1`` is one the head must match during generation). ``argmax`` only when every
    sequence has it (online features compute it for validation sequences only)."""
    t = max(len(s["tokens"]) for s in seqs) - 1
    b = len(seqs)
    hdim = seqs[0]["hidden"].shape[-1]
    fdim = seqs[0]["feats"].shape[-1]
    feats = torch.zeros(b, t, fdim, dtype=torch.bfloat16)
    hidden = torch.zeros(b, t, hdim, dtype=torch.bfloat16)
    ids = torch.zeros(b, t, dtype=torch.long)
    with_argmax = all("argmax" in s for s in seqs)
    argmax = torch.zeros(b, t, dtype=torch.long)
    weight = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s["tokens"]) - 1
        if n <= 0:
            continue
        feats[i, :n] = s["feats"][:n]
        hidden[i, :n] = s["hidden"][1:]
        ids[i, :n] = s["tokens"][1:]
        if with_argmax:
            argmax[i, :n] = s["argmax"][1:]
        weight[i, :n - 1] = s["loss_mask"][2:]
    out = {"feats": feats, "hidden": hidden, "input_ids": ids, "weight": weight}
    if with_argmax:
        out["argmax"] = argmax
    return {k: v.to(device) for k, v in out.items()}


def ttt_loss(head, batch: dict[str, torch.Tensor], target_lm_rows: torch.Tensor, steps: int,
             decay: float = 0.8, target_lm: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted TTT loss ``sum_k decay^k * loss_k`` and per-step statistics.

    ``loss_k`` is the soft cross-entropy between the head's logits and the target's distribution restricted
    to the draft vocabulary (``softmax(hidden @ target_lm_rows.T)``, ``target_lm_rows`` = the target's
    ``lm_head`` rows of the draft vocabulary in draft-id order), averaged over the response positions
    valid at step k. Per step the statistics hold the summed loss, the number of positions, and how many
    of them have ``draft argmax (as a target id) == target argmax over the full vocabulary`` (greedy
    acceptance of that step given a correct prefix; a batch without ``argmax``: the target's argmax over the
    draft vocabulary, which the full one equals wherever the head can be right), plus ``[B, T]`` ``correct`` /
    ``valid`` masks for chain statistics.

    ``target_lm`` (the target's whole ``lm_head`` weight; validation): the statistics add, summed over step 0's
    rows, ``sampled`` = ``sum_x min(p(x), q(x))``, the probability that speculative sampling at temperature 1
    accepts the head's sampled first token (``p`` the target's distribution over its whole vocabulary, ``q`` the
    head's), and ``coverage`` = the target's probability mass on the draft vocabulary."""
    weight = batch["weight"]
    t = weight.shape[1]
    qpos = torch.arange(t, device=weight.device)
    # Logits at every loss row at every step, the rows a step has no chain for (q < k: at most the first k
    # positions of a sequence, rarely a response) weighted 0: the same rows each step, so the target
    # distribution is computed once and never copied per step.
    outs = ttt_forward(head, batch["feats"], batch["input_ids"], steps, logits_rows=[weight] * steps)
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        # the target's distribution over the draft vocabulary, once, at every loss position, in fp32
        tgt_all = torch.softmax(batch["hidden"][weight].float() @ target_lm_rows.float().T, dim=-1)
        am_all = batch["argmax"][weight] if "argmax" in batch else head.draft_to_target(tgt_all.argmax(-1))
        wpos = qpos.expand_as(weight)[weight]  # query position of each loss row
    total = torch.zeros((), device=weight.device)
    stats: dict[str, list] = {"loss_sum": [], "count": [], "correct": [], "correct_mask": [], "valid_mask": []}
    for k, (_, logits) in enumerate(outs):
        sel = wpos >= k  # the loss rows of step k
        n = int(sel.sum())
        loss_k = soft_cross_entropy(logits, tgt_all, sel.float())
        if n:
            total = total + (decay ** k) * loss_k / n
        with torch.no_grad():
            ok_rows = (head.draft_to_target(logits.max(-1).indices) == am_all) & sel
            ok = torch.zeros_like(weight)
            ok[weight] = ok_rows
        stats["loss_sum"].append(float(loss_k.detach()))
        stats["count"].append(n)
        stats["correct"].append(int(ok_rows.sum()))
        stats["correct_mask"].append(ok)
        stats["valid_mask"].append(weight & (qpos >= k)[None])
    if target_lm is not None:
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            stats["sampled"], stats["coverage"] = sampled_acceptance(
                outs[0][1].float(), tgt_all, batch["hidden"][weight].float(), target_lm_rows, target_lm)
    return total, stats


def sampled_acceptance(logits: torch.Tensor, target_draft: torch.Tensor, hidden: torch.Tensor,
                       target_lm_rows: torch.Tensor, target_lm: torch.Tensor, chunk: int = 1024) -> tuple[float, float]:
    """Summed over rows: ``sum_x min(p(x), q(x))`` (speculative sampling's acceptance of one token drawn from
    ``q = softmax(logits)`` over the draft vocabulary, against the target's ``p`` over its whole vocabulary) and the
    target's mass on the draft vocabulary. ``target_draft``: ``p`` restricted to the draft vocabulary and renormalised
    (``softmax(hidden @ target_lm_rows.T)``); the mass is ``exp(lse(hidden @ target_lm_rows.T) - lse(hidden @
    target_lm.T))``, the whole-vocabulary log-normaliser computed ``chunk`` rows at a time."""
    rows, w = target_lm_rows.float(), target_lm.float()  # no copies when the caller passes fp32 (validation does)
    mass = torch.cat([torch.exp(torch.logsumexp(h @ rows.T, -1) - torch.logsumexp(h @ w.T, -1))
                      for h in hidden.split(chunk)]) if hidden.shape[0] else hidden.new_zeros(0)
    q = torch.softmax(logits, -1)
    acc = torch.minimum(target_draft * mass[:, None], q).sum(-1)
    return float(acc.sum()), float(mass.sum())


def chain_lengths(correct: list[torch.Tensor], valid: list[torch.Tensor]) -> tuple[float, int]:
    """Greedy single-chain acceptance from per-step correctness: for every base ``b`` valid at step 0, the
    number of leading steps ``k`` whose prediction at ``b + k`` is correct (all earlier ones correct too).
    Returns (sum of chain lengths, number of bases)."""
    k_steps = len(correct)
    base = valid[0]
    alive = torch.ones_like(base)
    total = torch.zeros(base.shape, dtype=torch.long, device=base.device)
    for k in range(k_steps):
        ck = correct[k]
        if k:  # ck[b] = correct_k[b + k]
            ck = torch.cat([ck[:, k:], torch.zeros_like(ck[:, :k])], dim=1)
        alive = alive & ck
        total += alive.long()
    return float(total[base].sum()), int(base.sum())


__all__ = ["chain_attention_reference", "chain_lengths", "collate", "sampled_acceptance", "shift_right", "soft_cross_entropy",
           "ttt_forward", "ttt_loss"]
