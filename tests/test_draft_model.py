"""``draft-model``: a second, smaller model drafting chains: lossless greedy and sampled, its cache kept in step
with the committed context, its time counted as drafting, bad inputs named."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, tiny_target
from test_engine import SAMPLING_CONFIGS, pair_pvalue, reference_greedy

from adaptree.core.engine import Engine
from adaptree.methods import DraftModelConfig, DraftModelController, make_controller
from adaptree.methods.draft_model import check_draft_model


def drafter(target, layers: int = 4, seed: int = 5, copy: bool = False):
    """A smaller model of the target's vocabulary; ``copy``: the target itself (every proposal accepted)."""
    return target if copy else tiny_target(vocab=target.config.vocab_size, seed=seed, layers=layers)


@pytest.mark.parametrize("tokens,min_prob", [(1, 0.0), (4, 0.0), (6, 0.5)])
def test_greedy_output_equals_autoregressive(tokens, min_prob):
    target = tiny_target()
    eng = Engine(target)
    ctl = make_controller("draft-model", draft_model=drafter(target), tokens=tokens, min_prob=min_prob)
    for prompt in PROMPTS:
        res = eng.generate(prompt, ctl, max_new_tokens=20)
        assert res.token_ids == reference_greedy(target, prompt, 20)
        assert all(c.chain <= tokens for c in res.cycles)


def test_the_target_as_its_own_draft_accepts_every_proposal():
    target = tiny_target()
    ctl = DraftModelController(DraftModelConfig(tokens=4), draft_model=drafter(target, copy=True))
    res = Engine(target).generate(PROMPTS[0], ctl, max_new_tokens=21)
    assert res.token_ids == reference_greedy(target, PROMPTS[0], 21)
    full = [c for c in res.cycles if c.chain == 4]
    assert full and all(c.accepted == 4 and c.chain_accepted == 4 for c in full)
    assert len(res.cycles) == 4  # 1 + 4 x (4 accepted + the bonus) = 21 tokens
    # the draft model's cache holds the committed context and its unfed last proposal's predecessors only
    assert ctl.cache.length == len(ctl.fed) == len(PROMPTS[0]) + 16 + 3


def test_the_cache_drops_rejected_proposals_and_reruns_nothing_it_kept():
    target = tiny_target()
    draft = drafter(target)
    ctl = DraftModelController(DraftModelConfig(tokens=3), draft_model=draft)
    calls = []
    real = draft.forward

    def counting(ids, *a, **kw):
        calls.append(ids.shape[1])
        return real(ids, *a, **kw)

    draft.forward = counting
    prompt = PROMPTS[1]
    res = Engine(target).generate(prompt, ctl, max_new_tokens=16)
    context = list(prompt) + res.token_ids
    # the cache holds the context committed when the last cycle began, then that cycle's proposals but the last
    n = ctl.checked
    assert ctl.fed[:n] == context[:n] and n < len(context)
    assert n <= len(ctl.fed) <= n + 3 - 1 and ctl.cache.length == len(ctl.fed)
    assert calls[0] == len(prompt) + 1  # the first cycle runs the prompt and the root
    assert max(calls[1:]) <= 3 + 1  # later cycles: the unseen accepted tokens and the bonus, then one per token


@pytest.mark.parametrize("cfg", SAMPLING_CONFIGS)
def test_sampling_matches_target_distribution(cfg):
    target = tiny_target(vocab=8, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.05)
    ctl = DraftModelController(DraftModelConfig(tokens=3), draft_model=drafter(target, seed=6))
    assert pair_pvalue(Engine(target), ctl, [1, 2, 3], cfg, n=2500, seed=2) > 1e-3


def test_draft_time_is_drafting_not_policy():
    target = tiny_target()
    ctl = make_controller("draft-model", draft_model=drafter(target), tokens=4)
    res = Engine(target).generate(PROMPTS[0], ctl, max_new_tokens=12)
    drafted = [c for c in res.cycles if c.chain]
    assert drafted and all(c.draft_s > 0 for c in drafted)
    assert all(c.policy_s < c.draft_s for c in drafted)


def test_context_limit_is_respected():
    target = tiny_target()
    eng = Engine(target, max_seq_len=len(PROMPTS[0]) + 9)
    ctl = make_controller("draft-model", draft_model=drafter(target), tokens=6)
    res = eng.generate(PROMPTS[0], ctl, max_new_tokens=50)
    assert res.stop_reason == "context_limit"
    assert res.token_ids == reference_greedy(target, PROMPTS[0], len(res.token_ids))


def test_bad_inputs_are_named():
    target = tiny_target()
    with pytest.raises(ValueError, match="needs a draft model"):
        make_controller("draft-model")
    with pytest.raises(ValueError, match="tokens"):
        DraftModelConfig(tokens=0)
    with pytest.raises(ValueError, match="min_prob"):
        DraftModelConfig(min_prob=1.5)
    with pytest.raises(ValueError, match="32 ids, the target's 16"):
        check_draft_model(target, tiny_target(vocab=32))
