"""Re-SpS: the (TT, d, k) action set, the feature state, action caching, losslessness, simulator replay,
seeded temperature sampling, strict policy files, the CLI flags and `adaptree train resps` on tiny models."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict

import numpy as np
import pytest
import torch
from ties import assert_mostly_exact, lossless_replays, replay_against_live

from adaptree.core.engine import Engine
from adaptree.methods import CONFIGS, LEARNED, METHODS, TreePlan, make_controller
from adaptree.methods.resps.controller import (
    RESPS_DEPTHS,
    RESPS_TOPKS,
    RESPS_TOTALS,
    ReSpSConfig,
    ReSpSController,
    ReSpSState,
    action_widths,
    check_actions,
    plan_of,
    resps_actions,
)
from adaptree.offline.latency import LatencyModel
from adaptree.offline.policy import MLPPolicy, MLPPolicyConfig
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import TraceSettings, record_trace

H = 32  # the tiny target's hidden size: features have 3H = 96 values
PROMPTS = [[1, 5, 3], [2, 9], [7, 7, 7, 7, 1, 0, 9], [4, 11, 2, 8, 15, 3, 6, 1, 12, 13, 5], [3, 3], [8, 1, 2, 3]]
N_NEW = 40
TINY = resps_actions(totals=(4, 10), depths=(2, 3, 4), topks=(2, 4))
"""7 actions over W in {2, 4} (the tiny head has a 12-token draft vocabulary)."""
LAT = LatencyModel(draft=[0.004, 0.0001, 1e-6, 0.0], verify=[0.03, 0.001, 2e-5, 1e-7], other_s=0.001)


@pytest.fixture(scope="module")
def traces(models):
    target, head = models
    s = TraceSettings(widths=(2, 4), max_depth=4, max_new_tokens=N_NEW, feature_dtype="float32")
    with torch.inference_mode():
        return [record_trace(target, head, p, settings=s, key=f"p{i}") for i, p in enumerate(PROMPTS)]


def nearest_center_policy(state: ReSpSState = ReSpSState(H), actions=TINY, seed: int = 4, scale: float = 1.0,
                          kind: str = "resps") -> MLPPolicy:
    """Hand-set weights: one hidden unit h = tanh(scale * <state, u>) for a fixed unit direction u; action i has
    the logit 2 c_i h - c_i^2 (= h^2 - (h - c_i)^2), so the action whose centre c_i (evenly spaced in [-1, 1]) is
    nearest to h wins: the plan changes with the features. Direction seed 4: no recorded state of the tiny
    model lies near a tie (test_replay_margins_are_not_ties), and all 7 actions occur."""
    cfg = MLPPolicyConfig(kind, state.dim, [list(a) for a in actions], [1], "tanh", state.to_dict())
    pol = MLPPolicy(cfg).eval()
    u = torch.randn(state.dim, generator=torch.Generator().manual_seed(seed))
    c = torch.linspace(-0.9, 0.9, len(actions))
    with torch.no_grad():
        pol.body[0].weight.copy_((scale * u / u.norm())[None])
        pol.body[0].bias.zero_()
        pol.head.weight.copy_(2 * c[:, None])
        pol.head.bias.copy_(-c * c)
    return pol


def uniform_policy(state: ReSpSState = ReSpSState(H), actions=TINY) -> MLPPolicy:
    """Every logit 0: argmax picks action 0, sampling is uniform."""
    pol = MLPPolicy(MLPPolicyConfig("resps", state.dim, [list(a) for a in actions], [4], "tanh", state.to_dict()))
    with torch.no_grad():
        for p in pol.parameters():
            p.zero_()
    return pol.eval()


def ctl(policy=None, **kw) -> ReSpSController:
    return ReSpSController(ReSpSConfig(**kw), policy=policy if policy is not None else nearest_center_policy())


# ----------------------------------------------------------------------------------------------- action set


def test_action_set_is_the_papers_177_valid_combinations():
    acts = resps_actions()
    assert len(acts) == 177 and len(set(acts)) == 177
    every = [(t, d, k) for t in RESPS_TOTALS for d in RESPS_DEPTHS for k in RESPS_TOPKS]
    assert len(every) == 180  # the paper's 180 combinations before filtering
    dropped = sorted(set(every) - set(acts))
    assert dropped == [(80, 3, 8), (96, 3, 8), (128, 3, 8)]  # 8^2 = 64 < TT
    assert all(t <= k ** (d - 1) for t, d, k in acts)
    assert acts == [a for a in every if a not in dropped]  # (TT, d, k) order
    assert action_widths(acts) == (8, 12, 16, 20, 32)
    p = plan_of((48, 5, 16))
    assert (p.width, p.max_depth, p.size) == (16, 5, 48)  # W = k, depth = d, V = TT
    # every plan's full tree has at least TT candidates: V is never clamped by the tree
    assert all(k + (d - 1) * k * k >= t for t, d, k in acts)
    assert len(TINY) == 7 and (10, 3, 2) not in TINY and (4, 2, 2) not in TINY and (10, 3, 4) in TINY


def test_tree_filter_reaches_the_small_trees_the_paper_filter_forbids():
    # every TT a tree of width k and d levels has candidates for: k + (d-1)k^2 (the paper's k^(d-1) implies it)
    assert check_actions([(1, 1, 10), (10, 1, 10)]) == [(1, 1, 10), (10, 1, 10)]
    assert check_actions([(32, 3, 8), (80, 3, 8), (136, 3, 8)])[1] == (80, 3, 8)  # outside the paper's filter
    tree = resps_actions((1, 2, 4, 8, 16, 32, 64, 128, 256), (1, 2, 3, 4, 6, 8), (10,), filter="tree")
    assert len(tree) == 46 and (1, 1, 10) in tree and (8, 1, 10) in tree and (16, 1, 10) not in tree
    assert (64, 2, 10) in tree and (128, 2, 10) not in tree and (256, 3, 10) not in tree and (256, 4, 10) in tree
    assert resps_actions((1, 4), (1, 2), (10,)) == [(1, 1, 10), (1, 2, 10), (4, 2, 10)]  # paper: TT <= 10^(d-1)
    assert resps_actions(filter="paper") == resps_actions()
    with pytest.raises(ValueError, match="action filter must be one of"):
        resps_actions(filter="any")
    from adaptree.methods.resps.train import ReSpSTrainConfig

    cfg = ReSpSTrainConfig(totals=(1, 2, 4, 8, 16, 32, 64, 128, 256), depths=(1, 2, 3, 4, 6, 8), topks=(10,),
                           action_filter="tree")
    assert cfg.actions() == tree and cfg.trace_widths() == (10,) and cfg.trace_depth() == 8
    with pytest.raises(ValueError, match="action_filter"):
        ReSpSTrainConfig(action_filter="any")


def test_bad_action_sets_name_the_entry():
    with pytest.raises(ValueError, match=r"\(137, 3, 8\) violates TT <= k \+ \(d-1\)k\^2 = 136"):
        check_actions([(32, 3, 8), (137, 3, 8)])
    with pytest.raises(ValueError, match=r"\(11, 1, 10\) violates TT <= k \+ \(d-1\)k\^2 = 10"):
        check_actions([(1, 1, 10), (11, 1, 10)])
    with pytest.raises(ValueError, match=r"\(32, 3, 8\) appears more than once"):
        check_actions([(32, 3, 8), [32, 3, 8]])
    with pytest.raises(ValueError, match="at least 2 actions"):
        check_actions([(32, 3, 8)])
    with pytest.raises(ValueError, match="action 1 must be a \\(TT, d, k\\) triple"):
        check_actions([(32, 3, 8), (32, 3)])
    with pytest.raises(ValueError, match="action 1 must be a \\(TT, d, k\\) triple"):
        check_actions([(32, 3, 8), ("32", 3, 8)])
    with pytest.raises(ValueError, match="d must be in 1..64, got 0"):
        check_actions([(32, 3, 8), (1, 0, 8)])
    with pytest.raises(ValueError, match="k must be in 1..64, got 65"):
        check_actions([(32, 3, 8), (32, 3, 65)])
    with pytest.raises(ValueError, match="TT must be >= 1"):
        check_actions([(32, 3, 8), (0, 3, 8)])


# ----------------------------------------------------------------------------------------------- state


def test_state_concat_mean_and_normalisation():
    g = torch.stack([torch.randn(H) * s for s in (1.0, 30.0, 400.0)])  # the deeper, the larger
    f = g.reshape(-1)
    raw = ReSpSState(H, "concat", "none")
    assert torch.equal(raw(f), f) and raw.dim == 3 * H
    assert torch.allclose(ReSpSState(H, "mean", "none")(f), g.mean(0)) and ReSpSState(H, "mean").dim == H
    rms = ReSpSState(H)(f).view(3, H)
    assert torch.allclose(rms.square().mean(1), torch.ones(3), atol=1e-4)  # every group at unit RMS
    assert torch.allclose(rms, g / g.square().mean(1, keepdim=True).sqrt(), atol=1e-5)
    assert torch.allclose(ReSpSState(H, "mean")(f), rms.mean(0))
    assert torch.equal(ReSpSState(H)(f.to(torch.bfloat16)), ReSpSState(H)(f.to(torch.bfloat16).float()))
    with pytest.raises(ValueError, match="features have 150 values.*hidden size 32 \\(3 x 32 = 96"):
        ReSpSState(H)(torch.zeros(150))
    with pytest.raises(ValueError, match="needs the target features"):
        ReSpSState(H)(None)
    with pytest.raises(ValueError, match="state must be one of"):
        ReSpSState(H, "sum")
    with pytest.raises(ValueError, match="normalize"):
        ReSpSState(H, normalize="layer")
    with pytest.raises(ValueError, match="hidden"):
        ReSpSState(0)


# ----------------------------------------------------------------------------------------------- caching


@pytest.mark.parametrize("interval", [1, 3, 30])
def test_action_is_chosen_every_n_cycles_and_kept_in_between(models, interval):
    target, head = models
    eng = Engine(target, head)
    c = ctl(uniform_policy(), interval=interval, temperature=1.0, seed=3)  # random plans: every change shows
    for prompt in (PROMPTS[3], PROMPTS[0]):
        res = eng.generate(prompt, c, max_new_tokens=120)
        n = len(res.cycles)
        assert n > 30  # interval 30 sees at least two decisions
        assert [cy for cy, _ in c.decisions] == list(range(0, n, interval))  # a new decision every N cycles
        chosen = dict(c.decisions)
        for rec in res.cycles:
            a = chosen[rec.cycle - rec.cycle % interval]
            tt, d, k = TINY[a]
            assert (rec.width, rec.depth, rec.size) == (k, d, tt)
        if interval == 1:
            assert len({a for _, a in c.decisions}) == len(TINY)  # the sampled plans really vary
    # the cache starts empty at every generation and the sampler restarts from its seed
    again = eng.generate(PROMPTS[0], c, max_new_tokens=120)
    assert [(r.width, r.depth, r.size) for r in again.cycles] == [(r.width, r.depth, r.size) for r in res.cycles]


def test_decisions_cost_policy_time_only_when_taken(models):
    target, head = models
    c = ctl(interval=4)
    res = Engine(target, head).generate(PROMPTS[3], c, max_new_tokens=60)
    assert sum(c.counts.values()) == len(c.decisions) == -(-len(res.cycles) // 4)
    assert all(r.policy_s > 0 for r in res.cycles if r.cycle % 4 == 0)


# ----------------------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("interval,temperature,seed", [(1, 0.0, 0), (3, 0.0, 0), (1, 1.5, 0), (5, 1.5, 7)])
def test_resps_is_lossless_and_replays_like_the_live_engine(models, traces, interval, temperature, seed):
    target, head = models
    pol = nearest_center_policy()
    plans = _lossless_replayed_plans(Engine(target, head), traces,
                                     lambda: ctl(pol, interval=interval, temperature=temperature, seed=seed))
    assert len(plans) >= 4  # the policy really switches plans


def _lossless_replayed_plans(eng, traces, make_ctl) -> set:
    """For every prompt: the live run with a controller from ``make_ctl`` equals AR (lossless, exact) and the replay
    of its traces takes the live run's decisions (up to near-ties, :func:`replay_against_live`); returns the
    (W, depth, V) plans the live runs used."""
    plans = set()
    checks = []
    for prompt, tr in zip(PROMPTS, traces):
        ar = eng.generate(prompt, None, max_new_tokens=N_NEW)
        live_ctl, sim_ctl = make_ctl(), make_ctl()
        check = replay_against_live(eng, live_ctl, sim_ctl, prompt, tr, N_NEW)  # the replay: up to near-ties
        assert check.live.token_ids == ar.token_ids  # lossless (fp32 greedy), whatever the plans: exact
        upto = check.compared  # the decisions up to the cycle where the replay left the live run, if it did
        assert [d for d in sim_ctl.decisions if d[0] < upto] == [d for d in live_ctl.decisions if d[0] < upto]
        if check.left_at is None:
            assert sim_ctl.decisions == live_ctl.decisions
        checks.append(check)
        plans |= {(c.width, c.depth, c.size) for c in check.live.cycles}
    assert_mostly_exact(checks)
    return plans


def test_replay_margins_are_not_ties(models, traces):
    """The replay test above means something only if no decision sits on a tie of the hand-set policy: the
    recorded features differ from the live ones in the last float bits (docs/traces.md). Checked at every
    recorded position (every state any path can reach) and on the live features of an interval-1 run."""
    target, head = models
    pol = nearest_center_policy()
    state = ReSpSState(H)

    @torch.no_grad()
    def margin(f):
        top = torch.topk(pol(state(f)), 2).values
        return float(top[0] - top[1])

    recorded = [margin(torch.from_numpy(f)) for tr in traces for f in tr.features]
    assert len(recorded) == sum(tr.end for tr in traces) and min(recorded) > 1e-3
    live = []

    class Spy(ReSpSController):
        def begin_cycle(self, ctx):
            live.append(margin(ctx.features))
            return super().begin_cycle(ctx)

    eng = Engine(target, head)
    for prompt in PROMPTS:
        eng.generate(prompt, Spy(ReSpSConfig(interval=1), policy=pol), max_new_tokens=N_NEW)
    assert min(live) > 1e-3


def test_temperature_sampling_uses_its_own_seeded_generator(models):
    target, head = models
    eng = Engine(target, head)
    pol = nearest_center_policy(scale=0.1)  # flat logits: sampling really samples
    ar = eng.generate(PROMPTS[3], None, max_new_tokens=N_NEW)
    runs = {}
    for seed in (0, 0, 1):
        torch.manual_seed(1234)
        state = torch.get_rng_state()
        c = ctl(pol, interval=1, temperature=1.5, seed=seed)
        res = eng.generate(PROMPTS[3], c, max_new_tokens=N_NEW)
        assert torch.equal(torch.get_rng_state(), state)  # torch's global RNG untouched
        assert res.token_ids == ar.token_ids  # lossless
        runs.setdefault(seed, []).append([a for _, a in c.decisions])
    assert runs[0][0] == runs[0][1]  # the same seed, the same plans
    assert runs[0][0] != runs[1][0]  # another seed, other plans
    argmax = ctl(pol, interval=1, temperature=0.0)
    eng.generate(PROMPTS[3], argmax, max_new_tokens=N_NEW)
    assert len({a for _, a in argmax.decisions}) < len({a for _, a in ctl_decisions(eng, pol)})


def ctl_decisions(eng, pol):
    c = ctl(pol, interval=1, temperature=1.5, seed=5)
    eng.generate(PROMPTS[3], c, max_new_tokens=N_NEW)
    return c.decisions


# ----------------------------------------------------------------------------------------------- files and errors


def test_policy_files_load_strictly_and_errors_name_the_problem(models, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    pol = nearest_center_policy()
    pol.save(tmp_path / "p", training={"inference_temperature": 1.5})
    c = make_controller("resps", policy=str(tmp_path / "p"))
    x = torch.randn(3 * H)
    assert torch.equal(c.policy(c.state(x)), pol(ReSpSState(H)(x)))
    assert c.temperature == 1.5 and c.config.interval == 30  # the recorded inference temperature; N = 30
    assert make_controller("resps", policy=str(tmp_path / "p"), temperature=0.0).temperature == 0.0
    assert c.plans[2].width == TINY[2][2] and c.actions == TINY
    # a kind mismatch
    ltd = MLPPolicy(MLPPolicyConfig("ltd-size", 3 * H, [20, 40], [4]))
    ltd.save(tmp_path / "ltd")
    with pytest.raises(ValueError, match="'ltd-size' policy, a 'resps' policy is needed"):
        make_controller("resps", policy=str(tmp_path / "ltd"))
    with pytest.raises(ValueError, match="Re-SpS needs a 'resps' policy"):
        ReSpSController(policy=ltd)
    # a policy trained on another target (hidden 48) refuses this one's features
    wide = ReSpSState(48)
    target, head = models
    c48 = ctl(nearest_center_policy(wide))
    with pytest.raises(ValueError, match="features have 96 values.*hidden size 48"):
        Engine(target, head).generate(PROMPTS[0], c48, max_new_tokens=8)
    # obs_dim inconsistent with the observation settings
    bad = MLPPolicy(MLPPolicyConfig("resps", 3 * H, [list(a) for a in TINY], [4], observation=ReSpSState(H, "mean").to_dict()))
    with pytest.raises(ValueError, match="obs_dim 96 does not match its observation \\(mean of H=32: 32 values\\)"):
        ReSpSController(policy=bad)
    with pytest.raises(ValueError, match="observation settings are not valid"):
        ReSpSController(policy=MLPPolicy(MLPPolicyConfig("resps", 3, [[4, 2, 4], [4, 3, 2]], [2],
                                                         observation={"colour": 1})))
    # an action outside the constraint
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    cfg["actions"][0] = [10, 2, 2]
    (tmp_path / "p" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"\(10, 2, 2\) violates TT <= k \+ \(d-1\)k\^2 = 6"):
        make_controller("resps", policy=str(tmp_path / "p"))
    # strict weights
    pol.save(tmp_path / "q")
    w = load_file(str(tmp_path / "q" / "model.safetensors"))
    save_file({k: v for k, v in w.items() if k != "head.bias"}, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'head.bias'"):
        make_controller("resps", policy=str(tmp_path / "q"))
    save_file({**w, "head.weight": torch.zeros(5, 1)}, str(tmp_path / "q" / "model.safetensors"))
    with pytest.raises(ValueError, match="'head.weight' has shape"):
        make_controller("resps", policy=str(tmp_path / "q"))
    # the state flag must match the policy's
    pol.save(tmp_path / "r")
    with pytest.raises(ValueError, match="--resps-state mean does not match the policy.*'concat'"):
        make_controller("resps", policy=str(tmp_path / "r"), state="mean")
    assert make_controller("resps", policy=str(tmp_path / "r"), state="concat").state.state == "concat"
    # config values
    with pytest.raises(ValueError, match="--resps-interval.*got 0"):
        ReSpSConfig(interval=0)
    with pytest.raises(ValueError, match="--resps-temperature.*got -1"):
        ReSpSConfig(temperature=-1.0)
    with pytest.raises(ValueError, match="--resps-state"):
        ReSpSConfig(state="sum")
    with pytest.raises(ValueError, match="bad options for method 'resps'.*interval"):
        make_controller("resps", width=4)
    # nothing given and no head folder: the error names the flag
    with pytest.raises(ValueError, match="--resps-policy PATH"):
        make_controller("resps")


def test_registry_and_cli_flags(tmp_path):
    from adaptree.cli import build_controller, build_parser

    assert "resps" in METHODS and "resps" in LEARNED and CONFIGS["resps"] == (ReSpSConfig, ReSpSController)
    nearest_center_policy().save(tmp_path / "p")
    p = build_parser()
    args = p.parse_args(["generate", "hi", "--method", "resps", "--resps-policy", str(tmp_path / "p"),
                         "--resps-interval", "5", "--resps-state", "concat", "--resps-temperature", "1.5"])
    c = build_controller(args, head=object())
    assert (c.name, c.config.interval, c.config.state, c.temperature) == ("resps", 5, "concat", 1.5)
    # bench: one args object for every arm; -W/-D/-V are the static tree's, never passed to resps
    args = p.parse_args(["bench", "-W", "4", "-D", "3", "-V", "9", "--resps-policy", str(tmp_path / "p")])
    args.method = "resps"
    c = build_controller(args, head=object())
    assert c.config == ReSpSConfig(policy=str(tmp_path / "p")) and c.config.interval == 30
    args.method = "static"
    assert build_controller(args, head=object()).config.width == 4
    # the policy shipped next to the head in use
    head_dir = tmp_path / "head"
    nearest_center_policy().save(head_dir / "resps")
    args = p.parse_args(["generate", "hi", "--method", "resps"])
    args.draft_path = str(head_dir)
    assert build_controller(args, head=object()).config.policy == str(head_dir / "resps")
    with pytest.raises(SystemExit):
        p.parse_args(["generate", "hi", "--method", "resps", "--resps-state", "sum"])
    assert asdict(ReSpSConfig()) == {"policy": None, "interval": 30, "state": None, "temperature": None, "seed": 0,
                                     "latency": None, "ar_fallback": True, "probe_every": 8, "chain": None,
                                     "chain_tokens": None, "tuned": None}


# ----------------------------------------------------------------------------------------------- training

MORE = [torch.randint(0, 16, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        for g in [torch.Generator().manual_seed(0)] for _ in range(6)]
EXPENSIVE = LatencyModel(draft=[0.05, 0.0, 0.0, 0.0], verify=[0.01, 0.01, 0.0, 0.0], other_s=0.0)
"""Every draft forward and every verified node costs a lot: the cheapest tree (TT 4, d 2, k 4) is best."""


@pytest.fixture(scope="module")
def train_traces(models):
    """12 prompts with widths 2, 4 (the tiny action set) and 10 at depth 8 (the static EAGLE-3 baseline)."""
    target, head = models
    s = TraceSettings(widths=(2, 4, 10), max_depth=8, max_new_tokens=N_NEW, feature_dtype="float16")
    with torch.inference_mode():
        return [record_trace(target, head, p, settings=s, key=f"p{i}") for i, p in enumerate(PROMPTS + MORE)]


def tiny_config(out, **kw):
    from adaptree.methods.resps.train import ReSpSTrainConfig

    base = dict(out=str(out), totals=(4, 10), depths=(2, 3, 4), topks=(2, 4), steps=256, interval=3, eval_every=2,
                checkpoint_every=2, pi=(32, 32), vf=(32, 32), threads=1)
    base.update(kw)
    return ReSpSTrainConfig(**base)


def sim_setup(traces, lat=LAT, val_fraction=0.25):
    from adaptree.methods.resps.train import SimValidator, split_prompts
    from adaptree.offline.envs import SimSource

    tr, va = split_prompts([t.key for t in traces], val_fraction)
    return (SimSource([t for t in traces if t.key in tr], lat), SimValidator([t for t in traces if t.key in va], lat),
            [t for t in traces if t.key in va])


def test_training_pipeline_budget_resume_export_summary(train_traces, tmp_path):
    import csv

    from adaptree.methods.resps.train import train_resps

    source, validator, val = sim_setup(train_traces)
    out = tmp_path / "run"
    first = train_resps(tiny_config(out, time_budget_s=0.0), source, validator, hidden=H, progress=False)
    assert first["interrupted"] and first["timesteps"] == 64  # stopped after one rollout, checkpointed
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["rollouts"] == 1 and not (out / "result.json").exists()
    s = train_resps(tiny_config(out), source, validator, hidden=H, progress=False)  # continues from the checkpoint
    assert s["training"]["timesteps"] == 256 and s["training"]["rollouts"] == 4
    rows = list(csv.DictReader(open(out / "log.csv")))
    assert [int(r["rollouts"]) for r in rows] == [1, 2, 3, 4] and [int(r["timesteps"]) for r in rows][-1] == 256
    assert rows[1]["val_metric"] and rows[3]["val_metric"] and not rows[2]["val_metric"]
    assert float(rows[0]["entropy"]) == pytest.approx(np.log(len(TINY)), abs=0.05)  # starts near uniform
    # the export loads as --method resps and replays to the summary's numbers
    c = make_controller("resps", policy=str(out / "policy"), ar_fallback=False)  # the summary: the policy alone
    assert c.temperature == 0.0 and c.actions == TINY and c.state.dim == 3 * H
    assert c.config.interval == 30
    sim = simulate(c, val, LAT, measure_policy=False)
    assert sim.speedup == pytest.approx(s["resps"]["resps N=30"]["modelled_speedup"], rel=1e-9)
    assert set(s["resps"]) == {"resps N=1", "resps N=3", "resps N=10", "resps N=30", "resps N=50"}
    assert s["resps"]["resps N=1"]["policy_overhead_pct"] > s["resps"]["resps N=50"]["policy_overhead_pct"] > 0
    base = s["baselines"]
    assert "static W10 d8 V60" in base and base["oracle per cycle (action grid)"]["modelled_speedup"] >= max(
        r["modelled_speedup"] for r in [*s["resps"].values(), *base.values()]) - 1e-12
    fixed = next(v for k, v in base.items() if k.startswith("best fixed action"))
    assert fixed["modelled_speedup"] >= s["resps"]["resps N=30"]["modelled_speedup"] - 1e-12  # the best constant
    table = (out / "summary.md").read_text()
    assert "| resps N=30 |" in table and "oracle per cycle" in table and "policy overhead" in table
    facts = json.loads((out / "policy" / "config.json").read_text())["training"]
    assert facts["interval_train"] == 3 and facts["interval_inference"] == 30 and facts["reward"] == "cycle_throughput"
    assert not list(out.rglob("*.zip")) and not list(out.rglob("*.pkl"))  # no pickles in the run folder
    # a finished run is not trained again; other settings are refused
    mtime = (out / "log.csv").stat().st_mtime
    again = train_resps(tiny_config(out), source, validator, hidden=H, progress=False)
    assert (out / "log.csv").stat().st_mtime == mtime and again["training"] == s["training"]
    with pytest.raises(ValueError, match="other settings \\(gamma\\)"):
        train_resps(tiny_config(out, gamma=0.99), source, validator, hidden=H, progress=False)
    more = train_resps(tiny_config(out, steps=384), source, validator, hidden=H, progress=False)  # raise --steps
    rows = list(csv.DictReader(open(out / "log.csv")))
    assert more["training"]["timesteps"] == 384 and [int(r["rollouts"]) for r in rows] == [1, 2, 3, 4, 5, 6]


def test_ppo_learns_the_cheapest_tree(train_traces, tmp_path):
    """With drafting and every verified node expensive, (TT 4, d 2, k 4) is the best tree at every state: PPO must
    find it (validated at N = 30 like inference) and match the best fixed action of the grid."""
    from adaptree.methods.resps.train import train_resps

    source, validator, _ = sim_setup(train_traces, EXPENSIVE)
    s = train_resps(tiny_config(tmp_path / "run", steps=2048, eval_every=4, lr=3e-3), source, validator, hidden=H,
                    progress=False)
    fixed = next(v for k, v in s["baselines"].items() if k.startswith("best fixed action"))
    assert next(k for k in s["baselines"] if k.startswith("best fixed")) == "best fixed action TT4 d2 k4"
    got = s["resps"]["resps N=30"]
    assert got["modelled_speedup"] == pytest.approx(fixed["modelled_speedup"], rel=1e-6)
    assert got["modelled_speedup"] > 3 * s["baselines"]["static W10 d8 V60"]["modelled_speedup"]
    pol = MLPPolicy.load(tmp_path / "run" / "policy", kind="resps")
    states = torch.stack([ReSpSState(H)(torch.from_numpy(f)) for t in train_traces for f in t.features])
    with torch.no_grad():
        picks = pol(states).argmax(1)
    assert (picks == TINY.index((4, 2, 4))).float().mean() > 0.9  # at (nearly) every recorded state


def test_max_entropy_variant_samples_at_temperature_1_5(train_traces, tmp_path):
    from adaptree.methods.resps.train import ReSpSTrainConfig, train_resps

    d = ReSpSTrainConfig()
    assert (d.ent_coef, d.inference_temperature, d.gamma, d.gae_lambda, d.interval, d.val_interval) == \
           (0.01, 0.0, 0.95, 0.9, 10, 30)
    assert (d.n_steps, d.batch_size, d.n_epochs, d.clip_range, d.lr, d.pi, d.vf) == \
           (64, 32, 4, 0.2, 3e-4, (128, 128), (128, 128))
    me = ReSpSTrainConfig(max_entropy=True)
    assert (me.ent_coef, me.inference_temperature) == (0.1, 1.5)
    assert len(d.actions()) == 177 and d.trace_widths() == (8, 10, 12, 16, 20, 32) and d.trace_depth() == 8
    source, validator, _ = sim_setup(train_traces)
    s = train_resps(tiny_config(tmp_path / "me", steps=128, max_entropy=True), source, validator, hidden=H,
                    progress=False)
    c = make_controller("resps", policy=str(tmp_path / "me" / "policy"))
    assert c.temperature == 1.5 and json.loads((tmp_path / "me" / "policy" / "config.json").read_text())[
        "training"]["ent_coef"] == 0.1
    assert s["resps"]["resps N=1"]["unique_actions"] > 1  # sampled: several plans
    for bad, match in [(dict(state="sum"), "state"), (dict(reward="speed"), "reward"), (dict(interval=0), "interval"),
                       (dict(n_steps=60), "multiple of batch_size"), (dict(gamma=1.5), "gamma"),
                       (dict(totals=(10,), depths=(2,), topks=(2,)), "at least 2 actions")]:
        with pytest.raises(ValueError, match=match):
            ReSpSTrainConfig(**bad)


def test_live_training_and_live_validation(models, tmp_path):
    """The paper's online mode: PlanEnv on the live engine (wall-clock rewards), validated live on held-out prompts
    with an engine of its own (the training generation is paused mid-way when validation runs)."""
    from adaptree.methods.resps.train import LiveValidator, train_resps
    from adaptree.offline.envs import LiveSource

    target, head = models
    engine = Engine(target, head)
    source = LiveSource(engine, PROMPTS[:4], max_new_tokens=N_NEW)
    validator = LiveValidator(engine, [("a", PROMPTS[4]), ("b", PROMPTS[5])], N_NEW)
    s = train_resps(tiny_config(tmp_path / "live", steps=128, eval_every=1), source, validator, hidden=H,
                    progress=False)
    assert s["val_metric"] == "tokens_per_s" and s["settings"]["source"] == "live"
    assert s["resps"]["resps N=30"]["tokens_per_s"] > 0 and set(s["baselines"]) == {"ar", "static W10 d8 V60"}
    assert s["baselines"]["ar"]["tau"] == 1.0
    c = make_controller("resps", policy=str(tmp_path / "live" / "policy"))
    ar = engine.generate(PROMPTS[0], None, max_new_tokens=N_NEW)
    assert engine.generate(PROMPTS[0], c, max_new_tokens=N_NEW).token_ids == ar.token_ids


def test_train_resps_cli_arguments():
    from adaptree.cli import build_parser

    args = build_parser().parse_args(["train", "resps", "--latency", "lat.json", "--max-entropy", "--state", "mean",
                                      "--totals", "32,64", "--live", "--val", "live", "--time-budget-min", "5"])
    assert args.func.__name__ == "cmd_train_resps"
    assert (args.max_entropy, args.state, args.totals, args.depths, args.live, args.val) == \
           (True, "mean", (32, 64), RESPS_DEPTHS, True, "live")
    assert (args.steps, args.interval, args.val_interval, args.train_chat, args.train_code) == (40000, 10, 30, 64, 0)


def test_each_step_is_credited_with_the_cycles_its_own_action_ran(traces):
    """The public code's reward landed one cycle late and timed no drafting. Here step i's reward is the mean
    (accepted + 1) / (draft + verify + other seconds) of exactly the cycles run under action i, and the
    observation is the controller's state of the decision cycle's features."""
    from adaptree.methods import Controller, TreePlan
    from adaptree.methods.resps.env import PlanEnv
    from adaptree.offline.envs import SimSource

    n = 3
    acts = [(4, 2, 4), (10, 4, 4), (4, 3, 2)]  # (TT, d, k)
    plans = [(k, d, tt) for tt, d, k in acts]
    state = ReSpSState(H)
    src = SimSource([traces[3]], LAT)
    env = PlanEnv(src, plans, state.dim, lambda ctx: state(ctx.features).numpy(), interval=n)

    class Cycling(Controller):  # what the agent below does, as a plain controller
        name = "cycling"

        def reset(self):
            self.i = -1

        def begin_cycle(self, ctx):
            if ctx.cycle % n == 0:
                self.i += 1
            return TreePlan(*plans[self.i % 3])

    ref = simulate(Cycling(), traces[3], LAT, measure_policy=False).runs[0].cycles
    obs, _ = env.reset(seed=0)
    rewards, observed, i, done = [], [obs], 0, False
    while not done:
        obs, r, done, _, info = env.step(i % 3)
        rewards.append((r, info["cycles"]))
        observed.append(obs)
        i += 1
    env.close()
    assert len(rewards) == -(-len(ref) // n)
    for k, (r, cycles) in enumerate(rewards):
        chunk = ref[k * n:(k + 1) * n]
        assert cycles == len(chunk) and {(c.width, c.depth) for c in chunk} == {plans[k % 3][:2]}
        want = np.mean([(c.accepted + 1) / (c.draft_s + c.verify_s + c.other_s) for c in chunk]) * src.reference_step_s
        assert r == pytest.approx(want, rel=1e-12) and all(c.draft_s > 0 for c in chunk)
    roots = np.cumsum([0] + [c.accepted + 1 for c in ref])[:-1]  # output position of every cycle's root
    for k in range(len(rewards)):
        f = torch.from_numpy(traces[3].features[roots[k * n]])
        assert np.allclose(observed[k], state(f).numpy())  # the state of the decision cycle, no later one


# ----------------------------------------------------------------------------- sentence-embedding state


class ToyTokenizer:
    """What the embedding state needs of the target's tokenizer: ``decode``. Token t -> a 3-letter word."""

    @staticmethod
    def decode(ids):
        return " ".join("abcdefghijklmnopqrstuvwxyz"[t % 26] * 3 for t in ids)


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    """A random 1-layer BERT with a word-piece vocabulary, saved as a folder (the MiniLM folder's layout)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path_factory.mktemp("encoder")
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [c * 3 for c in "abcdefghijklmnopqrstuvwxyz"]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(str(folder))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32, max_position_embeddings=64)).save_pretrained(str(folder))
    return folder


def embedding_state(folder) -> ReSpSState:
    return ReSpSState(H, "embedding", encoder=str(folder), encoder_dim=16, max_tokens=12)


def test_embedding_state_encodes_the_context_text(tiny_encoder):
    from adaptree.core.controller import CycleContext
    from adaptree.models.sentence import SentenceEncoder, shared_encoder

    st = embedding_state(tiny_encoder)
    assert st.dim == 16 and ReSpSState.from_dict(st.to_dict()) == st
    observe = st.observer(ToyTokenizer())
    gen = [3, 4]
    ctx = CycleContext(0, 5, 2, None, [1, 2, 0], gen)
    x = observe(ctx)
    enc = SentenceEncoder(tiny_encoder, max_tokens=12)
    assert torch.allclose(x, enc.encode(["bbb ccc aaa ddd eee"])[0], atol=1e-6)
    assert x.shape == (16,) and torch.linalg.vector_norm(x).item() == pytest.approx(1.0, abs=1e-5)
    gen.append(9)  # the generated list grows between cycles: the state follows it
    assert not torch.allclose(observe(ctx), x)
    # a context longer than max_tokens keeps its end (12 tokens incl. [CLS]/[SEP] = the last 10 words)
    long = CycleContext(0, 40, 1, None, list(range(30)), [25])
    assert torch.allclose(observe(long), observe(CycleContext(0, 10, 1, None, list(range(21, 30)), [25])), atol=1e-6)
    assert shared_encoder(tiny_encoder, 12) is shared_encoder(tiny_encoder, 12)
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        st.observer(None)
    with pytest.raises(ValueError, match="gives 16 values, the policy was trained on 384"):
        ReSpSState(H, "embedding", encoder=str(tiny_encoder), max_tokens=12).observer(ToyTokenizer())
    with pytest.raises(ValueError, match="built from the context text"):
        st(torch.zeros(3 * H))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        SentenceEncoder(tiny_encoder / "missing")


def test_embedding_policy_is_lossless_and_replays_like_the_live_engine(models, traces, tiny_encoder):
    from adaptree.core.controller import CycleContext

    target, head = models
    st = embedding_state(tiny_encoder)
    # centre the hand-set unit on the contexts this test visits, so that the plan follows the text
    observe = st.observer(ToyTokenizer())
    seen = [observe(CycleContext(0, 0, 0, None, list(t.prompt), list(t.output[:k]))) for t in traces
            for k in range(1, N_NEW, 5)]
    pol = nearest_center_policy(st, scale=40.0)
    with torch.no_grad():
        proj = torch.stack(seen) @ (pol.body[0].weight[0] / 40.0)
        pol.body[0].bias.fill_(-40.0 * float(proj.median()))
    plans = _lossless_replayed_plans(
        Engine(target, head), traces,
        lambda: ReSpSController(ReSpSConfig(interval=2), policy=pol, tokenizer=ToyTokenizer()))
    assert len(plans) >= 2  # the text state really changes the plan
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        ReSpSController(policy=pol)


def test_training_on_the_embedding_state(train_traces, tmp_path, tiny_encoder):
    from adaptree.methods.resps.train import train_resps

    source, validator, val = sim_setup(train_traces)
    out = tmp_path / "emb"
    cfg = tiny_config(out, state="embedding", encoder=str(tiny_encoder), steps=128)
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        train_resps(cfg, source, validator, hidden=H, progress=False)
    s = train_resps(cfg, source, validator, hidden=H, progress=False, tokenizer=ToyTokenizer())
    assert s["training"]["timesteps"] == 128
    c = make_controller("resps", policy=str(out / "policy"), tokenizer=ToyTokenizer(), ar_fallback=False)
    assert c.state.state == "embedding" and c.state.dim == 16 and c.state.encoder == str(tiny_encoder)
    sim = simulate(c, val, LAT, measure_policy=False)
    assert sim.speedup == pytest.approx(s["resps"]["resps N=30"]["modelled_speedup"], rel=1e-9)


@pytest.mark.slow
def test_real_minilm_encoder_from_its_package():
    from adaptree.models.sentence import minilm_path, shared_encoder

    try:
        minilm_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    enc = shared_encoder()
    a, b, c = (enc(t) for t in ("How do I sort a list in Python?", "Sorting a Python list, how?",
                                "The weather in Paris is mild in spring."))
    assert enc.dim == 384 and a.shape == (384,) and torch.linalg.vector_norm(a).item() == pytest.approx(1.0, abs=1e-5)
    assert float(a @ b) > float(a @ c) + 0.2  # paraphrases are closer than unrelated text


# ------------------------------------------------------------------------------------------------------- context chains

REPEATS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 5, 5, 5, 5], [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def chain_traces(models):
    """Traces 16 tokens longer than the generations replayed on them (a chain's acceptance near a generation's end
    is then known to the replay too)."""
    target, head = models
    s = TraceSettings(widths=(2, 4), max_depth=4, max_new_tokens=N_NEW + 16, feature_dtype="float32")
    with torch.inference_mode():
        return [record_trace(target, head, p, settings=s, key=f"c{i}") for i, p in enumerate(PROMPTS + REPEATS)]


def test_match_state_and_chains_are_lossless_and_replay_like_the_live_engine(models, chain_traces):
    from adaptree.methods.common import ChainCalibration

    target, head = models
    cal = ChainCalibration.fit(chain_traces)
    state = ReSpSState(H, use_match=True)
    assert state.dim == 3 * H + 3
    f = torch.randn(3 * H)
    x = state(f, [0.5, 0.25, 1.0])
    assert x[-3:].tolist() == [0.5, 0.25, 1.0] and torch.equal(x[:-3], ReSpSState(H)(f))
    with pytest.raises(ValueError, match="observes the context match"):
        state(torch.randn(3 * H))
    pol = nearest_center_policy(state)
    with torch.no_grad():
        pol.body[0].weight[0, -3:] = 3.0  # the match moves the choice
    with pytest.raises(ValueError, match="--resps-chain PATH"):
        ReSpSController(ReSpSConfig(), policy=pol)

    def make():
        c = ReSpSController(ReSpSConfig(interval=2), policy=pol, chain_calibration=cal)
        c.use_latency(LAT)
        return c

    checks = lossless_replays(Engine(target, head), make, PROMPTS + REPEATS, chain_traces, N_NEW)
    cycles = [c for check in checks for c in check.live.cycles]
    assert sum(c.chain_accepted for c in cycles) > 0 and len({(c.width, c.size) for c in cycles if c.depth}) > 1
    plain = ReSpSController(ReSpSConfig(chain_tokens=4), policy=nearest_center_policy(), chain_calibration=cal)
    assert plain.chain_rule.tokens == 4 and ctl().context_index() is None  # no chain unless asked


def test_training_with_match_features(models, chain_traces, tmp_path):
    from adaptree.methods.common import ChainCalibration
    from adaptree.methods.resps.train import train_resps

    source, validator, val = sim_setup(chain_traces)
    cal = ChainCalibration.fit(source.traces)
    cfg = tiny_config(tmp_path / "run", match=True, chain_tokens=8)
    with pytest.raises(ValueError, match="chain calibration"):
        train_resps(cfg, source, validator, hidden=H, progress=False)
    s = train_resps(cfg, source, validator, hidden=H, progress=False, chain_calibration=cal)
    c = make_controller("resps", policy=str(tmp_path / "run/policy"), ar_fallback=False,
                        chain=str(tmp_path / "run/chain.json"), chain_tokens=8)
    assert c.state.use_match and c.state.dim == 3 * H + 3
    sim = simulate(c, val, LAT, measure_policy=False)
    assert sim.speedup == pytest.approx(s["resps"]["resps N=30"]["modelled_speedup"], rel=1e-9)
    assert sum(cy.chain for r in sim.runs for cy in r.cycles) > 0


# ------------------------------------------------------------------------------------------------------- machine costs

CHEAP = LatencyModel(draft=[0.001, 0.0, 0.0, 0.0], verify=[0.03, 0.0001, 0.0, 0.0], other_s=0.001)
"""Drafting and verification nearly free: large trees pay."""


def costs_policy(ref) -> MLPPolicy:
    """nearest_center_policy on a state that ends with the cost features, weighted so that they move the choice."""
    pol = nearest_center_policy(ReSpSState(H, use_costs=True, reference_costs=ref))
    with torch.no_grad():
        pol.body[0].weight[0, -5:] = torch.tensor([0.3, 0.3, -0.3, 0.3, -0.3])
    return pol


def test_state_ends_with_the_machines_cost_features(models, traces, tmp_path):
    from adaptree.offline.family import COST_FEATURES, cost_features

    ref = cost_features(EXPENSIVE)
    state = ReSpSState(H, use_costs=True, reference_costs=ref)
    assert len(COST_FEATURES) == 5 and state.dim == 3 * H + 5 and ReSpSState.from_dict(state.to_dict()) == state
    f = torch.randn(3 * H)
    x = state(f, costs=cost_features(LAT))
    assert torch.equal(x[:-5], ReSpSState(H)(f)) and torch.allclose(x[-5:], torch.tensor(cost_features(LAT)))
    assert torch.allclose(state(f)[-5:], torch.tensor(ref))  # no latency model: the reference costs
    assert state.costs_of(LAT) == cost_features(LAT, 10) != cost_features(CHEAP, 10)
    both = ReSpSState(H, use_match=True, use_costs=True, reference_costs=ref)  # the match first, the costs last
    y = both(f, [0.5, 0.25, 1.0], cost_features(CHEAP))
    assert both.dim == 3 * H + 8 and y[-8:-5].tolist() == [0.5, 0.25, 1.0] and torch.equal(y[-5:], x.new_tensor(
        cost_features(CHEAP)))
    with pytest.raises(ValueError, match="--resps-latency PATH"):
        ReSpSState(H, use_costs=True)(f)
    with pytest.raises(ValueError, match="reference_costs needs 5 values"):
        ReSpSState(H, use_costs=True, reference_costs=[1.0])
    # the controller reads them from its latency model: the config's, or each machine the simulator replays
    pol = costs_policy(ref)
    pol.save(tmp_path / "p")
    LAT.save(tmp_path / "lat.json")
    c = make_controller("resps", policy=str(tmp_path / "p"), ar_fallback=False)
    assert c.costs is None and c.state.use_costs
    assert make_controller("resps", policy=str(tmp_path / "p"), latency=str(tmp_path / "lat.json")).costs == \
           cost_features(LAT)
    plans = {}
    for name, lat in [("lat", LAT), ("cheap", CHEAP), ("expensive", EXPENSIVE)]:
        sim = simulate(c, traces, lat, measure_policy=False)
        assert c.costs == cost_features(lat)
        plans[name] = [(cy.width, cy.depth, cy.size) for r in sim.runs for cy in r.cycles]
    assert len({tuple(p) for p in plans.values()}) == 3  # the same traces, other machines: other trees
    # lossless, and the replay is the live engine's, with a latency model's costs
    target, head = models

    def make():
        m = ReSpSController(ReSpSConfig(interval=2, ar_fallback=False), policy=pol)
        m.use_latency(CHEAP)
        return m

    lossless_replays(Engine(target, head), make, PROMPTS, traces, N_NEW)


def test_old_policy_configs_load_and_run_unchanged(traces, tmp_path):
    from pathlib import Path

    import adaptree

    shipped = Path(adaptree.__file__).parent / "heads" / "smollm2-135m" / "resps"
    if (shipped / "config.json").exists():  # the shipped policy (retrained over the family): relative actions
        new = MLPPolicy.load(shipped, kind="resps")
        c = ReSpSController(ReSpSConfig(tuned=str(shipped.parent / "static_gs.json"),
                                        chain=str(shipped.parent / "chain.json")), policy=new)
        assert c.state.use_costs and c.state.relative and c.state.dim == new.config.obs_dim and len(c.actions) == 35
    # a policy written before cost features (no use_costs / reference_costs) replays exactly as the same policy now
    pol = nearest_center_policy()
    obs = {k: v for k, v in ReSpSState(H).to_dict().items() if k not in ("use_costs", "reference_costs")}
    legacy = MLPPolicy(MLPPolicyConfig("resps", 3 * H, [list(a) for a in TINY], [1], "tanh", obs))
    legacy.load_state_dict(pol.state_dict())
    legacy.save(tmp_path / "old")
    assert "use_costs" not in json.loads((tmp_path / "old" / "config.json").read_text())["observation"]
    c = make_controller("resps", policy=str(tmp_path / "old"), ar_fallback=False, interval=3)
    a = simulate(c, traces, LAT, measure_policy=False)
    assert c.costs is None  # given a latency model, it still sees no costs
    b = simulate(ctl(pol, interval=3, ar_fallback=False), traces, LAT, measure_policy=False)
    assert [(x.width, x.depth, x.size, x.accepted) for r in a.runs for x in r.cycles] == \
           [(x.width, x.depth, x.size, x.accepted) for r in b.runs for x in r.cycles]


def test_plan_env_observes_the_costs_of_each_generations_family_member(traces):
    from adaptree.methods.resps.env import PlanEnv
    from adaptree.offline.envs import SimSource
    from adaptree.offline.family import LatencyFamily, cost_features

    fam = LatencyFamily([LAT, EXPENSIVE], names=["lat", "expensive"])
    state = ReSpSState(H, use_costs=True, reference_costs=fam.reference_costs())
    env = PlanEnv(SimSource(traces[:3], LAT, family=fam), [(4, 2, 4), (2, 3, 4)], state.dim,
                  lambda ctx, costs=None: state(ctx.features, costs=costs).numpy(), interval=3,
                  costs_of=state.costs_of)
    members = {tuple(np.float32(cost_features(m))): n for n, m in zip(fam.names, fam.bases)}
    seen = []
    obs, _ = env.reset(seed=0)
    for _ in range(8):  # episodes (generations), each on a member drawn for it
        seen.append(members[tuple(obs[-5:])])
        assert obs[-5:].tolist() == np.float32(cost_features(env.latency)).tolist()  # the generation's own
        done = False
        while not done:
            obs, r, done, _, _ = env.step(0)
            if not done:
                assert members[tuple(obs[-5:])] == seen[-1]
        obs, _ = env.reset()
    env.close()
    assert set(seen) == {"lat", "expensive"}


def test_family_training_exports_a_policy_that_sees_the_machine(train_traces, tmp_path):
    import csv

    from adaptree.methods.resps.train import SimValidator, split_prompts, train_resps
    from adaptree.offline.envs import SimSource
    from adaptree.offline.family import Member, write_index

    index = write_index([Member("expensive", EXPENSIVE, False, "test"), Member("cheap", CHEAP, False, "test"),
                         Member("held", LAT, True, "test")], tmp_path / "family")
    cfg = tiny_config(tmp_path / "run", costs=True, family=(str(index),), spread=1.2, steps=128)
    fam = cfg.latency_family(LAT)
    assert fam.names == ["main", "expensive", "cheap"] and fam.validation == [0, 1, 2]  # the held-out one: never
    tr, va = split_prompts([t.key for t in train_traces], cfg.val_fraction)
    train, val = [t for t in train_traces if t.key in tr], [t for t in train_traces if t.key in va]
    validator = SimValidator.of_family(val, fam)
    with pytest.raises(ValueError, match="latency family"):
        train_resps(cfg, SimSource(train, LAT), validator, hidden=H, progress=False)
    s = train_resps(cfg, SimSource(train, LAT, family=fam), validator, hidden=H, progress=False)
    c = make_controller("resps", policy=str(tmp_path / "run" / "policy"), ar_fallback=False)
    assert c.state.use_costs and c.state.dim == 3 * H + 5 and c.state.reference_costs == fam.reference_costs()
    row = s["resps"]["resps N=30"]
    assert set(row["per_machine"]) == {"main", "expensive", "cheap"} and s["val_machines"] == fam.names
    speedups = []
    for name, lat in zip(fam.names, fam.bases):  # the export replays to each machine's number
        speedups.append(simulate(c, val, lat, measure_policy=False).speedup)
        assert speedups[-1] == pytest.approx(row["per_machine"][name], abs=1e-5)
    assert row["modelled_speedup"] == pytest.approx(float(np.exp(np.mean(np.log(speedups)))), rel=1e-9)
    base = s["baselines"]
    assert "per_machine" in base["static W10 d8 V60"] and "oracle per cycle (action grid, main only)" in base
    assert any(k.startswith("best fixed action") and k.endswith("(main only)") for k in base)
    assert "first one (main) only" in s["baselines_note"]
    assert "main only" in (tmp_path / "run" / "summary.md").read_text()
    rows = [r for r in csv.DictReader(open(tmp_path / "run" / "log.csv")) if r["val_metric"]]
    assert rows and all(r["val_per_machine"].startswith("main=") for r in rows)
    settings = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert settings["costs"] and settings["spread"] == 1.2 and settings["family"]["validation"] == fam.names
    old = json.loads((tmp_path / "run" / "settings.json").read_text())
    assert "action_filter" not in old  # at its default: folders of older runs stay resumable


def test_an_existing_trace_folder_is_used_when_it_holds_what_the_actions_need(tmp_path):
    from adaptree.cli import build_parser
    from adaptree.methods.resps.train import ReSpSTrainConfig
    from adaptree.methods.resps.workflow import trace_settings_for
    from adaptree.offline.traces import TraceStore

    fps = {"model": "m", "head": "h"}
    TraceStore(tmp_path / "w10", fps, TraceSettings(widths=(10,), max_depth=12, max_new_tokens=192))
    TraceStore(tmp_path / "short", fps, TraceSettings(widths=(4, 10), max_depth=4, feature_dtype="none"))
    cpu = ReSpSTrainConfig(totals=(1, 2, 4, 8, 16, 32, 64, 128, 256), depths=(1, 2, 3, 4, 6, 8), topks=(10,),
                           action_filter="tree")
    assert trace_settings_for(cpu, tmp_path / "w10", "float32") == ((10,), 12, "float16")  # the folder's own
    assert trace_settings_for(cpu, tmp_path / "new", "float32") == ((10,), 8, "float32")  # a new folder: the run's
    with pytest.raises(ValueError, match=r"lacks .*widths \[8, 12, 16, 20, 32\] \(it has \[10\]\)"):
        trace_settings_for(ReSpSTrainConfig(), tmp_path / "w10", "float16")
    with pytest.raises(ValueError, match=r"depth 8 \(it has max_depth 4\); the target features"):
        trace_settings_for(cpu, tmp_path / "short", "float16")
    small = ReSpSTrainConfig(totals=(1, 4), depths=(1, 2), topks=(4, 10), action_filter="tree", state="embedding")
    assert trace_settings_for(small, tmp_path / "short", "float16") == ((4, 10), 4, "none")  # no static baseline
    args = build_parser().parse_args(["train", "resps", "--family", "standard,x.json", "--costs", "--spread", "1.5",
                                      "--action-filter", "tree", "--totals", "1,2", "--depths", "1,2", "--topks", "10"])
    assert (args.family, args.costs, args.spread, args.action_filter) == (("standard", "x.json"), True, 1.5, "tree")


def test_relative_actions_follow_each_machines_static_tree(train_traces, tmp_path):
    """Trained with the machine tree, the policy picks (depth offset, V factor) and every plan is made from the
    machine's own static tree: the same action is a different tree on another machine."""
    from adaptree.methods.common import MachineTree
    from adaptree.methods.resps.controller import check_relative_actions, relative_actions, relative_plan
    from adaptree.methods.resps.train import SimValidator, split_prompts, train_resps
    from adaptree.offline.envs import SimSource
    from adaptree.offline.family import Member, write_index

    with pytest.raises(ValueError, match="V factor"):
        check_relative_actions([(0, 1.0), (1, 0.0)])
    tree = MachineTree(3, 8, {1: 2, 2: 4, 3: 8})
    assert relative_plan(tree, (0, 1.0), 8) == TreePlan(10, 3, 8)
    assert relative_plan(tree, (-2, 0.5), 8) == TreePlan(10, 1, 1) and relative_plan(tree, (2, 2.0), 4).max_depth == 4
    index = write_index([Member("expensive", EXPENSIVE, False, "test"), Member("cheap", CHEAP, False, "test")],
                        tmp_path / "family")
    cfg = tiny_config(tmp_path / "run", costs=True, machine_tree=True, max_depth=8, family=(str(index),), steps=128)
    assert cfg.trace_widths() == (10,) and cfg.actions() == relative_actions()
    lat = dataclasses.replace(LAT, meta={})
    fam = cfg.latency_family(lat)
    from adaptree.methods.common.machine_tree import attach

    tr, va = split_prompts([t.key for t in train_traces], cfg.val_fraction)
    train, val = [t for t in train_traces if t.key in tr], [t for t in train_traces if t.key in va]
    attach(fam.bases, train, width=10, max_depth=8)
    train_resps(cfg, SimSource(train, lat, family=fam), SimValidator.of_family(val, fam), hidden=H, progress=False)
    (tmp_path / "tuned.json").write_text(json.dumps(MachineTree.of(fam.bases[1]).to_dict()))
    c = make_controller("resps", policy=str(tmp_path / "run" / "policy"), ar_fallback=False,
                        tuned=str(tmp_path / "tuned.json"))
    assert c.state.relative and c.plans is None
    plain = dataclasses.replace(EXPENSIVE, meta={})
    res = simulate(c, val, plain, measure_policy=False)  # the tuned file's tree
    mt = MachineTree.of(fam.bases[1])
    allowed = {relative_plan(mt, a, 8) for a in relative_actions()}
    assert all((cy.width, cy.depth) in {(p.width, p.max_depth) for p in allowed} for r in res.runs for cy in r.cycles)
    bare = make_controller("resps", policy=str(tmp_path / "run" / "policy"), ar_fallback=False)
    with pytest.raises(ValueError, match="--resps-tuned"):
        simulate(bare, val, plain, measure_policy=False)
