"""Fixed-shape target steps (adaptree.core.graphs): the padded step equals the plain forward, and the engine gives
the same ids with it (on the CPU the steps run uncaptured; tests/test_cuda.py captures them)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, tiny_head, tiny_target

from adaptree.core.engine import Engine
from adaptree.core.graphs import BUCKETS, StepGraphs, bucket_of
from adaptree.methods import StaticConfig, StaticController, make_controller
from adaptree.offline.latency import random_tree


def test_bucket_of_is_the_smallest_that_holds():
    assert [bucket_of(n) for n in (1, 2, 3, 5, 16, 17, 256)] == [1, 2, 4, 8, 16, 32, 256]
    assert bucket_of(257) is None and bucket_of(3, (1, 2)) is None


@torch.inference_mode()
@pytest.mark.parametrize("n", [1, 3, 5, 16, 30])
def test_padded_step_equals_the_plain_forward(n):
    """Logits within 1e-4 (the tiny model's logits reach about 50: float32 rounding of a different summation order),
    features and the cache's committed and new slots within 1e-5 of the plain forward (fp32), for trees that fill a
    bucket and trees that leave padding rows."""
    target = tiny_target()
    gen = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, 16, (1, 20), generator=gen)
    depth, mask = random_tree(n, gen, "cpu")
    ids = torch.randint(0, 16, (1, n), generator=gen)
    caches = []
    outs = []
    for fixed in (False, True):
        cache = target.new_cache(128)
        target(prompt, cache=cache)
        if fixed:
            out = StepGraphs(target, cache).forward(ids, depth + 20, mask if n > 1 else None)
        else:
            out = target(ids, position_ids=depth + 20, cache=cache, tree_mask=mask if n > 1 else None, features=True)
        caches.append(cache)
        outs.append(out)
    assert caches[0].length == caches[1].length == 20 + n
    assert outs[1].logits.shape == outs[0].logits.shape and outs[1].features.shape == outs[0].features.shape
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(outs[1].features, outs[0].features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1].k[:, :, :, :20 + n], caches[0].k[:, :, :, :20 + n], rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_no_bucket_or_no_room_falls_back():
    """Forwards larger than the largest bucket, or whose bucket would run past the cache, are left to the plain
    forward (None), with the cache untouched."""
    target = tiny_target()
    cache = target.new_cache(24)
    target(torch.zeros(1, 20, dtype=torch.long), cache=cache)
    steps = StepGraphs(target, cache, max_tokens=4)
    assert steps.buckets == (1, 2, 4)
    assert steps.forward(torch.zeros(1, 5, dtype=torch.long), torch.arange(20, 25), None) is None
    assert steps.forward(torch.zeros(1, 3, dtype=torch.long), torch.arange(20, 23), None) is not None  # 4 fits
    assert cache.length == 23
    assert steps.forward(torch.zeros(1, 1, dtype=torch.long), torch.arange(23, 24), None) is not None
    cache.length = 22
    assert steps.forward(torch.zeros(1, 3, dtype=torch.long), torch.arange(22, 25), None) is None  # 4 > 2 left
    assert cache.length == 22
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        StepGraphs(target, cache, max_tokens=0)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        StepGraphs(target, cache, capture=True)
    assert BUCKETS[-1] == 256


def test_engine_with_fixed_steps_gives_the_plain_engines_ids():
    """fp32 greedy: AR, a static tree and an adaptive method give the same ids through padded fixed-shape steps as
    through plain forwards."""
    target = tiny_target()
    head = tiny_head(target)
    plain, fixed = Engine(target, head), Engine(target, head, graphs=True)
    assert plain.steps is None and plain.draft_steps is None
    assert not fixed.steps.capture and not fixed.draft_steps.capture
    for prompt in PROMPTS:
        for make in (lambda: make_controller("ar"), lambda: StaticController(StaticConfig(width=3, depth=5, size=10)),
                     lambda: StaticController(StaticConfig(width=8, depth=8, size=60)),
                     lambda: make_controller("deagle"), lambda: make_controller("ngram")):
            a = plain.generate(prompt, make(), max_new_tokens=20).token_ids
            assert fixed.generate(prompt, make(), max_new_tokens=20).token_ids == a


@torch.inference_mode()
def test_padded_head_steps_equal_the_plain_ones():
    """The draft head through fixed-shape steps: a first step over pending positions (causal) and a tree level
    (its mask over the earlier level's slots too) give the plain forward's hidden states and logits."""
    target = tiny_target()
    head = tiny_head(target)
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 7, 3 * target.config.hidden_size, generator=gen)
    ids = torch.randint(0, 16, (1, 7), generator=gen)
    beam = torch.randn(1, 3, head.config.hidden_size, generator=gen)
    beam_ids = torch.randint(0, 16, (1, 3), generator=gen)
    tree = torch.tensor([[1, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    outs = []
    for fixed in (False, True):
        cache = head.new_cache(64)
        steps = StepGraphs(head, cache) if fixed else None
        head(feats[:, :4], ids[:, :4], cache=cache)  # committed context
        pos = torch.arange(4, 7)
        first = steps.forward(ids[:, 4:], pos, None, feats[:, 4:]) if fixed else head(feats[:, 4:], ids[:, 4:],
                                                                                          cache=cache)
        level = torch.full((3,), 7)
        second = (steps.forward(beam_ids, level, tree, beam) if fixed else
                  head(beam, beam_ids, position_ids=level, cache=cache, tree_mask=tree))
        outs.append((first, second, cache.length))
    assert outs[0][2] == outs[1][2] == 10
    for a, b in zip(outs[0][:2], outs[1][:2]):
        torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b[1], a[1], rtol=1e-5, atol=1e-4)
