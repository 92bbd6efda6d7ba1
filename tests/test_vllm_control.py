"""The draft-length controllers adaptree's vLLM scheduler asks (adaptree.vllm_plugin.control): plain Python, no vLLM."""

import json

import pytest

from adaptree.vllm_plugin.control import (
    Acceptance,
    CostAwareLength,
    FixedLength,
    StepCosts,
    build_controller,
)


# A compute-bound CPU: a step costs 10 ms + 6 ms per verified row; drafting costs 1 ms per draft step per request.
def _costs(batch_sizes=(1, 4, 16), k_max=5, base=0.010, row=0.006, draft=0.001):
    return StepCosts(list(batch_sizes), [[base + row * b * (1 + k) + draft * b * k for k in range(k_max + 1)]
                                         for b in batch_sizes])


def test_step_costs_interpolate_in_the_batch_and_refuse_bad_tables(tmp_path):
    c = _costs()
    assert c.k_max == 5
    assert c.time(4, 2) == pytest.approx(0.010 + 0.006 * 12 + 0.008)
    assert c.time(2, 0) == pytest.approx(c.time(1, 0) + (c.time(4, 0) - c.time(1, 0)) / 3)  # linear in B
    assert c.time(1, 0) < c.time(2, 0) < c.time(4, 0)
    assert c.time(32, 1) > c.time(16, 1)  # extrapolated at the last slope
    c.save(tmp_path / "c.json")
    assert StepCosts.load(tmp_path / "c.json") == c
    with pytest.raises(ValueError, match="K 6"):
        c.time(1, 6)
    with pytest.raises(ValueError, match="increasing"):
        StepCosts([4, 1], [[1.0], [1.0]])
    with pytest.raises(ValueError, match="B=1, K=1 must be a positive number, got -1"):
        StepCosts([1], [[1.0, -1]])
    (tmp_path / "bad.json").write_text(json.dumps({"format": "adaptree-vllm-step-costs/1", "batch_sizes": [1],
                                                   "seconds": [[0.1]], "extra": 1}))
    with pytest.raises(ValueError, match=r"unknown fields \['extra'\]"):
        StepCosts.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="not a vLLM step-cost file"):
        StepCosts.load(tmp_path / "other.json")


def test_acceptance_counts_each_position_once_reached():
    a = Acceptance(3, prior=(0.5, 0.5, 0.5), strength=0.0001)
    a.observe(3, 1)  # position 0 accepted, 1 rejected, 2 never reached
    a.observe(3, 3)
    assert (a.reached, a.accepted) == ([2, 2, 1], [2, 1, 1])
    assert a.rate(0) == pytest.approx(1.0, abs=1e-3) and a.rate(1) == pytest.approx(0.5, abs=1e-3)
    assert a.survival(3) == pytest.approx([1.0, 0.5, 0.5], abs=1e-3)
    with pytest.raises(ValueError, match="accepted 4 of 3"):
        a.observe(3, 4)
    child = Acceptance(3, prior=a)  # a request's estimate starts at the batch's
    assert child.rate(1) == pytest.approx(a.rate(1))


def _warm(ctl, requests, drafted, accepted, times=50):
    for _ in range(times):
        for r in requests:
            ctl.observe(r, drafted, accepted)


def test_costaware_drafts_at_one_stream_and_backs_off_under_load():
    """Rows are cheap next to a step's fixed cost at one request and cost nearly a token each at 16: the same
    acceptance earns drafts at B=1 and none at B=16."""
    ctl = CostAwareLength(_costs(base=0.030, row=0.002))
    _warm(ctl, ["a"], 5, 2)  # per position: 1, 1, then rejected
    ks, k = ctl.decide(["a"])
    assert k >= 2 and ks["a"] >= 2
    load = CostAwareLength(_costs(base=0.002, row=0.006))
    many = [f"r{i}" for i in range(16)]
    _warm(load, many, 5, 1, times=10)
    ks, k = load.decide(many)
    assert k == 0 and set(ks.values()) == {0}


def test_costaware_trims_the_requests_that_do_not_accept():
    ctl = CostAwareLength(_costs(base=0.030, row=0.004))
    _warm(ctl, ["good"], 5, 5)
    _warm(ctl, ["bad"], 5, 0)
    ks, k = ctl.decide(["good", "bad"])
    assert k >= 3 and ks["good"] == k and ks["bad"] < ks["good"]
    ctl.forget(["good"])
    assert set(ctl.requests) == {"good"}


def test_timed_steps_correct_a_table_that_got_the_draft_cost_wrong():
    """The table says a second draft costs 13 ms of a 30 ms step, so with these rates one draft is best; the steps
    as they run say drafts cost 1 ms each. The engine's own K=1 steps are slower than the table: that level is
    corrected everywhere, K=2 then models faster (55.8 against 54.7 tokens/s), it is tried, timed, found cheap
    and kept."""
    from adaptree.vllm_plugin.control import LiveCosts

    table = StepCosts([1], [[0.030, 0.032, 0.045, 0.058]])
    ctl = CostAwareLength(table)
    _warm(ctl, ["a"], 3, 1, times=10)
    _warm(ctl, ["a"], 3, 2, times=10)
    _warm(ctl, ["a"], 3, 3, times=10)  # rates 1, 2/3, 1/2 per position
    assert ctl.decide(["a"])[1] == 1
    real = [0.036, 0.037, 0.038, 0.039]
    chosen = []
    for _ in range(40):
        k = ctl.decide(["a"])[1]
        chosen.append(k)
        ctl.observe_step(1, k, real[k])
    assert chosen[:4] == [1] * 4 and set(chosen[-10:]) == {2}
    live = LiveCosts(table)
    for _ in range(10):
        live.observe(1, 1, 1.0)  # a stalled step counts as at most twice the table's
    assert live.time(1, 1) == pytest.approx(0.064) and live.time(1, 3) == pytest.approx(0.058 * live.ratio)
    live.observe(1, 7, 0.01)  # a K the table does not cover is ignored
    assert (1, 7) not in live.cells


def test_fixed_and_settings():
    assert FixedLength(3).decide(["a", "b"]) == ({"a": 3, "b": 3}, 3)
    assert isinstance(build_controller({"controller": "fixed", "k": 2}, 5), FixedLength)
    with pytest.raises(ValueError, match=r"integer in 0..5 .*got 7"):
        build_controller({"controller": "fixed", "k": 7}, 5)
    with pytest.raises(ValueError, match="needs additional_config"):
        build_controller({"controller": "costaware"}, 5)
    with pytest.raises(ValueError, match="must be one of .*got 'resps'"):
        build_controller({"controller": "resps"}, 5)
    with pytest.raises(ValueError, match=r"unknown settings \['kk'\]"):
        build_controller({"kk": 1}, 5)


def test_step_cost_rows_keep_k0_and_fit_a_line_over_the_drafting_ks():
    from adaptree.vllm_plugin.engine import _line

    # the drafter off at K=0, a fixed cost for any drafting on top of one per draft
    assert _line([10.0, 14.0, 16.0, 18.0]) == pytest.approx([10.0, 14.0, 16.0, 18.0])
    noisy = _line([27.2, 32.7, 30.7, 36.7, 46.4, 50.0])  # medians measured at B=2 on a shared 2-core EPYC
    assert noisy[0] == 27.2 and all(b > a for a, b in zip(noisy, noisy[1:]))
    assert sum(noisy[1:]) == pytest.approx(32.7 + 30.7 + 36.7 + 46.4 + 50.0)  # least squares keeps the mean
    assert _line([5.0, 6.0, 5.5, 5.0]) == pytest.approx([5.0, 5.5, 5.5, 5.5])  # slope clamped at 0
    assert _line([5.0, 4.0, 4.0]) == pytest.approx([5.0, 5.0, 5.0])  # drafting never cheaper than not
    assert _line([5.0, 7.0]) == [5.0, 7.0]


def test_hybrid_verifies_the_contexts_chain_where_it_is_worth_more_than_the_heads_drafts():
    from adaptree.vllm_plugin.control import HybridLength

    ctl = HybridLength(_costs(base=0.030, row=0.002))
    assert ctl.uses_context and not CostAwareLength(_costs()).uses_context
    loop = [7, 8, 9, 10, 11, 12, 7, 8, 9]  # "7 8 9" occurred before: the chain proposes 10 11 12 7 8
    _warm(ctl, ["a"], 5, 1)  # the head: its first draft accepted, the second never
    ks, k = ctl.decide(["a"])
    assert ks["a"] == 1
    # an unproven chain (half its tokens accepted, the prior) is worth less than a head draft accepted every time
    assert ctl.chains({"a": loop}, {"a": 1}, {"a": 5}) == {}
    ctl.chained = {"a": 1}  # as if it had been verified (a 3-token match's bucket), in full, 20 times
    for _ in range(20):
        ctl.observe("a", 5, 5)
    assert ctl.requests["a"].reached[0] == 50 and ctl.chain_rates[1].reached[0] == 20
    ctl.decide(["a"])
    assert ctl.chains({"a": loop}, {"a": 1}, {"a": 5})["a"] == (10, 11, 12, 7, 8) and ctl.chained == {"a": 1}
    assert ctl.chains({"a": loop}, {"a": 1}, {"a": 2})["a"] == (10, 11)  # no further than the request may go
    assert ctl.chain_steps == 2
    assert ctl.chains({"a": [1, 2, 3, 4]}, {"a": 2}, {"a": 5}) == {}  # a new context (fewer tokens), no match
    # where the head's drafts are rejected, an unproven chain is tried; one rejected every time is not
    bad = HybridLength(_costs(base=0.030, row=0.002))
    _warm(bad, ["a"], 5, 0)
    assert bad.decide(["a"])[0]["a"] == 0
    assert bad.chains({"a": loop}, {"a": 0}, {"a": 5})["a"][:1] == (10,)
    for _ in range(30):
        bad.observe("a", 5, 0)
    bad.decide(["a"])
    assert bad.chains({"a": loop}, {"a": 0}, {"a": 5}) == {} and bad.chained == {}
    bad.forget([])
    assert not bad.indexes and not bad.requests
    with pytest.raises(ValueError, match="the hybrid controller needs"):
        build_controller({"controller": "hybrid"}, 5)


def _grid(costs, rates):
    """``costs`` with the grid search's tokens per second ``rates`` (one row per batch size)."""
    return StepCosts(costs.batch_sizes, costs.seconds, {}, [list(map(float, row)) for row in rates])


def test_static_gs_drafts_the_grids_fastest_length_at_each_batch_size(tmp_path):
    from adaptree.vllm_plugin.control import StaticGridLength

    c = _grid(_costs(), [[30, 40, 45, 44, 43, 41], [100, 110, 105, 100, 90, 80], [300, 250, 200, 180, 160, 150]])
    assert [c.best_fixed(b) for b in (1, 2, 3, 4, 15, 16, 64)] == [2, 2, 2, 1, 1, 0, 0]
    c.save(tmp_path / "c.json")
    assert StepCosts.load(tmp_path / "c.json") == c
    ctl = build_controller({"controller": "static-gs", "step_costs": str(tmp_path / "c.json")}, 5)
    assert isinstance(ctl, StaticGridLength) and not ctl.reads_drafts
    assert ctl.decide(["a"]) == ({"a": 2}, 2)
    assert ctl.decide([f"r{i}" for i in range(5)])[1] == 1
    assert ctl.decide([f"r{i}" for i in range(16)])[1] == 0
    assert StaticGridLength(c, k_max=1).decide(["a"]) == ({"a": 1}, 1)  # never past num_speculative_tokens
    _costs().save(tmp_path / "old.json")  # measured before the grid was recorded
    with pytest.raises(ValueError, match="no grid search"):
        build_controller({"controller": "static-gs", "step_costs": str(tmp_path / "old.json")}, 5)
    with pytest.raises(ValueError, match="shape of seconds"):
        StepCosts([1], [[0.1, 0.2]], {}, [[1.0]])


def _logprobs(probs, width=1):
    """Drafts whose drafted token had probability ``p`` each, the rest spread over ``width - 1`` others."""
    import math

    return [[math.log(p)] + [math.log((1 - p) / max(width - 1, 1))] * (width - 1) for p in probs]


def test_deagle_verifies_each_chain_up_to_where_two_votes_stop_it():
    """Survivals 0.9, 0.45, 0.225: at depth 3 the momentum (two halvings) and the expected length (1.58, so a
    chain of 3 is a full token deeper than expected) vote; the survival vote (below 0.15) has not come."""
    from adaptree.vllm_plugin.control import DeagleLength

    ctl = DeagleLength(_costs(base=0.030, row=0.002))
    assert ctl.reads_drafts and ctl.width == 1
    assert ctl.stop(_logprobs([0.9, 0.5, 0.5, 0.9, 0.9])) == 3
    assert ctl.stop(_logprobs([0.99] * 5)) == 5
    _warm(ctl, ["a", "b", "c"], 5, 5)
    assert ctl.decide(["a", "b", "c"]) == ({"a": 5, "b": 5, "c": 5}, 5)  # no drafts judged yet: costaware's
    ctl.drafted("a", _logprobs([0.9, 0.5, 0.5, 0.9, 0.9]))
    ctl.drafted("b", _logprobs([0.99] * 5))
    ks, k = ctl.decide(["a", "b", "c"])
    assert ks == {"a": 3, "b": 5, "c": 5} and k == 5 and ctl.stopped == 2
    ctl.drafted("a", _logprobs([0.9, 0.5, 0.5, 0.9, 0.9]))
    ks, k = ctl.decide(["a"])  # every request judged: one draft past the longest chain let through
    assert ks == {"a": 3} and k == 4
    # the log-probs of a step's drafts are read once: then costaware's length (the scheduler verifies no more
    # drafts than the request has)
    assert ctl.decide(["a"]) == ({"a": 5}, 5)
    ctl.drafted("gone", _logprobs([0.9]))
    ctl.forget(["a"])
    assert "gone" not in ctl.logprobs


def test_deagle_backs_off_under_load_as_costaware_does():
    from adaptree.vllm_plugin.control import DeagleLength

    load = DeagleLength(_costs(base=0.002, row=0.006))
    many = [f"r{i}" for i in range(16)]
    _warm(load, many, 5, 1, times=10)
    for r in many:
        load.drafted(r, _logprobs([0.99] * 5))
    ks, k = load.decide(many)
    assert k == 0 and set(ks.values()) == {0}


def _policy_controller(tmp_path, name, policy, costs):
    """The controller ``name`` built from settings naming ``policy`` and ``costs`` saved under ``tmp_path``, after one
    request's drafts were all accepted 50 times and a step was decided; and the settings."""
    costs.save(tmp_path / "c.json")
    settings = {"controller": name, "step_costs": str(tmp_path / "c.json"), "policy": str(policy)}
    ctl = build_controller(settings, 5)
    _warm(ctl, ["a"], 5, 5)
    ctl.decide(["a"])
    return ctl, settings


def test_radar_reads_its_policy_and_the_machines_costs_from_the_step_costs(tmp_path):
    """The shipped RADAR policy, on chains: a decision per draft, never more than the drafts; its machine features
    are the step costs' at the batch (rows dearer relative to a step at 16 requests than at one)."""
    import math

    from adaptree.models.assets import shipped_head
    from adaptree.vllm_plugin.control import RadarLength, draft_logprob_width, vllm_cost_features

    c = _grid(_costs(base=0.030, row=0.002), [[30, 40, 45, 44, 43, 41]] * 3)
    one, many = vllm_cost_features(c, 1), vllm_cost_features(c, 16)
    assert len(one) == 5 and one[0] < many[0] and one[3] < many[3]
    assert one[1] == pytest.approx(math.log1p(4 * one[0]))
    ctl, settings = _policy_controller(tmp_path, "radar", shipped_head(None) / "radar", c)
    assert isinstance(ctl, RadarLength) and ctl.reads_drafts and ctl.width == draft_logprob_width(settings) == 10
    for probs in ([0.99] * 5, [0.3] * 5, [0.99, 0.2, 0.9]):
        assert 1 <= ctl.stop(_logprobs(probs, width=10)) <= len(probs)
    with pytest.raises(ValueError, match="needs additional_config\\['adaptree'\\]\\['policy'\\]"):
        build_controller({"controller": "radar", "step_costs": str(tmp_path / "c.json")}, 5)
    _costs().save(tmp_path / "old.json")
    with pytest.raises(ValueError, match="no grid search"):  # the policy observes a static tree: the grid's
        build_controller({**settings, "step_costs": str(tmp_path / "old.json")}, 5)
    assert draft_logprob_width({"controller": "deagle"}) == 1
    assert draft_logprob_width({"controller": "costaware"}) == draft_logprob_width(None) == 0
    with pytest.raises(ValueError, match="no readable config.json"):
        draft_logprob_width({"controller": "radar", "policy": str(tmp_path)})


def test_ltd_depth_policy_verifies_longer_chains_where_the_drafter_is_sure_and_rows_are_cheap(tmp_path):
    """The shipped LTD depth policy on chains: its observation is adaptree's (``LTDObservation.frontier_obs``) with the
    chain's continuations as the frontier; confident drafts at one request go deeper than unsure ones, and at 16
    requests, where the step costs make every row dear, it stops at the first draft."""
    from adaptree.models.assets import shipped_head
    from adaptree.vllm_plugin.control import LtdLength, draft_logprob_width

    c = _grid(_costs(base=0.030, row=0.002), [[30, 40, 45, 48, 43, 41], [100, 110, 105, 100, 90, 80],
                                                [300, 250, 200, 180, 160, 150]])
    ctl, settings = _policy_controller(tmp_path, "ltd", shipped_head(None) / "ltd" / "depth", c)
    assert isinstance(ctl, LtdLength) and ctl.reads_drafts and ctl.width == draft_logprob_width(settings) == 10
    sure, unsure = ctl.stop(_logprobs([0.97] * 5, width=10), 200), ctl.stop(_logprobs([0.3] * 5, width=10), 200)
    assert 1 <= unsure < sure <= 5, (unsure, sure)
    ctl.batch_size = 16
    assert ctl.stop(_logprobs([0.97] * 5, width=10), 200) == 1
    with pytest.raises(ValueError, match=r"needs additional_config\['adaptree'\]\['policy'\]: an LTD depth policy"):
        build_controller({"controller": "ltd", "step_costs": str(tmp_path / "c.json")}, 5)
    with pytest.raises(ValueError, match="holds a 'ltd-size' policy, a 'ltd-depth' policy is needed"):
        LtdLength(c, shipped_head(None) / "ltd" / "size")
