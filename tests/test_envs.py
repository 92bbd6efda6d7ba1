"""gymnasium environments over the engine seam: check_env, exact rewards, the bridge against simulate."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from adaptree.core.engine import Engine
from adaptree.methods import StaticConfig, StaticController
from adaptree.methods.ltd.controller import LTDObservation
from adaptree.methods.ltd.env import DepthEnv, RandomDepthController, SizeEnv
from adaptree.methods.resps.env import PlanEnv
from adaptree.offline.envs import LiveSource, SimSource
from adaptree.offline.latency import LatencyModel
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import TraceSettings, record_trace

PROMPTS = [[1, 5, 3], [2, 9], [7, 7, 7, 7, 1, 0, 9]]
SETTINGS = TraceSettings(widths=(4,), max_depth=6, max_new_tokens=24, feature_dtype="float32")
LAT = LatencyModel(draft=[0.004, 0.0001, 1e-6, 0.0], verify=[0.03, 0.001, 2e-5, 1e-7], other_s=0.001)
OBS = LTDObservation(width=4, max_depth=6)


@pytest.fixture(scope="module")
def traces(models):
    target, head = models
    with torch.inference_mode():
        return [record_trace(target, head, p, settings=SETTINGS, key=f"p{i}") for i, p in enumerate(PROMPTS)]


def static(d=6, v=10):
    return StaticController(StaticConfig(4, d, v))


def make_envs(traces):
    src = SimSource(traces, LAT)
    return [
        DepthEnv(src, OBS, static()),
        SizeEnv(src, OBS, lambda rng: RandomDepthController(rng, width=4, max_depth=6), sizes=[2, 4, 8, 16]),
        PlanEnv(src, [(4, 2, 4), (4, 4, 12), (4, 6, 30)], 96, lambda ctx: ctx.features.numpy(), interval=3),
    ]


def test_check_env_passes_on_every_environment(traces):
    for env in make_envs(traces):
        check_env(env, skip_render_check=True)
        env.close()


def test_observation_dims_and_content(traces):
    env = DepthEnv(SimSource(traces, LAT), OBS, static())
    obs, _ = env.reset(seed=3)
    assert obs.shape == (OBS.depth_dim,) == (16 + 2,)
    # depth 1: W=4 scores sorted descending, the rest padded with the floor
    s = obs[:16]
    assert np.all(np.diff(s[:4]) <= 0) and np.all(s[4:] == np.float32(OBS.score_floor * OBS.score_scale))
    assert obs[16] == pytest.approx(1 / 6)  # D / max_depth
    assert obs[17] > 0  # L / 1000
    obs2, r, term, trunc, _ = env.step(1)
    assert not term and r == 0.0 and obs2[16] == pytest.approx(2 / 6)
    assert np.all(obs2[:16] > OBS.score_floor * OBS.score_scale)  # W² real scores at depth 2
    env.close()


def test_depth_env_reward_is_the_cycles_throughput_and_matches_simulate(traces):
    """Always-CONTINUE through the env replays exactly the static controller: same cycles, and each
    episode's reward is that cycle's (accepted + 1) / (draft + verify) in AR-step units."""
    src = SimSource([traces[0]], LAT)
    env = DepthEnv(src, OBS, static())
    ref = simulate(static(), traces[0], LAT, measure_policy=False).runs[0]
    obs, _ = env.reset(seed=0)
    rewards = []
    while len(rewards) < len(ref.cycles):
        obs, r, term, trunc, info = env.step(1)
        if term:
            rewards.append((r, env.last_cycle.to_dict()))
            obs, _ = env.reset()
    env.close()
    for (r, c), rc in zip(rewards, ref.cycles):
        assert c["accepted"] == rc.accepted and c["depth"] == rc.depth == 6
        assert r == pytest.approx((rc.accepted + 1) / (rc.draft_s + rc.verify_s) * src.reference_step_s)


def test_depth_env_stop_gives_depth_one_cycles(traces):
    env = DepthEnv(SimSource(traces, LAT), OBS, static())
    env.reset(seed=1)
    for _ in range(10):
        _, r, term, _, info = env.step(0)
        assert term and info["cycle"]["depth"] == 1 and r > 0
        env.reset()
    env.close()


def test_size_env_uses_the_chosen_size_and_random_depths(traces):
    env = SizeEnv(SimSource(traces, LAT), OBS, lambda rng: RandomDepthController(rng, width=4, max_depth=6),
                  sizes=[2, 4, 8, 16])
    depths = set()
    env.reset(seed=0)
    for i in range(40):
        a = i % 4
        _, r, term, _, info = env.step(a)
        c = info["cycle"]
        assert term and c["size"] == min([2, 4, 8, 16][a], c["candidates"])
        depths.add(c["depth"])
        env.reset()
    env.close()
    assert len(depths) >= 4  # the random depth rule varies the tree


def test_plan_env_keeps_an_action_for_the_interval_and_ends_with_the_generation(traces):
    plans = [(4, 2, 4), (4, 4, 12)]
    env = PlanEnv(SimSource([traces[0]], LAT), plans, 96, lambda ctx: ctx.features.numpy(), interval=3)
    env.reset(seed=0)
    steps, done = 0, False
    while not done:
        _, r, done, _, info = env.step(1)
        steps += 1
        assert r > 0 and info["cycles"] <= 3
    env.close()
    ref = simulate(StaticController(StaticConfig(4, 4, 12)), traces[0], LAT, measure_policy=False).runs[0]
    assert steps == -(-len(ref.cycles) // 3)  # one step per 3 cycles of the static (4, 4, 12) run


def test_reset_mid_episode_abandons_it_cleanly(traces):
    env = DepthEnv(SimSource(traces, LAT), OBS, static())
    env.reset(seed=0)
    env.step(1)
    obs, _ = env.reset()  # mid-cycle: the cycle finishes with the inner rule, silently
    assert obs[16] == pytest.approx(1 / 6)  # a new cycle starts at depth 1
    _, r, term, _, _ = env.step(0)
    assert term
    env.close()


def test_bad_arguments_name_the_value(traces):
    src = SimSource(traces, LAT)
    with pytest.raises(ValueError, match="reward 'speed'"):
        DepthEnv(src, OBS, static(), reward="speed")
    with pytest.raises(ValueError, match="sizes"):
        SizeEnv(src, OBS, static(), sizes=[])
    with pytest.raises(ValueError, match="interval"):
        PlanEnv(src, [(4, 2, 4), (4, 3, 4)], 96, lambda c: c.features.numpy(), interval=0)
    with pytest.raises(ValueError, match="latency"):
        SimSource(traces, None)
    env = DepthEnv(src, OBS, static())
    with pytest.raises(RuntimeError, match="reset"):
        env.step(0)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="action 5"):
        env.step(5)
    env.close()


def test_live_env_wall_clock_rewards(models):
    target, head = models
    engine = Engine(target, head)
    src = LiveSource(engine, PROMPTS, max_new_tokens=12)
    # check_env asserts equal rewards for equal seeds: wall-clock rewards never are, the acceptance reward is
    env = DepthEnv(src, OBS, static(), reward="acceptance")
    check_env(env, skip_render_check=True)
    env.close()
    env = DepthEnv(src, OBS, static())
    env.reset(seed=0)
    n = 0
    for _ in range(30):
        _, r, term, _, info = env.step(int(np.random.default_rng(n).integers(2)))
        if term:
            n += 1
            assert r > 0 and env.last_cycle.verify_s > 0 and env.last_cycle.accepted == info["cycle"]["accepted"]
            env.reset()
    env.close()
    assert n > 3


def test_a_live_source_serves_one_environment_at_a_time(models):
    target, head = models
    src = LiveSource(Engine(target, head), PROMPTS, max_new_tokens=8)
    a = DepthEnv(src, OBS, static())
    b = DepthEnv(src, OBS, static())
    a.reset(seed=0)
    with pytest.raises(RuntimeError, match="serves another environment"):
        b.reset(seed=0)
    a.close()
    b.reset(seed=0)  # free again once the first is closed
    b.close()
