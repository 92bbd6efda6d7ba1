"""Draft-length controllers for vLLM's speculative decoding: what adaptree's scheduler plugin
(:mod:`adaptree.vllm_plugin.scheduler`) asks before every engine step. Plain Python, no vLLM import: the decisions are
unit-tested on their own (``tests/test_vllm_control.py``).

vLLM drafts ``K`` tokens for every running request after each step and verifies them in the next one, all
requests in one forward of ``sum(1 + k_i)`` rows. A fixed ``K`` pays off at one request and loses under load,
where the forward is compute-bound and every drafted row costs nearly a token (docs/vllm.md). The controller
decides, per step:

- ``k_i`` for each running request: how many of the drafts it already has are verified (vLLM verifies a prefix
  of any length), and
- ``K``: how many tokens the drafter drafts after this step (vLLM's dynamic speculative decoding takes any
  ``0 <= K <= num_speculative_tokens`` per step).

:class:`CostAwareLength` is adaptree's cost-aware rule (docs/adapting.md) on vLLM's terms: expected tokens per
second of the whole batch, from :class:`StepCosts` (vLLM's own step time at B requests x K drafts, measured by
:func:`adaptree.vllm_plugin.engine.measure_step_costs`) and each request's acceptance per draft position
(:class:`Acceptance`, learned online from the verifications, starting from the batch's). :class:`HybridLength` is
adaptree's ``hybrid``: the same, each request verifying the context's chain in place of the head's drafts where
that is worth more. :class:`StaticGridLength` is ``static-gs``: the fixed length a grid search measured fastest at
each batch size. :class:`DeagleLength`, :class:`RadarLength` and :class:`LtdLength` bring adaptree's depth rules
(DEAGLE's vote, RADAR's policy, LTD's depth policy): costaware's drafts, each request's chain verified up to where
the rule stops it, reading the drafter's log-probs (:class:`StopRuleLength`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from adaptree.core.context import ContextIndex

STEP_COSTS_FORMAT = "adaptree-vllm-step-costs/1"


@dataclass
class StepCosts:
    """vLLM's wall time of one engine step (target forward, rejection sampling, drafting, bookkeeping) with
    ``B`` decoding requests each verifying ``K`` drafts and drafting ``K`` more: ``seconds[b][k]`` at
    ``batch_sizes[b]`` and ``K = k`` (0..K_max). Between measured batch sizes the time is linear in
    B; past the largest it grows at the last interval's slope (the forward is compute-bound there)."""

    batch_sizes: list[int]
    seconds: list[list[float]]
    machine: dict = field(default_factory=dict)
    """Where it was measured (adaptree.core.machine's profile) and with what (model, dtype, threads)."""
    tokens_per_s: list[list[float]] | None = None
    """The grid search the same runs make: tokens per second of ``batch_sizes[b]`` requests decoding under a fixed
    ``K = k``, over each whole run (prompt steps included): what ``static-gs`` picks its lengths from. None in
    files measured before it was recorded."""

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(not isinstance(b, int) or b < 1 for b in self.batch_sizes) \
                or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError(f"StepCosts.batch_sizes must be increasing positive integers, got {self.batch_sizes!r}")
        if len(self.seconds) != len(self.batch_sizes):
            raise ValueError(f"StepCosts.seconds has {len(self.seconds)} rows for {len(self.batch_sizes)} batch sizes")
        widths = {len(row) for row in self.seconds}
        if len(widths) != 1 or min(widths) < 1:
            raise ValueError(f"StepCosts.seconds rows must all cover K = 0..K_max, got lengths {sorted(widths)}")
        for b, row in zip(self.batch_sizes, self.seconds):
            for k, t in enumerate(row):
                if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
                    raise ValueError(f"StepCosts.seconds at B={b}, K={k} must be a positive number, got {t!r}")
        if self.tokens_per_s is not None:
            if [len(row) for row in self.tokens_per_s] != [len(row) for row in self.seconds]:
                raise ValueError("StepCosts.tokens_per_s must have the shape of seconds (batch sizes x K = 0..K_max)")
            if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0
                       for row in self.tokens_per_s for t in row):
                raise ValueError(f"StepCosts.tokens_per_s must hold positive numbers, got {self.tokens_per_s!r}")

    @property
    def k_max(self) -> int:
        return len(self.seconds[0]) - 1

    def time(self, batch: int, k: int) -> float:
        """Seconds of a step with ``batch`` decoding requests and ``k`` drafts each."""
        if batch < 1 or not 0 <= k <= self.k_max:
            raise ValueError(f"StepCosts.time: batch {batch} and K {k} (measured K: 0..{self.k_max})")
        bs = self.batch_sizes
        if len(bs) == 1:
            return self.seconds[0][k] * batch / bs[0]
        i = 0
        while i < len(bs) - 2 and batch > bs[i + 1]:
            i += 1
        lo, hi = bs[i], bs[i + 1]
        t_lo, t_hi = self.seconds[i][k], self.seconds[i + 1][k]
        return max(t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo), 1e-6)

    def best_fixed(self, batch: int) -> int:
        """The grid search's K at ``batch`` requests: the fastest fixed K measured at the largest measured batch
        size up to ``batch`` (the smallest one below them). A ValueError without a grid (:attr:`tokens_per_s`)."""
        if self.tokens_per_s is None:
            raise ValueError("these step costs hold no grid search (tokens_per_s): measured before adaptree recorded "
                             "it; measure them again (adaptree.vllm_plugin.engine.measure_step_costs)")
        below = [i for i, b in enumerate(self.batch_sizes) if b <= batch]
        row = self.tokens_per_s[below[-1] if below else 0]
        return max(range(len(row)), key=lambda k: (row[k], -k))

    def to_json(self) -> dict:
        out = {"format": STEP_COSTS_FORMAT, "batch_sizes": self.batch_sizes, "seconds": self.seconds,
               "machine": self.machine}
        if self.tokens_per_s is not None:
            out["tokens_per_s"] = self.tokens_per_s
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "StepCosts":
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != STEP_COSTS_FORMAT:
            raise ValueError(f"{path}: not a vLLM step-cost file (format {STEP_COSTS_FORMAT!r})")
        unknown = set(data) - {"format", "batch_sizes", "seconds", "machine", "tokens_per_s"}
        if unknown:
            raise ValueError(f"{path}: unknown fields {sorted(unknown)}")
        try:
            grid = data.get("tokens_per_s")
            return cls([int(b) for b in data["batch_sizes"]], [[float(t) for t in row] for row in data["seconds"]],
                       dict(data.get("machine") or {}),
                       None if grid is None else [[float(t) for t in row] for row in grid])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: missing or malformed field ({exc})") from None


class Acceptance:
    """Acceptance per draft position: ``rate(j)`` is the chance that draft ``j`` (0-based) is accepted once drafts
    ``0..j-1`` were, estimated from verifications with a prior of ``strength`` pseudo-observations at ``prior``'s
    rates (the batch's own estimate, for a request's)."""

    def __init__(self, k_max: int, prior: Sequence[float] | "Acceptance", strength: float = 4.0) -> None:
        self.k_max, self.prior, self.strength = k_max, prior, strength
        self.reached = [0] * k_max
        self.accepted = [0] * k_max

    def observe(self, drafted: int, accepted: int) -> None:
        """One verification of ``drafted`` drafts of which the first ``accepted`` were accepted."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafts")
        for j in range(min(drafted, self.k_max)):
            self.reached[j] += 1
            if j < accepted:
                self.accepted[j] += 1
            else:
                break

    def _prior(self, j: int) -> float:
        return self.prior.rate(j) if isinstance(self.prior, Acceptance) else float(self.prior[j])

    def rate(self, j: int) -> float:
        return (self.accepted[j] + self.strength * self._prior(j)) / (self.reached[j] + self.strength)

    def survival(self, k: int) -> list[float]:
        """``P(at least j+1 drafts accepted)`` for j < k."""
        out, p = [], 1.0
        for j in range(k):
            p *= self.rate(j)
            out.append(p)
        return out


DEFAULT_PRIOR = (0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5)
"""Before any verification: half of the drafts at each position (the batch's estimate replaces it quickly)."""


class FixedLength:
    """``k`` drafts for every request at every step (vLLM's static behaviour, and the step-cost measurement's)."""

    name = "fixed"
    uses_context = False
    """Reads each request's tokens when it decides (vLLM's synchronous scheduler only)."""
    reads_drafts = False
    """Reads the drafter's log-probs of each request's drafts (the same)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def decide(self, requests: Sequence[str]) -> tuple[dict[str, int], int]:
        return dict.fromkeys(requests, self.k), self.k

    def observe(self, request: str, drafted: int, accepted: int) -> None:
        pass

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        pass

    def forget(self, live: Iterable[str]) -> None:
        pass


class LiveCosts:
    """Step times as this engine runs them: the measured table corrected by the steps it has timed.

    A table measured minutes earlier, on other prompts and a shared machine, is off by a few ms per step, which is
    the whole difference between one draft and two at one stream. So every timed pure decode step of ``B``
    requests each verifying and drafting ``K`` updates a running mean of that cell (``alpha``) and one of the
    ratio measured / table over all cells; a cell timed ``min_steps`` times is its own mean, any other the table's
    time scaled by that ratio. A controller that tries a length the table got wrong thus moves to the right one."""

    def __init__(self, table: StepCosts, alpha: float = 0.1, min_steps: int = 4) -> None:
        self.table, self.alpha, self.min_steps = table, alpha, min_steps
        self.cells: dict[tuple[int, int], tuple[float, int]] = {}
        self.ratio = 1.0

    @property
    def k_max(self) -> int:
        return self.table.k_max

    def observe(self, batch: int, k: int, seconds: float) -> None:
        """One pure decode step of ``batch`` requests that verified and drafted ``k`` each took ``seconds``."""
        if batch < 1 or not 0 <= k <= self.table.k_max or not (math.isfinite(seconds) and seconds > 0):
            return
        predicted = self.table.time(batch, k)
        # one step stalled by the machine (another process, a page fault) moves the estimates by at most 2x
        seconds = min(max(seconds, 0.5 * predicted), 2.0 * predicted)
        mean, n = self.cells.get((batch, k), (seconds, 0))
        self.cells[(batch, k)] = (mean + self.alpha * (seconds - mean) if n else seconds, n + 1)
        self.ratio += self.alpha * (seconds / predicted - self.ratio)

    def time(self, batch: int, k: int) -> float:
        mean, n = self.cells.get((batch, k), (0.0, 0))
        return mean if n >= self.min_steps else self.table.time(batch, k) * self.ratio


class CostAwareLength:
    """The batch's drafts that maximise modelled tokens per second.

    For each ``K`` in 0..K_max: the step's expected tokens ``sum_i (1 + sum_{j<K} S_i(j))`` (``S_i`` request i's
    survival) over its time ``costs.time(B, K)`` (the measured table, corrected by the steps timed since:
    :class:`LiveCosts`); the best ``K`` is the one drafted. A request verifies its own prefix ``k_i <= K`` of
    drafts: a draft whose chance of being reached and accepted is below what a verified row costs at the batch's
    rate (``rate x (time(B, K) - time(B, K-1)) / B``) is left out, the same trade the cost-aware rule makes per tree
    node in adaptree's engine."""

    name = "costaware"
    uses_context = False
    reads_drafts = False

    def __init__(self, costs: StepCosts, k_max: int | None = None, prior: Sequence[float] = DEFAULT_PRIOR) -> None:
        self.costs = LiveCosts(costs)
        self.k_max = costs.k_max if k_max is None else min(k_max, costs.k_max)
        if len(prior) < self.k_max:
            raise ValueError(f"the acceptance prior covers {len(prior)} positions; K_max is {self.k_max}")
        self.batch = Acceptance(self.k_max, prior, strength=8.0)
        self.requests: dict[str, Acceptance] = {}
        self.rate, self.batch_size = 0.0, 1
        """The last decision's modelled tokens per second and batch."""

    def _acceptance(self, request: str) -> Acceptance:
        acc = self.requests.get(request)
        if acc is None:
            acc = self.requests[request] = Acceptance(self.k_max, self.batch)
        return acc

    def decide(self, requests: Sequence[str]) -> tuple[dict[str, int], int]:
        if not requests or self.k_max == 0:
            return dict.fromkeys(requests, 0), 0
        b = len(requests)
        survival = {r: self._acceptance(r).survival(self.k_max) for r in requests}
        best_k, best_rate = 0, -1.0
        for k in range(self.k_max + 1):
            tokens = sum(1.0 + sum(s[:k]) for s in survival.values())
            rate = tokens / self.costs.time(b, k)
            if rate > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        self.rate, self.batch_size = best_rate, b
        if best_k == 0:
            return dict.fromkeys(requests, 0), 0
        row = max(self.costs.time(b, best_k) - self.costs.time(b, best_k - 1), 0.0) / b
        bar = best_rate * row
        ks = {r: sum(1 for p in s[:best_k] if p >= bar) for r, s in survival.items()}
        return ks, best_k

    def observe(self, request: str, drafted: int, accepted: int) -> None:
        self.batch.observe(drafted, accepted)
        self._acceptance(request).observe(drafted, accepted)

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A timed pure decode step: ``batch`` requests each verified ``k`` drafts and drafted ``k`` more."""
        self.costs.observe(batch, k, seconds)

    per_request = ("requests",)
    """The attributes holding a mapping per running request, which :meth:`forget` prunes."""

    def forget(self, live: Iterable[str]) -> None:
        """Drop what is held for requests that are no longer running."""
        keep = set(live)
        for name in self.per_request:
            held = getattr(self, name)
            for r in [r for r in held if r not in keep]:
                del held[r]


MATCH_BUCKETS = (2, 3, 4, 8, 16)
"""Lower bounds of the match lengths whose context chains :class:`HybridLength` estimates apart (a longer shared past
predicts a longer shared future)."""


class HybridLength(CostAwareLength):
    """Costaware's head drafts, or the context's chain in their place: adaptree's ``hybrid`` on vLLM's terms.

    After :meth:`decide` (the head's lengths and ``K``, costaware's), :meth:`chains` looks up each decoding
    request's context (prompt and output) for its longest earlier match of ``min_n`` to ``max_n`` tokens
    (:class:`~adaptree.core.context.ContextIndex`, the index of adaptree's ``ngram`` and ``hybrid``) and
    verifies what followed it instead of the head's drafts where that is worth more: the chain's first ``k``
    tokens are worth ``sum_{t<k} C_m(t) - bar k`` (``C_m(t)``: the chance its first ``t + 1`` tokens are
    accepted, learned online per match-length bucket; ``bar``: a verified row's seconds, the slope of the step
    costs over K per request, at the batch's modelled rate), the head's ``sum_{j<k_i} S_i(j) - bar k_i``. The
    head's drafts are already made when the scheduler decides (vLLM drafts after each step), so only the
    verification is weighed; the chain needs no drafter, so a request takes one even in a step that drafts
    nothing (``K = 0``).

    vLLM's scheduler must see each request's output when it decides, so this runs under vLLM's synchronous
    scheduler (``async_scheduling=False``)."""

    name = "hybrid"
    uses_context = True
    per_request = ("requests", "indexes")

    def __init__(self, costs: StepCosts, k_max: int | None = None, prior: Sequence[float] = DEFAULT_PRIOR,
                 min_n: int = 2, max_n: int = 4) -> None:
        super().__init__(costs, k_max, prior)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"min_n ({min_n}) must be in 1..max_n ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.chain_rates = [Acceptance(self.k_max, prior, strength=4.0) for _ in MATCH_BUCKETS]
        self.indexes: dict[str, ContextIndex] = {}
        self.chained: dict[str, int] = {}
        """Requests verifying a chain this step, and the bucket of their match."""
        self.chain_steps = 0
        """Request-steps that verified a chain instead of the head's drafts."""

    def _index(self, request: str, tokens: Sequence[int]) -> ContextIndex:
        index = self.indexes.get(request)
        if index is None or len(tokens) < len(index):  # a new request, or one whose tokens were replaced
            index = self.indexes[request] = ContextIndex(max_ngram=self.max_n)
        index.extend(tokens[len(index):])
        return index

    def chains(self, contexts: Mapping[str, Sequence[int]], lengths: Mapping[str, int], room: Mapping[str, int]
               ) -> dict[str, tuple[int, ...]]:
        """The context chains to verify in place of the head's drafts, after :meth:`decide`: ``contexts`` holds
        each decoding request's tokens (prompt and output; the step computes the last one), ``lengths`` the head
        drafts it would verify (``decide``'s ``k_i``, or fewer where fewer were drafted), ``room`` the most draft
        tokens it may verify (what its token limit and the context length leave)."""
        self.chained = {}
        if self.k_max == 0 or not contexts:
            return {}
        b, rate = self.batch_size, self.rate
        top = self.k_max
        slope = (self.costs.time(b, top) - self.costs.time(b, 1)) / (top - 1) if top > 1 else \
            self.costs.time(b, 1) - self.costs.time(b, 0)
        bar = rate * max(slope, 0.0) / b
        out = {}
        for r, tokens in contexts.items():
            limit = min(self.k_max, room.get(r, self.k_max))
            if limit < 1:
                continue
            m = self._index(r, tokens).match(limit, self.min_n)
            if m is None:
                continue
            bucket = sum(1 for lo in MATCH_BUCKETS if m.length >= lo) - 1
            c = self.chain_rates[bucket].survival(limit)
            gains = [sum(c[:k]) - bar * k for k in range(limit + 1)]
            k_c = max(range(limit + 1), key=lambda k: (gains[k], -k))
            k_h = lengths.get(r, 0)
            head = sum(self._acceptance(r).survival(k_h)) - bar * k_h
            if k_c and gains[k_c] > head:
                out[r] = m.tokens[:k_c]
                self.chained[r] = bucket
        self.chain_steps += len(out)
        return out

    def observe(self, request: str, drafted: int, accepted: int) -> None:
        bucket = self.chained.get(request)
        if bucket is None:
            super().observe(request, drafted, accepted)
        else:
            self.chain_rates[bucket].observe(drafted, accepted)


class StaticGridLength(FixedLength):
    """``static-gs`` on vLLM's terms: the fixed draft length a measured grid search found fastest, per batch size.

    adaptree's ``static-gs`` verifies, every cycle, the static tree a grid search measured fastest on the machine.
    vLLM drafts chains and runs many requests at once, so the grid is over K at each batch size: the step-cost
    measurement (:func:`adaptree.vllm_plugin.engine.measure_step_costs`) runs B requests under every fixed K and
    records their tokens per second (:attr:`StepCosts.tokens_per_s`); each step drafts the K measured fastest at
    the largest measured batch size up to the step's (:meth:`StepCosts.best_fixed`). Static in what it reads: no
    acceptance, no confidence, only the batch size."""

    name = "static-gs"

    def __init__(self, costs: StepCosts, k_max: int | None = None) -> None:
        costs.best_fixed(1)  # a ValueError now for step costs without the grid
        self.table = costs
        super().__init__(costs.k_max if k_max is None else min(k_max, costs.k_max))

    def decide(self, requests: Sequence[str]) -> tuple[dict[str, int], int]:
        k = min(self.table.best_fixed(max(len(requests), 1)), self.k)
        return dict.fromkeys(requests, k), k


class StopRuleLength(CostAwareLength):
    """A per-draft stop rule of adaptree's engine, deciding how much of each request's chain is verified.

    adaptree's depth rules (DEAGLE's votes, RADAR's policy) stop drafting once the drafter is unsure. vLLM drafts
    the whole batch's chains in one loop of ``K`` forwards, so here the rule decides what is verified: after each
    step adaptree's worker hands over, with each request's drafts, the drafter's top-``width`` log-probs at every
    draft (:mod:`adaptree.vllm_plugin.worker`), and the request verifies its chain up to the draft where the rule
    stops. How many the drafter makes (``K``) is costaware's batch decision, so the rule drafts where rows are
    nearly free and backs off under load as costaware does, but never more than one past the longest chain a rule
    let through in this step. The drafts arrive with vLLM's synchronous scheduler only (its async one keeps them in
    the worker), so these controllers run under it."""

    reads_drafts = True
    width = 1
    """Log-probs per draft the rule reads (the drafted token's first)."""
    per_request = ("requests", "logprobs")

    def __init__(self, costs: StepCosts, k_max: int | None = None, prior: Sequence[float] = DEFAULT_PRIOR) -> None:
        super().__init__(costs, k_max, prior)
        self.logprobs: dict[str, tuple[list[list[float]], int]] = {}
        self._machines: dict[tuple[int, bool], tuple] = {}
        self.stopped = 0
        """Drafts the rule left unverified (the bench reports them)."""

    def drafted(self, request: str, logprobs: Sequence[Sequence[float]], context_len: int = 0) -> None:
        """The drafter's top-``width`` log-probs at each of the drafts ``request`` just received, after
        ``context_len`` tokens of prompt and output."""
        self.logprobs[request] = ([list(row) for row in logprobs], context_len)

    def stop(self, logprobs: list[list[float]], context_len: int = 0) -> int:
        """How many of the drafts (their log-probs ``logprobs``, after ``context_len`` tokens) are verified."""
        raise NotImplementedError

    def machine(self, batch: int, tree: bool = True):
        """vLLM at ``batch`` requests as adaptree's learned policies see a machine: its cost features
        (:func:`vllm_cost_features`) and, with ``tree``, its best static tree: the grid search's chain there
        (:meth:`StepCosts.best_fixed`, at least one draft; a chain of d drafts verifies d). Read from the measured
        table, so computed once per batch size."""
        seen = self._machines
        if (batch, tree) not in seen:
            from adaptree.methods.common.machine_tree import MachineTree

            features = vllm_cost_features(self.costs.table, batch)
            k = max(self.costs.table.best_fixed(batch), 1) if tree else 0
            seen[(batch, tree)] = features, MachineTree(k, k, {d: d for d in range(1, 17)}) if tree else None
        return seen[(batch, tree)]

    def continuations(self, logprobs: list[list[float]]):
        """The chain as the beam a policy trained on trees reads: after draft ``d`` (1-based), the cumulative
        log-probs of the ``width`` best continuations of the chain's first ``d - 1`` drafts (what EAGLE-3's beam
        holds at depth 1; padded with -1e9, below every policy's floor). Yields ``(d, scores)``."""
        import torch

        prefix = 0.0
        for d, row in enumerate(logprobs, start=1):
            scores = torch.tensor(row[:self.width], dtype=torch.float32) + prefix
            if scores.numel() < self.width:
                scores = torch.cat([scores, scores.new_full((self.width - scores.numel(),), -1e9)])
            yield d, scores
            prefix += row[0]

    def decide(self, requests: Sequence[str]) -> tuple[dict[str, int], int]:
        ks, k = super().decide(requests)
        reach = 0  # the most drafts a rule let through; None once a request has no drafts to judge yet
        for r in requests:
            lp, context_len = self.logprobs.pop(r, ((), 0))  # each step's drafts are read once
            if lp and k:
                n = min(k, len(lp))
                ks[r] = min(n, self.stop(lp[:n], context_len))
                self.stopped += n - ks[r]
                reach = None if reach is None else max(reach, ks[r])
            else:
                reach = None
        # drafts past where every rule stopped would not be verified: draft one more than that, so a rule that lets
        # its whole chain through sees a longer one next step
        return ks, k if reach is None else min(k, reach + 1)


class DeagleLength(StopRuleLength):
    """DEAGLE's training-free vote (:class:`~adaptree.methods.rules.deagle.DeagleController`, its own code) on a
    chain: at depth ``d`` the chain's survival ``s_d`` (the product of its drafts' probabilities) is the beam's
    top-k sum, ``s_d / s_{d-1}`` the momentum, and the expected length counts the chain's own survivals; the chain is
    verified up to the depth where two of the three votes stop it."""

    name = "deagle"

    def __init__(self, costs: StepCosts, k_max: int | None = None, prior: Sequence[float] = DEFAULT_PRIOR) -> None:
        from adaptree.methods.rules.deagle import DeagleConfig, DeagleController

        super().__init__(costs, k_max, prior)
        self.rule = DeagleController(DeagleConfig())

    def stop(self, logprobs: list[list[float]], context_len: int = 0) -> int:
        import torch

        survival = 0.0
        for d, row in enumerate(logprobs, start=1):
            survival += row[0]
            s = torch.tensor([survival])
            if self.rule.observe(d, s, s):  # the chain is both the beam and the level's only leaf
                return d
        return len(logprobs)


class RadarLength(StopRuleLength):
    """RADAR's LSTM stop policy (:class:`~adaptree.methods.radar.policy.RadarPolicy`, the one shipped with the head)
    on a chain: after draft ``d`` it reads the chain's continuations as its beam (:meth:`StopRuleLength.continuations`;
    deeper than depth 1 a tree's beam would also hold other branches) and stops where ``P(STOP) >= 0.5``. It sees vLLM's machine at the step's batch size
    (:meth:`StopRuleLength.machine`); no context match (0s: this port verifies the head's drafts only)."""

    name = "radar"

    def __init__(self, costs: StepCosts, policy: str | Path, k_max: int | None = None,
                 prior: Sequence[float] = DEFAULT_PRIOR) -> None:
        from adaptree.methods.radar.policy import RadarPolicy

        super().__init__(costs, k_max, prior)
        self.policy = RadarPolicy.load(policy).eval()
        pc = self.policy.config
        if pc.tree_features:
            costs.best_fixed(1)  # the static tree it observes is the grid search's chain
        self.width = pc.width
        self.match = [0.0] * 3 if pc.match_features else None
        self._inputs: dict[int, object] = {}

    def _costs(self, batch: int):
        x = self._inputs.get(batch)
        if x is None and self.policy.config.cost_features:
            features, tree = self.machine(batch, self.policy.config.tree_features)
            x = self._inputs[batch] = self.policy.costs_tensor(self.policy.machine_values(features, tree))
        return x

    def stop(self, logprobs: list[list[float]], context_len: int = 0) -> int:
        import torch

        costs = self._costs(self.batch_size)
        hc = None
        with torch.inference_mode():
            for d, scores in self.continuations(logprobs):
                logits, hc = self.policy.step(scores, d, hc, costs, self.match)
                if float(torch.softmax(logits.float(), -1)[0]) >= 0.5:
                    return d
        return len(logprobs)


class LtdLength(StopRuleLength):
    """LTD's depth policy π_D (:class:`~adaptree.offline.policy.MLPPolicy`, the one shipped with the head) on a chain:
    after draft ``d`` its observation (:meth:`~adaptree.methods.ltd.controller.LTDObservation.frontier_obs`) holds the
    chain's continuations (:meth:`StopRuleLength.continuations`; a tree's frontier holds ``W²``, the rest is padding,
    as at a tree's depth 1), D, the request's context length, vLLM's machine at
    the step's batch size (:meth:`StopRuleLength.machine`) and no context match; STOP ends the verified chain. A
    chain's V is its depth, so LTD's size policy has nothing to decide here."""

    name = "ltd"

    def __init__(self, costs: StepCosts, policy: str | Path, k_max: int | None = None,
                 prior: Sequence[float] = DEFAULT_PRIOR) -> None:
        from adaptree.methods.ltd.controller import LTDObservation
        from adaptree.offline.policy import MLPPolicy

        super().__init__(costs, k_max, prior)
        self.policy = MLPPolicy.load(policy, kind="ltd-depth").eval()
        self.obs = LTDObservation.from_dict(self.policy.config.observation)
        if self.obs.use_tree:
            costs.best_fixed(1)
        self.width = self.obs.width
        self.match = [0.0] * 3 if self.obs.use_match else None

    def stop(self, logprobs: list[list[float]], context_len: int = 0) -> int:
        from adaptree.methods.ltd.controller import STOP

        features, tree = self.machine(self.batch_size, self.obs.use_tree)
        costs = features if self.obs.use_costs else None
        for d, scores in self.continuations(logprobs):
            if self.policy.act(self.obs.frontier_obs(scores, d, context_len, costs, self.match, tree)) == STOP:
                return d
        return len(logprobs)


def vllm_cost_features(costs: StepCosts | LiveCosts, batch: int) -> list[float]:
    """adaptree's machine cost features (:data:`adaptree.offline.family.COST_FEATURES`) read from vLLM's step costs
    at ``batch`` requests, per request: one autoregressive step is the step without drafts, a verified row the slope
    of the step time over K (the drafter's step and the row are not measured apart: the slope stands for both), the
    growth of ``V`` rows ``log(1 + V x slope / T(B, 0))``, and no per-cycle overhead of its own."""
    top = costs.k_max
    t0 = costs.time(batch, 0)
    slope = max((costs.time(batch, top) - costs.time(batch, 1)) / (top - 1) if top > 1 else
                costs.time(batch, 1) - t0, 0.0)
    return [slope / t0, *(math.log1p(v * slope / t0) for v in (4, 16, 64)), 0.0]


CONTROLLERS = ("fixed", "static-gs", "costaware", "hybrid", "deagle", "radar", "ltd")
"""What ``additional_config['adaptree']['controller']`` may name."""
SYNC_CONTROLLERS = ("hybrid", "deagle", "radar", "ltd")
"""Those that read each request's output or drafts when they decide: vLLM's synchronous scheduler only."""
COSTED_CONTROLLERS = ("static-gs", "costaware", "hybrid", "deagle", "radar", "ltd")
"""Those that read vLLM's step costs (``step_costs``)."""


def build_controller(settings: Mapping, k_max: int):
    """The controller that ``settings`` (``additional_config["adaptree"]`` of the vLLM config) names:
    ``{"controller": "costaware", "step_costs": PATH}`` (also ``static-gs``, ``hybrid``, ``deagle``; ``radar`` and
    ``ltd`` with ``"policy": FOLDER``, a RADAR or LTD depth policy of adaptree's) or ``{"controller": "fixed", "k":
    K}``."""
    if not isinstance(settings, Mapping):
        raise ValueError(f"additional_config['adaptree'] must be a mapping, got {settings!r}")
    unknown = set(settings) - {"controller", "k", "step_costs", "policy"}
    if unknown:
        raise ValueError(f"additional_config['adaptree']: unknown settings {sorted(unknown)}")
    name = settings.get("controller", "costaware")
    if name not in CONTROLLERS:
        raise ValueError(f"additional_config['adaptree']['controller'] must be one of {CONTROLLERS}, got {name!r}")
    if name == "fixed":
        k = settings.get("k", k_max)
        if not isinstance(k, int) or not 0 <= k <= k_max:
            raise ValueError(f"additional_config['adaptree']['k'] must be an integer in 0..{k_max} "
                             f"(num_speculative_tokens), got {k!r}")
        return FixedLength(k)
    path = settings.get("step_costs")
    if not path:
        raise ValueError(f"the {name} controller needs additional_config['adaptree']['step_costs']: the file "
                         "adaptree.vllm_plugin.engine.measure_step_costs writes")
    costs = StepCosts.load(path)
    if name in ("radar", "ltd"):
        policy = settings.get("policy")
        if not policy:
            what, where = POLICIES[name]
            raise ValueError(f"the {name} controller needs additional_config['adaptree']['policy']: {what} folder "
                             f"(the one shipped next to the head: HEAD/{where})")
        return (RadarLength if name == "radar" else LtdLength)(costs, policy, k_max)
    return {"static-gs": StaticGridLength, "costaware": CostAwareLength, "hybrid": HybridLength,
            "deagle": DeagleLength}[name](costs, k_max)


POLICIES = {"radar": ("a RADAR policy", "radar"), "ltd": ("an LTD depth policy", "ltd/depth")}
"""The controllers that read a policy of adaptree's (``"policy"``): what it is, and where a head folder holds it."""


def draft_logprob_width(settings: Mapping | None) -> int:
    """How many log-probs per draft the worker records for the controller ``settings`` names (0: none). Read in the
    worker's process, so a policy's width is read from its config without loading it."""
    name = (settings or {}).get("controller") if isinstance(settings, Mapping) else None
    if name == "deagle":
        return DeagleLength.width
    if name in POLICIES and settings.get("policy"):
        try:
            config = json.loads((Path(settings["policy"]) / "config.json").read_text(encoding="utf-8"))
            return int(config["width"] if name == "radar" else config["observation"]["width"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"the {name} policy {settings['policy']}: no readable config.json with a width ({exc})"
                             ) from None
    return 0
