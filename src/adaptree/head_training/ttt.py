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

The step-0 keys are attended with an ordinary (shifted) causal score matrix; the k chain keys of a step-k
query are one per query, so they are dot products along the diagonal, concatenated to the scores before
the softmax: ``O(T^2 + k T)`` per step, not ``O(k T^2)``.
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


def _ttt_attention(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
                   values: list[torch.Tensor], step: int) -> torch.Tensor:
    """The head's attention (``llama.Attention`` weights) for TTT step ``step``; appends this step's keys
    and values to ``keys``/``values`` (index = step).

    Scores, softmax and the weighted sum run in fp32 even under autocast: the ``[T, T]`` score matrices
    are the largest activations here, and casting them back and forth costs more than the fp32 matmuls."""
    b, t, _ = x.shape
    h, kv, hd = attn.n_heads, attn.n_kv, attn.head_dim
    g = h // kv
    qkv = attn.qkv_proj(x).view(b, t, h + 2 * kv, hd).transpose(1, 2)
    with torch.autocast(x.device.type, enabled=False):
        qk = apply_rope(qkv[:, : h + kv].float(), cos.float(), sin.float())
        q = qk[:, :h] * (1.0 / math.sqrt(hd))
        keys.append(qk[:, h:])
        values.append(qkv[:, h + kv:].float())
        # step-0 keys: position i visible to query q iff i <= q - step (additive -inf bias, fused in baddbmm)
        bias = torch.zeros(t, t, device=x.device).masked_fill_(
            ~torch.ones(t, t, dtype=torch.bool, device=x.device).tril_(-step), float("-inf"))
        q3 = q.reshape(b * kv, g * t, hd)
        s0 = torch.baddbmm(bias.repeat(g, 1), q3, keys[0].reshape(b * kv, t, hd).transpose(1, 2))
        s0 = s0.view(b, kv, g, t, t)
        # chain keys: step j key at q - step + j, j = 1..step (the last is the query's own key)
        q5 = q.reshape(b, kv, g, t, hd)
        chain_v = [shift_right(values[j], step - j).unsqueeze(2) for j in range(1, step + 1)]
        scores = [s0] + [(q5 * shift_right(keys[j], step - j).unsqueeze(2)).sum(-1, keepdim=True)
                         for j in range(1, step + 1)]
        p = torch.softmax(torch.cat(scores, dim=-1) if step else s0, dim=-1)
        out = (p[..., :t].reshape(b * kv, g * t, t) @ values[0].reshape(b * kv, t, hd)).view(b, kv, g, t, hd)
        for j, vj in enumerate(chain_v):
            out = out + p[..., t + j:t + j + 1] * vj
        out = out.reshape(b, h, t, hd).transpose(1, 2).reshape(b, t, h * hd)
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
    cos, sin = head._rope(pos, head.dtype)
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
    """``sum_i w_i * CE(target_i, softmax(logits_i))`` with the gradient ``(softmax - target) * w`` computed
    directly: one fp32 [rows, V] buffer instead of log_softmax + product + sum graphs (``target`` rows sum
    to 1)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=-1)
        loss = -((target * logp).sum(-1) * w).sum()  # not ``@``: autocast would run a matmul in bf16
        ctx.save_for_backward(logp, target, w)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logp, target, w = ctx.saved_tensors
        g = logp.exp_().sub_(target).mul_((w * grad)[:, None])
        return g.to(ctx.in_dtype), None, None


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over rows of the cross-entropy between ``target`` (probabilities) and ``logits``."""
    return _SoftCrossEntropy.apply(logits, target, weights.float())


def collate(seqs: list[dict[str, torch.Tensor]], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Right-padded training tensors from stored sequences (see :class:`~adaptree.train.features.FeatureStore`).

    Query positions ``q = 0..L-2``: ``feats = f[q]``, ``input_ids = x[q+1]``, target ``hidden`` and
    ``argmax`` at ``q+1``, and ``weight[q] = 1`` iff ``x[q+2]`` exists and is a response token (the target
    distribution at ``q+1`` is one the head must match during generation)."""
    t = max(len(s["tokens"]) for s in seqs) - 1
    b = len(seqs)
    hdim = seqs[0]["hidden"].shape[-1]
    fdim = seqs[0]["feats"].shape[-1]
    feats = torch.zeros(b, t, fdim, dtype=torch.bfloat16)
    hidden = torch.zeros(b, t, hdim, dtype=torch.bfloat16)
    ids = torch.zeros(b, t, dtype=torch.long)
    argmax = torch.zeros(b, t, dtype=torch.long)
    weight = torch.zeros(b, t, dtype=torch.bool)
    for i, s in enumerate(seqs):
        n = len(s["tokens"]) - 1
        if n <= 0:
            continue
        feats[i, :n] = s["feats"][:n]
        hidden[i, :n] = s["hidden"][1:]
        ids[i, :n] = s["tokens"][1:]
        argmax[i, :n] = s["argmax"][1:]
        weight[i, :n - 1] = s["loss_mask"][2:]
    out = {"feats": feats, "hidden": hidden, "input_ids": ids, "argmax": argmax, "weight": weight}
    return {k: v.to(device) for k, v in out.items()}


def ttt_loss(head, batch: dict[str, torch.Tensor], target_lm_rows: torch.Tensor, steps: int,
             decay: float = 0.8) -> tuple[torch.Tensor, dict]:
    """Weighted TTT loss ``sum_k decay^k * loss_k`` and per-step statistics.

    ``loss_k`` is the soft cross-entropy between the head's logits and the target's distribution restricted
    to the draft vocabulary (``softmax(hidden @ target_lm_rows.T)``, ``target_lm_rows`` = the target's
    ``lm_head`` rows of the draft vocabulary in draft-id order), averaged over the response positions
    valid at step k. Per step the statistics hold the summed loss, the number of positions, and how many
    of them have ``draft argmax (as a target id) == target argmax over the full vocabulary`` (greedy
    acceptance of that step given a correct prefix), plus ``[B, T]`` ``correct`` / ``valid`` masks for
    chain statistics."""
    weight = batch["weight"]
    t = weight.shape[1]
    qpos = torch.arange(t, device=weight.device)
    masks = [weight & (qpos >= k)[None] for k in range(steps)]
    outs = ttt_forward(head, batch["feats"], batch["input_ids"], steps, logits_rows=masks)
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        # the target's distribution over the draft vocabulary, once, at every loss position, in fp32
        tgt_all = torch.softmax(batch["hidden"][weight].float() @ target_lm_rows.float().T, dim=-1)
        am_all = batch["argmax"][weight]
        wpos = qpos.expand_as(weight)[weight]  # query position of each loss row
    total = torch.zeros((), device=weight.device)
    stats: dict[str, list] = {"loss_sum": [], "count": [], "correct": [], "correct_mask": [], "valid_mask": []}
    for k, (_, logits) in enumerate(outs):
        sel = wpos >= k  # rows of step k among the loss rows (same row-major order as masks[k])
        n = int(sel.sum())
        ones = torch.ones(n, device=logits.device)
        loss_k = soft_cross_entropy(logits, tgt_all[sel], ones)
        if n:
            total = total + (decay ** k) * loss_k / n
        with torch.no_grad():
            ok_rows = head.draft_to_target(logits.max(-1).indices) == am_all[sel]
            ok = torch.zeros_like(weight)
            ok[masks[k]] = ok_rows
        stats["loss_sum"].append(float(loss_k.detach()))
        stats["count"].append(n)
        stats["correct"].append(int(ok_rows.sum()))
        stats["correct_mask"].append(ok)
        stats["valid_mask"].append(masks[k])
    return total, stats


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


__all__ = ["chain_lengths", "collate", "shift_right", "soft_cross_entropy", "ttt_forward", "ttt_loss"]
