"""The tie-aware comparisons of tests/ties.py accept a near-tie and still reject a genuine difference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import PROMPTS
from ties import (
    TIE,
    PathTree,
    ReplayCheck,
    assert_mostly_exact,
    assert_same_argmax,
    compare_trees,
    replay_against_live,
)

from adaptree.core.engine import Engine
from adaptree.methods import StaticConfig, StaticController
from adaptree.offline.traces import TraceSettings, record_trace

# ------------------------------------------------------------------------------ compare_trees by hand

# W=2, depth 2: level 1 holds tokens 5 and 6 (root children), level 2 the two children of each beam node.
TOKENS = torch.tensor([5, 6, 7, 8, 9, 10])
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 1])
DEPTHS = torch.tensor([1, 1, 2, 2, 2, 2])


def tree(scores, tokens=TOKENS, parents=PARENTS):
    scores = torch.tensor(scores)
    beam = torch.tensor([p for p in parents[2::2].tolist()])  # the level-1 beam: the parents of level 2
    return PathTree(tokens, scores, parents, DEPTHS, 2, [(tokens[beam], scores[beam])])


def check(live, rep, v=3):
    return compare_trees(live, rep, [torch.zeros(1, 16)] * 2, {t: t for t in range(16)}, live.top(v), rep.top(v))


def test_compare_trees_accepts_equal_trees_and_rounding():
    a = tree([-1.0, -2.0, -1.5, -2.5, -2.2, -3.0])
    assert check(a, a) == 0.0
    b = tree([-1.0 + 3e-6, -2.0, -1.5, -2.5 - 2e-6, -2.2, -3.0])
    assert check(a, b) == pytest.approx(3e-6, rel=0.05)  # float32 scores


def test_compare_trees_accepts_a_near_tie_swap_and_rejects_a_real_one():
    # the selected top-3 of the live tree is {5, 6, 5.7}; in the replay 5.8 edges past 6 by less than TIE
    live = tree([-1.0, -2.0, -1.5, -2.00002, -2.2, -3.0])
    near = tree([-1.0, -2.00001, -1.5, -2.000005, -2.2, -3.0])
    assert live.top(3) != near.top(3)
    check(live, near)
    far = tree([-1.0, -2.01, -1.5, -2.0, -2.21, -3.01])  # the same swap, with a gap of 0.01 > TIE
    with pytest.raises(AssertionError, match="score differs|selected"):
        check(live, far)
    # the level-1 beam order swapped on a near-tie (tokens 5 and 6 have the same score to 1e-5) is fine ...
    tie_live = tree([-1.0, -1.00001, -1.5, -2.5, -2.2, -3.0])
    tokens = torch.tensor([5, 6, 9, 10, 7, 8])  # ... the replay ranks 6 first: its children come first
    tie_rep = tree([-1.00001, -1.0, -2.2, -3.0, -1.5, -2.5], tokens, torch.tensor([-1, -1, 1, 1, 0, 0]))
    check(tie_live, tie_rep)
    # ... but not where the scores are 0.1 apart
    gap_rep = tree([-1.1, -1.0, -2.3, -3.1, -1.5, -2.5], tokens, torch.tensor([-1, -1, 1, 1, 0, 0]))
    with pytest.raises(AssertionError):
        check(tie_live, gap_rep)


def test_compare_trees_rejects_another_token_or_score():
    a = tree([-1.0, -2.0, -1.5, -2.5, -2.2, -3.0])
    with pytest.raises(AssertionError):
        check(a, tree([-1.0, -2.0, -1.5, -2.5, -2.2, -3.0], torch.tensor([5, 6, 7, 11, 9, 10])))
    with pytest.raises(AssertionError, match="score differs"):
        check(a, tree([-1.0, -2.0, -1.5, -2.5 + 2 * TIE, -2.2, -3.0]))


def test_assert_same_argmax_accepts_a_near_tie_only():
    assert_same_argmax(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([0.0, 3.0005, 1.0]), 1e-3)
    assert_same_argmax(torch.tensor([0.0, 3.0, 2.9995]), torch.tensor([0.0, 2.9995, 3.0]), 1e-3)  # swapped: a tie
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_same_argmax(torch.tensor([0.0, 3.0, 2.9]), torch.tensor([0.0, 2.9, 3.0]), 1e-3)


def test_assert_mostly_exact_needs_most_cycles_compared():
    run = type("Run", (), {"cycles": list(range(10))})
    assert_mostly_exact([ReplayCheck(run, run, None), ReplayCheck(run, run, 3)])
    with pytest.raises(AssertionError, match="only 4 of 20 cycles"):
        assert_mostly_exact([ReplayCheck(run, run, 1), ReplayCheck(run, run, 3)])


# ------------------------------------------------------------------------------ live vs replay


@pytest.fixture(scope="module")
def setup(models):
    target, head = models
    s = TraceSettings(widths=(4,), max_depth=5, max_new_tokens=20, feature_dtype="float32")
    return Engine(target, head), PROMPTS[3], record_trace(target, head, PROMPTS[3], settings=s, key="p3")


def with_scores(trace, fix):
    """A copy of ``trace`` whose W=4 scores went through ``fix(scores)`` (in place on the copy)."""
    wt = trace.width(4)
    scores = wt.scores.copy()
    fix(scores)
    return dataclasses.replace(trace, widths={4: dataclasses.replace(wt, scores=scores, _torch=None)})


class StopAbove(StaticController):
    """Stops after depth 1 where the best depth-1 score is above ``threshold``: a decision on a float."""

    def __init__(self, threshold):
        super().__init__(StaticConfig(4, 5, 12))
        self.threshold = threshold

    def continue_drafting(self, step):
        return step.depth > 1 or float(step.beam_scores[0]) <= self.threshold


def test_replay_equal_to_live_passes(setup):
    eng, prompt, tr = setup
    c = replay_against_live(eng, StaticController(StaticConfig(4, 5, 12)), StaticController(StaticConfig(4, 5, 12)),
                            prompt, tr, 20)
    assert c.left_at is None and c.compared == len(c.live.cycles) > 3
    assert max(r.accepted for r in c.live.cycles) >= 1  # the accepted lengths are compared too


def test_a_near_tie_is_accepted_and_the_same_difference_beyond_tie_is_not(setup):
    """The live run's first best depth-1 score is the stop threshold (the live run goes on); the replayed score,
    moved just above it, stops the replay at depth 1: a near-tie. Moved 0.01 above it, the same divergence is a
    genuine difference."""
    eng, prompt, tr = setup
    seen = []

    class Spy(StaticController):
        def continue_drafting(self, step):
            seen.append(float(step.beam_scores[0]))
            return super().continue_drafting(step)

    eng.generate(prompt, Spy(StaticConfig(4, 5, 12)), max_new_tokens=20)
    live_best = seen[0]
    top = int(tr.width(4).beam[0, 0, 0])

    def moved(by):
        def fix(scores):
            scores[0, top] = live_best + by  # a level-1 score; its children keep theirs (within TIE for `by` small)
        return with_scores(tr, fix)

    c = replay_against_live(eng, StopAbove(live_best), StopAbove(live_best), prompt, moved(2e-6), 20)
    assert c.left_at == 0 and c.live.cycles[0].depth == 5 and c.sim.cycles[0].depth == 1
    assert c.sim.token_ids == c.live.token_ids
    with pytest.raises(AssertionError, match="score differs"):
        replay_against_live(eng, StopAbove(live_best), StopAbove(live_best), prompt, moved(0.01), 20)


def test_another_controller_state_is_rejected(setup):
    """V=12 live, V=11 replayed: the trees agree, but the live controller given the replay's inputs chooses 12."""
    eng, prompt, tr = setup
    with pytest.raises(AssertionError, match="live controller state"):
        replay_against_live(eng, StaticController(StaticConfig(4, 5, 12)), StaticController(StaticConfig(4, 5, 11)),
                            prompt, tr, 20)


def test_an_accepted_length_that_does_not_follow_from_the_tree_is_rejected(setup, monkeypatch):
    from adaptree.offline import simulator

    eng, prompt, tr = setup
    real = simulator._accepted
    monkeypatch.setattr(simulator, "_accepted", lambda *a: max(0, real(*a) - 1))
    with pytest.raises(AssertionError, match="the replay's accepted length"):
        replay_against_live(eng, StaticController(StaticConfig(4, 5, 12)), StaticController(StaticConfig(4, 5, 12)),
                            prompt, tr, 20)


def test_another_tree_or_other_tokens_are_rejected(setup):
    """The trace's level-1 node on the greedy path at a cycle that accepted something gets another token: the
    replay accepts less there, and the trees differ by more than a near-tie. Another output token: other tokens."""
    eng, prompt, tr = setup
    live = eng.generate(prompt, StaticController(StaticConfig(4, 5, 12)), max_new_tokens=20)
    j = next(c.context_len for c in live.cycles if c.accepted >= 1) - len(prompt)
    wt = tr.width(4)
    tokens = wt.tokens.copy()
    level1 = tokens[j, :4].tolist()
    tokens[j, level1.index(int(tr.output[j + 1]))] = next(t for t in range(16) if t not in level1)
    other_tree = dataclasses.replace(tr, widths={4: dataclasses.replace(wt, tokens=tokens, _torch=None)})
    with pytest.raises(AssertionError, match="only the (live tree|replay) has it"):
        replay_against_live(eng, StaticController(StaticConfig(4, 5, 12)), StaticController(StaticConfig(4, 5, 12)),
                            prompt, other_tree, 20)
    out = tr.output.copy()
    out[6] = (out[6] + 1) % 16
    with pytest.raises(AssertionError, match="other tokens"):
        replay_against_live(eng, StaticController(StaticConfig(4, 5, 12)), StaticController(StaticConfig(4, 5, 12)),
                            prompt, dataclasses.replace(tr, output=out), 20)
