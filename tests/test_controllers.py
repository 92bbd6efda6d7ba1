"""The training-free controllers (DEAGLE, DDD, SVIP, Gammatune): their stop / depth rules on hand-built
score sequences, config validation, the registry and CLI, and greedy losslessness on tiny models; the learned
methods' shared runtime."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch
from conftest import PROMPTS, open_tree

from adaptree.core.engine import Engine
from adaptree.core.records import CycleRecord
from adaptree.core.tree import DraftStep
from adaptree.methods import (
    METHODS,
    REGISTRY,
    CycleContext,
    DDDConfig,
    DDDController,
    DeagleConfig,
    DeagleController,
    GammatuneConfig,
    GammatuneController,
    SVIPConfig,
    SVIPController,
    make_controller,
)

NEW = ("deagle", "ddd", "svip", "gammatune")
CTX = CycleContext(cycle=0, context_len=5, generated=1, features=None)


def step(depth, beam_probs=None, level_mass=1.0, beam_scores=None, logp=None, beam_rows=None):
    """A DraftStep built by hand: beam survival probabilities (or scores) and the level's total mass."""
    scores = torch.tensor(beam_scores if beam_scores is not None else [math.log(p) for p in beam_probs])
    w = scores.numel()
    child = torch.tensor([[math.log(level_mass)]])  # the controllers only sum exp(child_scores)
    return DraftStep(depth, w, 0, torch.zeros(w, dtype=torch.long), scores, child, None, logp, beam_rows)


def run_deagle(ctl, seq):
    """Feed (beam probs, level mass) per depth; return the depth at which it stops (None: never)."""
    ctl.begin_cycle(CTX)
    for d, (probs, mass) in enumerate(seq, start=1):
        if not ctl.continue_drafting(step(d, probs, mass)):
            return d
    return None


# ----------------------------------------------------------------------------------------------- DEAGLE
# S_d = 0.9, 0.5 (rho .56: drop 1), 0.4 (rho .8), 0.2 (rho .5: drop 2), 0.1 ...
# E_d = 0.95, 1.55, 1.99, 2.29 ...: the expected vote (d >= ceil(E_d) + 1) is cast from depth 3 on.
SEQ = [([0.5, 0.3, 0.1], 0.95), ([0.3, 0.15, 0.05], 0.6), ([0.2, 0.1, 0.1], 0.44), ([0.1, 0.05, 0.05], 0.3),
       ([0.05, 0.03, 0.02], 0.2), ([0.02, 0.01, 0.01], 0.1)]


def test_deagle_two_of_three_votes():
    ctl = DeagleController(DeagleConfig(width=3, depth=12))
    ctl.begin_cycle(CTX)
    assert ctl.continue_drafting(step(1, *SEQ[0]))
    assert ctl.continue_drafting(step(2, *SEQ[1]))  # momentum seen once: no vote yet
    assert ctl.drops == 1 and ctl.last_votes == {"survival": False, "momentum": False, "expected": False}
    assert ctl.continue_drafting(step(3, *SEQ[2]))  # expected votes alone: 1 of 3
    assert ctl.last_votes == {"survival": False, "momentum": False, "expected": True}
    assert not ctl.continue_drafting(step(4, *SEQ[3]))  # second drop: momentum + expected
    assert ctl.last_votes == {"survival": False, "momentum": True, "expected": True}
    assert abs(ctl.expected - 2.29) < 1e-5


def test_deagle_single_vote_ablations():
    def stop(votes, seq=SEQ, **kw):
        kw.setdefault("min_votes", 1)
        return run_deagle(DeagleController(DeagleConfig(width=3, votes=votes, **kw)), seq)

    assert stop(("expected",)) == 3
    assert stop(("momentum",)) == 4
    assert stop(("survival",)) == 5  # S_5 = 0.10 < 0.15; S_4 = 0.20 is not
    assert stop(("survival", "momentum", "expected"), min_votes=3) == 5  # all three at depth 5
    # S_d exactly tau_s is not below it; momentum needs two drops, so one sharp fall does not vote.
    flat = [([1.0], 1.0)] * 3  # exp(0) is exactly 1
    assert stop(("survival",), seq=flat, tau_s=1.0) is None
    one_drop = [([0.9], 0.99), ([0.3], 0.99), ([0.3], 0.99), ([0.29], 0.99)]
    assert stop(("momentum",), seq=one_drop) is None


def test_deagle_expected_vote_offsets():
    seq = [([0.99], 0.99), ([0.99], 0.99), ([0.2], 0.2), ([0.2], 0.2)]  # E_d = 0.99, 1.98, 2.18, 2.38
    exp_only = dict(width=1, votes=("expected",), min_votes=1)
    assert run_deagle(DeagleController(DeagleConfig(**exp_only)), seq) == 4  # 4 >= ceil(2.38) + 1
    assert run_deagle(DeagleController(DeagleConfig(**exp_only, expected_offset=0)), seq) == 1  # literal: always
    assert run_deagle(DeagleController(DeagleConfig(**exp_only, expected_offset=2)), seq) is None


def test_deagle_state_is_per_cycle():
    ctl = DeagleController(DeagleConfig(width=1, votes=("momentum",), min_votes=1))
    for _ in range(3):  # one drop per cycle never adds up to two
        ctl.begin_cycle(CTX)
        assert ctl.continue_drafting(step(1, [0.9]))
        assert ctl.continue_drafting(step(2, [0.3]))
        assert ctl.drops == 1
    # Depth 1 restarts the cycle's state even without begin_cycle.
    assert ctl.continue_drafting(step(1, [0.9])) and ctl.drops == 0 and ctl.prev_s == pytest.approx(0.9)


def test_deagle_top_k_sum():
    ctl = DeagleController(DeagleConfig(width=3, top_k=1, votes=("survival",), min_votes=1))
    ctl.begin_cycle(CTX)
    assert not ctl.continue_drafting(step(1, [0.1, 0.1, 0.1]))  # top-1 = 0.1 < 0.15; top-3 would be 0.3


# -------------------------------------------------------------------------------------------------- DDD
def run_ddd(ctl, beams):
    ctl.begin_cycle(CTX)
    for d, scores in enumerate(beams, start=1):
        if not ctl.continue_drafting(step(d, beam_scores=scores)):
            return d
    return None


def test_ddd_checks_only_at_its_depths():
    ctl = DDDController(DDDConfig(heuristic="best"))
    # Best path below -0.3 at depths 1-4 and 6 (unchecked), above at 5: goes on; below at 7: stops.
    best = [-0.5, -0.6, -0.8, -1.0, -0.2, -2.0, -0.4, -3.0]
    assert run_ddd(ctl, [[s, s - 1] for s in best]) == 7
    assert run_ddd(ctl, [[-0.1, -2.0]] * 12) is None  # never below: drafts to the max depth
    exact = DDDController(DDDConfig(heuristic="best", threshold=-0.5))  # -0.5 is exact in float32
    assert run_ddd(exact, [[-0.5, -2.0]] * 12) is None  # exactly the threshold is not below it
    assert run_ddd(DDDController(DDDConfig(heuristic="best", check_depths=(2,))), [[-0.5]] * 5) == 2


def test_ddd_logsumexp_heuristic():
    ctl = DDDController(DDDConfig())  # default: log of the beam's total probability
    beam = torch.tensor([-0.5, -0.5])
    assert ctl.heuristic(beam) == pytest.approx(-0.5 + math.log(2))  # 0.19 > -0.3: goes on
    assert DDDController(DDDConfig(heuristic="best")).heuristic(beam) == pytest.approx(-0.5)
    assert run_ddd(ctl, [[-0.5, -0.5]] * 12) is None
    assert run_ddd(ctl, [[-1.0, -1.2]] * 12) == 5  # log(e^-1 + e^-1.2) = -0.40


# ------------------------------------------------------------------------------------------------- SVIP
def test_svip_entropy_rule():
    cfg = SVIPConfig()
    assert cfg.entropy_threshold == pytest.approx(0.6)  # h^2 / gamma = 0.09 / 0.15
    ctl = SVIPController(cfg)
    assert not ctl.should_stop(0.59) and ctl.should_stop(0.61) and not ctl.should_stop(0.0)
    peaked = torch.tensor([0.9, 0.1, 0.0]).clamp_min(1e-30).log()  # H = 0.325
    coin = torch.tensor([0.5, 0.5, 0.0]).clamp_min(1e-30).log()  # H = ln 2 = 0.693
    logp = torch.stack([peaked, coin])
    s = step(2, beam_scores=[-0.1, -0.2], logp=logp, beam_rows=torch.tensor([1, 0]))
    assert s.entropy.tolist() == pytest.approx([0.3251, math.log(2)], abs=1e-4)
    assert not ctl.continue_drafting(s)  # the best node was drawn from the coin flip
    s2 = step(2, beam_scores=[-0.1, -0.2], logp=logp, beam_rows=torch.tensor([0, 1]))
    assert ctl.continue_drafting(s2)
    assert SVIPController(SVIPConfig(entropy_source="beam_min")).continue_drafting(s)
    loose = SVIPController(SVIPConfig(min_entropy=0.4))  # threshold 0.16/0.15 = 1.07 nats
    assert loose.continue_drafting(s)


def test_draft_steps_carry_their_distributions(tiny_pair):
    target, head = tiny_pair
    with torch.no_grad():
        tree, first, _ = open_tree(target, head, [3, 1, 4, 1, 5], 4)
        steps = [first] + [tree.step() for _ in range(2)]
    for s in steps:
        rows = 1 if s.depth == 1 else 4
        assert s.logp.shape == (rows, head.config.draft_vocab_size)
        assert torch.allclose(s.logp.exp().sum(-1), torch.ones(rows), atol=1e-5)
        # Each beam node's score is its parent's row: parent score + a log-prob of that row's distribution.
        for i, r in enumerate(s.beam_rows.tolist()):
            assert float(s.beam_scores[i]) in s.child_scores[r].tolist()
        probs = s.logp.exp()
        assert torch.allclose(s.entropy, -(probs * s.logp).sum(-1))
        assert s.beam_entropy.shape == (4,) and torch.all(s.beam_entropy >= 0)


# -------------------------------------------------------------------------------------------- Gammatune
def rec(depth, accepted):
    return CycleRecord(cycle=0, context_len=0, width=10, depth=depth, size=60, candidates=0, accepted=accepted,
                       emitted=accepted + 1)


def drive(ctl, accepted_fn, n):
    depths = []
    for _ in range(n):
        d = ctl.begin_cycle(CTX).max_depth
        depths.append(d)
        ctl.end_cycle(rec(d, accepted_fn(d)))
    return depths


def test_gammatune_depth_follows_smoothed_acceptance():
    ctl = GammatuneController(GammatuneConfig())
    assert (ctl.d_min, ctl.d_max) == (4, 12)
    up = drive(ctl, lambda d: d, 30)  # every drafted level accepted
    # r = 0.5, 0.6, 0.68, 0.744, 0.795, 0.836 -> depth round(4 + 8 r)
    assert up[:6] == [8, 9, 9, 10, 10, 11]
    assert up == sorted(up) and up[-1] == 12 and max(up) == 12
    down = drive(ctl, lambda d: 0, 40)  # nothing accepted
    assert down == sorted(down, reverse=True) and down[-1] == 4 and min(down) == 4
    mixed = drive(ctl, lambda d: d // 2, 40)  # rate about 1/2 comes back to about the default depth
    assert all(4 <= d <= 12 for d in up + down + mixed) and 7 <= mixed[-1] <= 8
    ctl.end_cycle(rec(0, 0))  # a cycle that drafted nothing leaves the rate alone
    r = ctl.smoothed
    ctl.end_cycle(rec(0, 0))
    assert ctl.smoothed == r
    ctl.reset()
    assert ctl.begin_cycle(CTX).max_depth == 8


def test_gammatune_bounds_for_odd_and_small_depths():
    assert GammatuneConfig(depth=5).bounds == (3, 7)  # inside [2.5, 7.5]
    assert GammatuneConfig(depth=1).bounds == (1, 1)
    assert GammatuneConfig(depth=50).bounds == (25, 64)  # capped at the engine's maximum depth
    ctl = GammatuneController(GammatuneConfig(depth=5, rate=1.0))
    assert drive(ctl, lambda d: d, 3) == [5, 7, 7] and drive(ctl, lambda d: 0, 2) == [7, 3]


# ------------------------------------------------------------------------------- configs and registry
@pytest.mark.parametrize("cls, bad, match", [
    (DeagleConfig, dict(width=0), "width"), (DeagleConfig, dict(depth=65), "depth"),
    (DeagleConfig, dict(size=0), "size"),
    (DeagleConfig, dict(tau_s=0.0), "tau_s.*0.0"), (DeagleConfig, dict(tau_rho=1.5), "tau_rho.*1.5"),
    (DeagleConfig, dict(votes=("survival", "hunch")), "hunch"), (DeagleConfig, dict(votes=()), "votes"),
    (DeagleConfig, dict(votes=("expected",), min_votes=2), "min_votes.*2"), (DeagleConfig, dict(top_k=11), "top_k.*11"),
    (DeagleConfig, dict(momentum_count=0), "momentum_count"),
    (DeagleConfig, dict(expected_offset=-1), "expected_offset"),
    (DDDConfig, dict(threshold=0.5), "threshold.*0.5"), (DDDConfig, dict(check_depths=(5, 0)), "check_depths.*0"),
    (DDDConfig, dict(check_depths="5,seven"), "seven"), (DDDConfig, dict(heuristic="mean"), "mean"),
    (DDDConfig, dict(width=100), "width.*100"),
    (SVIPConfig, dict(entropy_factor=-1.0), "entropy_factor.*-1.0"), (SVIPConfig, dict(min_entropy=1.0), "min_entropy"),
    (SVIPConfig, dict(entropy_source="worst"), "worst"), (SVIPConfig, dict(depth=0), "depth.*0"),
    (GammatuneConfig, dict(rate=0.0), "rate.*0.0"), (GammatuneConfig, dict(min_factor=1.5), "min_factor.*1.5"),
    (GammatuneConfig, dict(max_factor=0.9), "max_factor.*0.9"), (GammatuneConfig, dict(depth=0), "default depth"),
])
def test_config_validation_names_the_bad_value(cls, bad, match):
    with pytest.raises(ValueError, match=match):
        cls(**bad)


def test_configs_parse_comma_strings():
    assert DeagleConfig(votes="survival,expected").votes == ("survival", "expected")
    assert DDDConfig(check_depths="3, 6").check_depths == (3, 6)


@pytest.mark.parametrize("method", NEW)
def test_make_controller_round_trip(method):
    assert method in METHODS
    ctl = make_controller(method)
    assert ctl.name == method and ctl.uses_draft
    again = make_controller(method, **asdict(ctl.config))
    assert type(again) is type(ctl) and again.config == ctl.config
    custom = make_controller(method, width=3, depth=5, size=9)
    assert (custom.config.width, custom.config.depth, custom.config.size) == (3, 5, 9)
    with pytest.raises(ValueError, match=f"method '{method}'.*width"):
        make_controller(method, wdith=3)


def save_learned_policies(folder) -> dict[str, dict]:
    """Untrained policies of RADAR (W 4), LTD (W 4, depth 10), Re-SpS (H 32), SpecDec++ (hidden states of width 32) and
    C2T, saved under ``folder``: learned method -> the options that load them."""
    from adaptree.methods.ltd.controller import LTD_SIZES, LTDObservation
    from adaptree.methods.radar.policy import RadarModelConfig, RadarPolicy
    from adaptree.methods.resps.controller import ReSpSState, resps_actions
    from adaptree.offline.policy import MLPPolicy, MLPPolicyConfig

    RadarPolicy(RadarModelConfig(width=4, max_depth=8, hidden=8)).save(folder / "radar")
    obs = LTDObservation(width=4, max_depth=10)
    MLPPolicy(MLPPolicyConfig("ltd-depth", obs.depth_dim, [0, 1], [8], observation=obs.to_dict())).save(
        folder / "ltd-depth")
    MLPPolicy(MLPPolicyConfig("ltd-size", obs.size_dim, list(LTD_SIZES), [8], observation=obs.to_dict())).save(
        folder / "ltd-size")
    MLPPolicy(MLPPolicyConfig("resps", 96, [list(a) for a in resps_actions()], [8],
                              observation=ReSpSState(32).to_dict())).save(folder / "resps")
    from adaptree.methods.c2t.controller import FEATURES
    from adaptree.methods.common.classifier import AcceptanceClassifier, ClassifierConfig

    AcceptanceClassifier(ClassifierConfig("specdec", inputs=32, hidden=8, blocks=1)).save(folder / "specdec")
    AcceptanceClassifier(ClassifierConfig("c2t", inputs=3, features=FEATURES, hidden=8)).save(folder / "c2t")
    depth, size = str(folder / "ltd-depth"), str(folder / "ltd-size")
    return {"radar": dict(policy=str(folder / "radar"), width=4), "resps": dict(policy=str(folder / "resps")),
            "specdec": dict(policy=str(folder / "specdec")), "c2t": dict(policy=str(folder / "c2t")),
            "ltd": dict(depth_policy=depth, size_policy=size, width=4), "ltd-depth": dict(depth_policy=depth, width=4),
            "ltd-size": dict(size_policy=size, width=4)}


def test_cli_flags_reach_every_method(tmp_path):
    import json

    from adaptree.cli import build_controller, build_parser

    tuned = tmp_path / "static_gs.json"
    tuned.write_text(json.dumps({"width": 5, "depth": 3, "size": 12}))
    save_learned_policies(tmp_path)
    from adaptree.methods.costaware.acceptance import AcceptanceCalibration
    from adaptree.offline.latency import LatencyModel

    LatencyModel([1e-3, 0, 0, 0], [2e-3, 1e-4, 0, 0]).save(tmp_path / "latency.json")
    AcceptanceCalibration([-5.0, 0.0], [0.1, 0.9], [0.6, 0.2]).save(tmp_path / "acceptance.json")
    from adaptree.methods.common import ChainCalibration

    ChainCalibration(3, [1, 4], [[0.5, 0.4], [0.9, 0.9]]).save(tmp_path / "chain.json")
    p = build_parser()
    args = p.parse_args(["bench", "-W", "4", "--costaware-latency", str(tmp_path / "latency.json"),
                         "--costaware-acceptance", str(tmp_path / "acceptance.json"), "--costaware-probe-every", "3",
                         "--deagle-tau-s", "0.2", "--deagle-votes", "expected",
                         "--ddd-threshold", "-0.5", "--ddd-check-depths", "3,4", "--svip-min-entropy", "0.4",
                         "--gammatune-rate", "0.5", "--tuned", str(tuned), "--radar-policy", str(tmp_path / "radar"),
                         "--ltd-depth-policy", str(tmp_path / "ltd-depth"),
                         "--ltd-size-policy", str(tmp_path / "ltd-size"), "--resps-policy", str(tmp_path / "resps"),
                         "--specdec-policy", str(tmp_path / "specdec"), "--specdec-threshold", "0.3",
                         "--c2t-policy", str(tmp_path / "c2t"),
                         "--hybrid-latency", str(tmp_path / "latency.json"), "--hybrid-acceptance",
                         str(tmp_path / "acceptance.json"), "--hybrid-chain", str(tmp_path / "chain.json"),
                         "--hybrid-max-n", "3", "--hybrid-chain-tokens", "9", "--ngram-min-n", "1",
                         "--draft-model-tokens", "3"])
    built = {}
    for m in METHODS:  # as bench does: one args object, method set per arm
        if REGISTRY[m].needs_draft_model:  # built with the pipeline's draft model (tests/test_draft_model.py)
            continue
        args.method = m
        built[m] = build_controller(args, head=object())
    from adaptree.cli.common import method_options

    assert method_options(args, "draft-model") == {"tokens": 3}
    assert built["static"].config.width == 4 and built["static"].config.depth == 8
    dg = built["deagle"].config
    assert (dg.width, dg.depth, dg.tau_s, dg.votes, dg.min_votes) == (4, 12, 0.2, ("expected",), 1)
    assert built["ddd"].config.threshold == -0.5 and built["ddd"].config.check_depths == (3, 4)
    assert built["svip"].config.min_entropy == 0.4 and built["gammatune"].config.rate == 0.5
    assert built["gammatune"].config.depth == 8 and built["ar"].name == "ar"
    assert (built["static-gs"].config.width, built["static-gs"].config.size) == (5, 12)  # the tuned W, not -W
    assert built["radar"].plan.width == 4 and built["radar"].plan.max_depth == 8
    assert built["ltd"].plan.max_depth == 10 and built["ltd"].depth_policy and built["ltd"].size_policy
    assert built["ltd-depth"].size_policy is None and built["ltd-depth"].plan.size == 60
    assert built["ltd-size"].depth_policy is None and built["ltd-size"].plan.max_depth == 8
    assert built["resps"].config.interval == 30 and len(built["resps"].plans) == 177
    assert built["specdec"].threshold == 0.3 and built["specdec"].plan.max_depth == 12
    assert built["c2t"].threshold == 0.5 and built["c2t"].plan.size == 240 and built["c2t"].plan.max_depth == 8
    assert built["c2t"].plan.width == built["specdec"].plan.width == 4
    ca = built["costaware"]
    assert (ca.config.width, ca.config.probe_every) == (4, 3) and ca.calibration.alpha == 0.6
    hy = built["hybrid"]
    assert (hy.config.width, hy.config.chain_tokens, hy.context_index().max_ngram) == (4, 9, 3)
    assert hy.chain_cal.rates.shape == (1, 2, 2) and built["ngram"].config.min_n == 1
    args = p.parse_args(["generate", "hi", "--method", "deagle", "--depth", "18", "--deagle-min-votes", "3"])
    assert build_controller(args, head=object()).config.depth == 18
    args = p.parse_args(["generate", "hi", "--method", "deagle", "--deagle-min-votes", "4"])
    with pytest.raises(ValueError, match="min_votes"):
        build_controller(args, head=object())


def test_learned_methods_share_one_runtime(tmp_path):
    """LTD, RADAR and Re-SpS declare their runtime once (LearnedRuntime: the fields, their checks, their help) and run
    it through the same hooks (LearnedSeam): on a machine where no tree pays, each one's first cycle is an AR step
    that still carries the context's chain; without the fallback, each drafts its tree next to the chain."""
    from dataclasses import fields

    from adaptree.cli.common import field_doc
    from adaptree.core.context import ContextIndex
    from adaptree.methods import LEARNED, REGISTRY
    from adaptree.methods.common import ChainCalibration, LearnedRuntime, LearnedSeam
    from adaptree.offline.latency import LatencyModel

    runtime = [f.name for f in fields(LearnedRuntime)]
    assert runtime == ["latency", "ar_fallback", "probe_every", "chain", "chain_tokens", "tuned"]
    for name in LEARNED:
        config = REGISTRY[name].config
        assert issubclass(config, LearnedRuntime) and issubclass(REGISTRY[name].controller, LearnedSeam), name
        assert not set(runtime) & set(vars(config).get("__annotations__", {})), name  # declared once
        assert all(f.kw_only for f in fields(config) if f.name in runtime), name  # no positional slip
        assert all(field_doc(config, f) == field_doc(LearnedRuntime, f) != "" for f in runtime), name
        for bad in (dict(probe_every=0), dict(probe_every=1.5), dict(chain_tokens=-1), dict(chain_tokens=True)):
            with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an integer.*got {bad[next(iter(bad))]}"):
                config(**bad)
    options = save_learned_policies(tmp_path)
    LatencyModel([0.05, 0, 0, 0], [0.0, 0.05, 0, 0]).save(tmp_path / "latency.json")  # a node costs an AR step
    ChainCalibration(4, [1], [[0.9] * 16]).save(tmp_path / "chain.json")
    toks = [7, 1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3]  # the suffix 1 2 3 occurred: the chain is 4 5 6 8
    for name in LEARNED:
        for fallback in (True, False):
            ctl = make_controller(name, **options[name], latency=str(tmp_path / "latency.json"), ar_fallback=fallback,
                                  chain=str(tmp_path / "chain.json"), chain_tokens=4)
            ctl.reset()
            index = ctl.context_index()
            assert isinstance(index, ContextIndex) and (ctl.gate is not None) == fallback
            index.extend(toks)
            plan = ctl.begin_cycle(CycleContext(0, len(toks), 1, torch.randn(96), toks, [], index))
            assert plan.chain == (4, 5, 6, 8), name
            assert (plan.max_depth == 0 and plan.size == 0) == fallback, (name, fallback, plan)


# ------------------------------------------------------------------------------------------ losslessness
LOSSLESS = [
    ("deagle", {}), ("deagle", dict(width=4, depth=6, size=20, votes=("expected",), min_votes=1)),
    ("deagle", dict(width=3, depth=8, size=15, tau_s=0.9, tau_rho=0.95, votes=("survival", "momentum"))),
    ("ddd", {}), ("ddd", dict(width=4, depth=8, size=25, threshold=-0.05, check_depths=(1, 2, 3), heuristic="best")),
    ("svip", {}), ("svip", dict(width=3, depth=8, size=20, min_entropy=0.05)),
    ("gammatune", {}), ("gammatune", dict(width=4, depth=3, size=12, rate=0.7)),
]


@pytest.mark.parametrize("method, options", LOSSLESS)
def test_greedy_output_equals_autoregressive(tiny_pair, method, options):
    target, head = tiny_pair
    eng = Engine(target, head)
    ctl = make_controller(method, **options)
    depths = []
    for prompt in PROMPTS:
        ar = eng.generate(prompt, None, max_new_tokens=30)
        sp = eng.generate(prompt, ctl, max_new_tokens=30)
        assert sp.token_ids == ar.token_ids and sp.method == method
        depths += [c.depth for c in sp.cycles]
    cfg = ctl.config
    if method == "gammatune":
        lo, hi = cfg.bounds
        assert all(lo <= d <= hi for d in depths)
    else:
        assert all(1 <= d <= cfg.depth for d in depths)


def test_dynamic_depths_vary_on_tiny_models(tiny_pair):
    """On the random tiny models the stop rules fire at different depths (not just the max)."""
    target, head = tiny_pair
    eng = Engine(target, head)
    for method, options in [("deagle", {}), ("svip", dict(min_entropy=0.25)), ("ddd", dict(check_depths=(1, 2, 3)))]:
        depths = set()
        for prompt in PROMPTS:
            depths |= {c.depth for c in eng.generate(prompt, make_controller(method, **options), 30).cycles}
        assert len(depths) >= 1 and min(depths) < make_controller(method, **options).config.depth, (method, depths)
