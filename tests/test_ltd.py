"""LTD: observations, policy files, the controller (lossless, replayable, true L, every step) and training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ties import assert_mostly_exact, lossless_replays, replay_against_live

from adaptree.core.context import ContextMatch
from adaptree.core.controller import TreePlan
from adaptree.core.engine import Engine
from adaptree.core.tree import DraftTree
from adaptree.methods import StaticConfig, StaticController, make_controller
from adaptree.methods.ltd.controller import (
    LTD_SIZES,
    LTDConfig,
    LTDController,
    LTDObservation,
)
from adaptree.offline.latency import LatencyModel
from adaptree.offline.policy import MLPPolicy, MLPPolicyConfig
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import TraceSettings, record_trace

PROMPTS = [[1, 5, 3], [2, 9], [7, 7, 7, 7, 1, 0, 9], [4, 11, 2, 8, 15, 3, 6, 1, 12, 13, 5], [3, 3], [8, 1, 2, 3]]
N_NEW = 30
W, DMAX = 4, 6
OBS = LTDObservation(width=W, max_depth=DMAX)
LAT = LatencyModel(draft=[0.004, 0.0001, 1e-6, 0.0], verify=[0.03, 0.001, 2e-5, 1e-7], other_s=0.001)


@pytest.fixture(scope="module")
def traces(models):
    target, head = models
    s = TraceSettings(widths=(W,), max_depth=DMAX, max_new_tokens=N_NEW, feature_dtype="none")
    with torch.inference_mode():
        return [record_trace(target, head, p, settings=s, key=f"p{i}") for i, p in enumerate(PROMPTS)]


def random_policy(kind: str, seed: int, obs: LTDObservation = OBS, hidden=(16,)) -> MLPPolicy:
    torch.manual_seed(seed)
    if kind == "depth":
        cfg = MLPPolicyConfig("ltd-depth", obs.depth_dim, ["stop", "continue"], list(hidden), observation=obs.to_dict())
    else:
        cfg = MLPPolicyConfig("ltd-size", obs.size_dim, [2, 5, 9, 14], list(hidden), observation=obs.to_dict())
    return MLPPolicy(cfg).eval()


def rule_policy(kind: str, c0: float = 0.3) -> MLPPolicy:
    """Hand-set weights with decisions that vary with D and L: the depth policy continues while
    50·D/max_depth < L + 50·(c0 - 0.2) (deeper as the context grows); the size policy picks a larger V as L
    grows."""
    pol = random_policy(kind, 0, hidden=(1,))
    n = pol.config.obs_dim
    with torch.no_grad():
        for p in pol.parameters():
            p.zero_()
        w = pol.body[0].weight
        if kind == "depth":
            w[0, n - 2], w[0, n - 1] = -50.0, 1000.0
            pol.body[0].bias[0] = 50.0 * (c0 - 0.2)
            pol.head.weight[1, 0] = 1.0
        else:
            w[0, n - 1] = 100.0
            pol.body[0].bias[0] = -2.0  # tanh(100 L/1000 - 2): -0.96 at L=1 .. +0.1 at L=21 .. 0.96 at L=40
            pol.head.weight[:, 0] = torch.tensor([-3.0, -1.0, 1.0, 3.0])
            pol.head.bias[:] = torch.tensor([0.0, 1.2, 1.2, 0.0])
    return pol


# ------------------------------------------------------------------------------------------ observations


def grow(models, depth: int, context=(1, 5, 3)):
    target, head = models
    eng = Engine(target, head)
    with torch.inference_mode():
        out = target(torch.tensor([list(context)]), cache=eng.cache, features=True, logits_at=slice(-1, None))
        tree = DraftTree(head, eng.draft_cache, W, 7, len(context))
        toks = torch.tensor([list(context[1:]) + [7]])
        steps = [tree.first_step(out.features, toks)]
        while tree.depth < depth:
            steps.append(tree.step())
    return tree, steps


def test_depth_observation_is_the_sorted_frontier_then_d_and_l(models):
    tree, steps = grow(models, 3)
    o1 = OBS.depth_obs(steps[0])
    assert o1.shape == (OBS.depth_dim,) == (W * W + 2,)
    want = torch.sort(steps[0].child_scores.reshape(-1), descending=True).values * OBS.score_scale
    assert torch.allclose(o1[:W], want) and torch.all(o1[W:W * W] == OBS.score_floor * OBS.score_scale)
    assert o1[-2] == pytest.approx(1 / DMAX) and o1[-1] == pytest.approx(3 / 1000)
    o3 = OBS.depth_obs(steps[2])
    s3 = torch.sort(steps[2].child_scores.reshape(-1), descending=True).values.clamp(min=OBS.score_floor)
    assert torch.allclose(o3[:W * W], s3 * OBS.score_scale) and o3[-2] == pytest.approx(3 / DMAX)


def test_size_observation_holds_every_candidate(models):
    tree, _ = grow(models, 4)
    o = OBS.size_obs(tree)
    assert o.shape == (OBS.size_dim,) == (W + (DMAX - 1) * W * W + 2,)
    n = tree.num_candidates
    want = torch.sort(tree.candidate_scores(), descending=True).values.clamp(min=OBS.score_floor) * OBS.score_scale
    assert torch.allclose(o[:n], want) and torch.all(o[n:-2] == OBS.score_floor * OBS.score_scale)
    assert o[-2] == pytest.approx(4 / DMAX)


@pytest.mark.parametrize("obs", [OBS, LTDObservation(width=W, max_depth=DMAX, use_depth=False)], ids=["pdl", "pl"])
def test_padded_size_policy_equals_the_full_observation(models, obs):
    """The controller's fast path (padding's share of the first layer cached per tree size) decides exactly
    as the policy does on the materialised observation, at every depth."""
    torch.manual_seed(0)
    pol = MLPPolicy(MLPPolicyConfig("ltd-size", obs.size_dim, list(LTD_SIZES), [64, 16])).eval()
    for depth in range(1, DMAX + 1):
        tree, _ = grow(models, depth)
        head, tail = obs.size_parts(tree)
        full = obs.size_obs(tree)
        assert torch.equal(torch.cat([head, torch.full((obs.max_candidates - head.numel(),), obs.pad_value), tail]),
                           full)
        for _ in range(2):  # the second call uses the cached padding term
            assert pol.act_padded(head, obs.pad_value, obs.max_candidates, tail) == pol.act(full)
        with torch.no_grad():
            logits = pol(full)
        assert (logits.topk(2).values[0] - logits.topk(2).values[1]) > 1e-4  # not a tie: the equality means something
    with pytest.raises(ValueError, match="does not make the policy's"):
        pol.act_padded(head, obs.pad_value, obs.max_candidates + 1, tail)


def test_observation_ablations_and_bad_values(models):
    tree, steps = grow(models, 2)
    pl = LTDObservation(width=W, max_depth=DMAX, use_depth=False)
    pd = LTDObservation(width=W, max_depth=DMAX, use_length=False)
    assert pl.depth_obs(steps[-1]).shape == (W * W + 1,) and pl.depth_obs(steps[-1])[-1] == pytest.approx(3 / 1000)
    assert pd.size_obs(tree).shape == (pd.max_candidates + 1,) and pd.size_obs(tree)[-1] == pytest.approx(2 / DMAX)
    with pytest.raises(ValueError, match="do not fit"):
        LTDObservation(width=W, max_depth=1).size_obs(tree)
    with pytest.raises(ValueError, match="score_floor"):
        LTDObservation(score_floor=1.0)
    with pytest.raises(ValueError, match="max_depth"):
        LTDObservation(max_depth=0)


# ------------------------------------------------------------------------------------------ policy files


def test_policy_round_trip_and_strict_loading(tmp_path):
    pol = random_policy("size", 0)
    pol.save(tmp_path / "p", training={"note": "x"})
    again = MLPPolicy.load(tmp_path / "p", kind="ltd-size")
    x = torch.randn(OBS.size_dim)
    assert torch.equal(pol(x), again(x)) and again.config == pol.config
    with pytest.raises(ValueError, match="'ltd-size' policy, a 'ltd-depth'"):
        MLPPolicy.load(tmp_path / "p", kind="ltd-depth")
    from safetensors.torch import load_file, save_file

    w = load_file(str(tmp_path / "p" / "model.safetensors"))
    bad = dict(w)
    bad.pop("head.bias")
    save_file(bad, str(tmp_path / "p" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'head.bias'"):
        MLPPolicy.load(tmp_path / "p")
    bad = dict(w)
    bad["head.weight"] = torch.zeros(3, 16)
    save_file(bad, str(tmp_path / "p" / "model.safetensors"))
    with pytest.raises(ValueError, match="'head.weight' has shape"):
        MLPPolicy.load(tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    cfg["colour"] = "red"
    (tmp_path / "p" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown policy config fields \\['colour'\\]"):
        MLPPolicy.load(tmp_path / "p")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MLPPolicy.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="activation"):
        MLPPolicyConfig("x", 3, [0, 1], activation="gelu")


def test_actor_extracted_from_sb3_gives_the_same_logits():
    import gymnasium as gym
    from stable_baselines3 import PPO

    class Dummy(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (7,), np.float32)
        action_space = gym.spaces.Discrete(3)

        def reset(self, *, seed=None, options=None):
            return np.zeros(7, np.float32), {}

        def step(self, a):
            return np.zeros(7, np.float32), 0.0, True, False, {}

    model = PPO("MlpPolicy", Dummy(), policy_kwargs=dict(net_arch=dict(pi=[32, 16], vf=[8])), device="cpu", seed=0)
    pol = MLPPolicy.from_sb3(model.policy, MLPPolicyConfig("t", 7, [0, 1, 2], [32, 16]))
    x = torch.randn(5, 7)
    with torch.no_grad():
        want = model.policy.get_distribution(x).distribution.logits
        got = torch.log_softmax(pol(x), -1)
    assert torch.allclose(want, got, atol=1e-6)
    with pytest.raises(ValueError, match="linear layers"):
        MLPPolicy.from_sb3(model.policy, MLPPolicyConfig("t", 7, [0, 1, 2], [32]))


# ------------------------------------------------------------------------------------------ controller


@pytest.mark.parametrize("mode,seed", [("both", 0), ("both", 2), ("depth", 1), ("size", 0)])
def test_ltd_is_lossless_and_replays_like_the_live_engine(models, traces, mode, seed):
    target, head = models
    dp, sp = rule_policy("depth", 0.2 + 0.1 * seed), rule_policy("size")

    def make():
        return LTDController(LTDConfig(width=W, depth=DMAX if mode != "size" else 4, size=7, mode=mode),
                             depth_policy=dp, size_policy=sp)

    eng = Engine(target, head)
    depths, sizes = set(), set()
    checks = []
    for prompt, tr in zip(PROMPTS, traces):
        ar = eng.generate(prompt, None, max_new_tokens=N_NEW)
        check = replay_against_live(eng, make(), make(), prompt, tr, N_NEW)  # the replay: up to near-ties
        live = check.live
        assert live.token_ids == ar.token_ids  # lossless (fp32 greedy): exact
        checks.append(check)
        depths |= {c.depth for c in live.cycles}
        sizes |= {c.size for c in live.cycles}
    assert_mostly_exact(checks)
    if mode in ("both", "depth"):
        assert len(depths) > 1  # the policy really varies the depth
    if mode in ("both", "size"):
        assert len(sizes) > 1


class Spy(LTDController):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = []

    def continue_drafting(self, step):
        obs = self.depth_obs.depth_obs(step)
        self.seen.append((step.depth, step.context_len, float(obs[-1])))
        return super().continue_drafting(step)


def test_depth_policy_sees_every_step_and_the_true_context_length(models):
    """The public code's defects: L was a constant at inference and the policy ran every 3rd step."""
    target, head = models
    always = random_policy("depth", 0)
    with torch.no_grad():
        always.head.weight.zero_()
        always.head.bias.copy_(torch.tensor([0.0, 1.0]))  # always CONTINUE
    spy = Spy(LTDConfig(width=W, depth=DMAX, size=7, mode="depth"), depth_policy=always)
    res = Engine(target, head).generate(PROMPTS[3], spy, max_new_tokens=N_NEW)
    per_cycle = len(spy.seen) / len(res.cycles)
    assert per_cycle == DMAX - 1  # asked after every draft forward but the last
    assert [d for d, _, _ in spy.seen[:DMAX - 1]] == list(range(1, DMAX))
    lengths = [(L, f) for _, L, f in spy.seen]
    assert lengths[0][0] == len(PROMPTS[3]) and all(f == pytest.approx(L / 1000) for L, f in lengths)
    assert len({L for L, _ in lengths}) == len(res.cycles)  # grows with every cycle


def test_ltd_config_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="--ltd-depth-policy"):
        make_controller("ltd")
    with pytest.raises(ValueError, match="--ltd-size-policy"):
        make_controller("ltd-size")
    with pytest.raises(ValueError, match="mode"):
        LTDConfig(mode="half")
    with pytest.raises(ValueError, match="W=4"):
        LTDController(LTDConfig(width=10, mode="depth"), depth_policy=random_policy("depth", 0))
    with pytest.raises(ValueError, match="max_depth 6"):
        LTDController(LTDConfig(width=W, depth=9, mode="size"), size_policy=random_policy("size", 0))
    random_policy("depth", 0).save(tmp_path / "d")
    random_policy("size", 0).save(tmp_path / "s")
    ctl = make_controller("ltd", depth_policy=str(tmp_path / "d"), size_policy=str(tmp_path / "s"), width=W)
    assert ctl.name == "ltd" and ctl.plan.max_depth == DMAX
    with pytest.raises(ValueError, match="'ltd-size' policy, a 'ltd-depth'"):
        make_controller("ltd-depth", depth_policy=str(tmp_path / "s"), width=W)


# ------------------------------------------------------------------------------------------ training


def tiny_train_config(out, **kw):
    from adaptree.methods.ltd.train import LTDTrainConfig

    base = dict(out=str(out), width=W, max_depth=DMAX, sizes=(2, 4, 8, 16), size_steps=2048, depth_steps=4096,
                iter_steps=1024, n_envs=4, rollout=512, batch_size=128, n_epochs=4, eval_every=2, fixed_depth=4,
                fixed_size=10, depth_pi=(32,), depth_vf=(32, 16), size_pi=(32, 16), size_vf=(32, 16), threads=1)
    base.update(kw)
    return LTDTrainConfig(**base)


def test_training_pipeline_stages_export_and_resume(traces, tmp_path):
    from adaptree.methods.ltd.train import train_ltd

    cfg = tiny_train_config(tmp_path / "run")
    s = train_ltd(cfg, traces, LAT, progress=False)
    assert list(s["stages"]) == ["stage1-size", "stage1-depth", "iter1-size", "iter2-depth", "iter3-size"]
    assert [r["iteration"] for r in s["iterations"]] == [0, 1, 2, 3]
    assert set(s["train_prompts"]).isdisjoint(s["val_prompts"]) and s["val_prompts"]
    for name in s["stages"]:
        log = (tmp_path / "run" / name / "log.csv").read_text().splitlines()
        assert log[0].startswith("timesteps") and len(log) > 2
    ctl = make_controller("ltd", depth_policy=str(tmp_path / "run/policy/depth"),
                          size_policy=str(tmp_path / "run/policy/size"), width=W)
    chosen = simulate(ctl, [t for t in traces if t.key in s["val_prompts"]], LAT, measure_policy=False)
    assert chosen.speedup == pytest.approx(s["chosen"]["modelled_speedup"])
    assert not list((tmp_path / "run").rglob("*.zip")) and not list((tmp_path / "run").rglob("*.pkl"))
    # a typed result: the run folder, the exported pair, and the summary it wrote
    assert s.out == tmp_path / "run" and s.export == tmp_path / "run/policy" and (s.export / "depth").is_dir()
    assert json.loads((s.out / "summary.json").read_text()) == json.loads(json.dumps(dict(s)))
    # resume: finished stages are not run again
    mtimes = {p: p.stat().st_mtime for p in (tmp_path / "run").glob("*/log.csv")}
    again = train_ltd(cfg, traces, LAT, progress=False)
    assert {p: p.stat().st_mtime for p in mtimes} == mtimes and again["chosen"] == s["chosen"]
    with pytest.raises(ValueError, match="other settings.*iter_steps"):
        train_ltd(tiny_train_config(tmp_path / "run", iter_steps=2048), traces, LAT, progress=False)


def test_ppo_learns_to_stop_when_drafting_is_expensive(traces, tmp_path):
    """With draft steps costing as much as a verification, the best depth is 1: the depth policy must find
    it (static depth 4 at the same V is far slower)."""
    from adaptree.methods.ltd.train import train_ltd

    lat = LatencyModel(draft=[0.03, 0.0, 0.0, 0.0], verify=[0.03, 0.0002, 0.0, 0.0], other_s=0.0)
    s = train_ltd(tiny_train_config(tmp_path / "run", iterations=0, depth_steps=4096), traces, lat, progress=False)
    best_depth = s["stages"]["stage1-depth"]["best"]
    static4 = simulate(StaticController(StaticConfig(W, 4, 10)), [t for t in traces if t.key in s["val_prompts"]],
                       lat, measure_policy=False)
    assert best_depth["mean_depth"] < 1.5
    assert best_depth["modelled_speedup"] > 1.5 * static4.speedup


def test_training_config_errors():
    from adaptree.methods.ltd.train import LTDTrainConfig

    with pytest.raises(ValueError, match="reward"):
        LTDTrainConfig(reward="cycle_throughput")
    with pytest.raises(ValueError, match="iterations"):
        LTDTrainConfig(iterations=4)
    with pytest.raises(ValueError, match="multiple of n_envs"):
        LTDTrainConfig(rollout=1000, n_envs=3)
    with pytest.raises(ValueError, match="sizes"):
        LTDTrainConfig(sizes=(20,))
    assert LTDTrainConfig().sizes == LTD_SIZES


def test_only_the_size_policy_for_the_ablations(traces, tmp_path):
    from adaptree.methods.ltd.train import train_ltd

    s = train_ltd(tiny_train_config(tmp_path / "run", only="size", reward="acceptance"), traces, LAT, progress=False)
    assert list(s["stages"]) == ["stage1-size"] and s["chosen"]["policy"] == "stage1-size"
    pol = MLPPolicy.load(tmp_path / "run/policy/size", kind="ltd-size")
    assert pol.config.actions == [2, 4, 8, 16] and not (tmp_path / "run/policy/depth").exists()


# ----------------------------------------------------------------------------------------------------- context chains

REPEATS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 5, 5, 5, 5], [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def chain_traces(models):
    """Traces 16 tokens longer than the generations replayed on them: a chain's acceptance near the end of a
    generation is then known to the replay too (the live engine verifies past max_new_tokens)."""
    target, head = models
    s = TraceSettings(widths=(W,), max_depth=DMAX, max_new_tokens=N_NEW + 16, feature_dtype="none")
    with torch.inference_mode():
        return [record_trace(target, head, p, settings=s, key=f"p{i}") for i, p in enumerate(PROMPTS + REPEATS)]


def match_policy(kind: str, seed: int) -> MLPPolicy:
    """A random policy that observes the context match; its decisions follow the match features strongly."""
    obs = LTDObservation(width=W, max_depth=DMAX, use_match=True)
    pol = random_policy(kind, seed, obs)
    with torch.no_grad():
        pol.body[0].weight[:, -3:] *= 40.0
    return pol


@pytest.mark.parametrize("observes", [False, True])
def test_ltd_with_a_context_chain_is_lossless_and_replays_like_the_live_engine(models, chain_traces, observes):
    """``chain_tokens`` puts the context's chain next to the policies' tree (ChainRule); policies trained with
    ``match`` see the match features. fp32 greedy output = AR, the replay makes the live decisions."""
    from adaptree.methods.common import ChainCalibration

    target, head = models
    cal = ChainCalibration.fit(chain_traces)
    dp, sp = (match_policy("depth", 1), match_policy("size", 2)) if observes else (rule_policy("depth"),
                                                                                    rule_policy("size"))

    def make():
        ctl = LTDController(LTDConfig(width=W, depth=DMAX, chain_tokens=None if observes else 8), depth_policy=dp,
                            size_policy=sp, chain_calibration=cal)
        ctl.use_latency(LAT)
        return ctl

    checks = lossless_replays(Engine(target, head), make, PROMPTS + REPEATS, chain_traces, N_NEW)
    assert sum(c.chain_accepted for check in checks for c in check.live.cycles) > 0
    assert make().chain_rule.tokens == (16 if observes else 8)
    ctl, priced = make(), 0  # the chain is priced at the gate's running throughput once it has one
    for t in chain_traces:
        simulate(ctl, [t], LAT, measure_policy=False)
        assert ctl.chain_rule.rate == ctl.gate.throughput()
        priced += ctl.chain_rule.rate is not None
    assert priced > 0
    ctl.reset()  # and from each generation's start at the AR rate again
    assert ctl.chain_rule.rate is None and ctl.gate.throughput() is None


def test_match_observations_and_their_errors(models, tmp_path):
    tree, steps = grow(models, 2)
    obs = LTDObservation(width=W, max_depth=DMAX, use_match=True)
    assert obs.depth_dim == OBS.depth_dim + 3 and obs.size_dim == OBS.size_dim + 3
    o = obs.depth_obs(steps[-1], match=[0.5, 0.25, 1.0])
    assert o[-3:].tolist() == [0.5, 0.25, 1.0] and torch.equal(o[:-3], OBS.depth_obs(steps[-1]))
    with pytest.raises(ValueError, match="observes the context match"):
        obs.size_obs(tree)
    with pytest.raises(ValueError, match="--ltd-chain PATH"):
        LTDController(LTDConfig(width=W, depth=DMAX, mode="depth"), depth_policy=match_policy("depth", 0))
    with pytest.raises(ValueError, match="chain_tokens must be >= 1, got 0"):
        LTDController(LTDConfig(width=W, depth=DMAX, mode="depth", chain_tokens=0), depth_policy=match_policy("depth", 0))
    with pytest.raises(ValueError, match="chain_tokens must be an integer >= 0, got -1"):
        LTDConfig(chain_tokens=-1)
    plain = LTDController(LTDConfig(width=W, depth=DMAX, mode="depth"), depth_policy=rule_policy("depth"))
    assert plain.chain_rule is None and plain.context_index() is None  # shipped policies: no chain unless asked


def test_training_with_match_features(chain_traces, tmp_path):
    from adaptree.methods.ltd.train import train_ltd

    s = train_ltd(tiny_train_config(tmp_path / "run", only="size", match=True, chain_tokens=8), chain_traces, LAT,
                  progress=False)
    pol = MLPPolicy.load(tmp_path / "run/policy/size", kind="ltd-size")
    assert LTDObservation.from_dict(pol.config.observation).use_match
    assert (tmp_path / "run/chain.json").is_file()
    ctl = make_controller("ltd-size", size_policy=str(tmp_path / "run/policy/size"), width=W, depth=4,
                          chain=str(tmp_path / "run/chain.json"), chain_tokens=8, ar_fallback=False)
    chosen = simulate(ctl, [t for t in chain_traces if t.key in s["val_prompts"]], LAT, measure_policy=False)
    assert chosen.speedup == pytest.approx(s["chosen"]["modelled_speedup"])
    assert sum(c.chain for r in chosen.runs for c in r.cycles) > 0


def split_policy(seed: int) -> MLPPolicy:
    """A random size policy that sizes the chain too; its decisions follow the match features."""
    obs = LTDObservation(width=W, max_depth=DMAX, use_match=True, chain_split=True)
    torch.manual_seed(seed)
    actions = [[v, k] for v in (2, 6, 12) for k in (-1, 0, 2, 8)]
    pol = MLPPolicy(MLPPolicyConfig("ltd-size", obs.size_dim, actions, [16], observation=obs.to_dict())).eval()
    with torch.no_grad():
        pol.body[0].weight[:, -3:] *= 40.0
    return pol


def test_a_size_policy_that_fixes_the_chain(models, chain_traces):
    """With chain_split π_V's actions are (V, chain) pairs: a token count the chain rule then returns (all of a shorter
    chain), or RULE: the rule's priced length. Lossless, and the replay makes the live decisions."""
    from adaptree.methods.common import RULE, ChainCalibration, ChainRule

    target, head = models
    cal = ChainCalibration.fit(chain_traces)
    rule = ChainRule(cal, tokens=8)
    rule.begin_match(ContextMatch(3, 1, 0, (5, 6, 7)), 10)
    plan = TreePlan(W, 2, 4, chain=(5, 6, 7))
    for tokens, k in ((0, 0), (2, 2), (8, 3)):
        rule.fix(tokens)
        assert rule.choose(None, plan, 4) == k
    rule.fix(RULE)
    assert rule.choose(None, plan, 4) == 3  # no latency model: the rule verifies the whole chain
    with pytest.raises(ValueError, match="token count >= 0, got -3"):
        rule.fix(-3)

    def make():
        ctl = LTDController(LTDConfig(width=W, depth=DMAX), depth_policy=match_policy("depth", 1),
                            size_policy=split_policy(3), chain_calibration=cal)
        ctl.use_latency(LAT)
        return ctl

    assert make().sizes[:4] == [(2, -1), (2, 0), (2, 2), (2, 8)]
    assert make().smallest[1] == 2  # the AR gate's probe: the smallest V, not a pair
    checks = lossless_replays(Engine(target, head), make, PROMPTS + REPEATS, chain_traces, N_NEW)
    cycles = [c for check in checks for c in check.live.cycles]
    assert sum(c.chain_accepted for c in cycles) > 0
    with pytest.raises(ValueError, match="chain_split needs use_match"):
        LTDObservation(width=W, max_depth=DMAX, chain_split=True)
    with pytest.raises(ValueError, match=r"\(size, chain tokens >= 0 or -1 for the rule\) pair, got 4"):
        LTDObservation(width=W, max_depth=DMAX, use_match=True, chain_split=True).action_of(4)


def test_a_plain_size_policy_gets_chain_options_with_its_decisions(models):
    from adaptree.methods.common import CHAIN_OPTIONS, RULE
    from adaptree.methods.ltd.train import with_chain_options

    plain = match_policy("size", 4)
    split = with_chain_options(plain)
    assert split.config.actions == [[v, k] for v in plain.config.actions for k in CHAIN_OPTIONS]
    assert LTDObservation.from_dict(split.config.observation).chain_split
    tree, _ = grow(models, 3)
    obs = LTDObservation.from_dict(plain.config.observation)
    for match in ([0.9, 0.5, 1.0], [0.1, 0.0, 0.1], [0.0, 0.0, 0.0]):
        x = obs.size_obs(tree, match=match)
        assert split.config.actions[split.act(x)] == [plain.config.actions[plain.act(x)], RULE]
    with pytest.raises(ValueError, match="does not size the chain"):
        with_chain_options(split)


def test_training_a_chain_split_fine_tune_with_a_validation_band(chain_traces, tmp_path):
    """π_V trained over (V, chain) actions from a plain pair; the depth stage runs against it sharing the environment's
    chain rule; a validation band of the family index is validated on, never trained on."""
    from adaptree.methods.common import CHAIN_OPTIONS
    from adaptree.methods.ltd.train import train_ltd
    from adaptree.offline.family import Member, synthetic, verify_ratio, write_index

    members = [Member(f"m{i}", synthetic(0.0, g, 0.1, 0.01), held_out=False, source="test")
               for i, g in enumerate((0.001, 0.01, 0.1))]
    index = str(write_index(members, tmp_path / "fam"))
    band = (verify_ratio(members[1].model) * 0.99, verify_ratio(members[2].model) * 0.99)
    common = dict(match=True, chain_tokens=8, family=(index,), validation_band=band, costs=True)
    train_ltd(tiny_train_config(tmp_path / "run", iterations=0, **common), chain_traces, LAT, progress=False)
    s = train_ltd(tiny_train_config(tmp_path / "ft", chain_split=True, iterations=2, init=str(tmp_path / "run/policy"),
                                    **common), chain_traces, LAT, progress=False)
    size = MLPPolicy.load(tmp_path / "ft/iter1-size/policy", kind="ltd-size")
    assert size.config.actions == [[v, k] for v in (2, 4, 8, 16) for k in CHAIN_OPTIONS]
    assert LTDObservation.from_dict(size.config.observation).chain_split
    assert s["settings"]["family"]["validation_only"] == ["m1"] and len(s["chosen"]["per_machine"]) == 4
    with pytest.raises(ValueError, match="chain_split needs match"):
        tiny_train_config(tmp_path / "x", chain_split=True)
    with pytest.raises(ValueError, match="validation_band needs two numbers"):
        tiny_train_config(tmp_path / "x", validation_band=(1.0, 2.0))


# ----------------------------------------------------------------------------------------- the rule's decisions as actions

def test_the_rule_actions_decide_as_costaware_at_the_same_price(models, chain_traces):
    """π_D's RULE and π_V's priced V are costaware's look-ahead and V (hybrid's without a match). At a generation's
    first cycle both price a node at the AR rate: the decisions are equal, on machines where they differ."""
    from adaptree.core.controller import CycleContext
    from adaptree.methods.common import ChainCalibration, ChainRule
    from adaptree.methods.costaware import CostAwareConfig, CostAwareController
    from adaptree.methods.costaware.acceptance import AcceptanceCalibration

    acc = AcceptanceCalibration.fit(chain_traces)
    tree, steps = grow(models, DMAX)
    ctx = CycleContext(cycle=0, context_len=tree.context_len, generated=0, features=None)
    goes, sizes = set(), set()
    for growth in (1e-4, 1e-3, 1e-2):
        lat = LatencyModel(draft=[0.002, 0.0, 0.0, 0.0], verify=[0.03, growth, 0.0, 0.0], other_s=0.001)
        ca = CostAwareController(CostAwareConfig(width=W, max_depth=DMAX), latency_model=lat, calibration=acc)
        rule = ChainRule(ChainCalibration.fit(chain_traces), tokens=8)
        rule.latency, rule.acceptance = lat, acc
        ca.begin_cycle(ctx)
        rule.begin_match(None, ctx.context_len)
        for step in steps:
            assert rule.priced_continue(step) == ca.continue_drafting(step)
            goes.add(rule.priced_continue(step))
        v = rule.priced_size(tree)
        assert v == ca.choose_size(tree, TreePlan(W, DMAX, 60))
        sizes.add(v)
    assert goes == {True, False} and len(sizes) > 1
    rule.acceptance = None
    with pytest.raises(ValueError, match="acceptance calibration"):
        rule.priced_size(tree)


CHEAP_TREES = LatencyModel(draft=[0.0005, 0.0, 0.0, 0.0], verify=[0.03, 1e-5, 0.0, 0.0], other_s=0.001)


def rule_pair(chain_split: bool = False) -> tuple[MLPPolicy, MLPPolicy]:
    from adaptree.methods.ltd.train import with_rule_action

    size = split_policy(3) if chain_split else match_policy("size", 2)
    return with_rule_action(match_policy("depth", 1)), with_rule_action(size)


def test_rule_actions_lead_from_the_start_and_keep_the_others_order(models):
    from adaptree.methods.common import RULE
    from adaptree.methods.ltd.controller import DEPTH_ACTIONS
    from adaptree.methods.ltd.train import PRICED, with_rule_action

    depth, size = match_policy("depth", 1), split_policy(3)
    d2, s2 = rule_pair(chain_split=True)
    assert d2.config.actions == list(DEPTH_ACTIONS) and s2.config.actions == [*size.config.actions, PRICED]
    assert with_rule_action(match_policy("size", 2)).config.actions[-1] == RULE
    tree, steps = grow(models, 3)
    obs = LTDObservation.from_dict(size.config.observation)
    for match in ([0.9, 0.5, 1.0], [0.1, 0.0, 0.1], [0.0, 0.0, 0.0]):
        for pol, new, x in ((size, s2, obs.size_obs(tree, match=match)),
                            (depth, d2, obs.depth_obs(steps[-1], match=match))):
            assert new.act(x) == len(new.config.actions) - 1  # the rule's action leads everywhere
            with torch.no_grad():
                assert torch.equal(new(x)[:-1].argsort(), pol(x).argsort())
    with pytest.raises(ValueError, match="has the priced V already"):
        with_rule_action(s2)
    with pytest.raises(ValueError, match="depth policy with actions"):
        with_rule_action(d2)
    with pytest.raises(ValueError, match="observes the match"):
        with_rule_action(random_policy("depth", 0))


@pytest.mark.parametrize("chain_split", [False, True])
def test_an_ltd_pair_with_the_rule_actions_is_lossless_and_replays_like_the_live_engine(models, chain_traces,
                                                                                      chain_split):
    from adaptree.methods.common import ChainCalibration
    from adaptree.methods.costaware.acceptance import AcceptanceCalibration

    target, head = models
    cal, acc = ChainCalibration.fit(chain_traces), AcceptanceCalibration.fit(chain_traces)
    dp, sp = rule_pair(chain_split)

    def make():
        ctl = LTDController(LTDConfig(width=W, depth=DMAX), depth_policy=dp, size_policy=sp, chain_calibration=cal,
                            acceptance=acc)
        ctl.use_latency(CHEAP_TREES)  # where the rule's depth varies
        return ctl

    assert make().smallest[1] == 1  # the priced V can be a single node
    checks = lossless_replays(Engine(target, head), make, PROMPTS + REPEATS, chain_traces, N_NEW)
    depths = {c.depth for check in checks for c in check.live.cycles}
    assert len(depths) > 1 and sum(c.chain_accepted for check in checks for c in check.live.cycles) > 0
    with pytest.raises(ValueError, match="--ltd-acceptance FILE"):
        LTDController(LTDConfig(width=W, depth=DMAX), depth_policy=dp, size_policy=sp, chain_calibration=cal)


def test_the_rule_prices_at_the_running_throughput_without_a_gate(chain_traces):
    """Without an AR gate (training, the fallback off) the chain rule measures the drafted cycles' throughput itself,
    as the gate would: training prices chains and the rule's decisions as inference does."""
    from adaptree.methods.common import ChainCalibration
    from adaptree.methods.common.ar_gate import Meter

    cal = ChainCalibration.fit(chain_traces)
    ctl = LTDController(LTDConfig(width=W, depth=DMAX, ar_fallback=False), depth_policy=match_policy("depth", 1),
                        size_policy=match_policy("size", 2), chain_calibration=cal)
    ctl.use_latency(LAT)
    priced = 0
    for t in chain_traces:
        res = simulate(ctl, [t], LAT, measure_policy=False)
        meter = Meter()
        for c in res.runs[0].cycles:
            meter.add(c.accepted + 1, LAT.cycle_time(c.width, c.depth, c.size + c.chain_nodes, c.context_len))
        assert ctl.chain_rule.rate == (None if meter.throughput() is None else pytest.approx(meter.throughput()))
        priced += ctl.chain_rule.rate is not None
    assert priced > 0 and ctl.gate is None
    ctl.reset()
    assert ctl.chain_rule.rate is None


def test_training_a_fine_tune_with_the_rule_actions(chain_traces, tmp_path):
    """``rule``: the init pair gets the rule's actions, the run fits the acceptance calibration, and both stages train
    with them (the depth stage's environment asks π_D with three actions)."""
    from adaptree.methods.common import CHAIN_OPTIONS
    from adaptree.methods.ltd.controller import DEPTH_ACTIONS
    from adaptree.methods.ltd.train import PRICED, train_ltd

    common = dict(match=True, chain_tokens=8)
    train_ltd(tiny_train_config(tmp_path / "run", iterations=0, **common), chain_traces, LAT, progress=False)
    s = train_ltd(tiny_train_config(tmp_path / "ft", chain_split=True, rule=True, iterations=2,
                                    init=str(tmp_path / "run/policy"), **common), chain_traces, LAT, progress=False)
    assert (tmp_path / "ft/acceptance.json").is_file()
    size = MLPPolicy.load(tmp_path / "ft/iter1-size/policy", kind="ltd-size")
    depth = MLPPolicy.load(tmp_path / "ft/iter2-depth/policy", kind="ltd-depth")
    assert size.config.actions == [[v, k] for v in (2, 4, 8, 16) for k in CHAIN_OPTIONS] + [PRICED]
    assert depth.config.actions == list(DEPTH_ACTIONS)
    assert s["iterations"][0]["modelled_speedup"] > 0
    ctl = make_controller("ltd", depth_policy=str(tmp_path / "ft/policy/depth"),
                          size_policy=str(tmp_path / "ft/policy/size"), width=W, depth=DMAX,
                          chain=str(tmp_path / "ft/chain.json"), acceptance=str(tmp_path / "ft/acceptance.json"),
                          chain_tokens=8, ar_fallback=False)
    chosen = simulate(ctl, [t for t in chain_traces if t.key in s["val_prompts"]], LAT, measure_policy=False)
    assert chosen.speedup == pytest.approx(s["chosen"]["modelled_speedup"])
    with pytest.raises(ValueError, match="rule needs match"):
        tiny_train_config(tmp_path / "x", rule=True)


# ----------------------------------------------------------------------------------------------------- machine costs

CHEAP_DRAFT = LatencyModel(draft=[0.0005, 0.0, 0.0, 0.0], verify=[0.03, 0.0001, 0.0, 0.0], other_s=0.0)
DEAR_DRAFT = LatencyModel(draft=[0.03, 0.0, 0.0, 0.0], verify=[0.03, 0.0002, 0.0, 0.0], other_s=0.0)


def test_cost_features_enter_the_observation_and_follow_the_simulated_machine(models, traces):
    from adaptree.offline.family import COST_FEATURES, cost_features

    obs = LTDObservation(width=W, max_depth=DMAX, use_costs=True)
    assert obs.depth_dim == OBS.depth_dim + len(COST_FEATURES) and obs.size_dim == OBS.size_dim + len(COST_FEATURES)
    tree, steps = grow(models, 2)
    costs = cost_features(LAT, W)
    assert obs.depth_obs(steps[-1], costs)[-len(costs):].tolist() == pytest.approx(costs)
    with pytest.raises(ValueError, match="latency model"):
        obs.depth_obs(steps[-1])
    ref = LTDObservation(width=W, max_depth=DMAX, use_costs=True, reference_costs=[0.1] * len(COST_FEATURES))
    assert ref.size_obs(tree)[-len(COST_FEATURES):].tolist() == pytest.approx([0.1] * len(COST_FEATURES))
    with pytest.raises(ValueError, match="reference_costs"):
        LTDObservation(use_costs=True, reference_costs=[0.1])
    # a depth policy that reads only the draft-step feature: continue iff drafting is cheap here
    pol = random_policy("depth", 0, obs, hidden=(1,))
    n = pol.config.obs_dim
    with torch.no_grad():
        for p in pol.parameters():
            p.zero_()
        pol.body[0].weight[0, n - len(COST_FEATURES)] = -10.0  # draft_step / ar
        pol.body[0].bias[0] = 2.0  # tanh(2 - 10 f): > 0 iff f < 0.2
        pol.head.weight[1, 0] = 1.0
    ctl = LTDController(LTDConfig(width=W, depth=DMAX, size=10, mode="depth", ar_fallback=False), depth_policy=pol)
    cheap = simulate(ctl, traces, CHEAP_DRAFT, measure_policy=False)
    dear = simulate(ctl, traces, DEAR_DRAFT, measure_policy=False)
    assert cheap.summary()["mean_depth"] == DMAX and dear.summary()["mean_depth"] == 1


def test_training_over_a_latency_family_then_a_fine_tune(traces, tmp_path):
    from adaptree.methods.ltd.train import train_ltd
    from adaptree.offline.policy import training_facts

    DEAR_DRAFT.save(tmp_path / "dear.json")
    cfg = tiny_train_config(tmp_path / "run", costs=True, family=(str(tmp_path / "dear.json"),), spread=1.5,
                            iterations=1)
    s = train_ltd(cfg, traces, CHEAP_DRAFT, progress=False)
    assert len(s["settings"]["family"]["bases"]) == 2 and s["settings"]["family"]["spread"] == 1.5
    assert len(s["chosen"]["per_machine"]) == 2  # validated on both measured machines
    assert s["chosen"]["modelled_speedup"] == pytest.approx(np.exp(np.mean(np.log(s["chosen"]["per_machine"]))),
                                                           rel=1e-4)
    pol = MLPPolicy.load(tmp_path / "run/policy/depth", kind="ltd-depth")
    o = LTDObservation.from_dict(pol.config.observation)
    assert o.use_costs and len(o.reference_costs) == 5
    assert training_facts(tmp_path / "run/policy/depth")["family"]["spread"] == 1.5
    # without a latency model the controller runs on the reference costs; with one, on that machine's
    make_controller("ltd", depth_policy=str(tmp_path / "run/policy/depth"),
                    size_policy=str(tmp_path / "run/policy/size"), width=W)
    # the fine-tune: the exported pair is Iter0, only the co-adaptation iterations run, each from its actor
    ft = train_ltd(tiny_train_config(tmp_path / "ft", costs=True, init=str(tmp_path / "run/policy"), iterations=1),
                   traces, DEAR_DRAFT, progress=False)
    assert list(ft["stages"]) == ["iter1-size"]
    assert [(r["depth_policy"], r["size_policy"]) for r in ft["iterations"]] == [("init-depth", "init-size"),
                                                                              ("init-depth", "iter1-size")]
    assert ft["chosen"]["modelled_speedup"] >= ft["iterations"][0]["modelled_speedup"]
    with pytest.raises(ValueError, match="costs=True"):
        train_ltd(tiny_train_config(tmp_path / "ft2", init=str(tmp_path / "run/policy"), iterations=1), traces,
                  DEAR_DRAFT, progress=False)
    with pytest.raises(ValueError, match="iterations"):
        tiny_train_config(tmp_path / "ft3", init=str(tmp_path / "run/policy"), iterations=0)


def test_a_cost_aware_size_policy_learns_both_machines_of_its_family(traces, tmp_path):
    """Trained over a machine where verifying more nodes is free and one where each node costs a third of a
    step, one size policy verifies more nodes where they are free: what a cost-blind policy cannot do."""
    from adaptree.methods.ltd.train import train_ltd

    flat = LatencyModel(draft=[0.002, 0.0, 0.0, 0.0], verify=[0.03, 0.0, 0.0, 0.0], other_s=0.0)
    steep = LatencyModel(draft=[0.002, 0.0, 0.0, 0.0], verify=[0.0, 0.01, 0.0, 0.0], other_s=0.0)
    steep.save(tmp_path / "steep.json")
    s = train_ltd(tiny_train_config(tmp_path / "run", costs=True, family=(str(tmp_path / "steep.json"),),
                                    only="size", size_steps=4096), traces, flat, progress=False)
    ctl = make_controller("ltd-size", size_policy=str(tmp_path / "run/policy/size"), width=W, depth=4)
    on_flat = simulate(ctl, traces, flat, measure_policy=False).summary()
    on_steep = simulate(ctl, traces, steep, measure_policy=False).summary()
    assert on_flat["mean_size"] > on_steep["mean_size"] + 4
    assert s["chosen"]["policy"] == "stage1-size"


def test_ar_fallback_takes_ar_steps_where_no_tree_pays_and_stays_lossless(models, traces):
    """On a machine where no tree pays (each verified node costs 1/8 of a step, a draft step 1/5): the gate turns
    the policy's cycles into AR steps (probing now and then) and the run is near AR speed; where trees pay it costs
    little."""
    from adaptree.methods.common import ARGate

    dear = LatencyModel(draft=[0.006, 0.0, 0.0, 0.0], verify=[0.026, 0.004, 0.0, 0.0], other_s=0.0)
    pair = dict(depth_policy=rule_policy("depth"), size_policy=rule_policy("size"))
    on = LTDController(LTDConfig(width=W, depth=DMAX), **pair)
    off = LTDController(LTDConfig(width=W, depth=DMAX, ar_fallback=False), **pair)
    gated, plain = (simulate(c, traces, dear, measure_policy=False) for c in (on, off))
    assert plain.speedup < 0.6 and gated.speedup > 0.78  # 30-token runs: the first 3 drafted cycles weigh a lot
    assert any(c.depth == 0 for r in gated.runs for c in r.cycles) and any(c.depth > 0 for r in gated.runs[1:]
                                                                             for c in r.cycles)
    for g, p in zip(gated.runs, plain.runs):
        assert g.token_ids == p.token_ids  # AR steps change the speed, never the tokens
    cheap_on, cheap_off = (simulate(c, traces, CHEAP_DRAFT, measure_policy=False) for c in (on, off))
    assert cheap_off.speedup > 1.0 and cheap_on.speedup >= 0.97 * cheap_off.speedup  # trees pay: the gate costs little
    # without a latency model the gate never closes; bad settings are named
    assert not LTDController(LTDConfig(width=W, depth=DMAX), **pair).gate.ar_mode
    with pytest.raises(ValueError, match="probe_every"):
        LTDConfig(probe_every=0)
    with pytest.raises(ValueError, match="smoothing"):
        ARGate(smoothing=0.0)


def test_ar_gate_calls_a_machine_hopeless_only_when_no_tree_size_can_pay():
    """Where the step from one row to several costs 0.8 of a forward, a one-node tree cannot pay even optimistically,
    but a few nodes can: not hopeless. Where every node costs 0.6 of a forward, no size pays: hopeless."""
    from adaptree.methods.common import ARGate
    from adaptree.offline.family import synthetic

    gate = ARGate()
    gate.latency = synthetic(step=0.8, growth=0.001, draft=0.1, other=0.005)
    assert gate._ratio(10, 1, 1, 100) > 1.0 + gate.optimistic  # the smallest tree alone would say hopeless
    assert not gate.hopeless(10, 1, 8, 100)
    gate.latency = synthetic(step=0.8, growth=0.6, draft=0.1, other=0.005)
    assert gate.hopeless(10, 1, 8, 100)
    gate.reset()
    assert gate.ar_step(10, 1, 8, 100) and gate.ar_mode  # a generation there starts in AR mode


def test_ar_gate_reopens_at_the_probes_that_earn_the_ar_rate_again():
    """A long bad stretch closes the gate and its failed probes wait longer and longer; once the acceptance is back,
    the first probe that (with the one before it) earns more than AR steps reopens it: probes are judged on their
    own, not diluted into the long averages that the bad stretch dragged down."""
    from adaptree.core.records import CycleRecord
    from adaptree.methods.common import ARGate

    lat = LatencyModel(draft=[0.001, 0.0, 0.0, 0.0], verify=[0.01, 0.0, 0.0, 0.0], other_s=0.0)  # a cycle: 1.2 steps
    gate = ARGate(probe_every=2, min_cycles=8, max_probe_every=4)
    gate.latency = lat

    def cycle(accepted: int) -> bool:
        """One cycle at the gate: True when it was an AR step; a drafted one is recorded with ``accepted``."""
        if gate.ar_step(4, 4, 2, 100):
            return True
        gate.record(CycleRecord(cycle=0, context_len=100, width=4, depth=2, size=4, candidates=8, accepted=accepted,
                                emitted=accepted + 1))
        return False

    for _ in range(10):  # trees pay: 3 tokens for 1.2 steps
        assert not cycle(2)
    probes = 0
    for _ in range(400):  # nothing accepted: 1 token for 1.2 steps; closed, and every probe fails
        probes += not cycle(0)
    assert gate.ar_mode and probes > 40 and gate.interval == gate.max_probe_every * gate.price
    while cycle(2):  # the acceptance is back: the next probe reopens the gate
        pass
    assert not gate.ar_mode
    assert not cycle(2) and not gate.ar_mode  # and it stays open while trees pay
    with pytest.raises(ValueError, match="probe_window"):
        ARGate(probe_window=0)


# ------------------------------------------------------------------------------------------ the machine's static tree


def test_machine_tree_is_the_best_static_tree_and_its_best_v_per_depth(traces, tmp_path):
    from adaptree.methods.common import MachineTree
    from adaptree.offline.oracle import best_static, sizes_by_depth

    mt = MachineTree.fit(traces, CHEAP_DRAFT, width=W, max_depth=DMAX)
    best = best_static(traces, CHEAP_DRAFT, widths=(W,), depths=range(1, DMAX + 1))
    assert (mt.depth, mt.size) == (best.depth, best.size)
    assert mt.size_by_depth == sizes_by_depth(traces, CHEAP_DRAFT, W, range(1, DMAX + 1))
    assert mt.size_at(mt.depth) == mt.size and mt.size_at(DMAX + 5) == mt.size_by_depth[DMAX]
    assert mt.relative_size(2, 1.0) == mt.size_at(2) and mt.relative_size(2, 0.01) == 1
    assert MachineTree.from_dict(mt.to_dict()) == mt
    old = MachineTree.from_dict({"width": W, "depth": 2, "size": 6})  # a setup's file from before size_by_depth
    assert old.size_at(1) == old.size_at(5) == 6
    (tmp_path / "bad.json").write_text('{"depth": 0, "size": 3}')
    with pytest.raises(ValueError, match="bad.json"):
        MachineTree.load(tmp_path / "bad.json")


def _factor_policy(obs: LTDObservation, action: int) -> MLPPolicy:
    """A size policy that always picks ``action``."""
    from adaptree.methods.common import SIZE_FACTORS

    torch.manual_seed(0)
    pol = MLPPolicy(MLPPolicyConfig("ltd-size", obs.size_dim, list(SIZE_FACTORS), [4],
                                    observation=obs.to_dict())).eval()
    with torch.no_grad():
        for p in pol.parameters():
            p.zero_()
        pol.head.bias[action] = 1.0
    return pol


def test_relative_sizes_scale_the_machines_v_at_the_trees_depth(traces, tmp_path):
    import dataclasses

    from adaptree.methods.common import SIZE_FACTORS, MachineTree
    from adaptree.methods.common.machine_tree import META_KEY, attach

    obs = LTDObservation(width=W, max_depth=DMAX, use_tree=True, relative_sizes=True)
    assert obs.size_dim == OBS.size_dim + 2 and obs.depth_dim == OBS.depth_dim + 2
    with pytest.raises(ValueError, match="use_tree"):
        LTDObservation(relative_sizes=True)
    lat = dataclasses.replace(CHEAP_DRAFT, meta={})
    attach([lat], traces, W, DMAX)
    mt = MachineTree.of(lat)
    ctl = LTDController(LTDConfig(width=W, depth=3, mode="size", ar_fallback=False),
                        size_policy=_factor_policy(obs, SIZE_FACTORS.index(2.0)))
    res = simulate(ctl, traces, lat, measure_policy=False)
    for c in (c for r in res.runs for c in r.cycles if c.depth == 3):
        assert c.size == min(mt.relative_size(3, 2.0), c.candidates)
    # at inference the tree comes from the machine setup's static_gs.json (``tuned``); without one: an error
    (tmp_path / "tuned.json").write_text(json.dumps({"width": W, **mt.to_dict()}))
    plain = dataclasses.replace(CHEAP_DRAFT, meta={})
    ctl = LTDController(LTDConfig(width=W, depth=3, mode="size", ar_fallback=False, tuned=str(tmp_path / "tuned.json")),
                        size_policy=_factor_policy(obs, SIZE_FACTORS.index(1.0)))
    sizes = {c.size for r in simulate(ctl, traces, plain, measure_policy=False).runs for c in r.cycles}
    assert sizes <= {mt.size_at(3), num_candidates_at(3)}
    bare = LTDController(LTDConfig(width=W, depth=3, mode="size", ar_fallback=False),
                         size_policy=_factor_policy(obs, 0))
    with pytest.raises(ValueError, match="--ltd-tuned"):
        simulate(bare, traces, plain, measure_policy=False)
    assert META_KEY not in plain.meta


def num_candidates_at(depth: int) -> int:
    from adaptree.offline.traces import num_candidates

    return num_candidates(W, depth)


def test_training_with_the_machine_tree(traces, tmp_path):
    from adaptree.methods.common import SIZE_FACTORS
    from adaptree.methods.ltd.train import train_ltd

    DEAR_DRAFT.save(tmp_path / "dear.json")
    cfg = tiny_train_config(tmp_path / "run", costs=True, machine_tree=True, depth_partner="size",
                            family=(str(tmp_path / "dear.json"),), iterations=1)
    s = train_ltd(cfg, traces, CHEAP_DRAFT, progress=False)
    size = MLPPolicy.load(tmp_path / "run/policy/size", kind="ltd-size")
    assert size.config.actions == list(SIZE_FACTORS)
    assert LTDObservation.from_dict(size.config.observation).relative_sizes
    assert len(s["chosen"]["per_machine"]) == 2
    with pytest.raises(ValueError, match="depth-partner"):
        tiny_train_config(tmp_path / "x", only="depth", depth_partner="size")


def test_first_decision_can_skip_drafting_and_stays_lossless(models, traces, tmp_path):
    """With first_decision, π_D is asked before the first draft forward too: a policy that always stops makes every
    cycle an AR step (with the context's chain when there is one), and the output is still AR's."""
    from adaptree.methods.ltd.train import train_ltd

    obs = LTDObservation(width=W, max_depth=DMAX, first_decision=True)
    stop = random_policy("depth", 0, obs, hidden=(1,))
    with torch.no_grad():
        for p in stop.parameters():
            p.zero_()
        stop.head.bias[0] = 1.0  # always STOP
    assert obs.first_obs(17).shape[0] == obs.depth_dim
    ctl = LTDController(LTDConfig(width=W, depth=DMAX, size=10, mode="depth", ar_fallback=False), depth_policy=stop)
    res = simulate(ctl, traces, LAT, measure_policy=False)
    assert all(c.depth == 0 for r in res.runs for c in r.cycles)
    target, head = models
    eng = Engine(target, head)
    with torch.inference_mode():
        live = eng.generate(PROMPTS[0], ctl, max_new_tokens=N_NEW)
        ar = eng.generate(PROMPTS[0], None, max_new_tokens=N_NEW)
    assert live.token_ids == ar.token_ids
    # a fine-tune that adds the decision to a pair trained without it
    train_ltd(tiny_train_config(tmp_path / "run", iterations=1), traces, LAT, progress=False)
    ft = train_ltd(tiny_train_config(tmp_path / "ft", init=str(tmp_path / "run/policy"), iterations=2,
                                     first_decision=True), traces, LAT, progress=False)
    depth = MLPPolicy.load(tmp_path / "ft/iter2-depth/policy", kind="ltd-depth")  # the depth stage learned it
    size = MLPPolicy.load(tmp_path / "ft/iter1-size/policy", kind="ltd-size")  # asked only once a tree was drafted
    assert LTDObservation.from_dict(depth.config.observation).first_decision
    assert not LTDObservation.from_dict(size.config.observation).first_decision
    assert list(ft["stages"]) == ["iter1-size", "iter2-depth"]
