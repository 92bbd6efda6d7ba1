"""The hybrid method (methods/hybrid): the chain calibration (fit checked by an independent count, files, strict
loading), the joint (V, chain length) decision against brute force, losslessness on the live engine, exact replay
and its behaviour in the simulator, on the tiny random models."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import N_NEW, PROMPTS
from test_context import brute_match
from test_costaware import CPU, DEAR, LINEAR, SETTINGS, lat
from test_traces import assert_replays_live
from test_traces import traces as replay_traces  # noqa: F401 (the fixture of the replay tests)

from adaptree.core.context import ContextIndex, ContextMatch
from adaptree.core.controller import AR_PLAN, CycleContext, TreePlan
from adaptree.core.engine import Engine
from adaptree.methods import make_controller
from adaptree.methods.common import MATCH_FEATURES, ChainCalibration, ChainRule
from adaptree.methods.costaware import AcceptanceCalibration, CostAwareConfig, CostAwareController
from adaptree.methods.hybrid import HybridConfig, HybridController
from adaptree.offline.latency import LatencyModel
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import record_trace

REPEATING = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 5, 5, 5, 5], [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def traces(models):
    target, head = models
    return [record_trace(target, head, p, settings=SETTINGS, key=f"p{i}") for i, p in enumerate(PROMPTS + REPEATING)]


@pytest.fixture(scope="module")
def cal(traces):
    return AcceptanceCalibration.fit(traces)


@pytest.fixture(scope="module")
def chain_cal(traces):
    return ChainCalibration.fit(traces)


# ------------------------------------------------------------------------------------------- calibration


def test_chain_rates_are_the_counted_acceptances(traces):
    fit = ChainCalibration.fit(traces, max_ngram=3, max_tokens=6, edges=(1, 2, 4), smoothing=0.0)
    hits, trials = np.zeros((3, 6)), np.zeros((3, 6))
    for t in traces:
        y = t.output.tolist()
        for j in range(t.end):
            m = brute_match(t.prompt.tolist() + y[:j + 1], 6, 1, 3, 64)  # the index's max_match, select longest
            if m is None:
                continue
            b = 0 if m[0] < 2 else 1 if m[0] < 4 else 2
            for i, tok in enumerate(m[3]):
                if j + 1 + i >= len(y):
                    break
                trials[b, i] += 1
                if tok != y[j + 1 + i]:
                    break
                hits[b, i] += 1
    assert fit.trials.tolist() == [trials.tolist()] and trials.sum() > 50 and fit.temperatures.tolist() == [0.0]
    np.testing.assert_allclose(fit.rates_at(0.0), np.divide(hits, trials, out=np.zeros_like(hits), where=trials > 0))
    assert fit.samples.tolist()[0] > 0 and fit.fingerprints["model"]
    # the same counts from plain token-id texts (a corpus), with the fingerprints given
    texts = ChainCalibration.fit_texts(((t.prompt.tolist(), t.output, t.end) for t in traces), {"model": "m"},
                                       max_ngram=3, max_tokens=6, edges=(1, 2, 4), smoothing=0.0)
    assert texts.trials.tolist() == [trials.tolist()] and texts.samples.tolist() == fit.samples.tolist()
    assert texts.fingerprints == {"model": "m"}


def test_probs_are_cumulative_products_per_bucket():
    cal = ChainCalibration(2, [1, 3], [[0.5, 0.5, 0.5], [0.9, 0.8, 0.7]])
    m = ContextMatch(length=1, count=1, position=0, tokens=(1, 2, 3, 4))
    np.testing.assert_allclose(cal.probs(m), [0.5, 0.25, 0.125, 0.0625])  # past the rates: the last one
    np.testing.assert_allclose(cal.probs(ContextMatch(5, 1, 0, (1, 2))), [0.9, 0.72])
    assert cal.probs(None).size == 0 and cal.bucket(2) == 0 and cal.bucket(3) == 1


def test_rates_are_interpolated_between_temperatures():
    greedy = ChainCalibration(2, [1, 3], [[0.5, 0.5], [0.9, 0.8]], fingerprints={"model": "m"})
    hot = ChainCalibration(2, [1, 3], [[0.1, 0.3], [0.5, 0.4]], fingerprints={"model": "m"}, temperatures=(1.0,))
    both = ChainCalibration.combine([hot, greedy])  # sorted by temperature
    assert both.temperatures.tolist() == [0.0, 1.0] and both.rates.shape == (2, 2, 2)
    m = ContextMatch(length=4, count=1, position=0, tokens=(1, 2))
    np.testing.assert_allclose(both.probs(m), [0.9, 0.72])
    np.testing.assert_allclose(both.probs(m, temperature=1.0), [0.5, 0.2])
    np.testing.assert_allclose(both.probs(m, temperature=0.5), [0.7, 0.7 * 0.6])  # halfway, rate by rate
    np.testing.assert_allclose(both.probs(m, temperature=2.0), [0.5, 0.2])  # beyond: the nearest
    np.testing.assert_allclose(greedy.probs(m, temperature=1.0), [0.9, 0.72])  # greedy rates only: those
    half = both.at(0.5)  # one temperature's view
    assert half.temperatures.tolist() == [0.5] and half.rates.shape == (1, 2, 2)
    np.testing.assert_allclose(half.probs(m, temperature=0.5), both.probs(m, temperature=0.5))
    np.testing.assert_allclose(half.probs(m, temperature=0.0), both.probs(m, temperature=0.5))
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        both.probs(m, temperature=-1)
    with pytest.raises(ValueError, match="strictly increasing"):
        ChainCalibration.combine([greedy, greedy])
    with pytest.raises(ValueError, match="different models"):
        ChainCalibration.combine([greedy, ChainCalibration(2, [1, 3], [[0.1] * 2] * 2, fingerprints={"model": "x"},
                                                           temperatures=(1.0,))])
    with pytest.raises(ValueError, match="different shapes"):
        ChainCalibration.combine([greedy, ChainCalibration(3, [1, 3], [[0.1] * 2] * 2, temperatures=(1.0,))])
    with pytest.raises(ValueError, match="different shapes.*select"):
        ChainCalibration.combine([greedy, ChainCalibration(2, [1, 3], [[0.1] * 2] * 2, temperatures=(1.0,),
                                                           select="recent")])
    assert both.select == "longest" and half.select == "longest"


def test_sampled_rates_count_the_sampled_outputs(models):
    """fit_sampled is fit_texts on the target's outputs sampled with the seeded generator (batched_generate's draws),
    every prompt ``samples_per_prompt`` times."""
    from adaptree.core.batched import batched_generate

    target = models[0]
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 7, 5, 6]]
    cal = ChainCalibration.fit_sampled(target, prompts, 1.0, 24, samples_per_prompt=2, seed=3, batch_size=4)
    rows = [p for p in prompts for _ in range(2)]
    outs = batched_generate(target, rows, 24, temperature=1.0, generator=torch.Generator().manual_seed(3),
                            batch_size=4)
    ref = ChainCalibration.fit_texts(((p, y, len(y)) for p, y in zip(rows, outs)), temperature=1.0)
    assert cal.temperatures.tolist() == [1.0] and cal.trials.tolist() == ref.trials.tolist()
    assert cal.trials.sum() > 0 and cal.fingerprints["model"]
    with pytest.raises(ValueError, match="temperature > 0, got 0"):
        ChainCalibration.fit_sampled(target, prompts, 0.0)


def test_chain_file_round_trip_and_strict_loading(chain_cal, tmp_path):
    p = tmp_path / "chain.json"
    chain_cal.save(p)
    back = ChainCalibration.load(p)
    np.testing.assert_allclose(back.rates, chain_cal.rates, atol=1e-6)
    assert back.trials.tolist() == chain_cal.trials.tolist() and back.max_ngram == chain_cal.max_ngram
    assert back.select == chain_cal.select == "longest"
    d = json.loads(p.read_text())
    v2 = {k: v for k, v in d.items() if k != "select"}  # the format before the occurrence rule: the most recent
    p.write_text(json.dumps(dict(v2, version=2)))
    old = ChainCalibration.load(p)
    assert old.select == "recent" and old.index().select == "recent" and old.rates.tolist() == back.rates.tolist()
    v1 = {k: v for k, v in v2.items() if k != "temperatures"}  # the format before temperatures: greedy rates
    v1.update(version=1, rates=d["rates"][0], trials=d["trials"][0], samples=d["samples"][0])
    p.write_text(json.dumps(v1))
    old = ChainCalibration.load(p)
    assert old.temperatures.tolist() == [0.0] and old.trials.tolist() == chain_cal.trials.tolist()
    assert old.select == "recent"
    for edit, match in [(lambda d: d.pop("rates"), "missing fields"), (lambda d: d.update(extra=1), "unknown"),
                        (lambda d: d.update(version=9), "version"), (lambda d: d.update(edges=[2, 3]), "edges"),
                        (lambda d: d["rates"][0][0].__setitem__(0, 1.5), "probabilities"),
                        (lambda d: d.update(temperatures=[0.0, 1.0]), "samples must be one count per"),
                        (lambda d: d.update(temperatures=[0.0, 1.0], samples=[1, 2]), "rates must be"),
                        (lambda d: d.update(version=1), "unknown fields"),
                        (lambda d: d.update(version=2), "unknown fields \\['select'\\]"),
                        (lambda d: d.update(select="first"), "select must be one of longest, recent")]:
        bad = json.loads(json.dumps(d))
        edit(bad)
        p.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            ChainCalibration.load(p)
    p.write_text("not json")
    with pytest.raises(ValueError, match="not a JSON chain calibration"):
        ChainCalibration.load(p)


# ------------------------------------------------------------------------------------------ decisions

SURE = ChainCalibration(4, [1], [[0.95] * 16])
NEVER = ChainCalibration(4, [1], [[0.01] * 16])


class FakeTree:
    """Candidates: tokens, parents (-1: the root's children), scores; depth."""

    def __init__(self, tokens, parents, scores, depth):
        self.t, self.p, self.s, self.depth = (torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores),
                                              depth)

    def candidate_scores(self):
        return self.s

    def candidate_tokens(self):
        return self.t

    def candidate_parents(self):
        return self.p


def hybrid(chain=SURE, **cfg):
    return HybridController(HybridConfig(**{"width": 2, "max_depth": 4, "max_size": 10, "probe_every": 4, **cfg}),
                            lat(), LINEAR, chain)


def context(tokens):
    idx = ContextIndex(max_ngram=4)
    idx.extend(tokens)
    return CycleContext(0, 20, 1, None, tokens, [], idx)


def test_a_sure_chain_is_verified_and_a_hopeless_one_is_not():
    toks = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3]  # the suffix 1 2 3 occurred: the chain is 4 5 6 8 9 1 2 3 ...
    for chain, want in ((SURE, True), (NEVER, False)):
        ctl = hybrid(chain)
        ctl.reset()
        plan = ctl.begin_cycle(context(toks))
        assert plan.chain[:4] == (4, 5, 6, 8)
        tree = FakeTree([4, 11, 5, 12], [-1, -1, 0, 0], [-1.0, -3.0, -2.0, -4.0], 2)
        v = ctl.choose_size(tree, plan)
        k = ctl.choose_chain(tree, plan, v)
        assert (k > 2) == want, (k, v)
    # AR mode: the chain alone, or a plain AR step when it does not pay
    for chain, want in ((SURE, True), (NEVER, False)):
        ctl = hybrid(chain)
        ctl.reset()
        ctl.ar_mode, ctl.interval = True, 100
        plan = ctl.begin_cycle(context(toks))
        assert (plan.max_depth == 0) and ((len(plan.chain) > 0) == want) and (want or plan is AR_PLAN)
        assert ctl.choose_chain(None, plan, 0) == len(plan.chain)


def test_the_chain_is_valued_at_the_cycles_temperature():
    """A calibration sure of the chain greedy and hopeless at T=1: verified greedy, not at T=1, by the hybrid (in AR
    mode: the chain alone) and by a learned method's chain rule."""
    both = ChainCalibration.combine([SURE, ChainCalibration(4, [1], [[0.01] * 16], temperatures=(1.0,))])
    toks = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3]
    for temperature, want in ((0.0, True), (1.0, False)):
        ctx = context(toks)
        ctx.temperature = temperature
        ctl = hybrid(both)
        ctl.reset()
        ctl.ar_mode, ctl.interval = True, 100
        assert (len(ctl.begin_cycle(ctx).chain) > 0) == want
        rule = ChainRule(both, 16)
        rule.latency = lat()
        plan = AR_PLAN.with_chain(rule.begin(ctx))
        assert (rule.choose(None, plan, 0) > 0) == want
        assert rule.features()[0] == pytest.approx(0.95 if want else 0.01)


def test_the_loop_tells_controllers_the_sampling_temperature(models):
    from adaptree.core.controller import Controller
    from adaptree.core.verify import SamplingConfig

    seen = []

    class Spy(Controller):
        def begin_cycle(self, ctx):
            seen.append(ctx.temperature)
            return AR_PLAN

    eng = Engine(*models)
    for temperature in (0.0, 0.7):
        seen.clear()
        eng.generate(PROMPTS[0], Spy(), max_new_tokens=4, sampling=SamplingConfig(temperature=temperature))
        assert seen and set(seen) == {temperature}


def brute_joint(ctl, tree, chain, limit):
    """max over V and k of the value, building the selected set and walking the chain explicitly."""
    scores = tree.s.tolist()
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    c = np.concatenate([[0.0], np.cumsum(ctl.chain_p)])
    best = None
    for v in range(min(limit, len(scores)) + 1):
        sel = set(order[:v])
        g = float(LINEAR(torch.tensor([scores[i] for i in order[:v]])).sum()) if v else 0.0
        s, cur = 0, -1  # shared: chain tokens down the selected nodes
        for tok in chain:
            kids = [i for i in sel if int(tree.p[i]) == cur and int(tree.t[i]) == tok]
            if not kids:
                break
            cur, s = kids[0], s + 1
        for k in range(len(chain) + 1):
            kk = max(k, s)
            val = g + c[kk] - c[s] - ctl.cost[v + kk - s]
            if best is None or val > best[0] + 1e-12:
                best = (val, v, kk)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_joint_choice_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    toks = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3]
    chain = ChainCalibration(4, [1], [rng.uniform(0.2, 0.95, 16).tolist()])
    ctl = hybrid(chain, max_size=10)
    ctl.reset()
    plan = ctl.begin_cycle(context(toks))
    # a random 2-level tree whose first level holds the chain's first token and often its second
    t1 = [4] + rng.choice([10, 11, 12, 13], 2, replace=False).tolist()
    t2 = [5 if rng.random() < 0.7 else 14] + rng.choice([15, 16, 17], 2, replace=False).tolist()
    tokens = t1 + t2 + rng.choice([18, 19, 20], 3, replace=False).tolist()
    parents = [-1, -1, -1, 0, 0, 0, 1, 1, 1]
    s1 = sorted(rng.uniform(-6, -0.1, 3).tolist(), reverse=True)
    scores = s1 + [s1[0] - x for x in sorted(rng.uniform(0.1, 4, 3))] + [s1[1] - x for x in rng.uniform(0.1, 4, 3)]
    tree = FakeTree(tokens, parents, scores, 2)
    v = ctl.choose_size(tree, plan)
    k = ctl.choose_chain(tree, plan, v)
    val, bv, bk = brute_joint(ctl, tree, plan.chain, 10)
    assert (v, k) == (bv, bk), (v, k, bv, bk, val)


@pytest.mark.parametrize("seed", range(4))
def test_chain_rule_verifies_the_chain_tokens_worth_their_time(seed):
    """ChainRule (the learned methods' chain): the k that maximises the chain's expected accepted tokens beyond the
    head's shared nodes minus their verification time at the method's throughput (the AR rate at least), by brute
    force; the whole chain without a latency model; features in [0, 1], 0 without a match, independent of the chain's length."""
    rng = np.random.default_rng(seed)
    toks = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3]
    cal = ChainCalibration(4, [1], [np.sort(rng.uniform(0.05, 0.98, 16))[::-1].tolist()])
    rule = ChainRule(cal, 10)
    chain = rule.begin(context(toks))
    assert chain[:4] == (4, 5, 6, 8) and len(chain) == 10
    plan = TreePlan(2, 2, 10, chain)
    assert rule.choose(None, plan, 0) == 10  # no latency model: the whole chain
    f = rule.features()
    assert len(f) == len(MATCH_FEATURES) and all(0.0 <= x <= 1.0 for x in f)
    assert f[0] == pytest.approx(cal.rates[0, 0, 0])
    assert ChainRule(cal, 3).begin(context(toks)) and ChainRule(cal, 3).features() == [0.0, 0.0, 0.0]  # no begin yet
    short = ChainRule(cal, 3)
    short.begin(context(toks))
    assert short.features() == pytest.approx(f)
    latency = LatencyModel([1e-3, 0.0, 0.0, 0.0], [7e-3, rng.uniform(5e-4, 6e-3), 0.0, 0.0], other_s=0.0)
    rule.latency = latency
    tree = FakeTree([4, 11, 5, 12], [-1, -1, 0, 0], [-1.0, -3.0, -2.0, -4.0], 2)  # the chain's 4 -> 5 is in the tree
    c = np.concatenate([[0.0], np.cumsum(cal.probs(ContextMatch(3, 1, 0, chain)))])
    for v in range(5):
        s = min(v, 2)  # top-V by score: 4 (-1), then 5 under it (-2), 11 (-3), 12 (-4)
        values = [c[max(k, s)] - c[s] - (latency.verify_time(v + max(0, k - s), 20) - latency.verify_time(v, 20))
                  / latency.ar_step(20) for k in range(11)]
        assert rule.choose(tree, plan, v) == int(np.argmax(values)), (v, values)
    for rate in (0.5, 3.0, 40.0):  # priced at the method's throughput (tokens/AR step), never below the AR rate
        rule.rate = rate / latency.ar_step(20)
        for v in range(5):
            s = min(v, 2)
            values = [c[max(k, s)] - c[s] - max(rate, 1.0) * (latency.verify_time(v + max(0, k - s), 20)
                                                              - latency.verify_time(v, 20)) / latency.ar_step(20)
                      for k in range(11)]
            assert rule.choose(tree, plan, v) == int(np.argmax(values)), (rate, v, values)
    assert rule.choose(tree, plan, 0) < 10  # at 40 tokens per AR step no chain token is worth its time
    rule.rate = None
    rule.begin(context([1, 2, 3, 4]))  # nothing repeats
    assert rule.features() == [0.0, 0.0, 0.0] and rule.choose(None, TreePlan(1, 0, 0), 0) == 0
    with pytest.raises(ValueError, match="positive integer, got 0"):
        ChainRule(cal, 0)
    with pytest.raises(ValueError, match="context index"):
        rule.begin(CycleContext(0, 20, 1, None, toks, [], None))


def test_config_and_files_are_checked(tmp_path, chain_cal):
    with pytest.raises(ValueError, match="chain_tokens must be a positive integer, got 0"):
        HybridConfig(chain_tokens=0)
    with pytest.raises(ValueError, match="needs a chain calibration"):
        HybridController(HybridConfig(), lat(), LINEAR)
    with pytest.raises(FileNotFoundError, match="chain calibration"):
        HybridController(HybridConfig(chain=str(tmp_path / "none.json")), lat(), LINEAR)
    with pytest.raises(ValueError, match="max_n 3"):
        HybridController(HybridConfig(max_n=3), lat(), LINEAR, chain_cal)
    # the loop's context index picks occurrences by the calibration's rule (its rates are of those chains)
    recent = ChainCalibration(4, [1], [[0.5] * 16], select="recent")
    for c, rule in ((chain_cal, "longest"), (recent, "recent")):
        assert HybridController(HybridConfig(), lat(), LINEAR, c).context_index().select == rule
        assert ChainRule(c).index().select == rule and c.index().max_ngram == 4


# ------------------------------------------------------------------------------------- engine and simulator


def test_greedy_output_equals_autoregressive(models, cal, chain_cal):
    target, head = models
    eng = Engine(target, head)
    for latency in (CPU, DEAR):
        ctl = HybridController(HybridConfig(width=4, max_depth=6, max_size=30, probe_every=3), latency, cal, chain_cal)
        chains = 0
        for prompt in PROMPTS + REPEATING:
            ar = eng.generate(prompt, None, max_new_tokens=N_NEW)
            out = eng.generate(prompt, ctl, max_new_tokens=N_NEW)
            assert out.token_ids == ar.token_ids and out.method == "hybrid"
            chains += sum(c.chain_accepted for c in out.cycles)
        assert chains > 0


def test_replay_equals_live(models, replay_traces):  # noqa: F811 (the fixture)
    fitted, chains = AcceptanceCalibration.fit(replay_traces), ChainCalibration.fit(replay_traces)
    for width, latency in ((8, CPU), (3, DEAR)):
        assert_replays_live(models, replay_traces,
                            lambda: HybridController(HybridConfig(width=width, max_depth=8, max_size=60, probe_every=3),
                                                     latency, fitted, chains))


def test_simulator_hybrid_at_least_matches_costaware_where_text_repeats(traces, cal, chain_cal):
    hyb = simulate(HybridController(HybridConfig(width=8), CPU, cal, chain_cal), traces, CPU, measure_policy=False)
    cost = simulate(CostAwareController(CostAwareConfig(width=8), CPU, cal), traces, CPU, measure_policy=False)
    ngram = simulate(make_controller("ngram", min_n=1), traces, CPU, measure_policy=False)
    cyc = [c for r in hyb.runs for c in r.cycles]
    assert [r.token_ids for r in hyb.runs] == [t.output[:t.end].tolist() for t in traces]
    assert sum(c.chain for c in cyc) > 0 and sum(c.chain_accepted for c in cyc) > 0
    assert hyb.speedup >= 0.98 * max(cost.speedup, ngram.speedup), (hyb.speedup, cost.speedup, ngram.speedup)


def test_registered_and_built_from_machine_files(tmp_path, cal, chain_cal):
    cal.save(tmp_path / "acceptance.json")
    chain_cal.save(tmp_path / "chain.json")
    CPU.save(tmp_path / "latency.json")
    ctl = make_controller("hybrid", machine={"latency": str(tmp_path / "latency.json"),
                                             "acceptance": str(tmp_path / "acceptance.json"),
                                             "chain": str(tmp_path / "chain.json")})
    assert isinstance(ctl, HybridController) and ctl.context_index().max_ngram == 4
    assert TreePlan(1, 0, 0, (1, 2)).chain == (1, 2)
