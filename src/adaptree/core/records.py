"""Per-cycle and per-generation records: what benchmarks, traces and learners consume."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CycleRecord:
    """One draft-and-verify cycle (for the autoregressive baseline: one target forward)."""

    cycle: int
    context_len: int
    """Target tokens committed before the cycle's root."""
    width: int
    depth: int
    """Draft forwards run this cycle (= levels of the tree)."""
    size: int
    """V: draft nodes verified (after clamping to the candidates)."""
    candidates: int
    """Draft candidates available when V was chosen."""
    accepted: int
    """Accepted draft tokens (the bonus token not included)."""
    emitted: int
    """Tokens this cycle added to the output (accepted + 1, less when EOS / the token limit cut it)."""
    chain: int = 0
    """Tokens of the plan's chain verified (:attr:`~adaptree.core.controller.TreePlan.chain`, cut to the room)."""
    chain_nodes: int = 0
    """Nodes the chain added to the verified tree (its prefix shared with the head's tree is not added)."""
    chain_accepted: int = 0
    """Accepted tokens that were the chain's first tokens (the chain's accepted length)."""
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy_s: float = 0.0
    other_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.policy_s + self.other_s

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    prompt_len: int
    token_ids: list[int]
    """Generated token ids (the EOS token included when generation stopped on it)."""
    cycles: list[CycleRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    wall_time_s: float = 0.0
    stop_reason: str = ""
    """One of: eos, max_new_tokens, context_limit."""
    method: str = ""

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tau(self) -> float:
        """Mean over cycles of (accepted draft tokens + 1), SPEC.md's acceptance length."""
        if not self.cycles:
            return 0.0
        return sum(c.accepted + 1 for c in self.cycles) / len(self.cycles)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def time_split(self) -> dict[str, float]:
        keys = ("draft_s", "verify_s", "policy_s", "other_s")
        return {k: sum(getattr(c, k) for c in self.cycles) for k in keys}
