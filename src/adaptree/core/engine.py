"""The one draft-and-verify loop (DESIGN.md). Every method is a controller plugged into it.

    prefill -> cycle: plan = ctl.begin_cycle(ctx)
                      draft depth 1; while depth < plan.max_depth and ctl.continue_drafting(step): draft
                      V = ctl.choose_size(tree, plan); select top-V nodes
                      verify on the target; accept; compact the KV cache
                      ctl.end_cycle(record)

The cycle bookkeeping (controller calls, clamps, stop rules, records) is
:func:`adaptree.core.cycle.run_cycles`, which the replay simulator runs too; this module is its live
source: the target and draft head, their KV caches and the wall clock.

The autoregressive baseline is the same loop with a zero-depth plan: the tree is the root alone, so
one target forward yields one token, on the same model code and KV cache.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from adaptree.core.controller import AutoregressiveController, Controller
from adaptree.core.cycle import CycleSource, emit, run_cycles
from adaptree.core.graphs import StepGraphs
from adaptree.core.records import CycleRecord, GenerationResult
from adaptree.core.tree import DraftStep, DraftTree, add_chain, is_chain, root_only_tree
from adaptree.core.verify import SamplingConfig, greedy_tokens, sample_token, verify

TREE_SLOTS = 4096
"""Draft-cache room for one cycle's throw-away tree entries (W x D <= 64 x 64)."""


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU): what every wall-clock timing calls before reading
    the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def gc_paused():
    """Python's cycle collector off for the block (and back on after, if it was on): a generation's objects go by
    reference counting, and a collection the allocations of a cycle trigger walks every object torch and the models
    hold, 2.4% of a llama.cpp backend's decode time by ``perf`` on a 2-core EPYC. Cycles made meanwhile are
    collected after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Engine:
    """Generates with a target model and (optionally) an EAGLE-3 draft head, batch size 1.

    :param target: the target :class:`~adaptree.models.llama.Transformer`.
    :param head: the draft head; None allows only the autoregressive baseline.
    :param eos_token_ids: generation stops after any of these tokens (it is kept in the output).
    :param max_seq_len: context limit (prompt + generated); default: the target's.
    :param graphs: run the target's decode steps and verifications and the head's draft steps at fixed shapes
        (:class:`~adaptree.core.graphs.StepGraphs`), captured as CUDA graphs on CUDA; default: on CUDA only
        (on a CPU the padded steps run eagerly and cost more than the plain forwards: for tests).
    """

    def __init__(self, target, head=None, eos_token_ids: Sequence[int] = (), max_seq_len: int | None = None,
                 graphs: bool | None = None) -> None:
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
        if graphs is None:
            graphs = target.device.type == "cuda"
        self.steps = StepGraphs(target, self.cache) if graphs else None
        """The fixed-shape target steps (None: plain forwards)."""
        self.draft_steps = StepGraphs(head, self.draft_cache) if graphs and head is not None else None
        """The draft head's fixed-shape steps (None: plain forwards)."""
        self._models = _ModelSource(self)

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
        vocab = self.target.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:  # the embedding lookup's IndexError would not name it
            raise ValueError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        dev = self.device
        ctl.reset()
        self.cache.reset()
        if self.draft_cache is not None:
            self.draft_cache.reset()
        result = GenerationResult(prompt_len=n, token_ids=[], method=ctl.name)

        with gc_paused():
            synchronize(dev)
            t_start = time.perf_counter()
            src = self._models
            root = src.prefill(prompt_ids, sampling, use_draft, dev)
            tokens = result.token_ids
            stop = emit(tokens, [root], max_new_tokens, self.eos)
            if on_tokens:
                on_tokens([root])
            synchronize(dev)
            result.prefill_s = time.perf_counter() - t_start

            stop = stop or run_cycles(src, ctl, prompt_ids, tokens, result.cycles, max_new_tokens, self.eos,
                                      time.perf_counter, on_tokens)
            synchronize(dev)
            result.wall_time_s = time.perf_counter() - t_start
        result.stop_reason = stop
        return result


class _ModelSource(CycleSource):
    """The engine's models as :func:`~adaptree.core.cycle.run_cycles`' source: drafts with the head, verifies
    on the target, keeps both KV caches and the draft inputs not consumed yet; timings are wall-clock."""

    warn_clamp = True  # once per engine

    def __init__(self, engine: Engine) -> None:
        self.target, self.head, self.max_len = engine.target, engine.head, engine.max_len
        self.cache, self.draft_cache = engine.cache, engine.draft_cache
        self.steps, self.draft_steps = engine.steps, engine.draft_steps
        # a backend's own greedy step (llama.cpp's: no torch object per token), looked up once: on an nn.Module a
        # missing attribute raises inside ``__getattr__``, which an AR cycle should not pay every token
        self.greedy_step = None if self.steps else getattr(self.target, "greedy_step", None)

    def prefill(self, prompt_ids: Sequence[int], sampling: SamplingConfig, use_draft: bool, dev: torch.device) -> int:
        """Run the prompt through the target (caches reset); return the first token (the first root)."""
        self.sampling, self.use_draft, self.dev = sampling, use_draft, dev
        self.temperature = float(sampling.temperature)
        self.gen = None if sampling.greedy else sampling.generator(dev)
        prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
        out = self.target(prompt, cache=self.cache, features=use_draft, logits_at=slice(-1, None))
        root = self.root = sample_token(out.logits[0, -1], sampling, self.gen)
        # draft inputs not consumed yet, in pieces joined when the head drafts: a run of cycles that draft nothing
        # (AR-like plans) then appends in O(1) per cycle instead of copying everything pending each time
        self.pend_h = [out.features] if use_draft else []
        self.pend_t = [torch.cat([prompt[:, 1:], prompt.new_tensor([[root]])], dim=1)] if use_draft else []
        self.feature_dtype = out.features.dtype if use_draft else None
        return root

    def context_len(self) -> int:
        return self.cache.length

    def start_cycle(self, features: bool = True) -> torch.Tensor | None:
        if not (self.use_draft and features):
            return None
        last = self.pend_h[-1]
        if isinstance(last, np.ndarray):  # an AR step's features, kept as the backend gave them (see _step)
            return torch.from_numpy(last[-1]).to(self.feature_dtype)
        return last[0, -1]

    def _pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft inputs not consumed yet as ``[1, P, 3H]`` features and ``[1, P]`` tokens: the pieces joined, the
        AR steps' numpy rows and token ids (a backend's greedy step) made tensors here, one per run of them."""
        hs: list = []
        ts: list = []
        for h, t in zip(self.pend_h, self.pend_t):
            if not isinstance(h, np.ndarray):
                hs.append(h)
                ts.append(t)
            elif hs and isinstance(hs[-1], list):
                hs[-1].append(h)
                ts[-1].append(t)
            else:
                hs.append([h])
                ts.append([t])
        hs = [torch.from_numpy(np.concatenate(h))[None].to(self.dev, self.feature_dtype) if isinstance(h, list) else h
              for h in hs]
        ts = [torch.tensor([t], dtype=torch.long, device=self.dev) if isinstance(t, list) else t for t in ts]
        return tuple(torch.cat(x, dim=1) if len(x) > 1 else x[0] for x in (hs, ts))

    def draft(self, width: int, rec: CycleRecord) -> DraftStep:
        t0 = time.perf_counter()
        tree = DraftTree(self.head, self.draft_cache, width, self.root, self.cache.length, self.draft_steps)
        h, t = self._pending()
        step = tree.first_step(h, t)
        self.pend_h, self.pend_t = [], []
        synchronize(self.dev)
        rec.draft_s += time.perf_counter() - t0
        return step

    def draft_more(self, tree: DraftTree, rec: CycleRecord) -> DraftStep:
        t0 = time.perf_counter()
        step = tree.step()
        synchronize(self.dev)
        rec.draft_s += time.perf_counter() - t0
        return step

    def verify(self, tree: DraftTree | None, v: int, chain: Sequence[int],
               rec: CycleRecord) -> tuple[int, list[int]]:
        L = self.cache.length
        if tree is None and not chain and self.sampling.greedy:
            return self._step(rec)
        if tree is not None:
            vtree = tree.select(v)
            tree.discard()
        else:
            vtree = root_only_tree(self.root, L, self.dev)
        if chain:
            vtree, rec.chain_nodes = add_chain(vtree, chain)
        t0 = time.perf_counter()
        # a chain runs as causal attention; telling costs a read of the tree, so on an accelerator only the root
        # alone (AR) does, and other chains pass their (causal) tree mask
        causal = is_chain(vtree) if self.dev.type == "cpu" or vtree.tokens.numel() == 1 else False
        tree_mask = None if causal else vtree.mask
        out = self.steps.forward(vtree.tokens[None], vtree.positions, tree_mask) if self.steps else None
        if out is None:
            out = self.target(vtree.tokens[None], position_ids=vtree.positions, cache=self.cache,
                              tree_mask=tree_mask, features=self.use_draft)
        acc = verify(vtree, out.logits[0], self.sampling, self.gen)
        synchronize(self.dev)
        rec.verify_s = time.perf_counter() - t0

        path = acc.path
        if acc.accepted == acc.nodes[-1]:  # path is 0..k: the accepted nodes are already in place
            self.cache.truncate(L + acc.accepted + 1)
        else:
            self.cache.compact(L, path)
        new = acc.tokens + [acc.bonus]
        if self.use_draft:
            feats = out.features[:, path]
            nxt = torch.tensor([new], dtype=torch.long, device=self.dev)
            self.pend_h.append(feats)
            self.pend_t.append(nxt)
        self.root = acc.bonus
        return acc.accepted, new

    def _step(self, rec: CycleRecord) -> tuple[int, list[int]]:
        """A greedy cycle of the root alone (AR, or a plan that drafted nothing): one decode step, its argmax. What
        :meth:`verify` does for a tree of one node, without building one: on llama.cpp's kernels a step costs 5 ms
        and the tree's bookkeeping 0.3 of them. On a backend's greedy step the draft inputs stay numpy rows and ids
        until the head drafts: a tree method's AR steps (its AR fallback) then make no torch object either."""
        t0 = time.perf_counter()
        if self.greedy_step is not None:  # a backend's own step (llama.cpp's: on the CPU, nothing to synchronize)
            bonus, feats = self.greedy_step(self.root, self.cache, self.use_draft)
            nxt = bonus  # numpy features and an id, made tensors only when the head drafts (_pending)
        else:
            ids = torch.tensor([[self.root]], dtype=torch.long, device=self.dev)
            out = self.steps.forward(ids, self.cache.length + torch.zeros(1, dtype=torch.long, device=self.dev),
                                     None) if self.steps else None
            if out is None:
                out = self.target(ids, cache=self.cache, features=self.use_draft)
            bonus = int(greedy_tokens(out.logits[0, -1:])[0])
            # a captured step's output is its buffer's until the next step
            feats = out.features[:, -1:].clone() if self.use_draft else None
            synchronize(self.dev)
            nxt = torch.tensor([[bonus]], dtype=torch.long, device=self.dev) if self.use_draft else None
        rec.verify_s = time.perf_counter() - t0
        if self.use_draft:
            self.pend_h.append(feats)
            self.pend_t.append(nxt)
        self.root = bonus
        return 0, [bonus]

    def close(self, rec: CycleRecord, t_cycle: float) -> None:
        rec.other_s = max(0.0, time.perf_counter() - t_cycle - rec.draft_s - rec.verify_s - rec.policy_s)
