"""RADAR on tiny random models: exact acceptance-length distributions, the dataset, the LSTM policy,
REINFORCE, and the controller's losslessness."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import PROMPTS, open_tree, tiny_head, tiny_target
from scipy.stats import chisquare
from ties import assert_mostly_exact, lossless_replays, replay_against_live

from adaptree.core.engine import Engine
from adaptree.core.controller import TreePlan
from adaptree.core.tree import DraftTree
from adaptree.core.verify import SamplingConfig, verify_sample
from adaptree.methods import make_controller
from adaptree.methods.radar.controller import RadarConfig, RadarController
from adaptree.methods.radar.dataset import (
    RadarDataSettings,
    RadarRecorder,
    RadarStore,
    acceptance_distribution,
    load_record,
    sub_tree,
    union_of,
)
from adaptree.methods.radar.policy import RadarModelConfig, RadarPolicy
from adaptree.methods.radar.train import (
    Episodes,
    RadarTrainConfig,
    cycle_times,
    evaluate_policy,
    reinforce_loss,
    static_baselines,
    train_radar,
)


@pytest.fixture
def flat_pair():
    """A flatter tiny target (vocab 8): acceptance probabilities far from 0 and 1 at many nodes."""
    target = tiny_target(vocab=8, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.05)
    return target, tiny_head(target, draft_vocab=6, seed=4)


def draft(target, head, prompt, width, depth):
    """A DraftTree of ``depth`` levels after ``prompt`` and a target cache holding the prompt."""
    with torch.no_grad():
        cache = target.new_cache(128)
        tree, _, _ = open_tree(target, head, prompt, width, cache=cache, head_cache=256)
        while tree.depth < depth:
            tree.step()
    return tree, cache


def tree_logits(target, cache, vt):
    with torch.no_grad():
        L = cache.length
        logits = target(vt.tokens[None], position_ids=vt.positions, cache=cache, tree_mask=vt.mask).logits[0]
        cache.truncate(L)
    return logits


# ------------------------------------------------------------------ the exact distribution


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_p=0.9, top_k=5)])
def test_distribution_equals_monte_carlo_of_verify_sample(flat_pair, cfg):
    target, head = flat_pair
    tree, cache = draft(target, head, [1, 2, 3], width=3, depth=4)
    vt = tree.select(14)
    logits = tree_logits(target, cache, vt)
    exact = acceptance_distribution(vt, logits, cfg).numpy()
    assert abs(exact.sum() - 1.0) < 1e-9 and exact[1:].sum() > 0.15  # something to accept
    gen = torch.Generator().manual_seed(0)
    n = 8000
    counts = np.bincount([verify_sample(vt, logits, cfg, gen).accepted for _ in range(n)], minlength=exact.size)
    keep = exact * n >= 5
    assert counts[~keep].sum() <= 30  # nothing much where the exact mass is ~0
    p = chisquare(counts[keep], exact[keep] * counts[keep].sum() / exact[keep].sum()).pvalue
    assert p > 1e-3, (counts, exact * n)
    # expected length by the tail-sum formula: sum over nodes of P(node accepted)
    assert abs((exact * np.arange(exact.size)).sum() - counts @ np.arange(exact.size) / n) < 0.05


def test_greedy_distribution_is_the_point_mass_of_verify(flat_pair):
    from adaptree.core.verify import verify_greedy

    target, head = flat_pair
    for prompt in PROMPTS[:3]:
        tree, cache = draft(target, head, [p % 8 for p in prompt], width=3, depth=5)
        vt = tree.select(20)
        logits = tree_logits(target, cache, vt)
        dist = acceptance_distribution(vt, logits, SamplingConfig())
        assert float(dist.max()) == 1.0 and int(dist.argmax()) == verify_greedy(vt, logits).accepted


def test_stop_point_trees_are_sub_trees_of_one_union_forward(flat_pair):
    """Each stop point's tree (top-V of levels 1..k+1) is an ancestor-closed subset of the union, and its
    nodes' logits in the union forward equal those of a forward over that tree alone."""
    target, head = flat_pair
    not_in_full = 0
    for prompt in ([1, 2, 3], [4, 0, 6, 1], [7]):
        tree, cache = draft(target, head, prompt, width=3, depth=5)
        v = 6
        sels = [tree.top_candidates(v, levels=k + 1) for k in range(5)]
        union, nodes = union_of(tree, sels)
        ulog = tree_logits(target, cache, union)
        full = set(tree.top_candidates(v).tolist())
        for k, (sel, nd) in enumerate(zip(sels, nodes)):
            own = tree.select(v, levels=k + 1)
            sub = sub_tree(union, nd)
            for name in ("tokens", "parents", "depth", "positions", "mask"):
                assert torch.equal(getattr(sub, name), getattr(own, name)), (k, name)
            torch.testing.assert_close(ulog[nd], tree_logits(target, cache, own), atol=1e-5, rtol=1e-5)
            not_in_full += len(set(sel.tolist()) - full)
        assert torch.equal(tree.select(v).tokens, tree.select(v, levels=5).tokens)
    assert not_in_full >= 0  # the tiny heads are near-uniform: shallow nodes always outrank deep ones here


def test_smaller_trees_need_not_be_sub_trees_of_the_full_depth_tree():
    """Hand-built scores: a confident child of the best depth-1 node pushes the weaker depth-1 node out of
    the top-V of all levels, while the depth-1 tree keeps it. Hence the union forward, not the full tree."""
    tree = DraftTree.__new__(DraftTree)
    tree.root, tree.context_len, tree._cat = 0, 5, None
    tree._tokens = [torch.tensor([1, 2]), torch.tensor([3, 4, 5, 6])]
    tree._scores = [torch.tensor([-0.1, -3.0]), torch.tensor([-0.2, -0.3, -4.0, -5.0])]
    tree._parents = [torch.tensor([-1, -1]), torch.tensor([0, 0, 1, 1])]
    tree._offset = 6
    assert tree.top_candidates(2, levels=1).tolist() == [0, 1]
    assert tree.top_candidates(2).tolist() == [0, 2]
    union, nodes = union_of(tree, [tree.top_candidates(2, levels=1), tree.top_candidates(2)])
    assert union.tokens.tolist() == [0, 1, 2, 3] and [n.tolist() for n in nodes] == [[0, 1, 2], [0, 1, 3]]
    assert union.parents.tolist() == [-1, 0, 0, 1]


# ------------------------------------------------------------------ the dataset


SETTINGS = RadarDataSettings(width=3, max_depth=4, size=10, max_new_tokens=16)


def test_recorder_leaves_the_trajectory_of_static_eagle3(flat_pair):
    from adaptree.methods import StaticConfig, StaticController

    target, head = flat_pair
    eng = Engine(target, head)
    for t in (0.0, 1.0):
        s = RadarDataSettings(width=3, max_depth=4, size=10, max_new_tokens=16, temperature=t)
        samp = s.sampling("k")
        rec = RadarRecorder(eng, s, samp)
        a = eng.generate([1, 2, 3], rec, 16, samp)
        b = eng.generate([1, 2, 3], StaticController(StaticConfig(3, 4, 10)), 16, samp)
        assert a.token_ids == b.token_ids and [c.accepted for c in a.cycles] == [c.accepted for c in b.cycles]
        assert len(rec.cycles) == len(a.cycles)
        for c in rec.cycles:
            assert c.scores.shape == (4, 3) and c.dist.shape == (4, 5)
            np.testing.assert_allclose(c.dist.sum(1), 1.0, atol=1e-5)
            for k in range(4):
                assert np.all(c.dist[k, k + 2:] == 0)  # a depth-(k+1) tree accepts at most k+1
            assert list(c.sizes) == [3, 10, 10, 10]
            assert np.all(np.diff(c.scores, axis=0) <= 1e-6)  # cumulative log-probs only decrease
            if t == 0.0:  # greedy: the full-depth point mass is where the engine's acceptance is
                assert c.dist[3, c.accepted] == 1.0


def test_dataset_round_trip_and_resume(flat_pair, tmp_path):
    target, head = flat_pair
    eng = Engine(target, head)
    fps = {"model": "m" * 64, "head": "h" * 64}
    store = RadarStore(tmp_path / "d", fps, SETTINGS)
    prompts = [(f"p{i}", [x % 8 for x in p]) for i, p in enumerate(PROMPTS)]
    assert store.record(eng, prompts[:2], progress=False)["recorded"] == 2
    first = store.path("p0").stat().st_mtime_ns
    again = RadarStore(tmp_path / "d", fps, SETTINGS)
    counts = again.record(eng, prompts, progress=False)
    assert (counts["recorded"], counts["skipped"]) == (2, 2)
    assert store.path("p0").stat().st_mtime_ns == first
    recs = {r.key: r for r in again.load_all()}
    assert set(recs) == {"p0", "p1", "p2", "p3"}
    r = load_record(store.path("p1"))
    assert r.scores.shape == (r.cycles, 4, 3) and r.dist.shape == (r.cycles, 4, 5) and r.cycles > 0
    assert r.header["fingerprints"] == fps and r.header["key"] == "p1"
    # the same prompt recorded again gives the same file contents (seed derived from the key)
    redo = RadarStore(tmp_path / "e", fps, SETTINGS)
    redo.record(eng, prompts[1:2], progress=False)
    np.testing.assert_array_equal(load_record(redo.path("p1")).dist, r.dist)
    with pytest.raises(ValueError, match="max_depth"):
        RadarStore(tmp_path / "d", fps, RadarDataSettings(width=3, max_depth=5, size=10, max_new_tokens=16))
    with pytest.raises(ValueError, match="different head"):
        RadarStore(tmp_path / "d", {**fps, "head": "x" * 64}, SETTINGS)
    store.path("p2").write_bytes(b"torn")
    assert not again.has("p2")


# ------------------------------------------------------------------ the policy


def test_lstm_shapes_step_equals_sequence_and_state_resets():
    pol = RadarPolicy(RadarModelConfig(width=4, max_depth=6, hidden=16)).eval()
    x = -torch.rand(5, 7, 4).cumsum(1)
    out = pol(x)
    assert out.shape == (5, 7, 2)
    with torch.no_grad():
        hc = None
        for t in range(7):
            logits, hc = pol.step(x[2, t], t + 1, hc)
            torch.testing.assert_close(logits, out[2, t], atol=1e-5, rtol=1e-5)
        assert hc[0].shape == (1, 16)
    # the controller starts every cycle from a zero state: same scores, same decisions, every cycle
    ctl = RadarController(RadarConfig(width=4, depth=6), policy=pol)
    from types import SimpleNamespace

    seen = []
    for _ in range(3):
        ctl.begin_cycle(None)
        assert ctl.hc is None
        seen.append([ctl.continue_drafting(SimpleNamespace(beam_scores=x[0, t], depth=t + 1)) or ctl.last_p_stop
                     for t in range(3)])
    assert seen[0] == seen[1] == seen[2]


def test_config_validation_names_the_bad_value():
    for call, match in [(lambda: RadarConfig(width=0), "width.*0"), (lambda: RadarConfig(threshold=0.0), "threshold"),
                        (lambda: RadarConfig(depth=0), "depth.*0"), (lambda: RadarConfig(size=0), "size.*0"),
                        (lambda: RadarModelConfig(hidden=0), "hidden.*0"),
                        (lambda: RadarModelConfig(dropout=1.5), "dropout.*1.5"),
                        (lambda: RadarDataSettings(max_depth=0), "max_depth.*0"),
                        (lambda: RadarDataSettings(temperature=-1.0), "temperature.*-1"),
                        (lambda: RadarTrainConfig(t_fixed=1, t_draft=1, gamma=1.5), "gamma.*1.5"),
                        (lambda: RadarTrainConfig(t_fixed=1, t_draft=1, alphas="0.1,-2"), "alphas.*-2"),
                        (lambda: RadarTrainConfig(t_fixed=1, t_draft=1, baseline="x"), "baseline.*'x'"),
                        (lambda: RadarTrainConfig(), "latency model"),
                        (lambda: make_controller("radar", wdith=3), "method 'radar'.*width")]:
        with pytest.raises(ValueError, match=match):
            call()


def test_strict_loading_refuses_mismatched_files(tmp_path):
    from safetensors.torch import load_file, save_file

    pol = RadarPolicy(RadarModelConfig(width=3, max_depth=4, hidden=8))
    pol.save(tmp_path / "ok")
    loaded = RadarPolicy.load(tmp_path / "ok")
    for k, v in pol.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    with pytest.raises(FileNotFoundError, match="config.json"):
        RadarPolicy.load(tmp_path / "missing")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    bad = tmp_path / "shape"
    pol.save(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden": 16}))
    with pytest.raises(ValueError, match="lstm.weight_ih_l0.*shape"):
        RadarPolicy.load(bad)
    extra = tmp_path / "extra"
    pol.save(extra)
    t = load_file(str(extra / "model.safetensors"))
    save_file({**t, "surprise": torch.zeros(1)}, str(extra / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor 'surprise'"):
        RadarPolicy.load(extra)
    save_file({k: v for k, v in t.items() if k != "mlp.3.bias"}, str(extra / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'mlp.3.bias'"):
        RadarPolicy.load(extra)
    (bad / "config.json").write_text(json.dumps({**cfg, "hiden": 8}))
    with pytest.raises(ValueError, match="hiden"):
        RadarPolicy.load(bad)
    with pytest.raises(ValueError, match="width.*10.*input width 3"):
        RadarController(RadarConfig(policy=str(tmp_path / "ok")))
    ctl = make_controller("radar", policy=str(tmp_path / "ok"), width=3, threshold=0.3)
    assert ctl.plan.max_depth == 4 and ctl.plan.width == 3


def test_cli_builds_radar_with_its_flags(tmp_path):
    from adaptree.cli import build_controller, build_parser

    RadarPolicy(RadarModelConfig(width=4, max_depth=5, hidden=8)).save(tmp_path / "pol")
    args = build_parser().parse_args(["generate", "hi", "--method", "radar", "--radar-policy", str(tmp_path / "pol"),
                                      "-W", "4", "--radar-threshold", "0.3", "--radar-stochastic", "-D", "3"])
    ctl = build_controller(args, head=object())
    assert (ctl.config.threshold, ctl.config.stochastic, ctl.plan.max_depth, ctl.plan.width) == (0.3, True, 3, 4)
    # a radar/ folder next to the head in use is the default policy
    RadarPolicy(RadarModelConfig(width=10, max_depth=6, hidden=8)).save(tmp_path / "head" / "radar")
    args = build_parser().parse_args(["generate", "hi", "--method", "radar"])
    args.draft_path = str(tmp_path / "head")
    assert build_controller(args, head=object()).plan.max_depth == 6


# ------------------------------------------------------------------ REINFORCE


def synthetic_episodes(n=1200, d=5, w=3, seed=0):
    """Half the cycles accept the whole tree whatever its depth (confident scores), half accept nothing
    (hopeless scores): the optimal rule is 'continue to D_max' vs 'stop at once', known exactly."""
    g = np.random.default_rng(seed)
    good = g.random(n) < 0.5
    per_step = np.where(good, -0.05, -3.0)[:, None, None]
    scores = per_step * np.arange(1, d + 1)[None, :, None] + g.normal(0, 0.02, (n, d, w))
    dist = np.zeros((n, d, d + 1))
    for k in range(d):
        dist[good, k, k + 1] = 1.0
        dist[~good, k, 0] = 1.0
    cfg = RadarTrainConfig(t_fixed=1.0, t_draft=0.2)
    t = cycle_times(np.full((n, d), 10), np.zeros(n, int), w, cfg)
    tokens = (dist * np.arange(d + 1)).sum(-1) + 1
    return Episodes(torch.tensor(scores, dtype=torch.float32), torch.tensor(dist), torch.tensor(t),
                    torch.tensor(tokens)), good


def reinforce(pol: RadarPolicy, ep: Episodes, updates: int, alpha: float = 0.0) -> RadarPolicy:
    """``updates`` REINFORCE steps of 128 sampled cycles (Adam 3e-3, beta 1, gamma 0.99, mean baseline, bonus)."""
    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(updates):
        loss, _ = reinforce_loss(pol, ep, torch.randint(0, len(ep), (128,), generator=gen), alpha, 1.0, 0.99, "mean",
                                 True, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return pol


def test_reinforce_learns_the_known_optimal_stop():
    torch.manual_seed(0)
    ep, good = synthetic_episodes()
    oracle = static_baselines(ep)["oracle_per_cycle"]
    pol = RadarPolicy(RadarModelConfig(width=3, max_depth=5, hidden=32, dropout=0.0))
    with torch.no_grad():  # start from (nearly) always-continue: EAGLE-3's static depth
        pol.mlp[3].bias.copy_(torch.tensor([-3.0, 3.0]))
    before = evaluate_policy(pol, ep)
    assert before == static_baselines(ep)["depth_5"]
    reinforce(pol, ep, 250)
    after = evaluate_policy(pol, ep)
    assert after["throughput"] > before["throughput"]
    assert after["throughput"] >= 0.99 * oracle["throughput"]
    with torch.no_grad():
        p_stop = torch.softmax(pol.eval()(ep.scores[:, :-1]), -1)[..., 0]
    assert bool((p_stop[~torch.tensor(good), 0] > 0.5).all()) and bool((p_stop[torch.tensor(good)] < 0.5).all())


def test_alpha_penalises_continuing():
    """With a large per-CONTINUE penalty the learned policy drafts less than with none."""
    torch.manual_seed(0)
    ep, _ = synthetic_episodes(seed=1)
    calls = {}
    for alpha in (0.0, 0.5):
        torch.manual_seed(0)
        pol = reinforce(RadarPolicy(RadarModelConfig(width=3, max_depth=5, hidden=16, dropout=0.0)), ep, 150, alpha)
        calls[alpha] = evaluate_policy(pol, ep)["calls"]
    assert calls[0.5] < calls[0.0]


def test_train_radar_end_to_end_checkpoint_resume(flat_pair, tmp_path, monkeypatch):
    target, head = flat_pair
    store = RadarStore(tmp_path / "d", {"model": "m", "head": "h"}, SETTINGS)
    store.record(Engine(target, head), [(f"p{i}", [x % 8 for x in p]) for i, p in enumerate(PROMPTS)], progress=False)
    base = dict(data=str(tmp_path / "d"), alphas=(0.0, 0.01), t_fixed=1.0, t_draft=0.1, t_policy=0.01, steps=20,
                batch_size=16, hidden=8, eval_every=5, checkpoint_every=5, val_fraction=0.3)
    s = train_radar(RadarTrainConfig(out=str(tmp_path / "a"), **base), progress=False)
    assert s["chosen_alpha"] in (0.0, 0.01) and s["train_cycles"] > 0
    pol = RadarPolicy.load(tmp_path / "a" / "policy")
    assert pol.config.width == 3 and pol.config.max_depth == 4
    log = (tmp_path / "a" / "alpha_0" / "log.csv").read_text().splitlines()
    assert len(log) == 21 and log[0].startswith("step,")
    with pytest.raises(ValueError, match="--resume"):
        train_radar(RadarTrainConfig(out=str(tmp_path / "a"), **base), progress=False)
    with pytest.raises(ValueError, match="other settings"):
        train_radar(RadarTrainConfig(out=str(tmp_path / "a"), resume=True, **{**base, "lr": 1e-3}), progress=False)
    # interrupted at update 13 (checkpoint at 10), resumed: the same weights as the uninterrupted run
    import adaptree.methods.radar.train as rt

    real, calls = rt.reinforce_loss, [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == 13:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(rt, "reinforce_loss", flaky)
    with pytest.raises(KeyboardInterrupt):
        train_radar(RadarTrainConfig(out=str(tmp_path / "b"), **base), progress=False)
    monkeypatch.setattr(rt, "reinforce_loss", real)
    train_radar(RadarTrainConfig(out=str(tmp_path / "b"), resume=True, **base), progress=False)
    a = RadarPolicy.load(tmp_path / "a" / "alpha_0" / "policy").state_dict()
    b = RadarPolicy.load(tmp_path / "b" / "alpha_0" / "policy").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0)
    assert len((tmp_path / "b" / "alpha_0" / "log.csv").read_text().splitlines()) == 21


# ------------------------------------------------------------------ the controller is lossless


def biased_policy(width, depth, seed):
    """A random policy whose P(STOP) spreads around 0.5 on the tiny models' scores: varied depths."""
    torch.manual_seed(seed)
    pol = RadarPolicy(RadarModelConfig(width=width, max_depth=depth, hidden=8, dropout=0.0)).eval()
    return pol


@pytest.mark.parametrize("threshold, stochastic", [(0.5, False), (0.45, False), (0.5, True)])
def test_greedy_output_equals_autoregressive(tiny_pair, threshold, stochastic):
    target, head = tiny_pair
    eng = Engine(target, head)
    depths = set()
    for seed in range(3):
        ctl = RadarController(RadarConfig(width=4, size=20, threshold=threshold, stochastic=stochastic, seed=seed),
                              policy=biased_policy(4, 6, seed))
        for prompt in PROMPTS:
            ar = eng.generate(prompt, None, max_new_tokens=30)
            sp = eng.generate(prompt, ctl, max_new_tokens=30)
            assert sp.token_ids == ar.token_ids and sp.method == "radar"
            depths |= {c.depth for c in sp.cycles}
    assert depths <= set(range(1, 7))
    if stochastic:
        assert len(depths) > 1


def test_sampling_distribution_is_the_target_s():
    from test_engine import pair_pvalue

    target = tiny_target(vocab=8, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.05)
    head = tiny_head(target, draft_vocab=6, seed=4)
    ctl = RadarController(RadarConfig(width=3, size=8, stochastic=True), policy=biased_policy(3, 3, 0))
    assert pair_pvalue(Engine(target, head), ctl, [1, 2, 3], SamplingConfig(temperature=1.0), n=1500, seed=2) > 1e-3


def test_radar_replays_live_on_traces():
    """The simulator replays the RADAR controller like the live engine, up to near-ties (tests/ties.py; the
    check of tests/test_traces.py)."""
    from adaptree.offline.traces import TraceSettings, record_trace

    target = tiny_target()
    head = tiny_head(target, draft_vocab=12)
    settings = TraceSettings(widths=(4,), max_depth=6, max_new_tokens=20, feature_dtype="float32")
    eng = Engine(target, head)
    checks = []
    for i, prompt in enumerate(PROMPTS[:2]):
        tr = record_trace(target, head, prompt, settings=settings, key=f"p{i}")

        def make():
            return RadarController(RadarConfig(width=4, size=20), policy=biased_policy(4, 6, 1))

        checks.append(replay_against_live(eng, make(), make(), prompt, tr, 20))
    assert_mostly_exact(checks)


def test_radar_with_a_context_chain_is_lossless_and_replays_live():
    """chain_tokens: the context's chain next to RADAR's tree; fp32 greedy = AR, replay = live."""
    from adaptree.methods.common import ChainCalibration
    from adaptree.offline.latency import LatencyModel
    from adaptree.offline.traces import TraceSettings, record_trace

    target = tiny_target()
    head = tiny_head(target, draft_vocab=12)
    settings = TraceSettings(widths=(4,), max_depth=6, max_new_tokens=36, feature_dtype="none")
    eng = Engine(target, head)
    prompts = PROMPTS[:2] + [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 5, 5, 5, 5]]
    traces = [record_trace(target, head, p, settings=settings, key=f"p{i}") for i, p in enumerate(prompts)]
    cal = ChainCalibration.fit(traces)
    lat = LatencyModel(draft=[0.004, 0.0001, 1e-6, 0.0], verify=[0.03, 0.001, 2e-5, 1e-7], other_s=0.001)
    with pytest.raises(ValueError, match="--radar-chain PATH"):
        RadarController(RadarConfig(width=4, size=20, chain_tokens=8), policy=biased_policy(4, 6, 1))

    def make():
        ctl = RadarController(RadarConfig(width=4, size=20, chain_tokens=8), policy=biased_policy(4, 6, 1),
                              chain_calibration=cal)
        ctl.use_latency(lat)
        return ctl

    checks = lossless_replays(eng, make, prompts, traces, 20)
    assert sum(c.chain_accepted for check in checks for c in check.live.cycles) > 0


def test_dataset_with_context_chains_holds_the_trees_the_engine_verifies(tiny_pair, tmp_path):
    """``chain_tokens``: every stop point's tree carries the chain; greedy, the full-depth point mass is the
    engine's acceptance of the static tree plus the chain, and the recorder's trajectory is that static run's."""
    from adaptree.methods import StaticConfig, StaticController
    from adaptree.methods.common import ChainCalibration
    from adaptree.methods.radar.train import match_features
    from adaptree.offline.traces import TraceSettings, record_trace

    target, head = tiny_pair
    eng = Engine(target, head)
    s = RadarDataSettings(width=3, max_depth=4, size=10, max_new_tokens=30, temperature=0.0, chain_tokens=6)
    samp = s.sampling("k")
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 5, 5, 5, 5], *PROMPTS[:2]]

    class StaticWithChain(StaticController):  # the trajectory: the static tree and the whole chain
        def __init__(self, k):
            super().__init__(StaticConfig(3, 4, 10))
            self.k = k

        def context_index(self):
            from adaptree.core.context import ContextIndex

            return ContextIndex(max_ngram=4)

        def begin_cycle(self, ctx):
            m = ctx.index.match(self.k, 1)
            return TreePlan(3, 4, 10, m.tokens) if m else self.plan

    matched = 0
    for prompt in prompts:
        rec = RadarRecorder(eng, s, samp)
        a = eng.generate(prompt, rec, 30, samp)
        b = eng.generate(prompt, StaticWithChain(6), 30, samp)
        assert a.token_ids == b.token_ids == eng.generate(prompt, None, max_new_tokens=30).token_ids
        assert [c.accepted for c in a.cycles] == [c.accepted for c in b.cycles]
        for c, cyc in zip(rec.cycles, a.cycles):
            assert c.dist[3, c.accepted] == 1.0  # the engine verified exactly the full-depth tree and the chain
            assert (c.match_length > 0) == (cyc.chain > 0)
            assert np.all(c.sizes >= np.array([3, 10, 10, 10])) and np.all(c.sizes <= np.array([3, 10, 10, 10]) + 6)
            matched += c.match_length > 0
    assert matched > 0
    # on disk, and the match features a policy reads from it
    store = RadarStore(tmp_path / "d", {"model": "m", "head": "h"}, s)
    store.record(eng, [(f"p{i}", p) for i, p in enumerate(prompts)], progress=False)
    recs = store.load_all()
    assert sum(int((r.match_length > 0).sum()) for r in recs) > 0
    traces = [record_trace(target, head, p, settings=TraceSettings(widths=(3,), max_depth=4, max_new_tokens=30),
                           key=f"p{i}") for i, p in enumerate(prompts)]
    feats = match_features(recs, ChainCalibration.fit(traces))
    lengths = np.concatenate([r.match_length for r in recs])
    assert feats.shape == (lengths.size, 3) and bool((feats[lengths == 0] == 0).all())
    assert bool((feats[lengths > 0, 2] > 0).all())
    with pytest.raises(ValueError, match="chain_tokens must be an integer >= 0"):
        RadarDataSettings(chain_tokens=-1)


def test_radar_trained_on_the_match_is_lossless(tiny_pair, tmp_path):
    from adaptree.methods.common import ChainCalibration
    from adaptree.offline.traces import TraceSettings, record_trace

    target, head = tiny_pair
    eng = Engine(target, head)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 5, 5, 5, 5], *PROMPTS]
    s = RadarDataSettings(width=3, max_depth=4, size=10, max_new_tokens=24, temperature=1.0, chain_tokens=6)
    RadarStore(tmp_path / "d", {"model": "m", "head": "h"}, s).record(
        eng, [(f"p{i}", p) for i, p in enumerate(prompts)], progress=False)
    traces = [record_trace(target, head, p, settings=TraceSettings(widths=(3,), max_depth=4, max_new_tokens=24),
                           key=f"p{i}") for i, p in enumerate(prompts)]
    ChainCalibration.fit(traces).save(tmp_path / "chain.json")
    base = dict(data=str(tmp_path / "d"), alphas=(0.0,), t_fixed=1.0, t_draft=0.1, steps=10, batch_size=16, hidden=8,
                eval_every=5, checkpoint_every=5, val_fraction=0.3)
    with pytest.raises(ValueError, match="chain calibration"):
        RadarTrainConfig(out=str(tmp_path / "a"), match=True, **base)
    train_radar(RadarTrainConfig(out=str(tmp_path / "a"), match=True, chain=str(tmp_path / "chain.json"), **base),
                progress=False)
    pol = RadarPolicy.load(tmp_path / "a" / "policy")
    assert pol.config.match_features
    with pytest.raises(ValueError, match="--radar-chain PATH"):
        RadarController(RadarConfig(width=3, size=10), policy=pol)
    ctl = make_controller("radar", policy=str(tmp_path / "a" / "policy"), width=3, size=10,
                          chain=str(tmp_path / "chain.json"))
    assert ctl.chain_rule.tokens == 16
    for prompt in prompts[:3]:
        assert eng.generate(prompt, ctl, max_new_tokens=24).token_ids == eng.generate(prompt, None,
                                                                                     max_new_tokens=24).token_ids
    plain = RadarStore(tmp_path / "e", {"model": "m", "head": "h"}, RadarDataSettings(width=3, max_depth=4, size=10,
                                                                                      max_new_tokens=8))
    plain.record(eng, [("p0", prompts[0])], progress=False)
    with pytest.raises(ValueError, match="recorded without context chains"):
        train_radar(RadarTrainConfig(out=str(tmp_path / "b"), match=True, chain=str(tmp_path / "chain.json"),
                                     **{**base, "data": str(tmp_path / "e")}), progress=False)


# ----------------------------------------------------------------------------- machine costs


def test_a_cost_aware_radar_policy_learns_both_machines():
    """The same cycles on a machine with cheap draft steps (continuing pays on confident cycles) and one where a
    draft step costs five verifications (stopping at once always pays): one policy that sees the costs learns
    both rules; the scores alone cannot tell them apart."""
    from adaptree.offline.family import cost_features
    from adaptree.offline.latency import LatencyModel

    ep, _ = synthetic_episodes(n=800)
    cfg = RadarTrainConfig(t_fixed=1.0, t_draft=0.2)
    parts = []
    for lat in (LatencyModel(draft=[0.2, 0, 0, 0], verify=[1.0, 0, 0, 0]),
                LatencyModel(draft=[5.0, 0, 0, 0], verify=[1.0, 0, 0, 0])):
        t = cycle_times(np.full((len(ep), ep.depth), 10), np.zeros(len(ep), int), 3, cfg, lat)
        costs = torch.tensor([cost_features(lat, 3)], dtype=torch.float32).expand(len(ep), -1)
        parts.append(Episodes(ep.scores, ep.dist, torch.tensor(t), ep.tokens,
                              ar=torch.ones(len(ep), dtype=torch.float64), costs=costs))
    both = Episodes.cat(parts)
    torch.manual_seed(0)
    pol = reinforce(RadarPolicy(RadarModelConfig(width=3, max_depth=5, hidden=32, dropout=0.0, cost_features=True)),
                    both, 300)
    cheap, dear = (evaluate_policy(pol, p) for p in parts)
    assert dear["calls"] < 1.2 and cheap["calls"] > 2.5
    for p, got in zip(parts, (cheap, dear)):
        assert got["throughput"] >= 0.97 * static_baselines(p)["oracle_per_cycle"]["throughput"]
    with pytest.raises(ValueError, match="latency model"):
        pol(ep.scores[:2, :-1])  # no costs and no reference costs


def test_train_radar_over_a_latency_family(flat_pair, tmp_path):
    from adaptree.offline.latency import LatencyModel

    target, head = flat_pair
    store = RadarStore(tmp_path / "d", {"model": "m", "head": "h"}, SETTINGS)
    store.record(Engine(target, head), [(f"p{i}", [x % 8 for x in p]) for i, p in enumerate(PROMPTS)], progress=False)
    LatencyModel(draft=[0.01, 0, 0, 0], verify=[0.03, 0.001, 0, 0]).save(tmp_path / "a.json")
    LatencyModel(draft=[0.001, 0, 0, 0], verify=[0.05, 0.0001, 0, 0]).save(tmp_path / "b.json")
    s = train_radar(RadarTrainConfig(data=str(tmp_path / "d"), out=str(tmp_path / "r"), alphas=(0.0,), steps=10,
                                     batch_size=16, hidden=8, eval_every=5, checkpoint_every=5, val_fraction=0.3,
                                     latency=str(tmp_path / "a.json"), family=(str(tmp_path / "b.json"),), spread=1.5,
                                     members=3, costs=True), progress=False)
    assert s["chosen_by"] == "speedup" and len(s["family"]["bases"]) == 2
    assert len(s["grid"]["0"]["per_machine"]) == 2 and s["train_cycles"] > 0
    pol = RadarPolicy.load(tmp_path / "r" / "policy")
    assert pol.config.cost_features and len(pol.config.reference_costs) == 5
    ctl = make_controller("radar", policy=str(tmp_path / "r" / "policy"), width=3, latency=str(tmp_path / "b.json"))
    assert ctl.costs is not None and ctl.gate.latency is not None
    with pytest.raises(ValueError, match="latency model"):
        RadarTrainConfig(t_fixed=1.0, t_draft=0.1, costs=True)


# ----------------------------------------------------------------------------- V per depth from the machine

# A CPU-like machine (every verified node costs), a GPU-like one (verification nearly flat in V) and a calibrated
# piecewise-linear one (a jump from 1 to 2 rows), as in tests/test_oracle.py.
TABLE_LATENCIES = {
    "cpu": dict(draft=[2e-3, 1e-4, 1e-6, 1e-8], verify=[8e-3, 2e-3, 2e-6, 1e-8], other_s=5e-4),
    "gpu": dict(draft=[4e-3, 1e-6, 1e-7, 0.0], verify=[1e-2, 1e-6, 1e-6, 1e-10], other_s=1e-4),
    "knots": dict(draft=[2e-3, 1e-4, 1e-6, 1e-8], verify=[8e-3, 2e-6, 1.4e-2, 2e-6, 1.5e-2, 2.5e-6, 2e-2, 4e-6, 6e-2,
                                                          1e-5], other_s=5e-4, verify_knots=[1, 2, 5, 17, 61]),
}
TRACE_W, TRACE_D = 3, 5


def latency_of(name):
    from adaptree.offline.latency import LatencyModel

    return LatencyModel(**TABLE_LATENCIES[name])


@pytest.fixture(scope="module")
def greedy_traces():
    """Greedy traces of a tiny pair (vocabulary 8, W=3, 5 levels, 24 tokens) whose acceptance grows with the depth
    where verification is cheap, one trace cut short by the context limit."""
    from adaptree.offline.traces import TraceSettings, record_trace

    target = tiny_target(vocab=8, seed=3)
    head = tiny_head(target, draft_vocab=6, seed=4)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s = TraceSettings(widths=(TRACE_W,), max_depth=TRACE_D, max_new_tokens=24, feature_dtype="none")
        out = [record_trace(target, head, [x % 8 for x in p], settings=s, key=f"p{i}") for i, p in enumerate(PROMPTS)]
        short = TraceSettings(widths=(TRACE_W,), max_depth=TRACE_D, max_new_tokens=24, max_seq_len=30,
                              feature_dtype="none")
        out.append(record_trace(target, head, [x % 8 for x in PROMPTS[3]], settings=short, key="short"))
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.parametrize("lat_name", sorted(TABLE_LATENCIES))
def test_sizes_by_depth_is_the_best_static_tree_of_each_depth(greedy_traces, lat_name):
    from adaptree.methods.radar.dataset import TraceCycles
    from adaptree.offline.oracle import best_static, sizes_by_depth

    lat = latency_of(lat_name)
    traces = greedy_traces[:4]
    table = sizes_by_depth(traces, lat, width=TRACE_W)  # depths 1..12 asked, the traces have 5
    assert sorted(table) == list(range(1, TRACE_D + 1))
    for d, v in table.items():
        assert v == best_static(traces, lat, widths=(TRACE_W,), depths=[d]).size
    assert sizes_by_depth(traces, lat, width=TRACE_W, depths=[2, 4]) == {2: table[2], 4: table[4]}
    # RADAR's per-machine tables (computed from arrays built once) are the oracle's, and so is the reference tree
    for trs in (traces, greedy_traces):
        m = TraceCycles(trs, TRACE_W, TRACE_D).machine(lat)
        best = best_static(trs, lat, widths=(TRACE_W,), depths=range(1, TRACE_D + 1))
        assert m.table == sizes_by_depth(trs, lat, width=TRACE_W) and (m.depth, m.size) == (best.depth, best.size)
    if lat_name == "gpu":
        assert table[TRACE_D] > table[1]  # cheap verification: deeper trees verify more
    with pytest.raises(ValueError, match="max_depth"):
        sizes_by_depth(traces, lat, width=TRACE_W, depths=[9])


def write_tuned(path, table, width=TRACE_W):
    path.write_text(json.dumps({"width": width, "depth": 1, "size": 2, "size_by_depth": {str(d): v for d, v in
                                                                                          table.items()}}))
    return str(path)


def test_controller_verifies_the_machine_table(tmp_path):
    RadarPolicy(RadarModelConfig(width=3, max_depth=5, hidden=8)).save(tmp_path / "old")
    tuned = write_tuned(tmp_path / "static_gs.json", {1: 2, 2: 5, 3: 9})
    ctl = make_controller("radar", policy=str(tmp_path / "old"), width=3, machine={"tuned": tuned})
    assert ctl.config.tuned == tuned
    assert [ctl.size_at(d) for d in range(1, 6)] == [2, 5, 9, 9, 9]  # past the table: its deepest V
    assert ctl.smallest == (3, 2, 5)
    for d in (1, 3):
        assert ctl.choose_size(type("T", (), {"depth": d})(), ctl.plan) == ctl.size_at(d)
    # no table: EAGLE-3's 60 at every depth for a policy trained without tables; a given V wins over the table
    for kw in ({}, {"tuned": str(tmp_path / "plain.json")}):
        (tmp_path / "plain.json").write_text(json.dumps({"width": 3, "depth": 1, "size": 2}))  # tune-static's
        ctl = make_controller("radar", policy=str(tmp_path / "old"), width=3, **kw)
        assert [ctl.size_at(d) for d in range(1, 6)] == [60] * 5 and ctl.smallest == (3, 60, 5)
    ctl = make_controller("radar", policy=str(tmp_path / "old"), width=3, size=20, tuned=tuned)
    assert [ctl.size_at(d) for d in range(1, 6)] == [20] * 5
    # a table searched for another W is not this one's
    ctl = make_controller("radar", policy=str(tmp_path / "old"), width=3,
                          tuned=write_tuned(tmp_path / "w10.json", {1: 7}, width=10))
    assert ctl.size_at(1) == 60
    # a policy trained with tables: the machine's table, else the one it stores
    with pytest.raises(ValueError, match="reference_sizes"):
        RadarModelConfig(width=3, max_depth=5, size_table=True)
    with pytest.raises(ValueError, match="one V >= 1 per depth"):
        RadarModelConfig(width=3, max_depth=5, size_table=True, reference_sizes=[1, 2])
    RadarPolicy(RadarModelConfig(width=3, max_depth=5, hidden=8, size_table=True,
                                 reference_sizes=[1, 3, 6, 6, 8])).save(tmp_path / "new")
    assert RadarPolicy.load(tmp_path / "new").config.reference_sizes == [1, 3, 6, 6, 8]
    ctl = make_controller("radar", policy=str(tmp_path / "new"), width=3)
    assert [ctl.size_at(d) for d in range(1, 6)] == [1, 3, 6, 6, 8]
    ctl = make_controller("radar", policy=str(tmp_path / "new"), width=3, tuned=tuned)
    assert [ctl.size_at(d) for d in range(1, 6)] == [2, 5, 9, 9, 9]
    with pytest.raises(FileNotFoundError, match="V table"):
        RadarConfig(tuned=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="size"):
        RadarConfig(size=0)


def test_the_shipped_policy_sees_the_machine():
    """The shipped policy (retrained over the standard family on greedy traces) loads strictly, verifies the
    machine's V per depth (the head's static tree without a machine setup), and sees the costs, the match and the
    machine tree; a policy of the old format (V = 60, no table) still verifies 60 at every depth."""
    from pathlib import Path

    import adaptree

    folder = Path(adaptree.__file__).parent / "heads" / "smollm2-135m" / "radar"
    pol = RadarPolicy.load(folder)
    c = pol.config
    assert c.size_table and c.cost_features and c.tree_features and c.match_features and c.max_depth == 12
    ctl = make_controller("radar", head_folder=folder.parent)
    assert ctl.machine_tree is not None and ctl.size_at(1) == ctl.machine_tree.size_at(1)
    assert ctl.costs is not None and ctl.costs.numel() == c.n_costs  # the reference costs and the head's tree
    RadarPolicy(RadarModelConfig(width=10, max_depth=8, hidden=8)).save(Path("/tmp") / "radar-old-format")
    old = RadarController(RadarConfig(policy="/tmp/radar-old-format"))
    assert [old.size_at(d) for d in range(1, 9)] == [60] * 8


def test_trace_cycles_are_the_simulator_s_cycles(greedy_traces):
    """At the roots the machine's best static tree visits, every stop point's accepted length is the simulator's for
    the static tree of that depth and the machine's V there, the beam scores are the replayed tree's, and the
    reference trajectory is the simulator's cycle for cycle."""
    from adaptree.core.controller import StaticConfig, StaticController
    from adaptree.methods.radar.dataset import TraceCycles
    from adaptree.offline.simulator import ReplayTree, simulate_one
    from adaptree.offline.traces import num_candidates

    lat = latency_of("knots")
    cycles = TraceCycles(greedy_traces, TRACE_W, TRACE_D)
    m = cycles.machine(lat)
    checked = 0
    for tr, rec in zip(greedy_traces, cycles.records(m)):
        n = tr.prompt_len
        pos = rec.context_len - n
        acc = rec.dist.argmax(-1)  # [P, D]
        assert (rec.dist.sum(-1) == 1).all() and (rec.dist.max(-1) == 1).all()  # greedy: point masses
        ref = simulate_one(StaticController(StaticConfig(TRACE_W, m.depth, m.size)), tr, lat, measure_policy=False)
        drafted = [c for c in ref.cycles if c.depth > 0]
        assert [c.context_len - n for c in drafted] == pos.tolist()
        assert [c.accepted for c in drafted] == rec.accepted.tolist() == acc[:, m.depth - 1].tolist()
        for d in range(1, TRACE_D + 1):
            run = simulate_one(StaticController(StaticConfig(TRACE_W, d, m.table[d])), tr, lat, measure_policy=False)
            sim = {c.context_len - n: (c.accepted, c.size) for c in run.cycles if c.depth > 0}
            for i, j in enumerate(pos.tolist()):
                if j in sim:
                    assert sim[j] == (acc[i, d - 1], rec.sizes[i, d - 1])
                    checked += 1
        for i, j in enumerate(pos.tolist()):
            tree = ReplayTree(tr.width(TRACE_W), j, int(tr.output[j]), n + j)
            steps = [tree.first_step()] + [tree.step() for _ in range(TRACE_D - 1)]
            np.testing.assert_array_equal(rec.scores[i], torch.stack([s.beam_scores for s in steps]).numpy())
        for d in range(1, TRACE_D + 1):  # the engine's clamps: the candidates and the context room
            room = tr.max_len - rec.context_len - 1
            np.testing.assert_array_equal(rec.sizes[:, d - 1], np.minimum(min(m.table[d], num_candidates(TRACE_W, d)),
                                                                          room))
    assert checked > 40


def test_trace_cycles_with_the_context_chain_are_the_simulator_s(greedy_traces):
    """With chains every stop point's tree carries the whole context chain: the reference trajectory, accepted lengths
    and verified nodes are the simulator's for the static tree verified with the context match's chain."""
    from adaptree.core.context import ContextIndex
    from adaptree.core.controller import StaticConfig, StaticController
    from adaptree.methods.radar.dataset import TraceCycles
    from adaptree.offline.simulator import simulate_one

    class StaticWithChain(StaticController):
        def context_index(self):
            return ContextIndex(max_ngram=3)

        def begin_cycle(self, ctx):
            m = ctx.index.match(6, 1)
            return self.plan.with_chain(m.tokens if m is not None else ())

    lat = latency_of("gpu")
    cycles = TraceCycles(greedy_traces, TRACE_W, TRACE_D, chain_tokens=6, max_ngram=3)
    m = cycles.machine(lat)
    chained = 0
    for tr, rec in zip(greedy_traces, cycles.records(m)):
        for d in (m.depth, TRACE_D):
            run = simulate_one(StaticWithChain(StaticConfig(TRACE_W, d, m.table[d])), tr, lat, measure_policy=False)
            sim = {c.context_len - tr.prompt_len: (c.accepted, c.size + c.chain_nodes, c.chain) for c in run.cycles
                   if c.depth > 0}
            if d == m.depth:
                assert sorted(sim) == (rec.context_len - tr.prompt_len).tolist()
            for i, j in enumerate((rec.context_len - tr.prompt_len).tolist()):
                if j in sim:
                    assert sim[j][:2] == (rec.dist[i, d - 1].argmax(), rec.sizes[i, d - 1])
                    assert rec.match_length[i] > 0 or sim[j][2] == 0  # a chain comes from a match (the room may cut it)
                    chained += sim[j][2] > 0
        assert rec.dist.shape[-1] == 7  # up to max(D_max, K) = 6 tokens
    assert chained > 10


def save_traces(traces, folder):
    from adaptree.offline.traces import TraceStore

    store = TraceStore(folder, {k: traces[0].fingerprints[k] for k in ("model", "head")}, traces[0].settings)
    for t in traces:
        store.put(t)
    return str(folder)


def test_train_radar_on_traces_over_a_family_exports_a_table_policy(greedy_traces, tmp_path, capsys):
    """A tiny run over a family (a latency file and a family index) on greedy traces: the exported policy loads
    strictly, records its V table, and replays in the simulator verifying the machine's V at each depth."""
    from adaptree.offline.family import Member, write_index
    from adaptree.offline.latency import LatencyModel
    from adaptree.offline.simulator import simulate

    folder = save_traces(greedy_traces[:4], tmp_path / "traces")
    latency_of("cpu").save(tmp_path / "cpu.json")
    write_index([Member("gpu", latency_of("gpu"), False, "test"), Member("knots", latency_of("knots"), False, "test"),
                 Member("held", latency_of("cpu"), True, "test")], tmp_path / "fam")
    base = dict(traces=folder, latency=str(tmp_path / "cpu.json"), alphas=(0.0, 0.01), steps=6, batch_size=16,
                hidden=8, eval_every=3, checkpoint_every=3, val_fraction=0.3, members=3, spread=1.5, costs=True)
    s = train_radar(RadarTrainConfig(out=str(tmp_path / "r"), family=(str(tmp_path / "fam" / "family.json"),),
                                     **base), progress=False)
    assert s["chosen_by"] == "speedup" and s["traces"] == folder and s["train_cycles"] > 0
    assert sorted(s["size_tables"]) == ["gpu", "knots", "main"] and len(s["grid"]["0"]["per_machine"]) == 3
    assert s["family"]["bases"].keys() == {"main", "gpu", "knots"}  # the held-out member is not trained on
    pol = RadarPolicy.load(tmp_path / "r" / "policy")
    c = pol.config
    assert c.size_table and c.max_depth == TRACE_D and c.width == TRACE_W and c.cost_features
    assert c.reference_sizes == s["reference_sizes"] and len(c.reference_sizes) == TRACE_D
    lat = LatencyModel.load(tmp_path / "cpu.json")
    table = dict(enumerate(s["size_tables"]["main"]["sizes"], start=1))
    tuned = write_tuned(tmp_path / "static_gs.json", table)
    ctl = make_controller("radar", policy=str(tmp_path / "r" / "policy"), width=TRACE_W, latency=str(tmp_path /
                          "cpu.json"), tuned=tuned, ar_fallback=False)
    res = simulate(ctl, greedy_traces, lat, measure_policy=False)
    drafted = [(tr, c) for tr, r in zip(greedy_traces, res.runs) for c in r.cycles if c.depth > 0]
    assert drafted and all(c.size == min(table[c.depth], c.candidates, tr.max_len - c.context_len - 1)
                           for tr, c in drafted)
    assert s["size_tables"]["gpu"]["sizes"] != s["size_tables"]["main"]["sizes"]  # V follows the machine
    # greedy traces with the context match observed: a chain calibration fitted on the training traces
    s = train_radar(RadarTrainConfig(out=str(tmp_path / "m"), match=True, **{**base, "alphas": (0.0,), "steps": 3,
                                                                               "spread": 1.0, "costs": False}),
                    progress=False)
    pol = RadarPolicy.load(tmp_path / "m" / "policy")
    assert pol.config.match_features and pol.config.size_table and (tmp_path / "m" / "chain.json").is_file()
    ctl = make_controller("radar", policy=str(tmp_path / "m" / "policy"), width=TRACE_W,
                          chain=str(tmp_path / "m" / "chain.json"), ar_fallback=False)
    assert simulate(ctl, greedy_traces[:2], lat, measure_policy=False).runs[0].cycles
    with pytest.raises(ValueError, match="only with traces"):
        RadarTrainConfig(t_fixed=1.0, t_draft=0.1, width=3)
    from adaptree.cli import main  # the command line: flags from the config, the tables printed

    latency_of("gpu").save(tmp_path / "gpu.json")
    assert main(["train", "radar", "--traces", folder, "--latency", str(tmp_path / "cpu.json"), "--family",
                 str(tmp_path / "gpu.json"), "--costs", "--alphas", "0", "--steps", "2", "--batch-size", "8",
                 "--hidden", "8", "--max-depth", "3", "--out", str(tmp_path / "c"), "--quiet"]) == 0
    assert "V per depth" in capsys.readouterr().out
    assert RadarPolicy.load(tmp_path / "c" / "policy").config.max_depth == 3
    with pytest.raises(ValueError, match="max_depth must be in 2..5"):
        train_radar(RadarTrainConfig(out=str(tmp_path / "x"), **{**base, "max_depth": 7}), progress=False)


def test_a_radar_policy_that_sees_the_machine_tree(greedy_traces, tmp_path):
    """With machine_tree the cost input ends with the machine's static depth and V: fitted per machine in training,
    read from the machine setup's static_gs.json at inference, and required there."""
    import json as _json

    from adaptree.methods.common import MachineTree
    from adaptree.offline.latency import LatencyModel
    from adaptree.offline.simulator import simulate

    folder = save_traces(greedy_traces[:4], tmp_path / "traces")
    latency_of("cpu").save(tmp_path / "cpu.json")
    latency_of("gpu").save(tmp_path / "gpu.json")
    s = train_radar(RadarTrainConfig(out=str(tmp_path / "r"), traces=folder, latency=str(tmp_path / "cpu.json"),
                                     family=(str(tmp_path / "gpu.json"),), costs=True, machine_tree=True,
                                     alphas=(0.0,), steps=4, batch_size=16, hidden=8, eval_every=2,
                                     checkpoint_every=2, val_fraction=0.3, members=2), progress=False)
    pol = RadarPolicy.load(tmp_path / "r" / "policy")
    assert pol.config.tree_features and pol.config.n_costs == 7
    lat = LatencyModel.load(tmp_path / "cpu.json")
    mt = MachineTree.fit(greedy_traces, lat, TRACE_W, TRACE_D)
    (tmp_path / "static_gs.json").write_text(_json.dumps({"width": TRACE_W, **mt.to_dict()}))
    ctl = make_controller("radar", policy=str(tmp_path / "r" / "policy"), width=TRACE_W, ar_fallback=False,
                          latency=str(tmp_path / "cpu.json"), tuned=str(tmp_path / "static_gs.json"))
    assert ctl.costs[-2:].tolist() == pytest.approx([mt.depth / TRACE_D, np.log2(mt.size) / 8])
    assert simulate(ctl, greedy_traces[:2], lat, measure_policy=False).runs[0].cycles
    with pytest.raises(ValueError, match="--radar-tuned"):
        make_controller("radar", policy=str(tmp_path / "r" / "policy"), width=TRACE_W, ar_fallback=False,
                        latency=str(tmp_path / "cpu.json"))
    assert s["train_cycles"] > 0
