"""Replay any controller over greedy traces, exactly as the engine would run it.

:func:`simulate` runs the engine's own cycle loop, :func:`adaptree.core.cycle.run_cycles`, over a
recorded trace instead of the models: the same controller calls in the same order (``reset``,
``begin_cycle`` -> ``TreePlan``, ``continue_drafting(DraftStep)`` after each level while
``depth < plan.max_depth``, ``choose_size(tree, plan)``, ``end_cycle(record)``), the same clamps (V to
the candidates and to the context room), the same stop rules (EOS kept, ``max_new_tokens``, the context
limit). The draft head is never run: a :class:`ReplayTree` (a :class:`~adaptree.core.tree.DraftTree`
whose levels come from the trace) gives the controller the live API, and the accepted length follows
from the recorded greedy continuation.

Cycle timings come from a :class:`~adaptree.offline.latency.LatencyModel` when one is given (else 0);
the controller's own time is measured (``policy_s``) unless ``measure_policy=False``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from adaptree.core.controller import Controller
from adaptree.core.cycle import CycleSource, emit, run_cycles
from adaptree.core.records import CycleRecord
from adaptree.core.tree import DraftStep, DraftTree, add_chain, root_only_tree
from adaptree.offline.latency import LatencyModel
from adaptree.offline.traces import (
    PromptTrace,
    WidthTrace,
    level_offset,
    match_mask,
    num_candidates,
)

_STEP_FIELDS = {f.name for f in dataclasses.fields(DraftStep)}
_STEP_CACHES_ENTROPY = isinstance(getattr(DraftStep, "entropy", None), cached_property)


class ReplayTree(DraftTree):
    """A :class:`DraftTree` replayed from a trace: same attributes, candidates and :meth:`select`;
    :meth:`first_step` / :meth:`step` read the next recorded level instead of running the head."""

    def __init__(self, wt: WidthTrace, position: int, root: int, context_len: int) -> None:  # noqa: D107
        self.head = self.cache = None
        self.width, self.root, self.context_len = wt.width, root, context_len
        self.depth = 0
        self.draft_forwards = 0
        self.committed = context_len  # the draft cache holds one pair per committed target position
        self.base_pos = context_len - 1
        self._wt, self._pos = wt, position
        tokens, scores, parents, depths, beam = wt.torch_views()
        self._row = (tokens[position], scores[position], parents[position], depths)
        self._beam_row = beam[position]
        self._entropy = None if wt.entropy is None else torch.from_numpy(wt.entropy[position])
        self._tokens, self._scores, self._parents = [], [], []
        self._offset = 0
        self._cat = None

    def _next_level(self) -> DraftStep:
        if self.depth >= self._wt.max_depth:
            raise ValueError(f"the controller drafted deeper than the trace's max_depth={self._wt.max_depth}; "
                             f"record traces with a larger --max-depth")
        w, d = self.width, self.depth + 1
        start, size = level_offset(w, d), (w if d == 1 else w * w)
        tokens, scores, parents, _ = self._row
        toks, sc = tokens[start:start + size], scores[start:start + size]
        self._tokens.append(toks)
        self._scores.append(sc)
        self._parents.append(parents[start:start + size])
        self._level_offset = start
        self._offset = start + size
        self._cat = None
        pos = self._beam_row[d - 1]
        self.beam_pos = pos
        self.beam_rows = torch.div(pos, w, rounding_mode="floor")
        self.beam_cand = pos + start
        self.beam_scores = sc[pos]
        self.beam_tokens = toks[pos]
        self.depth = d
        self.draft_forwards += 1
        rows = 1 if d == 1 else w
        child = sc.view(rows, w)
        step = DraftStep(d, w, self.context_len, self.beam_tokens, self.beam_scores, child, self)
        if "beam_rows" in _STEP_FIELDS:
            step.beam_rows = self.beam_rows
        if self._entropy is not None and _STEP_CACHES_ENTROPY:
            step.__dict__["entropy"] = self._entropy[d - 1, :rows]  # the recorded value of the cached property
        return step

    def first_step(self, hidden=None, tokens=None) -> DraftStep:  # noqa: D102 (signature kept for the API)
        return self._next_level()

    def step(self) -> DraftStep:  # noqa: D102
        return self._next_level()

    def discard(self) -> None:  # noqa: D102
        pass

    def best_hidden(self) -> torch.Tensor:  # noqa: D102
        if self._wt.hidden is None:
            raise ValueError("this trace holds no draft hidden states (a SpecDec++ replay needs them): record traces "
                             "with hidden_dtype float16 (`adaptree traces record --hidden-dtype float16`)")
        return torch.from_numpy(self._wt.hidden[self._pos, self.depth - 1].astype(np.float32))

    def _all(self):
        if self._cat is None:
            tokens, scores, parents, depths = self._row
            n = self._offset
            self._cat = (tokens[:n], scores[:n], parents[:n], depths[:n])
        return self._cat


@dataclass
class SimRun:
    """One prompt replayed."""

    key: str
    prompt_len: int
    token_ids: list[int]
    cycles: list[CycleRecord] = field(default_factory=list)
    stop_reason: str = ""
    ar_s: float = 0.0
    """Modelled time of autoregressive decoding of the same tokens (one root-only verify per token after
    the first), from the same latency model."""

    @property
    def tau(self) -> float:
        return sum(c.accepted + 1 for c in self.cycles) / len(self.cycles) if self.cycles else 0.0

    @property
    def total_s(self) -> float:
        return sum(c.total_s for c in self.cycles)


class RunTotals:
    """Totals over ``self.runs`` (simulated runs or oracle schedules: each has ``cycles``, ``total_s``, ``ar_s``)."""

    runs: list

    @property
    def cycles(self) -> int:
        return sum(len(r.cycles) for r in self.runs)

    @property
    def tau(self) -> float:
        """Mean over all cycles of all prompts of (accepted + 1)."""
        n = self.cycles
        return sum(c.accepted + 1 for r in self.runs for c in r.cycles) / n if n else 0.0

    @property
    def total_s(self) -> float:
        return sum(r.total_s for r in self.runs)

    @property
    def ar_s(self) -> float:
        return sum(r.ar_s for r in self.runs)

    @property
    def speedup(self) -> float:
        """Modelled AR time / modelled time (0 without a latency model)."""
        t = self.total_s
        return self.ar_s / t if t > 0 else 0.0


@dataclass
class SimResult(RunTotals):
    runs: list[SimRun]

    @property
    def new_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.runs)

    def summary(self) -> dict:
        cyc = [c for r in self.runs for c in r.cycles]
        n = max(1, len(cyc))
        return {"prompts": len(self.runs), "cycles": len(cyc), "new_tokens": self.new_tokens, "tau": self.tau,
                "mean_depth": sum(c.depth for c in cyc) / n, "mean_size": sum(c.size for c in cyc) / n,
                "modelled_s": self.total_s, "modelled_ar_s": self.ar_s, "modelled_speedup": self.speedup,
                "policy_s": sum(c.policy_s for c in cyc)}


class _ReplaySource(CycleSource):
    """One prompt's trace as :func:`~adaptree.core.cycle.run_cycles`' source: the root is output position
    ``j``, a tree is a :class:`ReplayTree`, the accepted length follows from the recorded greedy
    continuation, and the cycle's seconds come from the latency model (0 without one)."""

    def __init__(self, trace: PromptTrace, use_draft: bool, latency_model: LatencyModel | None) -> None:
        self.trace, self.lat = trace, latency_model
        self.max_len, self.n = trace.max_len, trace.prompt_len
        self.y = trace.output.tolist()
        self.feats = torch.from_numpy(trace.features) if (use_draft and trace.features is not None) else None
        self.matches: dict[int, np.ndarray] = {}
        self.j = 0  # index of the cycle's root in y

    def context_len(self) -> int:
        return self.n + self.j

    def start_cycle(self, features: bool = True) -> torch.Tensor | None:
        trace, j = self.trace, self.j
        if j >= trace.end:
            raise RuntimeError(f"trace {trace.key!r}: root {j} is past the recorded {trace.end} positions")
        return None if self.feats is None or not features else self.feats[j].float()

    def draft(self, width: int, rec: CycleRecord) -> DraftStep:
        j = self.j
        self.wt = self.trace.width(width)
        return ReplayTree(self.wt, j, self.y[j], self.n + j).first_step()

    def draft_more(self, tree: DraftTree, rec: CycleRecord) -> DraftStep:
        return tree.step()

    def verify(self, tree: DraftTree | None, v: int, chain: Sequence[int],
               rec: CycleRecord) -> tuple[int, list[int]]:
        trace, j = self.trace, self.j
        acc = 0
        if v > 0:  # a tree was drafted this cycle, from self.wt
            wt = self.wt
            if wt.width not in self.matches:
                self.matches[wt.width] = match_mask(wt, trace.output, np.arange(trace.end))
            acc = _accepted(wt, j, tree.depth, v, self.matches[wt.width][j], tree)
        if chain:
            vtree = tree.select(v) if tree is not None else root_only_tree(self.y[j], self.n + j)
            rec.chain_nodes = add_chain(vtree, chain)[1]
            acc = max(acc, chain_credit(self.y, j, chain))
        new = self.y[j + 1:j + acc + 2]
        if len(new) != acc + 1:
            raise RuntimeError(f"trace {trace.key!r}: the recorded output ends before position {j + acc + 1}")
        self.j = j + acc + 1
        return acc, new

    def close(self, rec: CycleRecord, t_cycle: float) -> None:
        lat = self.lat
        if lat is not None:
            rec.draft_s = lat.draft_time(rec.width, rec.depth, rec.context_len)
            rec.verify_s = lat.verify_time(rec.size + rec.chain_nodes, rec.context_len)
            rec.other_s = lat.other_s


def chain_credit(output: Sequence[int], j: int, chain: Sequence[int]) -> int:
    """Accepted tokens of a context chain verified under root ``output[j]`` (greedy): its prefix up to where it
    leaves the recorded output. A chain longer than the trace's look-ahead is credited up to the look-ahead (a
    generation's last cycles), keeping the bonus token after it recorded."""
    k = 0
    while k < len(chain) and j + 2 + k < len(output) and chain[k] == output[j + 1 + k]:
        k += 1
    return k


def simulate_one(controller: Controller, trace: PromptTrace, latency_model: LatencyModel | None = None,
                 max_new_tokens: int | None = None, measure_policy: bool = True) -> SimRun:
    """Replay ``controller`` over one prompt's trace (see the module docstring)."""
    ctl, lat = controller, latency_model
    s = trace.settings
    limit = s.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
    if not 1 <= limit <= s.max_new_tokens:
        raise ValueError(f"max_new_tokens must be in 1..{s.max_new_tokens} (the trace's), got {limit}")
    eos = frozenset(s.eos_token_ids)
    src = _ReplaySource(trace, ctl.uses_draft, lat)
    n = trace.prompt_len
    if lat is not None:
        ctl.use_latency(lat)  # the simulated machine is the controller's machine
    ctl.reset()
    run = SimRun(trace.key, n, [])
    tokens = run.token_ids
    run.stop_reason = emit(tokens, [src.y[0]], limit, eos) or run_cycles(
        src, ctl, trace.prompt.tolist(), tokens, run.cycles, limit, eos,
        time.perf_counter if measure_policy else _no_clock)
    if lat is not None:
        run.ar_s = sum(lat.ar_step(n + i) for i in range(len(tokens) - 1))
    return run


def _no_clock() -> float:
    return 0.0


def _accepted(wt: WidthTrace, j: int, depth: int, v: int, match: np.ndarray, tree: ReplayTree) -> int:
    c = num_candidates(wt.width, depth)
    m = match[:c]
    if not m.any():
        return 0
    scores = tree.candidate_scores()
    order = torch.sort(scores, descending=True, stable=True).indices[:v].numpy()
    sel = order[m[order]]
    return int(tree.candidate_depths()[torch.from_numpy(sel)].max()) if sel.size else 0


def simulate(controller: Controller, traces: PromptTrace | Iterable[PromptTrace],
             latency_model: LatencyModel | None = None, max_new_tokens: int | None = None,
             measure_policy: bool = True) -> SimResult:
    """Replay ``controller`` over one trace or several (one generation per prompt, in order).

    :param latency_model: gives every cycle's ``draft_s``/``verify_s``/``other_s`` (0 without one), and is handed
        to the controller (:meth:`~adaptree.core.controller.Controller.use_latency`) before every generation.
    :param max_new_tokens: a smaller token limit than the traces were recorded with.
    :param measure_policy: time the controller's calls (``policy_s``); False keeps results deterministic.
    """
    if isinstance(traces, PromptTrace):
        traces = [traces]
    traces = list(traces)
    if traces:
        ref = traces[0].fingerprints
        for t in traces[1:]:
            if t.fingerprints.get("model") != ref.get("model") or t.fingerprints.get("head") != ref.get("head"):
                raise ValueError(f"trace {t.key!r} was recorded with another model or head than {traces[0].key!r}; "
                                 f"simulate one model/head pair at a time")
    return SimResult([simulate_one(controller, t, latency_model, max_new_tokens, measure_policy) for t in traces])
