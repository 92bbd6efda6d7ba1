"""The one draft-and-verify loop (DESIGN.md). Every method is a controller plugged into it.

    prefill -> cycle: plan = ctl.begin_cycle(ctx)
                      draft depth 1; while depth < plan.max_depth and ctl.continue_drafting(step): draft
                      V = ctl.choose_size(tree, plan); select top-V nodes
                      verify on the target; accept; compact the KV cache
                      ctl.end_cycle(record)

The autoregressive baseline is the same loop with a zero-depth plan: the tree is the root alone, so
one target forward yields one token, on the same model code and KV cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from adaptree.core.controller import AutoregressiveController, Controller, CycleContext
from adaptree.core.records import CycleRecord, GenerationResult
from adaptree.core.tree import DraftTree, root_only_tree
from adaptree.core.verify import SamplingConfig, sample_token, verify

log = logging.getLogger(__name__)

TREE_SLOTS = 4096
"""Draft-cache room for one cycle's throw-away tree entries (W x D <= 64 x 64)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Generates with a target model and (optionally) an EAGLE-3 draft head, batch size 1.

    :param target: the target :class:`~adaptree.models.llama.Transformer`.
    :param head: the draft head; None allows only the autoregressive baseline.
    :param eos_token_ids: generation stops after any of these tokens (it is kept in the output).
    :param max_seq_len: context limit (prompt + generated); default: the target's.
    """

    def __init__(self, target, head=None, eos_token_ids: Sequence[int] = (), max_seq_len: int | None = None) -> None:
        self.target, self.head = target, head
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.max_len = min(max_seq_len or target.max_seq_len, target.max_seq_len)
        if head is not None:
            hc, tc = head.config, target.config
            if hc.vocab_size != tc.vocab_size:
                raise ValueError(f"draft head vocabulary {hc.vocab_size} does not match the target's {tc.vocab_size}")
            if hc.target_hidden_size != tc.hidden_size:
                raise ValueError(f"draft head expects target hidden size {hc.target_hidden_size}, "
                                 f"the target has {tc.hidden_size}")
        self.cache = target.new_cache(self.max_len)
        self.draft_cache = head.new_cache(self.max_len + TREE_SLOTS) if head is not None else None
        self._warned_clamp = False

    @property
    def device(self) -> torch.device:
        return self.target.device

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], controller: Controller | None = None, max_new_tokens: int = 256,
                 sampling: SamplingConfig | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

        :param controller: shapes every cycle's tree; None = autoregressive decoding.
        :param sampling: greedy by default; see :class:`SamplingConfig`.
        :param on_tokens: called with each cycle's new token ids (streaming).
        """
        ctl = controller or AutoregressiveController()
        sampling = sampling or SamplingConfig()
        use_draft = ctl.uses_draft
        if use_draft and self.head is None:
            raise ValueError(f"method {ctl.name!r} needs a draft head; none was given")
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= self.max_len:
            raise ValueError(f"the prompt has {n} tokens; the context limit is {self.max_len}, "
                             f"leaving no room to generate")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        dev = self.device
        ctl.reset()
        self.cache.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()
        gen = None if sampling.greedy else sampling.generator(dev)
        result = GenerationResult(prompt_len=n, token_ids=[], method=ctl.name)

        _sync(dev)
        t_start = time.perf_counter()
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
        out = self.target(prompt, cache=self.cache, features=use_draft, logits_at=slice(-1, None))
        root = sample_token(out.logits[0, -1], sampling, gen)
        pend_h = out.features if use_draft else None  # draft inputs not consumed yet: (feature_t, token_t+1)
        pend_t = torch.cat([prompt[:, 1:], prompt.new_tensor([[root]])], dim=1) if use_draft else None
        tokens = result.token_ids
        stop = self._emit(tokens, [root], max_new_tokens)
        if on_tokens:
            on_tokens([root])
        _sync(dev)
        result.prefill_s = time.perf_counter() - t_start

        while not stop:
            L = self.cache.length
            room = self.max_len - L  # target slots left for the root and the verified nodes
            if room < 1:
                stop = "context_limit"
                break
            t_cycle = time.perf_counter()
            rec = CycleRecord(cycle=len(result.cycles), context_len=L, width=0, depth=0, size=0,
                              candidates=0, accepted=0, emitted=0)
            ctx = CycleContext(rec.cycle, L, len(tokens), pend_h[0, -1] if use_draft else None, prompt_ids, tokens)
            t0 = time.perf_counter()
            plan = ctl.begin_cycle(ctx)
            rec.policy_s += time.perf_counter() - t0
            rec.width = plan.width

            if use_draft and plan.max_depth > 0 and room > 1:
                t0 = time.perf_counter()
                tree = DraftTree(self.head, self.draft_cache, plan.width, root, L)
                step = tree.first_step(pend_h, pend_t)
                pend_h = pend_t = None
                _sync(dev)
                rec.draft_s += time.perf_counter() - t0
                while tree.depth < plan.max_depth:
                    t0 = time.perf_counter()
                    go_on = ctl.continue_drafting(step)
                    rec.policy_s += time.perf_counter() - t0
                    if not go_on:
                        break
                    t0 = time.perf_counter()
                    step = tree.step()
                    _sync(dev)
                    rec.draft_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                v = int(ctl.choose_size(tree, plan))
                rec.policy_s += time.perf_counter() - t0
                if v < 0:
                    raise ValueError(f"controller {ctl.name!r} chose a negative verification size V={v}")
                rec.depth, rec.candidates = tree.depth, tree.num_candidates
                # A plan whose full-depth tree has fewer than V candidates is worth one warning; a controller
                # that stopped drafting early gets fewer candidates by design (nothing to say).
                if v > tree.num_candidates and tree.depth == plan.max_depth and not self._warned_clamp:
                    log.warning("V=%d exceeds the %d draft candidates (W=%d, depth %d); clamping V to the "
                                "candidate count (said once)", v, tree.num_candidates, plan.width, tree.depth)
                    self._warned_clamp = True
                vtree = tree.select(min(v, tree.num_candidates, room - 1))
                tree.discard()
            else:
                vtree = root_only_tree(root, L, dev)
            rec.size = vtree.size

            t0 = time.perf_counter()
            out = self.target(vtree.tokens[None], position_ids=vtree.positions, cache=self.cache,
                              tree_mask=vtree.mask if vtree.size else None, features=use_draft)
            acc = verify(vtree, out.logits[0], sampling, gen)
            _sync(dev)
            rec.verify_s = time.perf_counter() - t0

            path = acc.path
            if acc.accepted == int(path[-1]):  # path is 0..k: the accepted nodes are already in place
                self.cache.truncate(L + acc.accepted + 1)
            else:
                self.cache.compact(L, path)
            new = vtree.tokens[path[1:]].tolist() + [acc.bonus]
            rec.accepted = acc.accepted
            if use_draft:
                feats = out.features[:, path]
                nxt = torch.tensor([new], dtype=torch.long, device=dev)
                pend_h = feats if pend_h is None else torch.cat([pend_h, feats], dim=1)
                pend_t = nxt if pend_t is None else torch.cat([pend_t, nxt], dim=1)
            root = acc.bonus
            before = len(tokens)
            stop = self._emit(tokens, new, max_new_tokens)
            rec.emitted = len(tokens) - before
            if on_tokens:
                on_tokens(tokens[before:])
            rec.other_s = max(0.0, time.perf_counter() - t_cycle - rec.draft_s - rec.verify_s - rec.policy_s)
            t0 = time.perf_counter()
            ctl.end_cycle(rec)
            rec.policy_s += time.perf_counter() - t0
            result.cycles.append(rec)

        _sync(dev)
        result.wall_time_s = time.perf_counter() - t_start
        result.stop_reason = stop
        return result

    def _emit(self, tokens: list[int], new: list[int], limit: int) -> str:
        """Append ``new`` up to EOS (kept) or the token limit; return the stop reason or ''."""
        for t in new:
            tokens.append(t)
            if t in self.eos:
                return "eos"
            if len(tokens) >= limit:
                return "max_new_tokens"
        return ""
