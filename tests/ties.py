"""Tie-aware comparison of what two code paths compute with different float rounding.

The live engine and the replay of its trace compute the same draft trees and controller inputs, but not
bit for bit: the live engine feeds the head in chunks and verifies trees, the recording feeds it one
position at a time and runs one full forward; other CPU kernels (AVX-512, AVX2, SSE4.1) and thread
counts round differently again. Scores agree to a few 1e-6, so wherever two candidates' scores (or a
controller's decision quantity) lie that close together, the two paths may rank them either way, and
from then on the generations take different (equally valid) paths through the same greedy output.

Exact equality of such structures is therefore not an invariant. What is:

* up to the first cycle where they differ, the two runs are identical (every cycle record and every
  controller decision);
* that first difference is explained by a near-tie: the live and replayed inputs agree within
  :data:`TIE` (candidates by their root-to-node token path, their scores, the beams, the selected
  sets) and :data:`FEATURE_TOL` (the features); the controller, restored to its live state before that
  cycle and given the replay's inputs, decides exactly as the replay did (so the difference lies in the
  inputs, not in the controller's state or the simulator's logic); and where the decisions were the
  same, the accepted lengths follow from the two selected sets;
* both emit the same tokens (the greedy output: that part is exact) with the same stop reason.

A genuine divergence (a score off by more than TIE, a controller state the replay does not restore, an
accepted length that does not follow from the verified tree, other tokens) still fails:
tests/test_ties.py shows each of these rejected.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from adaptree.core.controller import Controller
from adaptree.core.tree import DraftTree
from adaptree.offline.simulator import ReplayTree, simulate

TIE = 1e-4
"""Score tolerance of a live-vs-replay comparison. The two compute the same cumulative log-probs with
different float rounding (a few 1e-6 apart on the tiny models, whatever the kernels), so candidates whose
scores are closer than this may rank either way: in a beam's order, at the beam's cut-off, among a
parent's top-W children, at V."""

FEATURE_TOL = 1e-4
"""Largest difference between live and recorded target features (|f| up to about 5 on the tiny models;
measured differences are below 1e-6)."""

RECORD_FIELDS = ("cycle", "context_len", "width", "depth", "size", "candidates", "accepted", "emitted", "chain",
                 "chain_nodes", "chain_accepted")
"""The fields of a :class:`~adaptree.core.records.CycleRecord` a replay must reproduce (the timings are not)."""


# ------------------------------------------------------------------------------------- trees by token path


class PathTree:
    """A drafted tree keyed by each candidate's root-to-node token path, which does not depend on the order
    of near-tied candidates (their indices do). Checks the tree's own structure on the way: every level
    but the last has a beam of W nodes, best first, whose W children each (distinct tokens) make the next
    level; the beam the controller saw after each level is that of the candidates."""

    def __init__(self, tokens, scores, parents, depths, width, beams_seen):
        tokens, scores, parents, depths = (x.tolist() for x in (tokens, scores, parents, depths))
        self.paths = []
        for i, (t, p, d) in enumerate(zip(tokens, parents, depths)):
            assert p < i and (p < 0) == (d == 1)
            self.paths.append((self.paths[p] if p >= 0 else ()) + (t,))
            assert len(self.paths[-1]) == d
        self.score = dict(zip(self.paths, scores))
        assert len(self.score) == len(self.paths)  # siblings carry distinct tokens: a path names one node
        self.levels = [[x for x in self.paths if len(x) == d] for d in range(1, max(depths) + 1)]
        assert len(self.levels[0]) == width
        self.beams = []  # the beam of every level but the last, best first: the parents of the next level
        self.children = {(): self.levels[0]}
        for d, (bt, bs) in enumerate(beams_seen[:len(self.levels) - 1], 1):
            next_parents = [p for p, dd in zip(parents, depths) if dd == d + 1]
            beam = next_parents[::width]
            assert len(beam) == width and all(depths[b] == d for b in beam)
            assert next_parents == [b for b in beam for _ in range(width)]
            assert bt.tolist() == [tokens[b] for b in beam] and bs.tolist() == [scores[b] for b in beam]
            self.beams.append([self.paths[b] for b in beam])
        assert len(self.beams) == len(self.levels) - 1
        for x in self.paths[width:]:
            self.children.setdefault(x[:-1], []).append(x)

    def top(self, v: int) -> set:
        """The paths of the top-``v`` candidates by score: DraftTree.select's rule (stable, descending)."""
        scores = torch.tensor([self.score[x] for x in self.paths])
        return {self.paths[i] for i in torch.sort(scores, descending=True, stable=True).indices[:v].tolist()}


def assert_best_of(chosen, pool, score, tol, what):
    """``chosen`` (a subset of ``pool``) are the best of ``pool`` by ``score``, up to ``tol`` at the cut-off."""
    rest = [score[x] for x in pool if x not in chosen]
    if chosen and rest:
        low = min(score[x] for x in chosen)
        assert low >= max(rest) - tol, f"{what}: kept {low}, left out {max(rest)}"


def assert_ordered(seq, score, tol, what):
    """``seq`` is best-first by ``score`` up to ``tol`` (a pair may swap only where the scores near-tie)."""
    for k, x in enumerate(seq):
        assert all(score[x] >= score[y] - tol for y in seq[k + 1:]), f"{what}: {x} out of order"


def compare_trees(live, rep, live_logp, draft_id, sel_live, sel_rep, tie=TIE):
    """Assert the replayed tree ``rep`` is the live tree ``live`` up to float near-ties; return the largest
    score difference over the candidates both have.

    Where no two scores near-tie this is exact equality of the trees (tokens, parent paths, depths, beams
    in order, selected set). Otherwise, a candidate in one tree only must descend from a beam difference, or
    be a parent's W-th child near-tied with the other tree's W-th child (a child only the replay has is
    scored with the live log-probs of its parent's distribution, ``live_logp[level][beam row]``: its live
    score must match). Beams and the selected sets must each be, among the candidates both trees have, the
    best by the *other* tree's scores up to ``tie``: with each tree's own selection exact, a difference in
    membership then lies within ``tie`` of both cut-offs (or follows from candidates only one tree has),
    and a difference in order within ``tie``.

    Without ``live_logp`` (two recordings compared: no log-probs kept) a child only one tree has must just
    have missed the other's top-W children of its parent, either way."""
    assert len(live.levels) == len(rep.levels) and len(live.paths) == len(rep.paths)
    worst = 0.0
    for d, (lv_live, lv_rep) in enumerate(zip(live.levels, rep.levels)):
        common = set(lv_live) & set(lv_rep)
        assert common, f"level {d + 1}: no candidate in common"
        worst = max([worst] + [abs(live.score[x] - rep.score[x]) for x in common])
        for tree, other, only in ((live, rep, set(lv_live) - common), (rep, live, set(lv_rep) - common)):
            for x in sorted(only):
                p = x[:-1]
                if p and (p not in other.score or p not in other.beams[d - 1]):
                    continue  # its parent is only in tree, or only in tree's beam (checked at level d - 1)
                cut = min(other.score[c] for c in other.children[p])  # the other's W-th child of p
                if tree is live or live_logp is None:  # just missed the other's top-W children of p
                    who = "live tree" if tree is live else "replay"
                    assert tree.score[x] <= cut + tie, f"{x}: only the {who} has it"
                else:  # the live score of this child: its parent's plus the live log-prob of its token
                    row = 0 if d == 0 else live.beams[d - 1].index(p)
                    assert x[-1] in draft_id, f"{x}: only the replay has it, a token outside the draft vocabulary"
                    s = live.score.get(p, 0.0) + float(live_logp[d][row, draft_id[x[-1]]])
                    assert abs(s - rep.score[x]) <= tie and s >= cut - tie, f"{x}: only the replay has it"
        if d < len(live.beams):
            for tree, other in ((live, rep), (rep, live)):
                beam = tree.beams[d]
                assert_best_of(set(beam), tree.levels[d], tree.score, 0.0, f"level {d + 1} beam")  # its own top-W
                assert_ordered(beam, tree.score, 0.0, f"level {d + 1} beam")
                assert_best_of(set(beam) & common, common, other.score, tie,
                               f"level {d + 1} beam vs the other's scores")
                assert_ordered([x for x in beam if x in common], other.score, tie, f"level {d + 1} beam order")
    assert worst <= tie, f"a candidate's score differs by {worst:.3g} > {tie}"
    common = set(live.paths) & set(rep.paths)
    for sel, tree, other in ((sel_live, live, rep), (sel_rep, rep, live)):
        assert len(sel) == len(sel_live) and sel <= set(tree.paths)
        assert_best_of(sel, tree.paths, tree.score, 0.0, "selected")
        assert_best_of(sel & common, common, other.score, tie, "selected vs the other's scores")
    return worst


def assert_same_argmax(ours: torch.Tensor, theirs: torch.Tensor, tol: float) -> None:
    """The best entries of two logit vectors the two code paths computed (each within ``tol / 2`` of the true
    ones) agree, or near-tie: each side's pick is within ``tol`` of the other side's best."""
    a, b = int(ours.argmax()), int(theirs.argmax())
    if a != b:
        assert float(theirs[a]) >= float(theirs.max()) - tol and float(ours[b]) >= float(ours.max()) - tol, (
            f"argmax {a} vs {b}: {float(ours[a]):.6g}, {float(ours[b]):.6g} vs {float(theirs[a]):.6g}, "
            f"{float(theirs[b]):.6g}, not a near-tie within {tol}")


def draft_ids(head) -> dict[int, int]:
    """Target token id -> draft-vocabulary index of ``head`` (what :func:`compare_trees` needs)."""
    vocab = head.d2t.numel()
    return dict(zip(head.draft_to_target(torch.arange(vocab)).tolist(), range(vocab)))


def replay_tree(trace, width: int, depth: int, context_len: int) -> tuple[PathTree, ReplayTree]:
    """The trace's tree at the root before which ``context_len`` tokens are committed (output position
    ``context_len - prompt_len``), grown to ``depth``."""
    j = context_len - trace.prompt_len
    rt = ReplayTree(trace.width(width), j, int(trace.output[j]), context_len)
    steps = [rt.first_step()] + [rt.step() for _ in range(depth - 1)]
    return PathTree(rt.candidate_tokens(), rt.candidate_scores(), rt.candidate_parents(), rt.candidate_depths(),
                    width, [(s.beam_tokens, s.beam_scores) for s in steps]), rt


# ------------------------------------------------------------------------------------------ the controller tap


@contextmanager
def _models_shared():
    """Deep copies of a controller share its modules (policies, a head a tree holds) and draft trees instead of
    copying them: they are read-only during generation and a tree holds the head and its cache."""
    saved = [(cls, cls.__dict__.get("__deepcopy__")) for cls in (torch.nn.Module, DraftTree)]
    for cls, _ in saved:
        cls.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        for cls, old in saved:
            if old is None:
                del cls.__deepcopy__
            else:
                cls.__deepcopy__ = old


def snapshot(ctl):
    """A deep copy of controller ``ctl`` (its state), sharing its modules."""
    with _models_shared():
        return copy.deepcopy(ctl)


def _out(kind, value):
    """A decision as compared: a plan, a bool, an int (None from ``end_cycle``)."""
    if kind == "continue_drafting":
        return bool(value)
    return int(value) if kind == "choose_size" else value


@dataclass
class TapCycle:
    """What a controller saw and decided in one cycle."""

    cycle: int
    context_len: int
    generated: int
    features: torch.Tensor | None
    state: object = None
    """The controller before ``begin_cycle`` (a deep copy)."""
    calls: list = field(default_factory=list)
    """``(method, output)`` of every decision, in order."""
    steps: list = field(default_factory=list)
    """``(depth, beam_tokens, beam_scores, logp)`` of every DraftStep the controller was shown."""
    tree: tuple | None = None
    """``(tokens, scores, parents, depths, last level's log-probs or None)`` when ``choose_size`` was asked."""
    record: object = None
    cross: list = field(default_factory=list)
    """``(method, own output, output of the reference's state given these inputs)`` (a replay tap only)."""


class Tap(Controller):
    """Passes every call through to ``inner`` and records, per cycle, its state, inputs and decisions.

    With ``reference`` (the tap of the live run), each cycle also feeds a copy of the reference's controller
    state before that cycle the same inputs (``TapCycle.cross``), until the run first leaves the reference's
    cycles: where the two decide differently, only the inputs can differ."""

    def __init__(self, inner: Controller, reference: Tap | None = None) -> None:
        self.inner, self.reference = inner, reference
        self.cycles: list[TapCycle] = []
        self._shadow = None
        self._left = False

    name = property(lambda self: self.inner.name)
    uses_draft = property(lambda self: self.inner.uses_draft)

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.cycles, self._shadow, self._left = [], None, False
        self.inner.reset()

    def _call(self, kind, *args):
        c = self.cycles[-1]
        out = getattr(self.inner, kind)(*args)
        if kind != "end_cycle":
            c.calls.append((kind, _out(kind, out)))
        if self._shadow is not None:
            c.cross.append((kind, _out(kind, out), _out(kind, getattr(self._shadow, kind)(*args))))
        return out

    def context_index(self):
        return self.inner.context_index()

    def begin_cycle(self, ctx):
        k = len(self.cycles)
        feats = None if ctx.features is None else ctx.features.detach().clone()
        state = snapshot(self.inner) if self.reference is None else None  # only the reference's are used
        self.cycles.append(TapCycle(k, ctx.context_len, ctx.generated, feats, state))
        ref = self.reference.cycles if self.reference is not None else []
        self._left = self._left or k >= len(ref) or ref[k].context_len != ctx.context_len
        self._shadow = None if self._left else snapshot(ref[k].state)
        return self._call("begin_cycle", ctx)

    def continue_drafting(self, step):
        logp = getattr(step, "logp", None)
        self.cycles[-1].steps.append((step.depth, step.beam_tokens.clone(), step.beam_scores.clone(),
                                      None if logp is None else logp.clone()))
        return self._call("continue_drafting", step)

    def choose_size(self, tree, plan):
        logp = getattr(tree, "level_logp", None)
        self.cycles[-1].tree = tuple(x.clone() for x in (tree.candidate_tokens(), tree.candidate_scores(),
                                                         tree.candidate_parents(), tree.candidate_depths())) + (
            None if logp is None else logp.clone(),)
        return self._call("choose_size", tree, plan)

    def choose_chain(self, tree, plan, size):
        return self._call("choose_chain", tree, plan, size)

    def end_cycle(self, record):
        c = self.cycles[-1]
        c.record = dataclasses.replace(record)
        self._call("end_cycle", record)
        ref = self.reference.cycles if self.reference is not None else []
        if not self._left and (record_tuple(record) != record_tuple(ref[k := c.cycle].record)
                               or c.calls != ref[k].calls):
            self._left = True  # the reference's later states belong to another path


def record_tuple(rec, fields=RECORD_FIELDS) -> tuple:
    return tuple(getattr(rec, f) for f in fields)


# ------------------------------------------------------------------------------------- live vs replay


@dataclass
class ReplayCheck:
    """One prompt run live and replayed: both results, and where the replay left the live run (None: never)."""

    live: object
    sim: object
    left_at: int | None

    @property
    def compared(self) -> int:
        """Cycles compared exactly (all of them when the replay never left the live run)."""
        return len(self.live.cycles) if self.left_at is None else self.left_at


def _live_tree(c: TapCycle, width: int):
    tokens, scores, parents, depths, last_logp = c.tree
    d = int(depths.max())
    steps = sorted(c.steps, key=lambda s: s[0])
    assert [s[0] for s in steps[:d - 1]] == list(range(1, d)), "the live tap missed a draft step"
    tree = PathTree(tokens, scores, parents, depths, width, [(s[1], s[2]) for s in steps[:d - 1]])
    logp = [s[3] for s in steps[:d - 1]] + [last_logp]
    return tree, logp, d


def _accepted(sel, output, j) -> int:
    """The longest selected path that the greedy continuation after root ``j`` starts with."""
    return max([len(p) for p in sel if list(p) == output[j + 1:j + 1 + len(p)]], default=0)


def explain_divergence(live_tap: Tap, sim_tap: Tap, live, sim, trace, draft_id, k: int, tie=TIE,
                       feature_tol=FEATURE_TOL) -> None:
    """Assert that the replay's first difference from the live run, at cycle ``k``, is a near-tie (module
    docstring): the same place, inputs within ``tie`` / ``feature_tol``, the live controller state deciding
    as the replay given the replay's inputs, and accepted lengths that follow from the selected sets."""
    lc, sc = live_tap.cycles[k], sim_tap.cycles[k]
    where = f"trace {trace.key!r}, cycle {k}"
    assert (lc.cycle, lc.context_len, lc.generated) == (sc.cycle, sc.context_len, sc.generated), where
    if sc.features is not None:  # (a trace recorded without features replays none)
        assert lc.features is not None, f"{where}: features in the replay only"
        rtol = 0.0 if trace.features.dtype == np.float32 else 2.0 ** -10  # float16 traces: their rounding
        rep = sc.features.to(lc.features.dtype)
        assert torch.allclose(lc.features, rep, rtol=rtol, atol=feature_tol), (
            f"{where}: features differ by {float((lc.features - rep).abs().max()):.3g}")
    for i in range(k + 1):  # the live state before each cycle, given the replay's inputs, decides as the replay
        c = sim_tap.cycles[i]
        assert c.cross and len(c.cross) == len(c.calls) + 1, f"trace {trace.key!r}, cycle {i}: no cross-check"
        for kind, own, ref in c.cross:
            assert own == ref, (f"trace {trace.key!r}, cycle {i}: the live controller state, given the replay's "
                                f"inputs, returns {ref!r} from {kind}, the replay {own!r}: not a near-tie")
    lr, sr = live.cycles[k], sim.cycles[k]
    j = lc.context_len - trace.prompt_len
    output = trace.output.tolist()
    if lc.tree is not None:  # the live tree against the recorded one grown to the same depth
        w = lr.width
        assert w in trace.widths, f"{where}: W={w} was not recorded; the divergence cannot be checked"
        live_tree, live_logp, d = _live_tree(lc, w)
        rep_tree, _ = replay_tree(trace, w, d, lc.context_len)
        sel_live, sel_rep = live_tree.top(lr.size), rep_tree.top(lr.size)
        compare_trees(live_tree, rep_tree, live_logp, draft_id, sel_live, sel_rep, tie)
        assert _accepted(sel_live, output, j) == lr.accepted, f"{where}: the live accepted length"
    if lc.calls == sc.calls:  # the same decisions: the same tree shape, and the accepted lengths follow
        assert record_tuple(lr, RECORD_FIELDS[:6]) == record_tuple(sr, RECORD_FIELDS[:6]), (
            f"{where}: the same decisions {lc.calls} but other cycles: live {lr}, replay {sr}")
        if lc.tree is not None:
            assert _accepted(sel_rep, output, j) == sr.accepted, f"{where}: the replay's accepted length"
    # else: another decision on inputs within tolerance from the same controller state: a near-tie


def replay_against_live(engine, live_ctl: Controller, sim_ctl: Controller, prompt, trace, max_new_tokens: int,
                        draft_id: dict[int, int] | None = None, tie=TIE) -> ReplayCheck:
    """Generate ``prompt`` live with ``live_ctl`` and replay ``trace`` with ``sim_ctl`` (a controller built
    the same way); assert the replay equals the live run up to near-ties (module docstring)."""
    live_tap = Tap(live_ctl)
    live = engine.generate(prompt, live_tap, max_new_tokens=max_new_tokens)
    sim_tap = Tap(sim_ctl, reference=live_tap)
    sim = simulate(sim_tap, trace, max_new_tokens=max_new_tokens, measure_policy=False).runs[0]
    assert sim.token_ids == live.token_ids, f"trace {trace.key!r}: other tokens"  # the greedy output: exact
    assert sim.stop_reason == live.stop_reason, f"trace {trace.key!r}"
    n = min(len(live.cycles), len(sim.cycles))
    k = next((i for i in range(n) if record_tuple(live.cycles[i]) != record_tuple(sim.cycles[i])
              or live_tap.cycles[i].calls != sim_tap.cycles[i].calls), None)
    if k is None:
        assert len(live.cycles) == len(sim.cycles), f"trace {trace.key!r}: the same cycles, then more on one side"
        for i, c in enumerate(sim_tap.cycles):
            assert all(own == ref for _, own, ref in c.cross), f"trace {trace.key!r}, cycle {i}: {c.cross}"
        return ReplayCheck(live, sim, None)
    if draft_id is None:
        draft_id = draft_ids(engine.head)
    explain_divergence(live_tap, sim_tap, live, sim, trace, draft_id, k, tie)
    return ReplayCheck(live, sim, k)


def lossless_replays(engine, make, prompts, traces, max_new_tokens: int) -> list[ReplayCheck]:
    """Every prompt generated live with ``make()`` and replayed from its trace with another ``make()``
    (:func:`replay_against_live`): the live output equals AR's (fp32 greedy: lossless), and the replays are
    mostly exact (:func:`assert_mostly_exact`). Returns the checks."""
    checks = []
    for prompt, trace in zip(prompts, traces):
        ar = engine.generate(prompt, None, max_new_tokens=max_new_tokens)
        check = replay_against_live(engine, make(), make(), prompt, trace, max_new_tokens)
        assert check.live.token_ids == ar.token_ids, f"trace {trace.key!r}: the output is not AR's"
        checks.append(check)
    assert_mostly_exact(checks)
    return checks


def assert_mostly_exact(checks: list[ReplayCheck], at_least: float = 0.5) -> None:
    """The replays left their live runs (on near-ties) late or seldom enough that the comparison still covers
    ``at_least`` of all live cycles: a test that only ever compared a cycle or two would mean little."""
    total = sum(len(c.live.cycles) for c in checks)
    done = sum(c.compared for c in checks)
    assert done >= at_least * total, (f"only {done} of {total} cycles compared exactly (near-ties at cycles "
                                      f"{[c.left_at for c in checks]})")
