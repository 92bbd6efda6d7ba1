"""Verification rules: greedy acceptance, warping, and the losslessness of tree rejection sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from adaptree.core.tree import VerifyTree, ancestor_mask
from adaptree.core.verify import (
    SamplingConfig,
    verify_greedy,
    verify_sample,
    warp_probs,
)


def make_tree(parents: list[int], tokens: list[int], context_len: int = 5) -> VerifyTree:
    par = torch.tensor(parents)
    depth = torch.zeros(len(parents), dtype=torch.long)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return VerifyTree(torch.tensor(tokens), par, depth, context_len + depth, ancestor_mask(par, depth))


# root(0) -> a(1) b(2); a -> c(3) d(4); c -> e(5); b -> f(6)
PARENTS = [-1, 0, 0, 1, 1, 3, 2]
TOKENS = [7, 1, 2, 3, 4, 5, 1]


def logits_with_argmax(argmax: list[int], vocab: int = 8) -> torch.Tensor:
    lg = torch.randn(len(argmax), vocab) * 0.1
    lg[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return lg


def test_greedy_accepts_longest_consistent_path():
    tree = make_tree(PARENTS, TOKENS)
    # root predicts 1 (a), a predicts 3 (c), c predicts 5 (e), e predicts 6 -> path root,a,c,e bonus 6
    acc = verify_greedy(tree, logits_with_argmax([1, 3, 0, 5, 0, 6, 0]))
    assert acc.path.tolist() == [0, 1, 3, 5] and acc.bonus == 6 and acc.accepted == 3


def test_greedy_rejects_everything():
    tree = make_tree(PARENTS, TOKENS)
    acc = verify_greedy(tree, logits_with_argmax([6, 3, 0, 5, 0, 6, 0]))
    assert acc.path.tolist() == [0] and acc.bonus == 6


def test_greedy_other_branch():
    tree = make_tree(PARENTS, TOKENS)
    # root predicts 2 (b), b predicts 1 (f), f predicts 4
    acc = verify_greedy(tree, logits_with_argmax([2, 0, 1, 0, 0, 0, 4]))
    assert acc.path.tolist() == [0, 2, 6] and acc.bonus == 4


def test_retrieve_indices_are_the_root_to_leaf_paths():
    tree = make_tree(PARENTS, TOKENS)
    ret = tree.retrieve_indices.tolist()
    assert sorted(ret) == sorted([[0, 1, 3, 5], [0, 1, 4, -1], [0, 2, 6, -1]])


def test_sampling_config_rejects_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        SamplingConfig(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(temperature=1.0, top_k=-1)


def test_warp_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = warp_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = warp_probs(logits, SamplingConfig(temperature=1.0, top_p=0.7))  # 0.5 + 0.3 reaches 0.7
    assert torch.allclose(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = warp_probs(logits, SamplingConfig(temperature=1.0, top_p=0.4))  # the top token alone
    assert torch.allclose(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def naive_verify_sample(tree, logits, cfg, gen):
    """A lossy variant (no renormalisation after a rejection): the negative control of the test."""
    probs = warp_probs(logits, cfg)
    cur, path = 0, [0]
    while True:
        kids = [i for i in range(len(tree.parents)) if int(tree.parents[i]) == cur]
        nxt = -1
        for kid in kids:
            if float(torch.rand(1, generator=gen)) < float(probs[cur, tree.tokens[kid]]):
                nxt = kid
                break
        if nxt < 0:
            return type("A", (), {"path": torch.tensor(path), "bonus": int(torch.multinomial(probs[cur], 1, generator=gen))})
        path.append(nxt)
        cur = nxt


def first_two_tokens_pvalue(verifier, n: int = 6000, seed: int = 0) -> float:
    """Chi-square p-value of the (first, second) emitted tokens against the exact target distribution.

    The second token is the next accepted node or, when the walk stopped after one token, a draw from
    the target's distribution at that point (the next cycle's first token); both cases are exact.
    """
    torch.manual_seed(seed)
    vocab = 5
    tree = make_tree(PARENTS, TOKENS := [0, 1, 2, 3, 4, 0, 0])  # noqa: F841 (tokens kept distinct per parent)
    logits = torch.randn(len(PARENTS), vocab) * 1.2
    # Next-cycle distribution after a bonus token x: a fixed random row per x.
    after = torch.softmax(torch.randn(vocab, vocab), dim=-1)
    cfg = SamplingConfig(temperature=1.0)
    probs = warp_probs(logits, cfg)
    # Exact joint of the first two tokens: tokens follow the target; when token 1 is node c's token,
    # token 2 ~ probs[c]; otherwise ~ after[token 1].
    child_of_root = {int(TOKENS[i]): i for i in range(len(PARENTS)) if PARENTS[i] == 0}
    exact = np.zeros((vocab, vocab))
    for x in range(vocab):
        second = probs[child_of_root[x]] if x in child_of_root else after[x]
        exact[x] = float(probs[0, x]) * second.numpy()
    gen = torch.Generator().manual_seed(seed + 1)
    counts = np.zeros((vocab, vocab))
    for _ in range(n):
        acc = verifier(tree, logits, cfg, gen)
        out = [int(tree.tokens[i]) for i in acc.path[1:].tolist()] + [acc.bonus]
        if len(out) == 1:
            out.append(int(torch.multinomial(after[out[0]], 1, generator=gen)))
        counts[out[0], out[1]] += 1
    exp = exact.ravel() * n
    keep = exp >= 5
    obs, exp = counts.ravel()[keep], exp[keep]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_tree_sampling_is_lossless():
    assert first_two_tokens_pvalue(verify_sample) > 1e-3


def test_distribution_test_detects_a_lossy_verifier():
    # The same test must reject the naive rule, or it proves nothing.
    assert first_two_tokens_pvalue(naive_verify_sample) < 1e-6


def test_sampling_is_reproducible_with_a_seed():
    tree = make_tree(PARENTS, [0, 1, 2, 3, 4, 0, 0])
    logits = torch.randn(len(PARENTS), 5)
    cfg = SamplingConfig(temperature=0.8, top_p=0.9, seed=3)
    a = [verify_sample(tree, logits, cfg, cfg.generator()).bonus for _ in range(20)]
    b = [verify_sample(tree, logits, cfg, cfg.generator()).bonus for _ in range(20)]
    assert a == b
