"""The cycle loop itself, shared by the live engine and the replay simulator (DESIGN.md).

:func:`run_cycles` is the only copy of a generation's cycle bookkeeping: the controller calls in their
order (``begin_cycle`` -> ``TreePlan``, ``continue_drafting(DraftStep)`` after each level while
``depth < plan.max_depth``, ``choose_size(tree, plan)``, ``choose_chain`` when the plan has a chain,
``end_cycle(record)``), the clamps (V to the candidates, V and the chain to the context room), the stop
rules (:func:`emit`: EOS kept, ``max_new_tokens``; the context limit), and the
:class:`~adaptree.core.controller.CycleContext` and :class:`~adaptree.core.records.CycleRecord` of every cycle.

Where the tokens come from is a :class:`CycleSource`: the live models
(:class:`adaptree.core.engine.Engine`) or a recorded greedy trace
(:func:`adaptree.offline.simulator.simulate`). A source grows the draft tree, verifies the chosen
``V`` nodes and accepts, and fills in the cycle's draft/verify/other seconds (measured live, modelled in
replay); the loop times the controller (``policy_s``) with its ``clock``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from adaptree.core.controller import Controller, CycleContext
from adaptree.core.records import CycleRecord
from adaptree.core.tree import DraftStep, DraftTree

log = logging.getLogger(__name__)


def emit(tokens: list[int], new: Sequence[int], limit: int, eos: frozenset[int]) -> str:
    """Append ``new`` to ``tokens`` up to EOS (kept) or the token limit; return the stop reason or ''."""
    for t in new:
        tokens.append(t)
        if t in eos:
            return "eos"
        if len(tokens) >= limit:
            return "max_new_tokens"
    return ""


class CycleSource:
    """The model side of the cycle loop: drafts, verifies and accepts at the current position.

    ``run_cycles`` calls, per cycle: :meth:`context_len`, then (when there is room) :meth:`start_cycle`,
    :meth:`draft` and :meth:`draft_more` (only when the plan drafts), :meth:`verify`, :meth:`close`.
    """

    max_len: int
    """Context limit (prompt + generated tokens)."""
    temperature: float = 0.0
    """The verification's sampling temperature (0: greedy), for :attr:`CycleContext.temperature`."""
    warn_clamp = False
    """True: log the first V clamped to the candidates of a full-depth tree (then set False: said once)."""

    def context_len(self) -> int:
        """Tokens committed in the target's context (before the next cycle's root)."""
        raise NotImplementedError

    def start_cycle(self, features: bool = True) -> torch.Tensor | None:
        """A cycle begins at the current position: the target features of the last accepted position
        ``[3*hidden]`` for :attr:`CycleContext.features` (None when the draft head is not used, or not ``features``:
        the controller does not read them)."""
        raise NotImplementedError

    def draft(self, width: int, rec: CycleRecord) -> DraftStep:
        """Start the cycle's tree of beam width ``width`` and draft its first level (``step.tree``)."""
        raise NotImplementedError

    def draft_more(self, tree: DraftTree, rec: CycleRecord) -> DraftStep:
        """Draft one more level of ``tree``."""
        raise NotImplementedError

    def verify(self, tree: DraftTree | None, v: int, chain: Sequence[int], rec: CycleRecord) -> tuple[int, list[int]]:
        """Verify the root, ``tree``'s top-``v`` candidates (``v`` already clamped; no tree: the root
        alone) and ``chain`` as one more path (:func:`~adaptree.core.tree.add_chain`; already cut to the
        room; set ``rec.chain_nodes``), accept, move to the next root; return (accepted draft tokens, new
        tokens incl. the bonus)."""
        raise NotImplementedError

    def close(self, rec: CycleRecord, t_cycle: float) -> None:
        """Fill in ``rec``'s draft/verify/other seconds (``t_cycle``: the loop clock at the cycle's start);
        called before ``end_cycle``."""
        raise NotImplementedError


def run_cycles(src: CycleSource, ctl: Controller, prompt_ids: Sequence[int], tokens: list[int],
               cycles: list[CycleRecord], max_new_tokens: int, eos: frozenset[int],
               clock: Callable[[], float] = time.perf_counter,
               on_tokens: Callable[[list[int]], None] | None = None) -> str:
    """Run cycles until a stop rule fires; return the stop reason.

    Call it after the first token (the prefill's) went through :func:`emit` without stopping.

    :param tokens: the generated ids so far, the root last; new tokens are appended.
    :param cycles: every cycle's record is appended.
    :param clock: times the controller's calls (``policy_s``).
    :param on_tokens: called with each cycle's new token ids (streaming).
    """
    use_draft = ctl.uses_draft
    max_len = src.max_len
    index = ctl.context_index()
    while True:
        L = src.context_len()
        room = max_len - L  # target slots left for the root and the verified nodes
        if room < 1:
            return "context_limit"
        t_cycle = clock()
        rec = CycleRecord(cycle=len(cycles), context_len=L, width=0, depth=0, size=0, candidates=0, accepted=0,
                          emitted=0)
        features = src.start_cycle(ctl.reads_features)
        t0 = clock()
        if index is not None:  # the index's upkeep counts as the controller's time
            index.sync(prompt_ids, tokens)
        ctx = CycleContext(rec.cycle, L, len(tokens), features, prompt_ids, tokens, index, src.temperature)
        plan = ctl.begin_cycle(ctx)
        rec.policy_s += clock() - t0
        rec.width = plan.width

        tree, v = None, 0
        if use_draft and plan.max_depth > 0 and room > 1:
            step = src.draft(plan.width, rec)
            tree = step.tree
            while tree.depth < plan.max_depth:
                t0 = clock()
                go_on = ctl.continue_drafting(step)
                rec.policy_s += clock() - t0
                if not go_on:
                    break
                step = src.draft_more(tree, rec)
            t0 = clock()
            v = int(ctl.choose_size(tree, plan))
            rec.policy_s += clock() - t0
            if v < 0:
                raise ValueError(f"controller {ctl.name!r} chose a negative verification size V={v}")
            rec.depth, rec.candidates = tree.depth, tree.num_candidates
            # A plan whose full-depth tree has fewer than V candidates is worth one warning; a controller
            # that stopped drafting early gets fewer candidates by design (nothing to say).
            if v > tree.num_candidates and tree.depth == plan.max_depth and src.warn_clamp:
                log.warning("V=%d exceeds the %d draft candidates (W=%d, depth %d); clamping V to the "
                            "candidate count (said once)", v, tree.num_candidates, plan.width, tree.depth)
                src.warn_clamp = False
            v = min(v, tree.num_candidates, room - 1)
        rec.size = v
        chain: Sequence[int] = ()
        if plan.chain:
            t0 = clock()
            k = int(ctl.choose_chain(tree, plan, v))
            rec.policy_s += clock() - t0
            if k < 0:
                raise ValueError(f"controller {ctl.name!r} chose a negative chain length {k}")
            chain = plan.chain[:min(k, max(0, room - 1 - v))]  # the root and the head's V nodes come first
        rec.chain = len(chain)

        rec.accepted, new = src.verify(tree, v, chain, rec)
        if chain:
            k = 0
            while k < min(rec.accepted, len(chain)) and new[k] == chain[k]:
                k += 1
            rec.chain_accepted = k
        before = len(tokens)
        stop = emit(tokens, new, max_new_tokens, eos)
        rec.emitted = len(tokens) - before
        if on_tokens:
            on_tokens(tokens[before:])
        src.close(rec, t_cycle)
        t0 = clock()
        ctl.end_cycle(rec)
        rec.policy_s += clock() - t0
        cycles.append(rec)
        if stop:
            return stop
