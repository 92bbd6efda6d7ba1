"""Re-SpS — Speculative Sampling with Reinforcement Learning (seeds/re-sps-speculative-sampling-rl.txt,
SPEC.md §3): one small PPO policy picks the whole tree configuration (TT, d, k) from the target's own
features, and the choice is kept for N cycles (action caching).

* Action set: TT in {32, 48, 64, 80, 96, 128}, d in 3..8, k in {8, 12, 16, 20, 32}, keeping only
  TT <= k^(d-1) (paper appendix A): 177 of the 180 combinations (k=8, d=3 allows TT <= 64 only).
  :func:`resps_actions` enumerates them (``filter="tree"`` keeps every TT the engine's tree of width k and d
  levels has candidates for, TT <= k + (d-1)k^2: the 1..8-node trees and d = 1 that pay on a CPU); a policy's
  ``actions`` are checked by :func:`check_actions`, which accepts any action of either filter.
* Mapping onto the engine's :class:`~adaptree.core.controller.TreePlan`: width W = k (top-k per expansion
  and beam size), max_depth = d (draft forwards = tree levels), V = TT (draft nodes verified; the root is
  extra, as EAGLE's ``total_tokens``). EAGLE's code counts ``depth`` as the forwards *after* the first one
  (depth 7 there = 8 levels); here d is the number of levels, as LTD and adaptree's other methods count it.
  Every level of the plan is drafted: the paper's Algorithm 2 also breaks the drafting loop once the drafted
  node count reaches TT, but the EAGLE tree the paper's code passes (TT, d, k) to does not, and neither do we.
* State: the target's low/mid/high features of the last accepted position — ``CycleContext.features``,
  ``[3H]``, already computed by the verification forward (no extra model forward, no external encoder).
  ``state="concat"`` keeps the three groups side by side (the paper, ``[3H]``); ``state="mean"`` averages
  them (the public code, ``[H]``). Encoding choice (the paper fixes the content, not the scale): with
  ``normalize="rms"`` (default) each H-wide group is divided by its root-mean-square first — raw hidden
  states reach magnitudes in the hundreds and would saturate the tanh layers; ``normalize="none"`` feeds
  them raw. The settings travel in the policy's ``config.json`` (``observation``), so training and
  inference build the same vector (:class:`ReSpSState`). ``state="embedding"`` is the paper's ablation: the
  all-MiniLM-L6-v2 sentence embedding of the context text (prompt + generated so far, decoded with the
  target's tokenizer; the controller then needs ``tokenizer=``), 384 values.
* Action caching: the policy runs at the first cycle of a generation (every turn of a conversation is a
  generation: the cache starts empty, as in the paper's Algorithm 2) and then every ``interval`` cycles
  (N = 30 at inference; training uses N = 10, see :mod:`adaptree.methods.resps.train`).
* Context chains: with ``use_match`` the state also ends with the decision cycle's context-match
  features (:data:`adaptree.methods.common.chain.MATCH_FEATURES`), and every cycle (not only the decision's)
  carries the context's chain next to the cached tree, its length chosen by
  :class:`~adaptree.methods.common.chain.ChainRule` (``chain_tokens`` adds it to other policies too). The chain,
  the latency model and the AR fallback are the learned methods' shared runtime
  (:mod:`adaptree.methods.common.runtime`).
* Machine costs: with ``use_costs`` the state ends with the machine's cost features
  (:func:`adaptree.offline.family.cost_features`: draft step, verification growth and overhead relative to one
  autoregressive step), read from this machine's latency model at inference (``latency``, filled from the machine
  setup) and from the family member of each generation in training; without a latency model the policy's
  ``reference_costs`` (its training family's median) stand in.
* Decisions: argmax at ``temperature`` 0; the max-entropy variant samples softmax(logits / 1.5) with the
  controller's own seeded generator (reset every generation; the token sampler's generator and torch's
  global RNG are never touched), so the output stays lossless either way — only the tree shape is random.

The policy defaults to the one shipped next to the model's head (``heads/smollm2-135m/resps/``).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from adaptree.core.config import between, choice, positive
from adaptree.core.controller import (
    AR_PLAN,
    MAX_DEPTH,
    MAX_WIDTH,
    Controller,
    CycleContext,
    TreePlan,
)
from adaptree.methods.common import MATCH_FEATURES, LearnedRuntime, LearnedSeam, match_values

RESPS_TOTALS = (32, 48, 64, 80, 96, 128)
"""TT: upper limit on the draft tokens verified per cycle (paper appendix A)."""
RESPS_DEPTHS = (3, 4, 5, 6, 7, 8)
"""d: tree depth (draft forwards per cycle)."""
RESPS_TOPKS = (8, 12, 16, 20, 32)
"""k: top-k expansion factor (= beam width W)."""
STATES = ("concat", "mean", "embedding")
ACTION_FILTERS = ("paper", "tree")
"""Which (TT, d, k) an action set keeps: paper = TT <= k^(d-1) (appendix A); tree = TT <= k + (d-1)k^2, the
candidates of the engine's tree of width k and d levels (every paper action is one)."""
COST_WIDTH = 10
"""Beam width the draft step of the cost features is read at (Re-SpS's widths vary with the action)."""
RELATIVE_OFFSETS = (-2, -1, 0, 1, 2)
"""Relative actions: the depth is the machine tree's depth plus one of these (at least 1, at most the tree's
deepest)."""
RELATIVE_WIDTH = 10
"""The beam width of relative actions (the machine tree's, EAGLE-3's)."""
NORMALIZE = ("rms", "none")
INTERVAL_INFERENCE = 30
"""The paper's cache interval N at inference (training uses 10)."""


# --------------------------------------------------------------------------------------------- actions


def tree_candidates(d: int, k: int) -> int:
    """Candidates of the engine's tree of width k and d levels: k + (d-1)k^2 (the most nodes V can take)."""
    return k + (d - 1) * k * k


def valid_action(tt: int, d: int, k: int, filter: str = "paper") -> bool:
    """Whether (TT, d, k) passes ``filter`` (:data:`ACTION_FILTERS`): paper = Re-SpS's TT <= k^(d-1); tree =
    TT <= k + (d-1)k^2 (:func:`tree_candidates`)."""
    if filter == "paper":
        return tt <= k ** (d - 1)
    if filter == "tree":
        return tt <= tree_candidates(d, k)
    raise ValueError(f"action filter must be one of {ACTION_FILTERS}, got {filter!r}")


def resps_actions(totals: Iterable[int] = RESPS_TOTALS, depths: Iterable[int] = RESPS_DEPTHS,
                  topks: Iterable[int] = RESPS_TOPKS, filter: str = "paper") -> list[tuple[int, int, int]]:
    """Every (TT, d, k) that passes ``filter`` (:func:`valid_action`), in (TT, d, k) order: 177 with the paper's
    sets and filter."""
    if filter not in ACTION_FILTERS:
        raise ValueError(f"action filter must be one of {ACTION_FILTERS}, got {filter!r}")
    out = [(int(t), int(d), int(k)) for t, d, k in itertools.product(totals, depths, topks)
           if valid_action(int(t), int(d), int(k), filter)]
    check_actions(out)
    return out


def check_actions(actions: Sequence) -> list[tuple[int, int, int]]:
    """Validate an action set: at least 2 distinct (TT, d, k) triples of integers with TT >= 1,
    d in 1..MAX_DEPTH, k in 1..MAX_WIDTH and TT <= k + (d-1)k^2 (the tree has that many candidates: the paper's
    TT <= k^(d-1) implies it). Returns them as int tuples; a ValueError names the first bad entry."""
    out: list[tuple[int, int, int]] = []
    for i, a in enumerate(actions):
        try:
            tt, d, k = (int(x) for x in a)
            if [tt, d, k] != [x for x in a]:
                raise TypeError
        except (TypeError, ValueError):
            raise ValueError(f"Re-SpS action {i} must be a (TT, d, k) triple of integers, got {a!r}") from None
        if tt < 1:
            raise ValueError(f"Re-SpS action {i} {(tt, d, k)}: TT must be >= 1, got {tt}")
        if not 1 <= d <= MAX_DEPTH:
            raise ValueError(f"Re-SpS action {i} {(tt, d, k)}: d must be in 1..{MAX_DEPTH}, got {d}")
        if not 1 <= k <= MAX_WIDTH:
            raise ValueError(f"Re-SpS action {i} {(tt, d, k)}: k must be in 1..{MAX_WIDTH}, got {k}")
        if not valid_action(tt, d, k, "tree"):
            n = tree_candidates(d, k)
            raise ValueError(f"Re-SpS action {i} {(tt, d, k)} violates TT <= k + (d-1)k^2 = {n} (the candidates of "
                             f"a tree of width k and d levels)")
        out.append((tt, d, k))
    if len(out) < 2:
        raise ValueError(f"a Re-SpS action set needs at least 2 actions, got {len(out)}")
    dup = [a for a, n in Counter(out).items() if n > 1]
    if dup:
        raise ValueError(f"Re-SpS action {dup[0]} appears more than once")
    return out


def relative_actions() -> list[tuple[int, float]]:
    """Every (depth offset, V factor) of a relative action set (:data:`RELATIVE_OFFSETS` x
    :data:`~adaptree.methods.common.SIZE_FACTORS`)."""
    from adaptree.methods.common import SIZE_FACTORS

    return [(dd, f) for dd in RELATIVE_OFFSETS for f in SIZE_FACTORS]


def check_relative_actions(actions: Sequence) -> list[tuple[int, float]]:
    """Validate a relative action set: at least 2 distinct (depth offset, V factor > 0) pairs."""
    out: list[tuple[int, float]] = []
    for i, a in enumerate(actions):
        try:
            dd, f = a
            dd, f = int(dd), float(f)
        except (TypeError, ValueError):
            raise ValueError(f"relative Re-SpS action {i} must be a (depth offset, V factor) pair, got {a!r}") from None
        if not f > 0:
            raise ValueError(f"relative Re-SpS action {i} {a!r}: the V factor must be > 0")
        out.append((dd, f))
    if len(set(out)) != len(out) or len(out) < 2:
        raise ValueError(f"a relative Re-SpS action set needs at least 2 distinct actions, got {actions!r}")
    return out


def relative_plan(tree, action: Sequence, max_depth: int = 12) -> TreePlan:
    """The tree of a relative action on the machine whose static tree is ``tree``
    (:class:`~adaptree.methods.common.MachineTree`): depth = its depth + the offset (1..``max_depth``), V = the best V
    at that depth times the factor, width :data:`RELATIVE_WIDTH`."""
    d = min(max(1, tree.depth + int(action[0])), max_depth)
    return TreePlan(width=RELATIVE_WIDTH, max_depth=d, size=tree.relative_size(d, float(action[1])))


def plan_of(action: Sequence[int]) -> TreePlan:
    """(TT, d, k) -> TreePlan(width=k, max_depth=d, size=TT) (see the module docstring)."""
    tt, d, k = (int(x) for x in action)
    return TreePlan(width=k, max_depth=d, size=tt)


def action_widths(actions: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """The beam widths an action set uses (traces must record every one for the simulator)."""
    return tuple(sorted({int(a[2]) for a in actions}))


# --------------------------------------------------------------------------------------------- state


@dataclass
class ReSpSState:
    """How the state vector is built from a cycle's context (stored as the policy's ``observation``)."""

    hidden: int
    """H: the target's hidden size; the features hold 3H values (low, mid, high layer outputs)."""
    state: str = "concat"
    """concat: the three feature groups side by side, [3H] (the paper); mean: their average, [H] (the public
    code); embedding: the sentence embedding of the context text (prompt + generated so far, decoded with the
    target's tokenizer), the paper's SentenceBERT ablation (:mod:`adaptree.models.sentence`)."""
    normalize: str = "rms"
    """rms: each group divided by its root-mean-square first (inputs of order 1); none: raw features."""
    eps: float = 1e-6
    """Added to the mean square before the square root (rms only)."""
    encoder: str = "all-MiniLM-L6-v2"
    """embedding only: the encoder (all-MiniLM-L6-v2 from its PyPI package, or a model folder)."""
    encoder_dim: int = 384
    """embedding only: the encoder's output size."""
    max_tokens: int = 256
    """embedding only: encoder tokens kept (the end of the context)."""
    use_match: bool = False
    """Append the cycle's context-match features (adaptree.methods.common.MATCH_FEATURES)."""
    use_costs: bool = False
    """Append the machine's cost features (adaptree.offline.family.COST_FEATURES), after the match features."""
    relative: bool = False
    """The actions are (depth offset, V factor) relative to the machine's static tree
    (adaptree.methods.common.machine_tree), whose depth and V then end the state (after the costs)."""
    max_depth: int = 12
    """With ``relative``: the deepest tree an action may ask for (the traces' max depth in training)."""
    reference_costs: list[float] | None = None
    """The cost features assumed when no latency model is given (the training family's median)."""

    def __post_init__(self) -> None:
        from adaptree.offline.family import check_costs

        self.reference_costs = check_costs(self.reference_costs)
        if int(self.hidden) < 1:
            raise ValueError(f"hidden (H) must be >= 1, got {self.hidden}")
        self.hidden = int(self.hidden)
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")
        if self.normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {NORMALIZE}, got {self.normalize!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if int(self.encoder_dim) < 1 or int(self.max_tokens) < 2:
            raise ValueError(f"encoder_dim must be >= 1 and max_tokens >= 2, got {self.encoder_dim}, {self.max_tokens}")

    @property
    def dim(self) -> int:
        from adaptree.offline.family import COST_FEATURES

        extra = ((len(MATCH_FEATURES) if self.use_match else 0) + (len(COST_FEATURES) if self.use_costs else 0)
                 + (2 if self.relative else 0))
        if self.state == "embedding":
            return self.encoder_dim + extra
        return (3 * self.hidden if self.state == "concat" else self.hidden) + extra

    def costs_of(self, latency) -> list[float] | None:
        """The cost features of ``latency`` for this state (None when it does not use them)."""
        from adaptree.offline.family import cost_features

        return cost_features(latency, COST_WIDTH) if self.use_costs else None

    def _with_extras(self, x: torch.Tensor, match: list[float] | None, costs: list[float] | None,
                     machine=None) -> torch.Tensor:
        """``x`` followed by the match features, the cost features and the machine tree's depth and V, for a state
        that uses them."""
        tail = match_values(match, "Re-SpS") if self.use_match else []
        if self.use_costs:
            from adaptree.offline.family import costs_or_reference

            tail += list(costs_or_reference(costs, self.reference_costs, "resps"))
        if self.relative:
            if machine is None:
                raise ValueError("this Re-SpS policy chooses trees relative to the machine's static tree: give it the "
                                 "machine setup's static_gs.json (--resps-tuned PATH)")
            tail += machine.summary(self.max_depth)
        return torch.cat([x, torch.tensor(tail, dtype=torch.float32)]) if tail else x

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ReSpSState":
        return cls(**d)

    def __call__(self, features: torch.Tensor | None, match: list[float] | None = None,
                 costs: list[float] | None = None, machine=None) -> torch.Tensor:
        """The policy's input ``[dim]`` (float32, CPU) from the cycle's target features ``[3H]`` (and the match
        features and the machine's cost features, for a state that uses them: :meth:`costs_of`; None = the
        reference costs)."""
        if self.state == "embedding":
            raise ValueError("the 'embedding' state is built from the context text: use ReSpSState.observer")
        if features is None:
            raise ValueError("Re-SpS needs the target features of the last accepted token (CycleContext.features); "
                             "none were given (a run without a draft head, or traces recorded with "
                             "--feature-dtype none)")
        f = features.detach().reshape(-1).float().cpu()
        if f.numel() != 3 * self.hidden:
            raise ValueError(f"the target features have {f.numel()} values; this Re-SpS policy was trained on a "
                             f"target with hidden size {self.hidden} (3 x {self.hidden} = {3 * self.hidden} values): "
                             f"use a policy trained for this model")
        g = f.view(3, self.hidden)
        if self.normalize == "rms":
            g = g * torch.rsqrt(g.square().mean(dim=1, keepdim=True) + self.eps)
        return self._with_extras(g.reshape(-1) if self.state == "concat" else g.mean(dim=0), match, costs, machine)

    def observer(self, tokenizer=None) -> Callable[..., torch.Tensor]:
        """``(ctx, match=None, costs=None) -> [dim]``: the function the controller (inference) and the environments
        (training) share. Feature states read ``ctx.features``; the embedding state decodes ``ctx.prompt_ids +
        ctx.generated_ids`` with ``tokenizer`` (the target's; anything with ``decode(ids)``) and encodes it; ``match``:
        the cycle's match features (:meth:`~adaptree.methods.common.chain.ChainRule.features`); ``costs``: the
        machine's (:meth:`costs_of`); ``machine``: its static tree (a relative state)."""
        if self.state != "embedding":
            return lambda ctx, match=None, costs=None, machine=None: self(ctx.features, match, costs, machine)
        if tokenizer is None:
            raise ValueError("a Re-SpS policy on the 'embedding' state needs the target's tokenizer to turn the "
                             "context into text (pass tokenizer=...; `adaptree simulate`/`oracle` cannot run it)")
        from adaptree.models.sentence import shared_encoder

        enc = shared_encoder(self.encoder, self.max_tokens)
        if enc.dim != self.encoder_dim:
            raise ValueError(f"the sentence encoder gives {enc.dim} values, the policy was trained on "
                             f"{self.encoder_dim}")

        def observe(ctx: CycleContext, match: list[float] | None = None, costs: list[float] | None = None,
                    machine=None) -> torch.Tensor:
            return self._with_extras(enc(tokenizer.decode(list(ctx.prompt_ids) + list(ctx.generated_ids))), match,
                                     costs, machine)

        return observe


# --------------------------------------------------------------------------------------------- controller


@dataclass
class ReSpSConfig(LearnedRuntime):
    """Re-SpS's inference settings."""

    policy: str | None = None
    """Policy folder (config.json + model.safetensors of `adaptree train resps`; ``resps/`` next to the head in
    use when built through the method registry)."""
    interval: int = positive(INTERVAL_INFERENCE, label="interval (--resps-interval)")
    """Cache interval N: the policy decides at a generation's first cycle, then every N cycles (paper: 30)."""
    state: str | None = choice(STATES, None, label="state (--resps-state)")
    """concat | mean; None = the policy's. A policy only runs on the state it was trained on (checked)."""
    temperature: float | None = between(0.0, math.inf, None, hi_open=True, label="temperature (--resps-temperature)")
    """0 = argmax; > 0 samples softmax(logits / T) (the max-entropy variant: 1.5). None = the value the policy's
    training recorded (``inference_temperature``; 0 when absent)."""
    seed: int = 0
    """Seed of the action-sampling generator (reset at every generation)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.interval = int(self.interval)


def load_policy(path: str | Path | None):
    """The Re-SpS :class:`~adaptree.offline.policy.MLPPolicy` at ``path``, strictly."""
    from adaptree.offline.policy import MLPPolicy

    if not path:
        raise ValueError("no Re-SpS policy given: pass --resps-policy PATH (train one with `adaptree train resps`, "
                         "see docs/resps.md)")
    return MLPPolicy.load(Path(path), kind="resps")


class ReSpSController(LearnedSeam, Controller):
    """EAGLE-3's tree with the (TT, d, k) a Re-SpS policy picked from the target's features, cached N cycles.

    :param policy: a loaded :class:`~adaptree.offline.policy.MLPPolicy` of kind ``resps`` (overrides
        ``config.policy``; training evaluates policies in memory this way).
    :param tokenizer: the target's tokenizer; needed by policies on the ``embedding`` state only.
    :param chain_calibration: a loaded :class:`~adaptree.methods.common.ChainCalibration` (overrides ``chain``).
    """

    name = "resps"
    reads_features = True  # its state is the target's features

    def __init__(self, config: ReSpSConfig | None = None, policy=None, tokenizer=None,
                 chain_calibration=None) -> None:
        self.config = cfg = config or ReSpSConfig()
        self.policy = (policy if policy is not None else load_policy(cfg.policy)).eval()
        pc = self.policy.config
        if pc.kind != "resps":
            raise ValueError(f"the policy given is a {pc.kind!r} policy, Re-SpS needs a 'resps' policy")
        try:
            self.state = ReSpSState.from_dict(pc.observation)
        except TypeError as exc:
            raise ValueError(f"the Re-SpS policy's observation settings are not valid: {exc}") from None
        if self.state.relative:  # plans follow the machine's static tree: made when the policy decides
            self.actions = check_relative_actions(pc.actions)
            self.plans = None
        else:
            self.actions = check_actions(pc.actions)
            self.plans = [plan_of(a) for a in self.actions]
        if self.state.dim != pc.obs_dim:
            raise ValueError(f"the Re-SpS policy's obs_dim {pc.obs_dim} does not match its observation "
                             f"({self.state.state} of H={self.state.hidden}: {self.state.dim} values)")
        if cfg.state is not None and cfg.state != self.state.state:
            raise ValueError(f"--resps-state {cfg.state} does not match the policy, which was trained on the "
                             f"{self.state.state!r} state")
        self.observe = self.state.observer(tokenizer)
        self.observes = self.state.use_match
        self.start_runtime(cfg, chain_calibration, self.observes)
        if cfg.temperature is not None:
            self.temperature = float(cfg.temperature)
        else:
            from adaptree.offline.policy import training_facts

            facts = training_facts(cfg.policy) if policy is None else {}
            self.temperature = float(facts.get("inference_temperature", 0.0) or 0.0)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.counts: Counter = Counter()
        """How often each action index was chosen (over every generation this controller ran)."""
        if self.plans is None:  # relative: the smallest tree any machine tree can give
            self.smallest = (RELATIVE_WIDTH, 1, self.state.max_depth)
        else:
            cheapest = min(self.plans, key=lambda p: (p.size, p.width))
            self.smallest = (cheapest.width, cheapest.size, max(p.max_depth for p in self.plans))  # probes' price
        self.costs: list[float] | None = None
        """This machine's cost features, for a state that uses them (None: the policy's reference costs)."""
        self.load_latency(cfg)
        self.reset()

    def use_latency(self, latency) -> None:
        self.costs = self.state.costs_of(latency)
        super().use_latency(latency)

    def reset(self) -> None:
        self.gen.manual_seed(self.config.seed)
        super().reset()
        self.left = 0
        self.plan: TreePlan | None = None
        self.decisions: list[tuple[int, int]] = []
        """(cycle, action index) of every decision of the current generation."""

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        chain = self.begin_chain(ctx)
        if self.ar_step(ctx):
            return AR_PLAN.with_chain(chain)
        if self.left <= 0 or self.plan is None:  # the match features only where the policy decides
            machine = self.require_tree() if self.state.relative else None
            obs = self.observe(ctx, self.match_features(self.observes), self.costs, machine)
            a = self.policy.act(obs, self.temperature, self.gen)
            self.plan = self.plans[a] if machine is None else relative_plan(machine, self.actions[a],
                                                                            self.state.max_depth)
            self.left = self.config.interval
            self.decisions.append((ctx.cycle, a))
            self.counts[a] += 1
        self.left -= 1
        return self.plan.with_chain(chain)
