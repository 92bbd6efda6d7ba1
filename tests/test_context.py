"""Context matches (n-gram / prompt-lookup drafts): the index, chains in verification trees, the ``ngram`` method
and hybrid trees (the head's tree plus a context chain) on tiny models: lossless, and replayed exactly."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import PROMPTS, tiny_head, tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import SAMPLING_CONFIGS, flat_engine, pair_pvalue
from test_traces import assert_replays_live, traces  # noqa: F401 (the traces fixture)

from adaptree.core.context import SELECT, ContextIndex
from adaptree.core.controller import Controller, TreePlan
from adaptree.core.engine import Engine
from adaptree.core.tree import VerifyTree, add_chain, ancestor_mask, is_chain, root_only_tree
from adaptree.core.verify import SamplingConfig
from adaptree.methods import make_controller
from adaptree.methods.ngram import NgramConfig


def brute_match(toks, max_tokens, min_ngram, max_ngram, max_match, select="longest", scan=64):
    """The longest suffix (min_ngram..max_ngram tokens) with an earlier occurrence, by scanning; of its occurrences
    the most recent (``recent``) or, of the ``scan`` most recent, the one that matches furthest back, the most
    recent among equals (``longest``)."""
    last = len(toks) - 1
    for n in range(min(max_ngram, last), min_ngram - 1, -1):
        suffix = toks[last - n + 1:]
        ends = [e for e in range(n - 1, last) if toks[e - n + 1:e + 1] == suffix]
        if not ends:
            continue

        def back(p):
            length = n
            if n == max_ngram:
                while length < max_match and p - length >= 0 and toks[p - length] == toks[last - length]:
                    length += 1
            return length

        tried = ends[-1:] if select == "recent" else ends[-scan:]
        length, p = max((back(e), e) for e in tried)  # equal lengths: the later end wins
        period = last - p  # the continuation goes on repeating past the context's end
        return length, len(ends), p + 1, tuple(toks[p + 1 + i] if p + 1 + i <= last else toks[p + 1 + i - period *
                                                 ((p + 1 + i - last - 1) // period + 1)] for i in range(max_tokens))
    return None


@settings(max_examples=300, deadline=None)
@given(toks=st.lists(st.integers(0, 3), min_size=1, max_size=60), cut=st.integers(0, 60),
       max_ngram=st.integers(1, 5), min_ngram=st.integers(1, 5), max_tokens=st.integers(1, 8),
       select=st.sampled_from(SELECT), scan=st.integers(1, 4))
def test_index_finds_the_longest_match_and_the_occurrence_its_rule_picks(toks, cut, max_ngram, min_ngram, max_tokens,
                                                                          select, scan):
    min_ngram = min(min_ngram, max_ngram)
    idx = ContextIndex(max_ngram=max_ngram, max_match=max_ngram + 6, select=select, scan=scan)
    cut = min(cut, len(toks))
    idx.sync(toks[:cut], [])
    for k in range(cut, len(toks) + 1):  # the generated tokens grow one at a time (or several)
        idx.sync(toks[:cut], toks[cut:k])
    assert idx.tokens == toks
    m = idx.match(max_tokens, min_ngram)
    want = brute_match(toks, max_tokens, min_ngram, max_ngram, max_ngram + 6, select, scan)
    assert (None if m is None else (m.length, m.count, m.position, m.tokens)) == want


def test_longest_rule_picks_the_occurrence_with_the_longer_past():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16
    toks = [5, 1, 2, 3, 7, 8, 9, 1, 2, 3, 4, 6, 0, 5, 1, 2, 3]  # "1 2 3" after 5 (pos 1-3) and after 9 (pos 7-9)
    longest, recent = ContextIndex(max_ngram=3), ContextIndex(max_ngram=3, select="recent")
    longest.extend(toks)
    recent.extend(toks)
    a, b = longest.match(3), recent.match(3)
    assert (a.length, a.position, a.tokens) == (4, 4, (7, 8, 9))  # "5 1 2 3" occurred before: continues "7 8 9"
    assert (b.length, b.position, b.tokens) == (3, 10, (4, 6, 0))  # the most recent "1 2 3" continued "4 6 0"
    assert a.count == b.count == 2
    one = ContextIndex(max_ngram=3, scan=1)  # scan 1: only the most recent occurrence is compared
    one.extend(toks)
    assert one.match(3) == b
    short = [1, 2, 3, 7, 4, 1, 2, 3, 8, 6, 1, 2, 3]  # "1 2 3" twice before, "6 1 2 3" never: a 3-token match
    got = []
    for rule in SELECT:
        idx = ContextIndex(max_ngram=4, select=rule)
        idx.extend(short)
        got.append(idx.match(2))
    assert got[0] == got[1] and (got[0].length, got[0].tokens) == (3, (8, 6))  # shorter than max_ngram: the same
    with pytest.raises(ValueError, match="select must be one of longest, recent, got 'first'"):
        ContextIndex(select="first")
    with pytest.raises(ValueError, match="scan must be a positive integer, got 0"):
        ContextIndex(scan=0)
    with pytest.raises(ValueError, match="select must be one of longest, recent, got 'oldest'"):
        NgramConfig(select="oldest")


def test_index_on_text_that_repeats_and_bad_input():
    idx = ContextIndex(max_ngram=3, max_match=10)
    idx.extend([7, 1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    m = idx.match(4)
    assert (m.length, m.count, m.position, m.tokens) == (3, 1, 4, (4, 5, 9, 9))
    loop = ContextIndex(max_ngram=2)
    loop.extend([8, 1, 2, 3, 1, 2, 3, 1, 2])  # a loop of period 3: its continuation repeats past the end
    assert loop.match(7).tokens == (3, 1, 2, 3, 1, 2, 3)
    idx.extend([4])  # the match extends past max_ngram, backwards
    assert idx.match(2).length == 4 and idx.match(2).tokens == (5, 9)
    assert ContextIndex().match(3) is None  # empty
    with pytest.raises(ValueError, match="max_ngram"):
        ContextIndex(max_ngram=0)
    with pytest.raises(ValueError, match="max_match"):
        ContextIndex(max_ngram=4, max_match=2)
    with pytest.raises(ValueError, match="max_tokens"):
        idx.match(0)
    with pytest.raises(ValueError, match="prompt changed"):
        idx2 = ContextIndex()
        idx2.sync([1, 2], [3])
        idx2.sync([1, 2, 5], [3])
    with pytest.raises(ValueError, match="min_n"):
        NgramConfig(min_n=5, max_n=4)
    with pytest.raises(ValueError, match="tokens must be a positive integer, got 0"):
        make_controller("ngram", tokens=0)


def _tree(tokens, parents, context_len=10):
    parents = torch.tensor(parents)
    depth = torch.zeros(len(tokens), dtype=torch.long)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    return VerifyTree(torch.tensor(tokens), parents, depth, context_len + depth, ancestor_mask(parents, depth))


@pytest.mark.parametrize("chain,shared,added", [((), 0, 0), ((4, 6), 2, 0), ((4, 6, 8, 9), 2, 2), ((5,), 1, 0),
                                                 ((3, 3), 0, 2), ((4, 7, 1), 2, 1)])
def test_add_chain_shares_the_common_prefix(chain, shared, added):
    # root 0; children 4 (node 1) and 5 (node 2); node 1's children 6 (node 3) and 7 (node 4)
    tree = _tree([0, 4, 5, 6, 7], [-1, 0, 0, 1, 1])
    out, n = add_chain(tree, chain)
    assert n == added == len(chain) - shared and out.tokens.numel() == 5 + added
    assert out.mask.equal(ancestor_mask(out.parents, out.depth))
    assert out.positions.equal(10 + out.depth)
    # the chain is a root-to-node path of the result
    cur = 0
    for t in chain:
        kids = [i for i in range(out.tokens.numel()) if int(out.parents[i]) == cur and int(out.tokens[i]) == t]
        assert len(kids) == 1
        cur = kids[0]
    assert not chain or int(out.depth[cur]) == len(chain)
    assert out.tokens[:5].equal(tree.tokens) and out.mask[:5, :5].equal(tree.mask)  # the head's nodes unchanged


def test_is_chain():
    assert is_chain(root_only_tree(3, 7))
    out, _ = add_chain(root_only_tree(3, 7), [1, 2, 3])
    assert is_chain(out) and out.positions.tolist() == [7, 8, 9, 10]
    assert not is_chain(_tree([0, 4, 5], [-1, 0, 0]))


class Hybrid(Controller):
    """The static tree plus the context's longest match as a chain (the hybrid tree, its shape fixed)."""

    name = "hybrid-test"

    def __init__(self, w=3, d=3, v=8, tokens=5, min_ngram=1):
        self.plan = TreePlan(w, d, v)
        self.tokens, self.min_ngram = tokens, min_ngram

    def context_index(self):
        return ContextIndex(max_ngram=4)

    def begin_cycle(self, ctx):
        m = ctx.index.match(self.tokens, self.min_ngram)
        return TreePlan(self.plan.width, self.plan.max_depth, self.plan.size, m.tokens if m else ())


REPEATING = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 5, 5, 5, 5], [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5]]


@pytest.mark.parametrize("make", [lambda: make_controller("ngram"), lambda: make_controller("ngram", min_n=1),
                                  lambda: Hybrid(), lambda: Hybrid(8, 4, 30, tokens=12)])
def test_ngram_and_hybrid_greedy_equal_autoregressive(make):
    target = tiny_target(seed=0)
    head = tiny_head(target)
    eng = Engine(target, head)
    chains = accepted = 0
    for prompt in PROMPTS + REPEATING:
        ar = eng.generate(prompt, None, max_new_tokens=40)
        out = eng.generate(prompt, make(), max_new_tokens=40)
        assert out.token_ids == ar.token_ids
        chains += sum(c.chain for c in out.cycles)
        accepted += sum(c.chain_accepted for c in out.cycles)
        for c in out.cycles:
            assert 0 <= c.chain_accepted <= min(c.accepted, c.chain) and c.chain_nodes <= c.chain
    assert chains > 0 and accepted > 0  # the chains were there and some were accepted


def test_ngram_needs_no_head_and_chains_shorten_generation():
    target = tiny_target(seed=0)
    eng = Engine(target)  # no draft head at all
    res = eng.generate(REPEATING[0], make_controller("ngram"), max_new_tokens=40)
    assert res.token_ids == eng.generate(REPEATING[0], None, max_new_tokens=40).token_ids
    assert len(res.cycles) < 39 and res.tau > 1.0  # the tiny model's output repeats itself: chains pay


def test_chain_is_cut_to_the_context_room():
    target = tiny_target(seed=0)
    head = tiny_head(target)
    prompt = REPEATING[0]
    eng = Engine(target, head, max_seq_len=len(prompt) + 12)
    ar = eng.generate(prompt, None, max_new_tokens=40)
    out = eng.generate(prompt, Hybrid(3, 2, 4, tokens=12), max_new_tokens=40)
    assert out.token_ids == ar.token_ids and out.stop_reason == ar.stop_reason == "context_limit"
    for c in out.cycles:
        assert c.context_len + 1 + c.size + c.chain <= len(prompt) + 12


@pytest.mark.parametrize("cfg", SAMPLING_CONFIGS)
def test_hybrid_sampling_matches_target_distribution(cfg):
    eng = flat_engine()
    prompt = [1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # every token has an earlier occurrence: always a chain
    ctl = Hybrid(3, 2, 4, tokens=3)
    res = eng.generate(prompt, ctl, max_new_tokens=3, sampling=SamplingConfig(1.0, seed=5))
    assert all(c.chain > 0 for c in res.cycles)
    assert pair_pvalue(eng, ctl, prompt, cfg, n=2500, seed=2) > 1e-3


def test_hybrid_and_ngram_replay_equals_live(models, traces):  # noqa: F811 (the fixture)
    assert_replays_live(models, traces, Hybrid)
    assert_replays_live(models, traces, lambda: Hybrid(8, 4, 30, tokens=8))
    assert_replays_live(models, traces, lambda: make_controller("ngram", min_n=1))


def test_index_cost_is_per_new_token():
    """O(new tokens) per cycle: syncing a long context one token at a time does the same work as extending it
    at once (counted in dictionary entries written, not timed)."""
    rng = random.Random(0)
    toks = [rng.randrange(50) for _ in range(3000)]
    a, b = ContextIndex(max_ngram=4), ContextIndex(max_ngram=4)
    a.extend(toks)
    b.sync(toks[:100], [])
    for k in range(100, 3001, 7):
        b.sync(toks[:100], toks[100:k])
    b.sync(toks[:100], toks[100:])
    assert a._ends == b._ends and sum(len(v) for v in a._ends.values()) <= 4 * len(toks)
