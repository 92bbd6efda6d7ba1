"""The cost-aware controller (methods/costaware): the acceptance calibration (monotone fit, files, strict
loading), the decision rule on hand-built trees, config errors, greedy losslessness on the live engine and its
behaviour in the simulator under cheap and dear verification, on the tiny random models."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from conftest import N_NEW, PROMPTS

from adaptree.core.controller import AutoregressiveController, CycleContext, StaticConfig, StaticController
from adaptree.core.engine import Engine
from adaptree.core.records import CycleRecord
from adaptree.core.tree import DraftStep
from adaptree.methods.costaware import AcceptanceCalibration, CostAwareConfig, CostAwareController
from adaptree.offline.latency import LatencyModel
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import TraceSettings, match_mask, record_trace

SETTINGS = TraceSettings(widths=(4, 8), max_depth=8, max_new_tokens=N_NEW, feature_dtype="none")

# Latency regimes. "cpu": every verified node costs (as on a CPU). "dear": one more verified node costs 100x an
# AR step (no tree can pay). "cheap": verification is flat in V and drafting is nearly free.
CPU = LatencyModel([2e-3, 1e-4, 1e-6, 1e-8], [8e-3, 2e-4, 2e-6, 1e-8], other_s=5e-4)
DEAR = LatencyModel([1e-3, 0.0, 0.0, 0.0], [1e-2, 1.0, 0.0, 0.0], other_s=1e-3)
CHEAP = LatencyModel([1e-6, 0.0, 0.0, 0.0], [1e-2, 1e-9, 0.0, 0.0], other_s=1e-4)


@pytest.fixture(scope="module")
def traces(models):
    target, head = models
    return [record_trace(target, head, p, settings=SETTINGS, key=f"p{i}") for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def cal(traces):
    return AcceptanceCalibration.fit(traces)


def labelled(traces):
    """(scores, accepted) of every labelled candidate of every recorded tree, written out independently."""
    xs, ys = [], []
    for t in traces:
        for wt in t.widths.values():
            m = match_mask(wt, t.output)
            for j in range(wt.tokens.shape[0]):
                ok = j + wt.depths() < len(t.output)
                xs.append(wt.scores[j][ok])
                ys.append(m[j][ok])
    return np.concatenate(xs).astype(np.float64), np.concatenate(ys)


# ------------------------------------------------------------------------------------------- calibration


def test_calibration_is_monotone_probabilities_fitted_on_every_candidate(traces, cal):
    x, y = labelled(traces)
    assert cal.samples == x.size and 0 < y.sum() < y.size
    assert np.all(np.diff(cal.knots_x) > 0) and np.all(np.diff(cal.knots_y) >= 0)
    assert cal.knots_y.min() >= 0 and cal.knots_y.max() <= 1 and len(cal.knots_x) <= 256
    grid = np.linspace(x.min() - 5, 1.0, 2000)
    p = cal(grid)
    assert p.shape == grid.shape and np.all(np.diff(p) >= 0) and p.min() >= 0 and p.max() <= 1
    assert cal(torch.tensor([[-1.0, -2.0]])).shape == (1, 2)  # any shape, torch or numpy
    px = cal(x)
    # isotonic regression keeps the mean; the knots summarise it closely
    assert abs(px.mean() - y.mean()) < 0.01
    assert px[y].mean() > 5 * px[~y].mean()  # accepted candidates score far higher than rejected ones
    assert 0 <= cal.alpha == cal.child_rates[0] <= 1 and cal.child_rates.sum() <= 1 + 1e-9
    assert len(cal.child_rates) == 8 and cal.rates(10)[8:].tolist() == [0.0, 0.0]
    assert cal.fingerprints == {k: traces[0].fingerprints[k] for k in ("model", "head")}
    few = AcceptanceCalibration.fit(traces, widths=(4,), max_knots=6)
    assert 2 <= len(few.knots_x) <= 6 and np.all(np.diff(few.knots_y) >= 0) and few.samples < cal.samples


def test_isotonic_fit_recovers_a_known_curve():
    """A synthetic trace-free check of the fit: labels drawn from a known increasing curve."""
    from adaptree.methods.costaware.acceptance import _isotonic_knots

    rng = np.random.default_rng(0)
    x = rng.uniform(-10, 0, 200_000)
    truth = 1 / (1 + np.exp(-(x + 4)))
    y = rng.random(x.size) < truth
    kx, ky = _isotonic_knots(x, y.astype(float), np.ones(x.size), 64)
    assert len(kx) <= 64 and np.all(np.diff(ky) >= 0)
    grid = np.linspace(-9.5, -0.5, 50)
    assert np.abs(np.interp(grid, kx, ky) - 1 / (1 + np.exp(-(grid + 4)))).max() < 0.06


def test_fit_refuses_mixed_heads_and_empty_input(traces):
    other = dataclasses.replace(traces[1], fingerprints={**traces[1].fingerprints, "head": "f" * 64})
    with pytest.raises(ValueError, match="another model or head"):
        AcceptanceCalibration.fit([traces[0], other])
    with pytest.raises(ValueError, match="no labelled"):
        AcceptanceCalibration.fit([])
    with pytest.raises(ValueError, match="W=3"):
        AcceptanceCalibration.fit(traces, widths=(3,))


def test_save_load_round_trip(cal, tmp_path, traces):
    path = tmp_path / "acceptance.json"
    cal.save(path)
    d = json.loads(path.read_text())
    assert set(d) == {"version", "knots", "alpha", "child_rates", "samples", "fingerprints"}
    back = AcceptanceCalibration.load(path)
    assert np.array_equal(back.knots_x, cal.knots_x) and np.array_equal(back.knots_y, cal.knots_y)
    assert np.array_equal(back.child_rates, cal.child_rates) and back.alpha == cal.alpha
    assert back.samples == cal.samples and back.fingerprints == cal.fingerprints
    scores = np.linspace(-20, 0, 101)
    assert np.array_equal(back(scores), cal(scores))
    assert back.check(traces[0].fingerprints) == []
    msgs = back.check({**traces[0].fingerprints, "head": "0" * 64})
    assert len(msgs) == 1 and "head" in msgs[0]


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(extra=1), r"unknown fields \['extra'\]"),
    (lambda d: d.pop("alpha"), r"missing fields \['alpha'\]"),
    (lambda d: (d.pop("samples"), d.update(knot=[])), r"unknown fields \['knot'\].*missing fields \['samples'\]"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(alpha=0.999), "alpha 0.999"),
    (lambda d: d.update(knots=[[-1.0, 0.5], [-2.0, 0.6]]), "strictly increasing"),
    (lambda d: d.update(knots=[[-2.0, 0.6], [-1.0, 0.5]]), "non-decreasing"),
    (lambda d: d.update(knots=[[-2.0, 0.1, 3.0]]), "pairs"),
    (lambda d: d.update(child_rates=[0.7, 0.6], alpha=0.7), "child_rates"),
])
def test_strict_loading_names_the_bad_field(cal, tmp_path, edit, match):
    d = cal.to_dict()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=match):
        AcceptanceCalibration.load(path)


def test_loading_a_non_json_file_is_a_value_error(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("not json")
    with pytest.raises(ValueError, match="not a JSON"):
        AcceptanceCalibration.load(path)


# --------------------------------------------------------------------------------------- the decision rule

# p = 1 + score / 10 on [-10, 0]; children: rank 1 accepted half the time after an accepted node, rank 2 10%.
LINEAR = AcceptanceCalibration([-10.0, 0.0], [0.0, 1.0], [0.5, 0.1])


def lat(step_s=1e-3):
    """verify(V) = 7 ms + 3 ms * (V + 1), no other_s: the AR step costs 10 ms (lambda starts at 100 tokens/s), one
    more verified node costs lambda * 3 ms = 0.3 tokens; a draft step costs lambda * step_s."""
    return LatencyModel([step_s, 0.0, 0.0, 0.0], [7e-3, 3e-3, 0.0, 0.0], other_s=0.0)


class FakeTree:
    """What the controller reads of a DraftTree: the candidates' scores and the depth."""

    def __init__(self, scores, depth=1):
        self.scores, self.depth = torch.tensor(scores), depth

    def candidate_scores(self):
        return self.scores


def ctx(cycle=0):
    return CycleContext(cycle=cycle, context_len=20, generated=1, features=None)


def controller(step_s=1e-3, **cfg):
    return CostAwareController(CostAwareConfig(**{"width": 2, "max_depth": 4, "max_size": 10, **cfg}), lat(step_s),
                               LINEAR)


def test_choose_size_takes_the_nodes_worth_their_verification():
    ctl = controller()
    plan = ctl.begin_cycle(ctx())
    assert (plan.width, plan.max_depth, plan.size) == (2, 4, 10) and ctl.rate == pytest.approx(100.0)
    # p = 0.9, 0.8, 0.5, 0.1 (creation order shuffled): each node costs 0.3 tokens -> the first three
    assert ctl.choose_size(FakeTree([-5.0, -1.0, -9.0, -2.0]), plan) == 3
    assert ctl.last_expected == pytest.approx(1 + 0.9 + 0.8 + 0.5)
    assert ctl.choose_size(FakeTree([-9.0, -8.0]), plan) == 0  # p = 0.1, 0.2: none pays, V = 0
    assert ctl.choose_size(FakeTree([-1.0] * 30), plan) == 10  # capped by max_size
    assert ctl.choose_size(FakeTree([-1.0] * 30), type(plan)(2, 4, 4)) == 4  # and by the plan's size


@pytest.mark.parametrize("step_s, go_on", [(1e-3, True), (4e-3, False)])
def test_continue_drafting_compares_the_predicted_level_with_a_draft_step(step_s, go_on):
    """Beam p = 0.9, 0.8; predicted children 0.45, 0.09, 0.4, 0.08: two of them pay 0.3 each, gaining
    0.15 + 0.10 = 0.25 tokens, against a draft step of lambda * step_s = 0.1 (go on) or 0.4 (stop)."""
    ctl = controller(step_s)
    ctl.begin_cycle(ctx())
    scores = torch.tensor([-1.0, -2.0])
    step = DraftStep(1, 2, 20, torch.zeros(2, dtype=torch.long), scores, scores[None], FakeTree([-1.0, -2.0]))
    assert ctl.continue_drafting(step) is go_on


def test_ar_mode_is_entered_when_trees_do_not_pay_and_left_after_a_good_probe():
    ctl = controller(probe_every=3, max_probe_every=3, smoothing=1.0)
    plan = ctl.begin_cycle(ctx())
    assert plan.max_depth == 4
    ctl.choose_size(FakeTree([-9.0, -8.5]), plan)  # nothing pays: advantage = -lambda * draft step < 0
    assert ctl.ar_mode and ctl.last_advantage < 0
    plans = [ctl.begin_cycle(ctx(i)) for i in range(1, 3)]
    assert all((p.width, p.max_depth, p.size) == (1, 0, 0) for p in plans)  # AR steps
    probe = ctl.begin_cycle(ctx(3))  # every 3rd cycle in AR mode drafts
    assert probe.max_depth == 4 and ctl.probing
    ctl.choose_size(FakeTree([-9.0]), probe)  # a bad probe: stay
    assert ctl.ar_mode and ctl.begin_cycle(ctx(4)).max_depth == 0
    assert ctl.begin_cycle(ctx(5)).max_depth == 0
    probe = ctl.begin_cycle(ctx(6))
    assert probe.max_depth == 4 and ctl.probing
    assert ctl.choose_size(FakeTree([-0.5, -1.0, -1.5]), probe) == 3 and ctl.last_advantage > 0
    assert not ctl.ar_mode and ctl.begin_cycle(ctx(8)).max_depth == 4
    ctl.reset()
    assert not ctl.ar_mode and ctl.advantage is None and ctl.tok_avg is None


def test_throughput_estimate_is_a_ratio_of_moving_averages():
    # timing="record": the record's seconds
    ctl = controller(smoothing=0.5, timing="record")
    ctl.begin_cycle(ctx())
    assert ctl.rate == pytest.approx(1 / 0.01)
    rec = CycleRecord(0, 20, 2, 2, 3, 6, 2, 3, draft_s=0.002, verify_s=0.018, other_s=0.0)
    ctl.end_cycle(rec)  # tokens (1 + 3) / 2 = 2, seconds (0.01 + 0.02) / 2 = 0.015
    assert ctl.rate == pytest.approx(2 / 0.015)
    ctl.end_cycle(CycleRecord(1, 23, 2, 2, 3, 6, 2, 3))  # no timings (replay without a latency model): kept
    assert ctl.rate == pytest.approx(2 / 0.015)
    ctl.reset()
    ctl.begin_cycle(ctx())
    assert ctl.rate == pytest.approx(100.0)
    # timing="model" (default): the latency model's time of the record's shape, whatever the record says
    ctl = controller(smoothing=0.5)
    ctl.begin_cycle(ctx())
    ctl.end_cycle(CycleRecord(0, 20, 2, 2, 3, 6, 2, 3, draft_s=5.0, verify_s=5.0))  # 2 draft steps + verify(3)
    assert ctl.rate == pytest.approx(2 / ((0.01 + 0.002 + 0.007 + 0.012) / 2))


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("bad, match", [
    (dict(width=0), "width.*0"), (dict(width=65), "width.*65"), (dict(max_depth=0), "max_depth.*0"),
    (dict(max_depth=65), "max_depth.*65"), (dict(max_size=0), "size.*0"), (dict(probe_every=0), "probe_every.*0"),
    (dict(smoothing=0.0), "smoothing.*0.0"), (dict(smoothing=1.5), "smoothing.*1.5"),
    (dict(timing="wall"), "timing.*wall"),
])
def test_config_validation_names_the_bad_value(bad, match):
    with pytest.raises(ValueError, match=match):
        CostAwareConfig(**bad)


def test_missing_or_absent_files_are_named(tmp_path, cal):
    with pytest.raises(ValueError, match="needs a latency model"):
        CostAwareController(CostAwareConfig(), calibration=cal)
    with pytest.raises(ValueError, match="needs an acceptance calibration"):
        CostAwareController(CostAwareConfig(), latency_model=CPU)
    missing = str(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CostAwareController(CostAwareConfig(latency=missing), calibration=cal)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        CostAwareController(CostAwareConfig(acceptance=missing), latency_model=CPU)
    # objects win over paths; paths alone work
    assert CostAwareController(CostAwareConfig(latency=missing, acceptance=missing), CPU, cal).latency is CPU
    CPU.save(tmp_path / "lat.json")
    cal.save(tmp_path / "acc.json")
    ctl = CostAwareController(CostAwareConfig(latency=str(tmp_path / "lat.json"), acceptance=str(tmp_path / "acc.json")))
    assert ctl.name == "costaware" and ctl.latency.verify == CPU.verify
    assert np.array_equal(ctl.calibration.knots_y, cal.knots_y)


def test_every_config_field_is_documented():
    from dataclasses import fields

    from adaptree.cli.common import field_doc

    for f in fields(CostAwareConfig):
        assert field_doc(CostAwareConfig, f.name), f.name


# ------------------------------------------------------------------------------------- engine and simulator


def test_greedy_output_equals_autoregressive(models, cal):
    target, head = models
    eng = Engine(target, head)
    for latency, drafted in ((CHEAP, True), (DEAR, False)):
        ctl = CostAwareController(CostAwareConfig(width=4, max_depth=6, max_size=30, probe_every=3), latency, cal)
        cycles = []
        for prompt in PROMPTS:
            ar = eng.generate(prompt, AutoregressiveController(), max_new_tokens=N_NEW)
            sp = eng.generate(prompt, ctl, max_new_tokens=N_NEW)
            assert sp.token_ids == ar.token_ids and sp.method == "costaware"
            cycles += sp.cycles
        assert all(c.depth <= 6 and c.size <= 30 for c in cycles)
        deep = sum(c.depth > 0 and c.size > 0 for c in cycles)
        assert (deep > len(cycles) // 2) if drafted else (deep == 0 and sum(c.depth == 0 for c in cycles) > 0)


def summary(sim):
    cyc = [c for r in sim.runs for c in r.cycles]
    return cyc, sum(c.depth == 0 for c in cyc) / len(cyc)


def test_dear_verification_gives_ar_steps(traces, cal):
    ctl = CostAwareController(CostAwareConfig(width=8, probe_every=4, max_probe_every=4), DEAR, cal)
    sim = simulate(ctl, traces, DEAR, measure_policy=False)
    cyc, ar_share = summary(sim)
    assert ar_share >= 0.7 and all(c.size == 0 for c in cyc)
    for run in sim.runs:  # the first cycle drafts, then one probe in every 4 cycles
        drafted = [c.cycle for c in run.cycles if c.depth > 0]
        assert drafted == list(range(0, len(run.cycles), 4))
    assert sim.speedup > 0.95
    # with the default backoff, each failed probe doubles the interval: 4, 8, 16, ... cycles apart
    ctl = CostAwareController(CostAwareConfig(width=8, probe_every=4, max_probe_every=16), DEAR, cal)
    backoff = simulate(ctl, traces, DEAR, measure_policy=False)
    for run in backoff.runs:
        drafted = [c.cycle for c in run.cycles if c.depth > 0]
        gaps = [b - a for a, b in zip(drafted, drafted[1:])]
        assert gaps == [4, 8, 16, 16, 16, 16, 16, 16][:len(gaps)]
    assert backoff.speedup >= sim.speedup


def test_cheap_verification_gives_big_trees(traces, cal):
    ctl = CostAwareController(CostAwareConfig(width=8, max_depth=8, max_size=60), CHEAP, cal)
    sim = simulate(ctl, traces, CHEAP, measure_policy=False)
    cyc, ar_share = summary(sim)
    assert ar_share == 0 and np.mean([c.size for c in cyc]) >= 30 and np.mean([c.depth for c in cyc]) >= 2
    assert sim.speedup > 1.2


def test_simulator_runs_and_beats_the_static_tree_on_a_cpu(traces, cal):
    def make():
        return CostAwareController(CostAwareConfig(width=8), CPU, cal)

    sim = simulate(make(), traces, CPU, measure_policy=False)
    again = simulate(make(), traces, CPU, measure_policy=False)
    assert [[c.to_dict() for c in r.cycles] for r in sim.runs] == [[c.to_dict() for c in r.cycles] for r in again.runs]
    assert [r.token_ids for r in sim.runs] == [t.output[:t.end].tolist() for t in traces]
    cyc, _ = summary(sim)
    assert all(c.depth <= 8 and c.size <= 60 for c in cyc) and len({c.size for c in cyc}) > 1
    static = simulate(StaticController(StaticConfig(8, 8, 60)), traces, CPU, measure_policy=False)
    assert sim.speedup > static.speedup + 0.2 and not math.isnan(sim.tau)
    # the same controller object replays again after reset (state is per generation)
    ctl = make()
    assert simulate(ctl, traces, CPU, measure_policy=False).total_s == simulate(ctl, traces, CPU,
                                                                                measure_policy=False).total_s


@pytest.mark.parametrize("width, latency", [(8, CPU), (4, DEAR)])
def test_replay_makes_the_live_engines_decisions(models, traces, cal, width, latency):
    """With model timing the decisions depend on the scores and context lengths only: the simulator (here without
    a latency model: zero seconds in the records) replays the live engine's cycles. The regimes are ones whose
    decisions are far from ties (value margins > 1e-4 where the scores differ in the last float bits)."""
    target, head = models
    eng = Engine(target, head)

    def make():
        return CostAwareController(CostAwareConfig(width=width, probe_every=3), latency, cal)

    def shape(cycles):
        return [(c.width, c.depth, c.size, c.accepted) for c in cycles]

    for prompt, tr in zip(PROMPTS, traces):
        live = eng.generate(prompt, make(), max_new_tokens=N_NEW)
        sim = simulate(make(), tr, measure_policy=False).runs[0]
        assert shape(sim.cycles) == shape(live.cycles) and sim.token_ids == live.token_ids
