"""The engine loop on tiny random models: losslessness (greedy and sampling), trees, stop rules, bad input."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from conftest import PROMPTS, open_tree, tiny_head, tiny_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from adaptree.core.engine import Engine
from adaptree.core.verify import SamplingConfig, warp_probs
from adaptree.methods import (
    Controller,
    StaticConfig,
    StaticController,
    TreePlan,
    make_controller,
)


def reference_greedy(target, prompt, n):
    """Greedy decoding by full re-forwards, no cache: independent of the engine."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class RandomSchedule(Controller):
    """Random (W, D, V) every cycle and random early stops: exercises every tree shape."""

    name = "random"

    def __init__(self, seed: int, max_w: int = 6, max_d: int = 6, max_v: int = 40) -> None:
        self.rng = random.Random(seed)
        self.max_w, self.max_d, self.max_v = max_w, max_d, max_v

    def begin_cycle(self, ctx):
        return TreePlan(self.rng.randint(1, self.max_w), self.rng.randint(0, self.max_d), self.rng.randint(0, self.max_v))

    def continue_drafting(self, step):
        return self.rng.random() < 0.8

    def choose_size(self, tree, plan):
        return min(plan.size, tree.num_candidates)


def test_ar_matches_uncached_reference(tiny_pair):
    target, head = tiny_pair
    eng = Engine(target, head)
    for prompt in PROMPTS:
        res = eng.generate(prompt, make_controller("ar"), max_new_tokens=12)
        assert res.token_ids == reference_greedy(target, prompt, 12)
        assert res.tau == 1.0 and len(res.cycles) == 11 and res.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("was_on", [True, False])
def test_the_cycle_collector_is_off_while_generating_and_left_as_it_was(tiny_pair, monkeypatch, was_on):
    import gc

    target, head = tiny_pair
    eng = Engine(target, head)
    seen = []
    forward = target.forward

    def record(*a, **k):
        seen.append(gc.isenabled())
        return forward(*a, **k)

    monkeypatch.setattr(target, "forward", record)
    (gc.enable if was_on else gc.disable)()
    try:
        eng.generate(PROMPTS[0], make_controller("ar"), max_new_tokens=4)
        after = gc.isenabled()
    finally:
        gc.enable()
    assert len(seen) == 4 and not any(seen)  # the prefill and three steps
    assert after == was_on


@pytest.mark.parametrize("cfg", [StaticConfig(), StaticConfig(width=3, depth=5, size=10), StaticConfig(1, 1, 1),
                                 StaticConfig(width=8, depth=12, size=200)])
def test_static_greedy_equals_autoregressive(tiny_pair, cfg, caplog):
    target, head = tiny_pair
    eng = Engine(target, head)
    for prompt in PROMPTS:
        ar = eng.generate(prompt, None, max_new_tokens=30)
        sp = eng.generate(prompt, StaticController(cfg), max_new_tokens=30)
        assert sp.token_ids == ar.token_ids
        assert len(sp.token_ids) == 30
        assert all(c.depth == cfg.depth and c.width == cfg.width for c in sp.cycles)
        assert sum(c.emitted for c in sp.cycles) + 1 == len(sp.token_ids)


def test_speculation_accepts_something(tiny_pair):
    # The tiny models are random, but with 16 tokens and W=8 some drafts must be accepted, or the
    # greedy-equality tests above would never exercise a multi-token path.
    target, head = tiny_pair
    eng = Engine(target, head)
    res = [eng.generate(p, StaticController(StaticConfig(8, 4, 40)), max_new_tokens=40) for p in PROMPTS]
    assert max(c.accepted for r in res for c in r.cycles) >= 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), prompt=st.lists(st.integers(0, 15), min_size=1, max_size=12),
       n=st.integers(1, 25), dtype_seed=st.integers(0, 3))
def test_random_schedules_are_lossless(tiny_pair, seed, prompt, n, dtype_seed):
    target, head = tiny_pair
    eng = Engine(target, head)
    ar = eng.generate(prompt, None, max_new_tokens=n)
    sp = eng.generate(prompt, RandomSchedule(seed), max_new_tokens=n)
    assert sp.token_ids == ar.token_ids


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=st.integers(1, 7), d=st.integers(1, 6), v=st.integers(0, 80), prompt=st.lists(st.integers(0, 15), min_size=1, max_size=8))
def test_tree_invariants(tiny_pair, w, d, v, prompt):
    target, head = tiny_pair
    with torch.no_grad():
        tree, step, _ = open_tree(target, head, prompt, w, head_cache=256)
        cache, root = tree.cache, tree.root
        assert step.child_scores.shape == (1, w) and step.depth == 1
        while tree.depth < d:
            step = tree.step()
            assert step.child_scores.shape == (min(w, w), w)
            assert step.beam_scores.shape == (w,)
            assert torch.all(step.beam_scores[:-1] >= step.beam_scores[1:])
        assert tree.num_candidates == w + (d - 1) * w * w
        committed = tree.committed
        vt = tree.select(v)
        tree.discard()
        assert cache.length == committed == len(prompt)
    n = vt.tokens.numel()
    assert vt.size == min(v, tree.num_candidates)
    parents, depth, mask = vt.parents.tolist(), vt.depth.tolist(), vt.mask
    assert parents[0] == -1 and depth[0] == 0 and int(vt.tokens[0]) == root
    for i in range(1, n):
        assert parents[i] < i and depth[i] == depth[parents[i]] + 1  # topological, depth consistent
        anc, j = {i}, parents[i]
        while j >= 0:
            anc.add(j)
            j = parents[j]
        assert set(mask[i].nonzero().squeeze(1).tolist()) == anc
    assert torch.equal(vt.positions, len(prompt) + vt.depth)
    # Selected = the top-V candidate scores.
    scores = tree.candidate_scores()
    if 0 < vt.size < scores.numel():
        kth = torch.sort(scores, descending=True).values[vt.size - 1]
        sel_scores = scores.sort(descending=True).values[: vt.size]
        assert torch.all(sel_scores >= kth)
    # Retrieve indices: each row a root-to-leaf path, every node on some row.
    ret = vt.retrieve_indices
    seen = set()
    for row in ret.tolist():
        row = [x for x in row if x >= 0]
        assert row[0] == 0
        for a, b in zip(row, row[1:]):
            assert parents[b] == a
        seen.update(row)
    assert seen == set(range(n))
    # Siblings carry distinct tokens (top-W of one distribution).
    for p in set(parents[1:]):
        kids = [int(vt.tokens[i]) for i in range(1, n) if parents[i] == p]
        assert len(kids) == len(set(kids))


def test_tree_scores_equal_sequential_draft_forwards(tiny_pair):
    """Throw-away tree KV with ancestor masks gives the same draft distributions as running each path alone."""
    target, head = tiny_pair
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        tree, _, out = open_tree(target, head, prompt, 4)
        nxt = torch.tensor([prompt[1:] + [tree.root]])
        for _ in range(3):
            tree.step()
        toks, scores, parents, depths = (tree.candidate_tokens(), tree.candidate_scores(),
                                         tree.candidate_parents(), tree.candidate_depths())
        checked = 0
        for c in (depths == 4).nonzero().squeeze(1)[:6].tolist():
            path = [c]
            while parents[path[-1]] >= 0:
                path.append(int(parents[path[-1]]))
            path.reverse()
            cache = head.new_cache(128)
            h, logits = head(out.features, nxt, cache=cache)
            h, lg = h[:, -1:], logits[0, -1]
            total = 0.0
            for node in path:
                lp = torch.log_softmax(lg.float(), -1)
                draft_id = int((head.draft_to_target(torch.arange(head.config.draft_vocab_size)) == toks[node]).nonzero())
                total += float(lp[draft_id])
                h, logits = head(h, toks[node].view(1, 1), cache=cache)
                lg = logits[0, -1]
            assert abs(total - float(scores[c])) < 1e-4
            checked += 1
        assert checked > 0


def exact_pair_distribution(target, prompt, cfg):
    """Exact joint distribution of generated tokens 2 and 3 (token 1 comes from the prefill)."""
    vocab = target.config.vocab_size
    with torch.no_grad():
        p1 = warp_probs(target(torch.tensor([prompt])).logits[0, -1], cfg)
        joint = np.zeros((vocab, vocab))
        for a in range(vocab):
            seqs = torch.tensor([prompt + [a]])
            p2 = warp_probs(target(seqs).logits[0, -1], cfg)
            seq3 = torch.tensor([prompt + [a, b] for b in range(vocab)])
            p3 = warp_probs(target(seq3).logits[:, -1], cfg)
            joint += float(p1[a]) * (p2[:, None] * p3).numpy()
    return joint


def pair_pvalue(engine, controller, prompt, cfg, n, seed):
    exact = exact_pair_distribution(engine.target, prompt, cfg)
    counts = np.zeros_like(exact)
    for i in range(n):
        res = engine.generate(prompt, controller, max_new_tokens=3,
                              sampling=SamplingConfig(cfg.temperature, cfg.top_p, cfg.top_k, seed=seed * 100_000 + i))
        counts[res.token_ids[1], res.token_ids[2]] += 1
    exp = exact.ravel() * n
    keep = exp >= 5
    obs, exp = counts.ravel()[keep], exp[keep]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


SAMPLING_CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9, top_k=6)]
"""The distribution tests' sampling settings: plain T=1, and temperature with top-p and top-k."""


def flat_engine() -> Engine:
    """An engine on a tiny target whose next-token distributions spread over its 8 tokens (many cells of the
    pair distribution carry mass), with a 6-token draft head: the distribution tests' models."""
    target = tiny_target(vocab=8, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.05)
    return Engine(target, tiny_head(target, draft_vocab=6, seed=4))


@pytest.mark.parametrize("cfg", SAMPLING_CONFIGS)
def test_speculative_sampling_matches_target_distribution(cfg):
    eng = flat_engine()
    assert pair_pvalue(eng, StaticController(StaticConfig(3, 3, 8)), [1, 2, 3], cfg, n=2500, seed=1) > 1e-3


def test_eos_stops_and_is_kept(tiny_pair):
    target, head = tiny_pair
    ar = Engine(target, head).generate([1, 2, 3], None, max_new_tokens=30).token_ids
    eos = ar[5]
    first = ar.index(eos)
    eng = Engine(target, head, eos_token_ids=[eos])
    for ctl in (None, StaticController()):
        res = eng.generate([1, 2, 3], ctl, max_new_tokens=30)
        assert res.token_ids == ar[: first + 1] and res.stop_reason == "eos"


def test_context_limit_stops_generation(tiny_pair):
    target, head = tiny_pair
    eng = Engine(target, head, max_seq_len=20)
    ar = eng.generate([1, 2, 3], None, max_new_tokens=100)
    sp = eng.generate([1, 2, 3], StaticController(), max_new_tokens=100)
    assert ar.stop_reason == sp.stop_reason == "context_limit"
    assert len(ar.token_ids) == 20 - 3 + 1 - 1 + 1 or len(ar.token_ids) <= 17
    assert sp.token_ids == ar.token_ids[: len(sp.token_ids)]


def test_bad_input_is_named(tiny_pair, caplog):
    target, head = tiny_pair
    eng = Engine(target, head, max_seq_len=16)
    with pytest.raises(ValueError, match="16"):
        eng.generate(list(range(16)), None)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([], None)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([1], None, max_new_tokens=0)
    with pytest.raises(ValueError, match="draft head"):
        Engine(target).generate([1], StaticController())
    with pytest.raises(ValueError, match="width"):
        StaticConfig(width=0)
    with pytest.raises(ValueError, match="depth"):
        StaticConfig(depth=-1)
    with pytest.raises(ValueError, match="size"):
        StaticConfig(size=0)
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        make_controller("fast")
    with caplog.at_level(logging.WARNING):
        eng = Engine(target, head)
        eng.generate([1, 2], StaticController(StaticConfig(2, 2, 500)), max_new_tokens=8)
        eng.generate([1, 2], StaticController(StaticConfig(2, 2, 500)), max_new_tokens=8)
    assert sum("clamping V" in r.message for r in caplog.records) == 1


def test_head_that_does_not_fit_is_refused():
    target = tiny_target(vocab=16)
    other = tiny_target(vocab=20)
    with pytest.raises(ValueError, match="vocabulary 20"):
        Engine(target, tiny_head(other))


def test_streaming_callback_sees_every_token(tiny_pair):
    target, head = tiny_pair
    seen = []
    res = Engine(target, head).generate([5, 6], StaticController(), max_new_tokens=17, on_tokens=seen.extend)
    assert seen == res.token_ids


def test_host_reads_per_cycle(tiny_pair):
    """The host reads of tensor values a cycle makes (each a wait for a GPU): one per AR step and per static-tree
    cycle on an accelerator (the packed greedy verification; a CPU run also tells chains from trees); the counter
    sees every kind of read, and leaves the CPU-only ones out of the accelerator count."""
    from adaptree.bench.host_reads import HostReads
    from adaptree.models.llama import cpu_max

    x = torch.arange(6)
    with HostReads() as reads:
        x.tolist(), int(x[0]), float(x[1]), bool(x[2] > 1), x.max().item(), x.numpy(), x.cpu(), cpu_max(x)
    assert reads.total == 8 and reads.accelerator == 7 and reads.kinds["__int__"] == 2
    sites = dict(reads.top(2))
    assert sites["outside adaptree"] == 7 and reads.per_cycle(7, accelerator=True) == 1.0
    assert [n for site, n in sites.items() if site.startswith("models/llama.py") and "(cpu_max)" in site] == [1]
    target, head = tiny_pair
    eng = Engine(target, head)
    for ctl in (make_controller("ar"), StaticController(StaticConfig(width=3, depth=4, size=8))):
        with HostReads() as reads:
            res = eng.generate(PROMPTS[0], ctl, max_new_tokens=20)
        assert reads.accelerator <= len(res.cycles) + 1, (ctl.name, reads.top(5))  # + the prefill's first token
    with pytest.raises(ValueError, match="cycles must be >= 1"):
        reads.per_cycle(0)


class FeatureLog(RandomSchedule):
    """RandomSchedule that keeps every cycle's CycleContext.features."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.seen = []

    def begin_cycle(self, ctx):
        self.seen.append(ctx.features.clone())
        return super().begin_cycle(ctx)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_backends_greedy_step_feeds_the_head_what_the_forward_does(tiny_pair, seed):
    """A target with its own greedy step (llama.cpp's returns numpy features and an id, kept so until the head drafts)
    runs every schedule of AR steps and trees exactly as the plain forward path: the same tokens, cycles and
    controller features."""
    import types

    target, head = tiny_pair
    calls = []

    def greedy_step(self, token, cache, features):
        calls.append(token)
        out = self(torch.tensor([[token]]), cache=cache, features=features)
        return int(out.logits[0, -1].argmax()), (out.features[0, -1:].numpy().copy() if features else None)

    stepped = tiny_target()
    stepped.load_state_dict(target.state_dict())
    stepped.greedy_step = types.MethodType(greedy_step, stepped)
    runs = []
    for t in (target, stepped):
        ctl = FeatureLog(seed)
        res = Engine(t, head).generate(PROMPTS[3], ctl, max_new_tokens=40)
        runs.append((res, ctl.seen))
    (plain, f_plain), (fast, f_fast) = runs
    assert fast.token_ids == plain.token_ids
    assert [(c.depth, c.size, c.accepted) for c in fast.cycles] == [(c.depth, c.size, c.accepted) for c in plain.cycles]
    assert sum(c.depth == 0 for c in plain.cycles) >= 3 and sum(c.depth > 0 for c in plain.cycles) >= 3
    assert len(calls) == sum(c.depth == 0 for c in fast.cycles)  # every AR step took the backend's step
    assert all(torch.equal(a, b) for a, b in zip(f_plain, f_fast)) and len(f_plain) == len(f_fast)
