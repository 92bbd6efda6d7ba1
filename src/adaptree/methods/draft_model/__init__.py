"""``draft-model``: classic two-model speculative decoding (Leviathan et al., Chen et al.: the baseline the
EAGLE papers compare with), on adaptree's engine.

A smaller model with the target's tokenizer (Qwen2.5-Coder-0.5B for the 1.5B) proposes a chain each cycle: it
decodes greedily from the committed context for up to ``tokens`` tokens, stopping early when its top token's
probability falls below ``min_prob``. The chain goes to the target as one causal forward under the root, the
n-gram method's way (:class:`~adaptree.core.controller.TreePlan` ``chain``). Lossless like every chain: the
engine's verification decides, and at a temperature it accepts a deterministic proposal by the target's own
probabilities (:mod:`adaptree.core.verify`), so the output follows the target's distribution whatever the draft
model proposes.

The draft model keeps its own KV cache across cycles: at a cycle's start it drops the entries after the longest
prefix it shares with the committed context (its rejected proposals) and runs the rest, typically the last
accepted token and the bonus token, in one forward. Its seconds are the cycle's draft time, not policy time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from adaptree.core.config import between, check_fields, positive
from adaptree.core.controller import AR_PLAN, Controller, CycleContext, TreePlan
from adaptree.core.records import CycleRecord


@dataclass
class DraftModelConfig:
    """The chain the draft model proposes per cycle."""

    tokens: int = positive(5, integer=True)
    """Most tokens the draft model proposes per cycle (its forwards per cycle, the first one over the tokens it
    has not seen yet)."""
    min_prob: float = between(0.0, 1.0, 0.0, hi_open=True)
    """Stop the chain early when the draft model's top token has less probability than this (0: always propose
    ``tokens``; transformers' assisted generation stops at 0.4)."""

    def __post_init__(self) -> None:
        check_fields(self)


def check_draft_model(target, draft) -> None:
    """A ValueError naming both sizes when ``draft`` cannot draft for ``target``: their vocabularies differ."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"the draft model's vocabulary has {dv} ids, the target's {tv}: a draft model must share "
                         f"the target's tokenizer")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DraftModelController(Controller):
    """Each cycle: the draft model's greedy chain from the committed context (see the module's docstring)."""

    name = "draft-model"
    uses_draft = False  # the EAGLE-3 head is never run; the chain comes through the plan

    def __init__(self, config: DraftModelConfig | None = None, *, draft_model=None) -> None:
        if draft_model is None:
            raise ValueError("method 'draft-model' needs a draft model: load(..., draft_model=NAME) "
                             "(the command line's --draft-model NAME), a model sharing the target's tokenizer")
        self.config = config or DraftModelConfig()
        self.model = draft_model
        self.cache = None
        self.fed: list[int] = []
        """The token ids in the draft model's KV cache, in order."""
        self.checked = 0
        """The length of the committed context already known to agree with ``fed`` (committed tokens never
        change within a generation)."""
        self._draft_s = 0.0

    def reset(self) -> None:
        if self.cache is None:
            self.cache = self.model.new_cache()
        self.cache.reset()
        self.fed, self.checked = [], 0

    @torch.inference_mode()
    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        t0 = time.perf_counter()
        prompt, gen = ctx.prompt_ids, ctx.generated_ids
        n = len(prompt) + len(gen)  # the committed context, the root last

        def at(i: int) -> int:
            return prompt[i] if i < len(prompt) else gen[i - len(prompt)]

        m, fed = self.checked, self.fed
        while m < len(fed) and m < n and fed[m] == at(m):
            m += 1
        self.checked = n
        room = self.cache.max_len - n  # the draft model's context left for the chain's fed tokens
        k = min(self.config.tokens, room + 1)
        if k < 1:
            self._draft_s = time.perf_counter() - t0
            return AR_PLAN
        del fed[m:]
        self.cache.truncate(m)
        new = [at(i) for i in range(m, n)]
        dev = self.model.device
        chain: list[int] = []
        while True:
            fed.extend(new)
            out = self.model(torch.tensor([new], dtype=torch.long, device=dev), cache=self.cache,
                             logits_at=slice(-1, None))
            logits = out.logits[0, -1].float()
            tok = int(logits.argmax())
            if self.config.min_prob > 0 and float(torch.softmax(logits, -1)[tok]) < self.config.min_prob:
                break
            chain.append(tok)
            if len(chain) >= k:
                break
            new = [tok]
        _synchronize(dev)
        self._draft_s = time.perf_counter() - t0
        return AR_PLAN.with_chain(chain)

    def end_cycle(self, record: CycleRecord) -> None:
        # the loop timed begin_cycle as the controller's; the draft model's forwards are the cycle's drafting
        moved = min(self._draft_s, record.policy_s)
        record.policy_s -= moved
        record.draft_s += moved
        self._draft_s = 0.0


__all__ = ["DraftModelConfig", "DraftModelController", "check_draft_model"]
