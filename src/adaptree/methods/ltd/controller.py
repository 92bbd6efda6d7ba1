"""LTD — Learning to Draft (seeds/ltd-learning-to-draft.txt, SPEC.md §2): two small MLP policies shape
every cycle's tree, trained with PPO on the cycle's throughput.

* depth policy π_D, consulted after EVERY draft forward (the public code asks only every 3rd step at
  inference): CONTINUE or STOP, from the W² cumulative log-probs of the frontier just scored, the depth
  D and the context length L;
* size policy π_V, once drafting stopped: V from 12 values 20, 40, ..., 240, from ALL candidate
  log-probs (padded to the largest tree), D and L.

With ``use_costs`` both observations end with the machine's cost features
(:func:`adaptree.offline.family.cost_features`: draft step, verification growth and overhead relative to one
autoregressive step), read from this machine's latency model at inference (``latency``, filled from the machine
setup) and from the family member of each generation in training; without a latency model the policy's
``reference_costs`` stand in.

With ``use_tree`` they also see the machine's static tree (:mod:`adaptree.methods.common.machine_tree`: how far the
tree is from the machine's best static depth, the best V at its depth; the machine setup's ``static_gs.json``, the
``tuned`` option) and, with ``relative_sizes``, π_V picks V as a factor of that V. With ``first_decision`` π_D is also
asked before the first draft forward: STOP there makes the cycle an AR step with the context's chain.

With ``use_match`` they also end with the cycle's context-match features
(:data:`adaptree.methods.common.chain.MATCH_FEATURES`) and every cycle carries the context's chain next to the
policies' tree, its length chosen by :class:`~adaptree.methods.common.chain.ChainRule` (``chain_tokens`` adds the
chain to policies that do not observe the match, too). The latency model, the AR fallback and the chain are the
learned methods' shared runtime (:mod:`adaptree.methods.common.runtime`).

With the rule's actions (``adaptree train ltd --rule``) π_D has a third action, RULE: draft on where the hybrid rule's
look-ahead would; π_V has the priced V among its actions: the V the hybrid rule would verify next to the chain. Both
are :class:`~adaptree.methods.common.ChainRule`'s, at the chain's price, with the head's acceptance calibration
(``acceptance``, filled from the machine setup): a policy can keep the rule where it pays and leave it where it learned
better.

L is the true context length at training and at inference (the public code reads it after the input
ids were overwritten: a constant at inference). The observation is built by :class:`LTDObservation`,
the one function the simulator environments (training) and this controller (inference) share, and its
settings travel in each policy's ``config.json``, so training and inference cannot disagree.

Representation choices (the paper fixes the content, not the encoding): scores are sorted in
descending order (the frontier's W² children and the tree's candidates are sets; sorting makes the
input permutation-free and puts the V-th best score at index V-1), clamped below at ``score_floor``
and multiplied by ``score_scale`` (log-probs reach -30 and below; tanh layers want inputs of order 1);
padding uses the floor; D enters as D / max_depth, L as L / 1000 (the paper's code's L scale).

Methods: ``ltd`` (both policies), ``ltd-depth`` (depth policy, V fixed), ``ltd-size`` (size policy, depth
fixed). Policies default to the ones shipped next to the model's head (``heads/<model>/ltd/{depth,size}/``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar
from pathlib import Path

import torch

from adaptree.core.config import choice
from adaptree.core.controller import AR_PLAN, Controller, CycleContext, TreePlan, TreeShape, check_shape
from adaptree.core.tree import DraftStep, DraftTree
from adaptree.methods.common import MATCH_FEATURES, RULE, LearnedRuntime, LearnedSeam, MachineTree, match_values
from adaptree.methods.common.machine_tree import FEATURES as TREE_FEATURES

STOP, CONTINUE, DEPTH_RULE = 0, 1, 2
DEPTH_ACTIONS = ("stop", "continue", "rule")
"""π_D's actions: STOP, CONTINUE, and (a policy trained with the rule's decisions) RULE: as the hybrid rule decides
(:meth:`~adaptree.methods.common.ChainRule.priced_continue`)."""
LTD_SIZES = tuple(range(20, 241, 20))
"""The size policy's 12 actions: V = 20, 40, ..., 240 (paper A.2.1)."""
MODES = ("both", "depth", "size")


@dataclass
class LTDObservation:
    """How an LTD observation vector is built (stored in each policy's config as ``observation``)."""

    width: int = 10
    """Beam width W the policy was trained with (the frontier has W² scores)."""
    max_depth: int = 12
    """Largest depth (draft forwards per cycle); pads the size policy's input to W + (max_depth-1)·W²."""
    use_depth: bool = True
    """Append D / max_depth (ablation P+L drops it)."""
    use_length: bool = True
    """Append L / length_scale (ablation P+D drops it)."""
    score_floor: float = -20.0
    """Log-probs below this are clamped to it; padding uses it too."""
    score_scale: float = 0.1
    """Scores enter as score * score_scale (inputs in [-2, 0] with the defaults)."""
    length_scale: float = 1000.0
    """L enters as L / length_scale (the paper's code)."""
    use_costs: bool = False
    """Append the machine's cost features (adaptree.offline.family.COST_FEATURES)."""
    reference_costs: list[float] | None = None
    """The cost features assumed when no latency model is given (the training family's median)."""
    use_match: bool = False
    """Append the cycle's context-match features (adaptree.methods.common.MATCH_FEATURES)."""
    use_tree: bool = False
    """Append what the machine's static tree says at the current depth (adaptree.methods.common.machine_tree)."""
    relative_sizes: bool = False
    """The size policy's actions are factors of the machine tree's best V at the tree's depth
    (adaptree.methods.common.SIZE_FACTORS), not V values."""
    first_decision: bool = False
    """π_D is also asked before the first draft forward (no scores yet: D = 0, the match, the costs, the machine
    tree): STOP there makes the cycle an AR step with the context's chain, the way hybrid skips the head when the
    context alone pays."""
    chain_split: bool = False
    """π_V's actions are (size, chain) pairs: the head's V (or its factor, ``relative_sizes``) and how many of the
    context chain's tokens are verified next to it (adaptree.methods.common.CHAIN_OPTIONS: a count, or the chain
    rule's price-based length); without it the chain rule sizes the chain after V is chosen."""

    def __post_init__(self) -> None:
        check_shape(self.width, self.max_depth, 1, "max_depth")
        if self.relative_sizes and not self.use_tree:
            raise ValueError("relative_sizes needs use_tree: the factors scale the machine tree's V")
        if self.chain_split and not self.use_match:
            raise ValueError("chain_split needs use_match: the policy sizes the context chain it observes")
        if not self.score_floor < 0:
            raise ValueError(f"score_floor must be < 0, got {self.score_floor}")
        if self.score_scale <= 0 or self.length_scale <= 0:
            raise ValueError(f"score_scale and length_scale must be > 0, got {self.score_scale}, {self.length_scale}")
        from adaptree.offline.family import check_costs

        self.reference_costs = check_costs(self.reference_costs)

    @classmethod
    def from_dict(cls, d: dict) -> "LTDObservation":
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def frontier(self) -> int:
        return self.width * self.width

    @property
    def max_candidates(self) -> int:
        return self.width + (self.max_depth - 1) * self.width * self.width

    def _extras(self) -> int:
        from adaptree.offline.family import COST_FEATURES

        return (int(self.use_depth) + int(self.use_length) + (len(COST_FEATURES) if self.use_costs else 0)
                + (len(MATCH_FEATURES) if self.use_match else 0) + (len(TREE_FEATURES) if self.use_tree else 0))

    def costs_of(self, latency) -> list[float] | None:
        """The cost features of ``latency`` for this observation (None when it does not use them)."""
        from adaptree.offline.family import cost_features

        return cost_features(latency, self.width) if self.use_costs else None

    @property
    def depth_dim(self) -> int:
        return self.frontier + self._extras()

    @property
    def size_dim(self) -> int:
        return self.max_candidates + self._extras()

    @property
    def pad_value(self) -> float:
        """What an empty score slot holds."""
        return self.score_floor * self.score_scale

    def _parts(self, scores: torch.Tensor, n: int, depth: int, context_len: int, costs: list[float] | None = None,
               match: list[float] | None = None, machine: MachineTree | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sorted, clamped, scaled scores; the extras D, L, the costs, the match and the machine tree's features):
        the observation without its padding."""
        s = scores.detach().float().reshape(-1).cpu()
        if s.numel() > n:
            raise ValueError(f"{s.numel()} scores do not fit the observation's {n} slots "
                             f"(W={self.width}, max_depth={self.max_depth})")
        srt = torch.sort(s, descending=True).values.clamp(min=self.score_floor)
        head = torch.nan_to_num(srt, nan=self.score_floor) * self.score_scale
        extras = ([depth / self.max_depth] if self.use_depth else []) + (
            [context_len / self.length_scale] if self.use_length else [])
        if self.use_costs:
            from adaptree.offline.family import costs_or_reference

            extras += list(costs_or_reference(costs, self.reference_costs, "ltd"))
        if self.use_match:
            extras += match_values(match, "LTD")
        if self.use_tree:
            if machine is None:
                raise ValueError("this LTD policy observes the machine's static tree: give it the machine setup's "
                                 "static_gs.json (--ltd-tuned PATH)")
            extras += machine.features(depth, self.max_depth)
        return head, torch.tensor(extras, dtype=torch.float32)

    def _vector(self, scores: torch.Tensor, n: int, depth: int, context_len: int, costs: list[float] | None,
                match: list[float] | None, machine: MachineTree | None) -> torch.Tensor:
        head, tail = self._parts(scores, n, depth, context_len, costs, match, machine)
        return torch.cat([head, torch.full((n - head.numel(),), self.pad_value), tail])

    def depth_obs(self, step: DraftStep, costs: list[float] | None = None, match: list[float] | None = None,
                  machine: MachineTree | None = None) -> torch.Tensor:
        """π_D's input after a draft forward: the frontier's cumulative log-probs (W at depth 1, W² later), D, L
        (and the costs, the match features, the machine tree's features)."""
        return self.frontier_obs(step.child_scores, step.depth, step.context_len, costs, match, machine)

    def frontier_obs(self, scores: torch.Tensor, depth: int, context_len: int, costs: list[float] | None = None,
                     match: list[float] | None = None, machine: MachineTree | None = None) -> torch.Tensor:
        """:meth:`depth_obs` from the frontier's scores themselves (at most W², any order), for a drafter that is not
        adaptree's tree (vLLM's chains: :class:`adaptree.vllm_plugin.control.LtdLength`)."""
        return self._vector(scores, self.frontier, depth, context_len, costs, match, machine)

    def first_obs(self, context_len: int, costs: list[float] | None = None, match: list[float] | None = None,
                  machine: MachineTree | None = None) -> torch.Tensor:
        """π_D's input before the first draft forward (``first_decision``): no scores (all padding), D = 0, L and the
        extras."""
        return self._vector(torch.zeros(0), self.frontier, 0, context_len, costs, match, machine)

    def size_obs(self, tree: DraftTree, costs: list[float] | None = None, match: list[float] | None = None,
                 machine: MachineTree | None = None) -> torch.Tensor:
        """π_V's input once drafting stopped: every candidate's cumulative log-prob, D, L (and the costs, the match
        features, the machine tree's features)."""
        return self._vector(tree.candidate_scores(), self.max_candidates, tree.depth, tree.context_len, costs, match,
                            machine)

    def size_parts(self, tree: DraftTree, costs: list[float] | None = None, match: list[float] | None = None,
                   machine: MachineTree | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`size_obs` without the padding, for :meth:`~adaptree.offline.policy.MLPPolicy.act_padded`."""
        return self._parts(tree.candidate_scores(), self.max_candidates, tree.depth, tree.context_len, costs, match,
                           machine)

    def action_of(self, value) -> float | int | tuple[float, int]:
        """A size action as the policy config stores it, checked: a V, a factor (``relative_sizes``), or with
        ``chain_split`` a (size, chain option) pair."""
        if self.chain_split:
            if isinstance(value, (int, float, str)) or len(value) != 2 or not (int(value[1]) >= 0 or value[1] == RULE):
                raise ValueError(f"a chain-split size action is a (size, chain tokens >= 0 or {RULE} for the rule) "
                                 f"pair, got {value!r}")
            return self._size_value(value[0]), int(value[1])
        return self._size_value(value)

    def _size_value(self, value) -> float | int:
        if value == RULE:
            return RULE
        v = float(value) if self.relative_sizes else int(value)
        if not v > 0:
            raise ValueError(f"a size action must be > 0 (a V >= 1, or a factor) or {RULE} (the priced V), got "
                             f"{value!r}")
        return v

    def decide(self, action, tree: DraftTree, machine: MachineTree | None, chain) -> int:
        """V of a size action (:meth:`action_of`'s) for ``tree``; with ``chain_split`` the chain rule ``chain`` (a
        :class:`~adaptree.methods.common.ChainRule`) is told the chain's length too. The size :data:`RULE` is the
        hybrid rule's V (:meth:`~adaptree.methods.common.ChainRule.priced_size`)."""
        size, tokens = action if self.chain_split else (action, None)
        if chain is None and (tokens is not None or size == RULE):
            raise ValueError("this LTD size policy sizes the context chain or prices V: it needs the chain rule (a "
                             "chain calibration, --ltd-chain PATH)")
        if tokens is not None:
            chain.fix(tokens)
        return chain.priced_size(tree) if size == RULE else self.size_of(size, tree.depth, machine)

    @staticmethod
    def continues(action: int, step: DraftStep, chain) -> bool:
        """Whether π_D's ``action`` drafts on after ``step``: CONTINUE, or RULE where the hybrid rule does (``chain``:
        the :class:`~adaptree.methods.common.ChainRule` that prices it)."""
        if action != DEPTH_RULE:
            return action == CONTINUE
        if chain is None:
            raise ValueError("this LTD depth policy defers to the hybrid rule (its action 'rule'): it needs the chain "
                             "rule (a chain calibration, --ltd-chain PATH)")
        return chain.priced_continue(step)

    @staticmethod
    def priced(sizes) -> bool:
        """Whether the size actions ``sizes`` (:meth:`action_of`'s) hold the priced V."""
        return any((a[0] if isinstance(a, tuple) else a) == RULE for a in sizes)

    def size_of(self, action_value: float, depth: int, machine: MachineTree | None) -> int:
        """V of a size action's value (the policy config's ``actions`` entry): the V itself, or with
        ``relative_sizes`` that factor of the machine tree's best V at ``depth``."""
        if not self.relative_sizes:
            return int(action_value)
        if machine is None:
            raise ValueError("this LTD size policy chooses V relative to the machine's static tree: give it the "
                             "machine setup's static_gs.json (--ltd-tuned PATH)")
        return machine.relative_size(depth, float(action_value))


@dataclass
class LTDConfig(LearnedRuntime, TreeShape):
    """LTD's inference settings. Which policies run is the method: ``ltd``, ``ltd-depth``, ``ltd-size``."""

    width: int = 10
    """Beam width W; must equal the policies' W."""
    depth: int | None = None
    """With the depth policy: the maximum depth (default: the policy's, 12). Without: the fixed depth
    (default 8, EAGLE-3's)."""
    size: int = 60
    """Without the size policy: the fixed V (EAGLE-3's 60)."""
    depth_policy: str | None = None
    """Depth policy folder (``ltd/depth`` next to the head in use when built through the method registry)."""
    size_policy: str | None = None
    """Size policy folder (``ltd/size`` next to the head in use when built through the method registry)."""
    mode: str = choice(MODES, "both")
    """both | depth | size: which policies decide."""
    acceptance: str | None = None
    """Acceptance calibration JSON of the model and head (the machine setup's): for policies with the hybrid rule's
    decisions among their actions (adaptree.methods.common.ChainRule.priced_size and priced_continue)."""

    unset_depth: ClassVar[int] = 8


@dataclass
class LTDDepthConfig(LTDConfig):
    """``ltd-depth``: the depth policy with a fixed V (the paper's -Size ablation)."""

    mode: str = "depth"


@dataclass
class LTDSizeConfig(LTDConfig):
    """``ltd-size``: the size policy with a fixed depth (the paper's -Depth ablation)."""

    mode: str = "size"


def _load(kind: str, path: str | None):
    from adaptree.offline.policy import MLPPolicy

    if not path:
        raise ValueError(f"no LTD {kind} policy given: pass --ltd-{kind}-policy PATH (train one with "
                         f"`adaptree train ltd`, see docs/ltd.md)")
    return MLPPolicy.load(Path(path), kind=f"ltd-{kind}")


class LTDController(LearnedSeam, Controller):
    """EAGLE-3's tree with LTD's learned depth (per draft step) and size (per cycle).

    :param depth_policy, size_policy: loaded :class:`~adaptree.offline.policy.MLPPolicy` objects (override the
        config's folders; used by training to evaluate policies in memory).
    :param chain_calibration: a loaded :class:`~adaptree.methods.common.ChainCalibration` (overrides ``chain``).
    :param chain_rule: a :class:`~adaptree.methods.common.ChainRule` to use instead of one of its own (a training
        environment's, whose ``choose_chain`` then returns the chain this controller's size policy chose).
    :param acceptance: a loaded acceptance calibration (overrides ``acceptance``), for policies with the rule's
        decisions among their actions.
    """

    name = "ltd"

    def __init__(self, config: LTDConfig | None = None, depth_policy=None, size_policy=None,
                 chain_calibration=None, chain_rule=None, acceptance=None) -> None:
        self.config = cfg = config or LTDConfig()
        self.name = {"both": "ltd", "depth": "ltd-depth", "size": "ltd-size"}[cfg.mode]
        self.depth_policy = self.size_policy = None
        obs = []
        if cfg.mode in ("both", "depth"):
            self.depth_policy = depth_policy or _load("depth", cfg.depth_policy)
            actions = list(self.depth_policy.config.actions)
            if len(actions) != 2 and actions != list(DEPTH_ACTIONS):  # two: STOP, CONTINUE, whatever their labels
                raise ValueError(f"an LTD depth policy has two actions (STOP, CONTINUE) or {list(DEPTH_ACTIONS)}, got "
                                 f"{actions}")
            self.depth_obs = LTDObservation.from_dict(self.depth_policy.config.observation)
            obs.append(self.depth_obs)
        if cfg.mode in ("both", "size"):
            self.size_policy = size_policy or _load("size", cfg.size_policy)
            self.size_obs = LTDObservation.from_dict(self.size_policy.config.observation)
            self.sizes = [self.size_obs.action_of(v) for v in self.size_policy.config.actions]
            obs.append(self.size_obs)
        for o in obs:
            if o.width != cfg.width:
                raise ValueError(f"width (W) {cfg.width} does not match the LTD policy's W={o.width}")
        if self.depth_policy is not None:
            depth = cfg.depth if cfg.depth is not None else self.depth_obs.max_depth
        else:
            depth = cfg.depth if cfg.depth is not None else 8
        if self.size_policy is not None and depth > self.size_obs.max_depth:
            raise ValueError(f"depth {depth} exceeds the size policy's max_depth {self.size_obs.max_depth}")
        self.plan = cfg.plan(depth)
        self.depth_costs = self.size_costs = None
        self.observes = any(o.use_match for o in obs)
        self.start_runtime(cfg, chain_calibration, self.observes)
        if chain_rule is not None:  # a training environment's: the chain the size policy chose is what it verifies
            self.chain_rule = chain_rule
        if self.size_policy is not None and self.size_obs.chain_split and self.chain_rule is None:
            raise ValueError("this LTD size policy sizes the context chain too: chain_tokens must be >= 1")
        if self.rule_decides:
            if self.chain_rule is None:
                raise ValueError("this LTD pair defers to the hybrid rule's decisions next to the context chain: "
                                 "chain_tokens must be >= 1")
            if acceptance is not None:
                self.chain_rule.acceptance = acceptance
            elif self.chain_rule.acceptance is None:
                from adaptree.methods.costaware.acceptance import AcceptanceCalibration
                from adaptree.methods.costaware.controller import _load as load_asset

                self.chain_rule.acceptance = load_asset(
                    cfg.acceptance, "acceptance calibration", "acceptance",
                    "the machine setup makes one (adaptree adapt), or fit one with "
                    "adaptree.methods.costaware.AcceptanceCalibration.fit(traces).save(PATH)",
                    AcceptanceCalibration.load, self.name)
        self.match: list[float] | None = None
        if self.size_policy is None:
            min_size = self.plan.size
        elif self.size_obs.relative_sizes or LTDObservation.priced(self.sizes):
            min_size = 1  # a factor of the machine tree's V, or the priced V: as few as one node
        else:  # the V values (a chain-split action's first part)
            min_size = min(a[0] if self.size_obs.chain_split else a for a in self.sizes)
        self.smallest = (self.plan.width, min_size, self.plan.max_depth)
        self.load_latency(cfg)

    @property
    def rule_decides(self) -> bool:
        """Whether a policy has the hybrid rule's decision among its actions (π_D's RULE, π_V's priced V)."""
        return (self.depth_policy is not None and len(self.depth_policy.config.actions) == len(DEPTH_ACTIONS)) or (
            self.size_policy is not None and LTDObservation.priced(self.sizes))

    def use_latency(self, latency) -> None:
        if self.depth_policy is not None:
            self.depth_costs = self.depth_obs.costs_of(latency)
        if self.size_policy is not None:
            self.size_costs = self.size_obs.costs_of(latency)
        super().use_latency(latency)

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        plan = super().begin_cycle(ctx)  # the policies' plan or the AR gate's step, with the chain
        if plan.max_depth > 0 and self.depth_policy is not None and self.depth_obs.first_decision:
            obs = self.depth_obs.first_obs(ctx.context_len, self.depth_costs, self.match, self.machine_tree)
            if self.depth_policy.act(obs) == STOP:
                return AR_PLAN.with_chain(plan.chain)
        return plan

    def continue_drafting(self, step: DraftStep) -> bool:
        if self.depth_policy is None:
            return True
        a = self.depth_policy.act(self.depth_obs.depth_obs(step, self.depth_costs, self.match, self.machine_tree))
        return LTDObservation.continues(a, step, self.chain_rule)

    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        if self.size_policy is None:
            return plan.size
        obs = self.size_obs
        head, tail = obs.size_parts(tree, self.size_costs, self.match, self.machine_tree)  # mostly padding: skipped
        a = self.size_policy.act_padded(head, obs.pad_value, obs.max_candidates, tail)
        return obs.decide(self.sizes[a], tree, self.machine_tree, self.chain_rule)
