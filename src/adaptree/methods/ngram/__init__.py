"""``ngram``: prompt-lookup drafting on adaptree's engine, no draft head (the n-gram speculator of vLLM,
SGLang and llama.cpp, and transformers' prompt lookup).

Every cycle: the longest suffix of the context (prompt and generated tokens, root last) of ``min_n`` to
``max_n`` tokens that occurred earlier in it (:class:`~adaptree.core.context.ContextIndex`), and the
``tokens`` tokens that followed its most recent earlier occurrence (``select="longest"``: the occurrence whose
match reaches furthest back, the hybrid's rule), verified as one chain under the root
(a causal forward). No match: an autoregressive step. Lossless like every tree: verification is the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptree.core.config import check_fields, choice
from adaptree.core.context import MAX_MATCH, SELECT, ContextIndex
from adaptree.core.controller import AR_PLAN, Controller, CycleContext, TreePlan


@dataclass
class NgramConfig:
    """Prompt lookup: chain length and the n-gram sizes matched."""

    tokens: int = 10
    """Continuation tokens proposed per cycle (transformers' ``prompt_lookup_num_tokens``)."""
    min_n: int = 2
    """Shortest suffix match (n-gram) that proposes a chain (a 1-token match proposes mostly noise, and verifying a
    chain costs more than an autoregressive step on a CPU)."""
    max_n: int = 4
    """Longest n-gram matched (vLLM's ``prompt_lookup_max``); longer matches are preferred."""
    select: str = choice(SELECT, "recent")
    """Which earlier occurrence of the match proposes the chain: ``recent`` (the most recent, as prompt lookup does
    it) or ``longest`` (the one whose match reaches furthest back, as the hybrid picks it)."""

    def __post_init__(self) -> None:
        for name in ("tokens", "min_n", "max_n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        check_fields(self)
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must be <= max_n ({self.max_n})")
        if self.max_n > MAX_MATCH:
            raise ValueError(f"max_n must be <= {MAX_MATCH} (the context index's longest match), got {self.max_n}")


class NgramController(Controller):
    """The chain of the context's longest earlier match, or an autoregressive step."""

    name = "ngram"
    uses_draft = False

    def __init__(self, config: NgramConfig | None = None) -> None:
        self.config = config or NgramConfig()

    def context_index(self) -> ContextIndex:
        return ContextIndex(max_ngram=self.config.max_n, select=self.config.select)

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        m = ctx.index.match(self.config.tokens, self.config.min_n)
        return AR_PLAN.with_chain(m.tokens) if m is not None else AR_PLAN


__all__ = ["NgramConfig", "NgramController"]
