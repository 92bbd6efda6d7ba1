"""The DP oracle and the best static tree (adaptree.offline.oracle) on tiny random models.

The oracle is checked against an exhaustive search written independently (every schedule enumerated,
acceptance from ``accepted_length``, times from ``LatencyModel.cycle_time``, the engine's stop rules
re-derived), against the simulator (its schedule replays to the same cycles and time), and as a lower
bound on every controller's modelled time.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from conftest import N_NEW, PROMPTS, TRACE_SETTINGS, record_tiny_traces

from adaptree.methods import METHODS, Controller, StaticConfig, StaticController, TreePlan, make_controller
from adaptree.methods.resps.controller import (
    ReSpSConfig,
    ReSpSController,
    ReSpSState,
    resps_actions,
)
from adaptree.offline.latency import LatencyModel
from adaptree.offline.oracle import (
    DEFAULT_SIZES,
    ScheduleController,
    best_static,
    compare_methods,
    format_table,
    fraction_of_oracle_gain,
    oracle,
    oracle_all,
    static_times,
    terminal_position,
)
from adaptree.offline.policy import MLPPolicy, MLPPolicyConfig
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import (
    TraceSettings,
    accepted_length,
    num_candidates,
)

SETTINGS = TRACE_SETTINGS

# Three regimes: CPU-like (every verified node costs), GPU-like (verification nearly flat in V, drafting
# dear), and one where the per-cycle overhead makes AR steps competitive.
LATENCIES = {
    "cpu": LatencyModel([2e-3, 1e-4, 1e-6, 1e-8], [8e-3, 2e-4, 2e-6, 1e-8], other_s=5e-4),
    "gpu": LatencyModel([4e-3, 1e-6, 1e-7, 0.0], [1e-2, 1e-6, 1e-6, 1e-10], other_s=1e-4),
    "slow_draft": LatencyModel([9e-3, 2e-4, 0.0, 0.0], [5e-3, 5e-4, 1e-6, 0.0], other_s=2e-3),
    # what `adaptree calibrate` fits on a CPU: verification piecewise linear in N = V + 1 (a jump from 1 to 2 rows)
    "cpu_knots": LatencyModel([2e-3, 1e-4, 1e-6, 1e-8], [8e-3, 2e-6, 1.4e-2, 2e-6, 1.5e-2, 2.5e-6, 2e-2, 4e-6,
                                                          6e-2, 1e-5], other_s=5e-4, verify_knots=[1, 2, 5, 17, 61]),
}


@pytest.fixture(scope="module")
def traces(models):
    return record_tiny_traces(models, SETTINGS)


@pytest.fixture(scope="module")
def small_traces(models, traces):
    """Short traces for the exhaustive search: plain, stopped by EOS, and cut by the context limit."""
    plain = record_tiny_traces(models, TraceSettings(widths=(2, 3), max_depth=3, max_new_tokens=7), PROMPTS[:3],
                               "plain")
    out = traces[0].output.tolist()
    eos = (next(t for i, t in enumerate(out) if i >= 3 and t not in out[:i]),)  # first emitted at index >= 3
    with_eos = record_tiny_traces(models, TraceSettings(widths=(2, 3), max_depth=3, max_new_tokens=9,
                                                        eos_token_ids=eos), PROMPTS[:2], "eos")
    ctx = record_tiny_traces(models, TraceSettings(widths=(2, 3), max_depth=3, max_new_tokens=20, max_seq_len=13),
                             [PROMPTS[2]], "ctx")
    assert ctx[0].stop_reason == "context_limit"
    assert any(t.stop_reason == "eos" for t in with_eos)
    return plain + with_eos + ctx


# ----------------------------------------------------------------------------------- exhaustive search


def brute_force(trace, lat, widths, depths, sizes, allow_ar=True, max_new_tokens=None):
    """Minimum modelled time over every schedule, each enumerated path by path (no dynamic programming).

    An action is (W, d, V) (d = 0: an AR step). The engine's rules, restated: a cycle at root j has
    context L = n + j and room = max_len - L; it drafts only if room > 1; V is clamped to the candidates
    and to room - 1; it emits output[j+1 .. j+acc+1]; generation stops after an EOS (kept) or at the
    token limit, and no cycle starts when room < 1.
    Returns (minimum seconds, number of complete schedules enumerated).
    """
    s = trace.settings
    limit = s.max_new_tokens if max_new_tokens is None else max_new_tokens
    eos = set(s.eos_token_ids)
    y = trace.output.tolist()
    n = trace.prompt_len
    actions = ([(widths[0], 0, 0)] if allow_ar else []) + [(w, d, v) for w in widths for d in depths for v in sizes]
    outcome = {}

    def step(j, emitted, a):  # -> (seconds, next root, tokens emitted, stopped)
        key = (j, emitted, a)
        if key not in outcome:
            w, d, v = a
            L = n + j
            room = trace.max_len - L
            if d == 0 or room <= 1:
                depth = size = acc = 0
            else:
                depth = d
                size = min(v, num_candidates(w, d), room - 1)
                acc = accepted_length(trace.widths[w], trace.output, j, d, size)
            stopped, count = False, emitted
            for t in y[j + 1:j + acc + 2]:
                count += 1
                if t in eos or count >= limit:
                    stopped = True
                    break
            outcome[key] = (lat.cycle_time(w, depth, size, L), j + acc + 1, count, stopped)
        return outcome[key]

    best = math.inf
    leaves = 0

    def walk(j, emitted, spent):
        nonlocal best, leaves
        if trace.max_len - (n + j) < 1:  # the context limit: no cycle starts
            leaves += 1
            best = min(best, spent)
            return
        for a in actions:
            sec, nj, count, stopped = step(j, emitted, a)
            if stopped:
                leaves += 1
                best = min(best, spent + sec)
            else:
                walk(nj, count, spent + sec)

    if y[0] in eos or limit <= 1:
        return 0.0, 1
    walk(0, 1, 0.0)
    return best, leaves


@pytest.mark.parametrize("lat_name", sorted(LATENCIES))
def test_oracle_equals_exhaustive_search(small_traces, lat_name):
    lat = LATENCIES[lat_name]
    total_leaves = 0
    for tr in small_traces:
        for widths, depths, sizes, allow_ar in [((2, 3), (1, 3), (1, 4), True), ((3,), (1, 2, 3), (2, 30), False),
                                                ((2,), (1, 2, 3), (1, 2, 3, 6), True)]:
            want, leaves = brute_force(tr, lat, widths, depths, sizes, allow_ar)
            total_leaves += leaves
            run = oracle(tr, lat, widths=widths, depths=depths, sizes=sizes, allow_ar=allow_ar)
            assert math.isclose(run.total_s, want, rel_tol=1e-12), (tr.key, widths, depths, sizes)
            assert math.isclose(run.dp_s, want, rel_tol=1e-12)
            assert run.tokens == terminal_position(tr) + 1
            assert all(c.depth in (0, *depths) and c.width in widths for c in run.cycles)
            assert allow_ar or all(c.depth > 0 or c.context_len >= tr.max_len - 1 for c in run.cycles)
    assert total_leaves > 10_000  # the search really enumerated many schedules


def test_oracle_every_size_equals_exhaustive_search(small_traces):
    """sizes='all' (only the smallest V per accepted length is kept) loses nothing against every V."""
    for lat in (LATENCIES["cpu"], LATENCIES["gpu"]):
        for tr in small_traces:
            limit = min(5, tr.settings.max_new_tokens) if tr.stop_reason != "context_limit" else None
            for w, depths in [(2, (1, 2)), (3, (2,))]:
                every_v = tuple(range(0, num_candidates(w, max(depths)) + 1))
                want, _ = brute_force(tr, lat, (w,), depths, every_v, allow_ar=True, max_new_tokens=limit)
                run = oracle(tr, lat, widths=(w,), depths=depths, sizes="all", max_new_tokens=limit)
                assert math.isclose(run.total_s, want, rel_tol=1e-12), (tr.key, w, depths)


def test_oracle_every_size_equals_explicit_every_size(traces):
    """On the full traces (W up to 10, depth 12: up to 1,110 candidates) 'all' equals listing every V."""
    lat = LATENCIES["cpu"]
    every_v = range(0, num_candidates(10, 12) + 1)
    for tr in traces[:2]:
        a = oracle(tr, lat, sizes="all")
        b = oracle(tr, lat, sizes=every_v)
        assert math.isclose(a.total_s, b.total_s, rel_tol=1e-12)
        assert a.total_s <= oracle(tr, lat).total_s * (1 + 1e-12)  # a superset of the default V set


def test_exhaustive_search_is_not_trivially_satisfied(small_traces):
    """The search's minimum differs from a fixed schedule's time: it does search."""
    lat = LATENCIES["cpu"]
    tr = small_traces[0]
    best, _ = brute_force(tr, lat, (2, 3), (1, 3), (1, 4))
    only_ar, _ = brute_force(tr, lat, (2,), (), (), allow_ar=True)
    assert best < only_ar


# -------------------------------------------------------------------------------- replay of the schedule


def cycle_tuples(cycles):
    return [(c.context_len, c.width, c.depth, c.size, c.accepted) for c in cycles]


@pytest.mark.parametrize("lat_name", sorted(LATENCIES))
def test_schedule_replays_exactly_in_the_simulator(traces, small_traces, lat_name):
    lat = LATENCIES[lat_name]
    depths_seen = set()
    for tr in traces + small_traces:
        for kwargs in [{}, {"sizes": "all"}, {"allow_ar": False}, {"sizes": "all", "allow_ar": False},
                       {"max_new_tokens": 5}, {"widths": (3,), "depths": (1, 2)}]:
            if "max_new_tokens" in kwargs and kwargs["max_new_tokens"] > tr.settings.max_new_tokens:
                continue
            run = oracle(tr, lat, **kwargs)
            sim = simulate(ScheduleController(run.schedule()), tr, lat, max_new_tokens=kwargs.get("max_new_tokens"),
                           measure_policy=False).runs[0]
            assert cycle_tuples(sim.cycles) == cycle_tuples(run.cycles), (tr.key, kwargs)
            assert sim.total_s == run.total_s  # same terms, same order: bit for bit
            assert sim.ar_s == run.ar_s
            assert len(sim.token_ids) == run.tokens
            assert [c.draft_s for c in sim.cycles] == [c.draft_s for c in run.cycles]
            assert [c.verify_s for c in sim.cycles] == [c.verify_s for c in run.cycles]
            assert math.isclose(run.dp_s, run.total_s, rel_tol=1e-12)
            depths_seen |= {c.depth for c in run.cycles}
    assert len(depths_seen) >= 2  # the schedules are not all one shape


def test_schedule_controller_refuses_to_leave_its_schedule(traces):
    lat = LATENCIES["cpu"]
    run = oracle(traces[0], lat)
    c = next(c for c in run.cycles if c.accepted > 0)
    broken = dict(run.schedule())
    broken[c.position] = (3, 0, 0)  # an AR step there: the next root is one the schedule does not name
    with pytest.raises(RuntimeError, match=f"root position {c.position + 1}: the replay diverged from the schedule"):
        simulate(ScheduleController(broken), traces[0], lat, measure_policy=False)


# ------------------------------------------------------------------------------------ a lower bound


def tiny_resps_policy() -> MLPPolicy:
    """A random Re-SpS policy for the tiny target (hidden 32: features of 96 values), over (TT, d, k) whose
    widths the traces recorded; the shipped one is for SmolLM2's 576-wide features and refuses these."""
    state = ReSpSState(32)
    actions = resps_actions(totals=(4, 16, 60), depths=(2, 4, 8), topks=(3, 8, 10))
    torch.manual_seed(0)
    pol = MLPPolicy(MLPPolicyConfig("resps", state.dim, [list(a) for a in actions], [16], "tanh", state.to_dict()))
    return pol.eval()


def registered_methods():
    """Every registered method that builds with its defaults (static-gs, radar and learned policies need files);
    Re-SpS with a policy for the tiny target."""
    out = {}
    for m in METHODS:
        if m == "resps":
            pol = tiny_resps_policy()
            out[m] = lambda pol=pol: ReSpSController(ReSpSConfig(interval=2), policy=pol)
            continue
        try:
            make_controller(m)
        except (ValueError, FileNotFoundError):
            continue
        out[m] = lambda m=m: make_controller(m)
    assert {"ar", "static", "deagle", "ddd", "svip", "gammatune", "resps"} <= set(out)
    return out


class RandomController(Controller):
    """Random width, depth, early stop and V per cycle (within the recorded widths and depth)."""

    name = "random"

    def __init__(self, seed, widths=(3, 8, 10), max_depth=12):
        self.seed, self.widths, self.max_depth = seed, widths, max_depth

    def reset(self):
        self.rng = random.Random(self.seed)

    def begin_cycle(self, ctx):
        if self.rng.random() < 0.15:
            return TreePlan(self.widths[0], 0, 0)
        return TreePlan(self.rng.choice(self.widths), self.rng.randint(1, self.max_depth), self.rng.randint(0, 80))

    def continue_drafting(self, step):
        return self.rng.random() < 0.8

    def choose_size(self, tree, plan):
        return self.rng.choice([plan.size, self.rng.randint(0, tree.num_candidates + 3)])


@pytest.mark.parametrize("lat_name", sorted(LATENCIES))
def test_oracle_is_a_lower_bound_on_every_method(traces, lat_name):
    lat = LATENCIES[lat_name]
    orc = oracle_all(traces, lat)
    orc_all = oracle_all(traces, lat, sizes="all")
    assert orc_all.total_s <= orc.total_s * (1 + 1e-12)
    controllers = registered_methods()
    for w in (3, 8, 10):  # statics over the default V set: the explicit-set oracle bounds them too
        for d in (1, 2, 4, 8, 12):
            for v in (1, 4, 16, 60, 240):
                controllers[f"static-{w}-{d}-{v}"] = lambda c=StaticConfig(w, d, v): StaticController(c)
    for seed in range(6):
        controllers[f"random-{seed}"] = lambda seed=seed: RandomController(seed)
    explicit_checked = 0
    for name, make in controllers.items():
        sim = simulate(make(), traces, lat, measure_policy=False)
        if any(c.chain for r in sim.runs for c in r.cycles):  # context chains: the chain oracle's test below
            assert name == "ngram", name
            continue
        sizes = {c.size for r in sim.runs for c in r.cycles if c.depth > 0}
        assert orc_all.total_s <= sim.total_s * (1 + 1e-12), name
        if sizes <= set(DEFAULT_SIZES):
            assert orc.total_s <= sim.total_s * (1 + 1e-12), name
            explicit_checked += 1
        assert orc_all.speedup >= sim.speedup * (1 - 1e-12), name
        for run, srun in zip(orc_all.runs, sim.runs):  # per prompt too (the oracle is per prompt)
            assert run.key == srun.key and run.total_s <= srun.total_s * (1 + 1e-12), (name, run.key)
    assert explicit_checked >= 70  # every static and the registered methods used V in the default set


def test_oracle_beats_static_and_ar_strictly_somewhere(traces):
    lat = LATENCIES["cpu"]
    orc = oracle_all(traces, lat)
    st = best_static(traces, lat)
    assert orc.total_s < st.total_s and orc.speedup > 1.0
    assert orc.speedup > st.speedup


# ----------------------------------------------------------------------------------------- best static


@pytest.mark.parametrize("lat_name", sorted(LATENCIES))
def test_best_static_agrees_with_simulating_the_grid(traces, lat_name):
    lat = LATENCIES[lat_name]
    widths, depths, sizes = (3, 10), (1, 2, 3, 5, 12), (1, 3, 10, 60, 500)
    for max_new in (None, 12):
        choice = best_static(traces, lat, widths=widths, depths=depths, sizes=sizes, max_new_tokens=max_new)
        assert len(choice.grid) == len(widths) * len(depths) * len(sizes)
        seen = {}
        for row in choice.grid:
            cfg = StaticConfig(row["width"], row["depth"], row["size"])
            sim = simulate(StaticController(cfg), traces, lat, max_new_tokens=max_new, measure_policy=False)
            assert math.isclose(row["total_s"], sim.total_s, rel_tol=1e-12), row
            assert math.isclose(row["speedup"], sim.speedup, rel_tol=1e-12)
            assert math.isclose(choice.ar_s, sim.ar_s, rel_tol=1e-12)
            seen[(cfg.width, cfg.depth, cfg.size)] = sim.total_s
        assert set(seen) == {(w, d, v) for w in widths for d in depths for v in sizes}
        best = min(seen.values())
        assert math.isclose(choice.total_s, best, rel_tol=1e-12)
        assert seen[(choice.width, choice.depth, choice.size)] <= best * (1 + 1e-12)
        assert choice.speedup == choice.ar_s / choice.total_s
        d = choice.to_dict()
        assert "grid" not in d and d["speedup"] == choice.speedup and len(choice.to_dict(grid=True)["grid"]) == 50


def test_static_times_per_trace_sum_to_best_static(traces):
    lat = LATENCIES["gpu"]
    per = [static_times(t, lat, (8,), (2, 6), (5, 50)) for t in traces]
    total = sum(p[3] for p in per)
    choice = best_static(traces, lat, widths=(8,), depths=(2, 6), sizes=(5, 50))
    assert np.allclose(sorted(total), sorted(r["total_s"] for r in choice.grid), rtol=1e-12)
    assert list(per[0][0]) == [8] * 4 and list(per[0][1]) == [2, 2, 6, 6] and list(per[0][2]) == [5, 50, 5, 50]


def test_best_static_default_widths_are_the_common_ones(traces, models):
    other = record_tiny_traces(models, TraceSettings(widths=(3, 5), max_depth=12, max_new_tokens=N_NEW),
                               PROMPTS[:1])
    choice = best_static([traces[0], other[0]], LATENCIES["cpu"], depths=(1, 2), sizes=(4,))
    assert {r["width"] for r in choice.grid} == {3}


# ------------------------------------------------------------------------------- fraction of oracle gain


def test_fraction_of_oracle_gain_values():
    assert math.isclose(fraction_of_oracle_gain(1.2, 1.5), 0.4)
    assert fraction_of_oracle_gain(1.5, 1.5) == 1.0
    assert math.isclose(fraction_of_oracle_gain(0.8, 1.5), -0.4)
    assert fraction_of_oracle_gain(1.0, 3.0) == 0.0
    assert fraction_of_oracle_gain(1.3, 1.0) is None  # the oracle gains nothing over AR
    assert fraction_of_oracle_gain(1.3, 0.7) is None


def test_compare_methods_rows_and_fractions(traces):
    lat = LATENCIES["cpu"]
    methods = {m: (lambda m=m: make_controller(m)) for m in ("ar", "static", "deagle", "svip")}
    res = compare_methods(traces, lat, methods, oracle_sizes="all")
    orc = res["oracle"]
    assert math.isclose(orc["modelled_speedup"], oracle_all(traces, lat, sizes="all").speedup, rel_tol=1e-12)
    assert orc["fraction_of_oracle_gain"] == 1.0
    st = best_static(traces, lat)
    assert res["best_static"]["modelled_speedup"] == st.speedup
    assert res["best_static"]["name"] == f"best-static W{st.width} D{st.depth} V{st.size}"
    for name, row in res["methods"].items():
        sim = simulate(methods[name](), traces, lat, measure_policy=False)
        assert row["modelled_speedup"] == sim.speedup and row["tau"] == sim.tau
        want = (sim.speedup - 1) / (orc["modelled_speedup"] - 1)
        assert math.isclose(row["fraction_of_oracle_gain"], want, rel_tol=1e-12)
        assert row["fraction_of_oracle_gain"] <= 1.0 + 1e-12
    assert res["methods"]["ar"]["fraction_of_oracle_gain"] == pytest.approx(0.0, abs=1e-12)
    assert 0.0 <= res["best_static"]["fraction_of_oracle_gain"] <= 1.0
    table = format_table(res)
    for name in ("ar", "static", "deagle", "svip", "oracle", "best-static"):
        assert name in table
    without = compare_methods(traces, lat, {"static": methods["static"]}, with_oracle=False, with_static=False)
    assert without["oracle"] is None and without["best_static"] is None
    assert without["methods"]["static"]["fraction_of_oracle_gain"] is None
    assert "-" in format_table(without).splitlines()[-1]


def test_compare_methods_none_when_the_oracle_gains_nothing(traces):
    """With drafting that costs more than it can ever save, the oracle is AR and every fraction is None."""
    dear = LatencyModel([1.0, 0.0, 0.0, 0.0], [1e-3, 0.0, 0.0, 0.0])
    res = compare_methods(traces[:2], dear, {"static": lambda: make_controller("static")})
    assert res["oracle"]["modelled_speedup"] == pytest.approx(1.0)
    assert res["oracle"]["mean_depth"] == 0.0 and res["oracle"]["ar_cycles"] == res["oracle"]["cycles"]
    assert all(r["fraction_of_oracle_gain"] is None
               for r in [*res["methods"].values(), res["oracle"], res["best_static"]])


# ------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_are_named(traces):
    tr, lat = traces[0], LATENCIES["cpu"]
    with pytest.raises(ValueError, match=r"depths must be in 1\.\.12.*\[13\]"):
        oracle(tr, lat, depths=(13,))
    with pytest.raises(ValueError, match=r"depths must be in 1\.\.12"):
        best_static(traces, lat, depths=(0, 2))
    with pytest.raises(ValueError, match="W=5 was not recorded"):
        oracle(tr, lat, widths=(3, 5))
    with pytest.raises(ValueError, match="W=4 was not recorded"):
        best_static(traces, lat, widths=(4,))
    with pytest.raises(ValueError, match="sizes must be a sequence of V values or 'all', got 'every'"):
        oracle(tr, lat, sizes="every")
    with pytest.raises(ValueError, match="non-negative integers"):
        oracle(tr, lat, sizes=(4, -1))
    with pytest.raises(ValueError, match="non-negative integers"):
        oracle(tr, lat, sizes=())
    with pytest.raises(ValueError, match="sizes must be"):
        oracle(tr, lat, sizes=7)
    with pytest.raises(ValueError, match="explicit list of sizes"):
        best_static(traces, lat, sizes="all")
    with pytest.raises(ValueError, match="widths"):
        oracle(tr, lat, widths=())
    with pytest.raises(ValueError, match="depths"):
        oracle(tr, lat, depths=())
    with pytest.raises(ValueError, match=r"max_new_tokens must be in 1\.\.30"):
        oracle(tr, lat, max_new_tokens=31)
    with pytest.raises(ValueError, match="at least one trace"):
        best_static([], lat)
    shrinking = LatencyModel([1e-3, 0, 0, 0], [1e-2, -1e-4, 0, 0])  # verification cheaper with more nodes
    with pytest.raises(ValueError, match="non-decreasing in V"):
        oracle(tr, shrinking, sizes="all")
    oracle(tr, shrinking, sizes=(1, 60))  # an explicit list is fine


def test_terminal_position_matches_the_simulator(traces, small_traces):
    for tr in traces + small_traces:
        for limit in sorted({1, 2, 5, tr.settings.max_new_tokens}):
            sim = simulate(make_controller("ar"), tr, max_new_tokens=limit).runs[0]
            assert len(sim.token_ids) == terminal_position(tr, limit) + 1
            assert len(sim.cycles) == terminal_position(tr, limit)


# ------------------------------------------------------------------------------------------ the command


def test_oracle_cli(tmp_path, models, capsys):
    import json

    from adaptree.cli import main
    from adaptree.offline.latency import machine_meta
    from adaptree.offline.traces import TraceStore, open_store_for

    target, head = models
    settings = TraceSettings(widths=(4, 10), max_depth=12, max_new_tokens=15)
    store = open_store_for(tmp_path / "tr", target, head, settings)
    store.record(target, head, [("q/0", PROMPTS[0]), ("q/1", PROMPTS[3])], progress=False)
    cpu = LATENCIES["cpu"]
    lat = LatencyModel(cpu.draft, cpu.verify, cpu.other_s, meta={"machine": machine_meta(), "source": "micro"})
    lat.save(tmp_path / "lat.json")
    out = tmp_path / "res" / "oracle.json"
    argv = ["oracle", "--traces", str(tmp_path / "tr"), "--latency", str(tmp_path / "lat.json"),
            "--methods", "ar,static,deagle", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "warning" not in cap.err
    for name in ("ar", "static", "deagle", "best-static", "oracle", "frac. oracle gain"):
        assert name in cap.out
    res = json.loads(out.read_text())
    traces = TraceStore(tmp_path / "tr").load_all()
    want = compare_methods(traces, lat, {m: (lambda m=m: make_controller(m)) for m in ("ar", "static", "deagle")})
    assert res["oracle"] == pytest.approx(want["oracle"]) and res["best_static"] == pytest.approx(want["best_static"])
    assert list(res["methods"]) == ["ar", "static", "deagle"]
    for m in res["methods"]:
        assert res["methods"][m] == pytest.approx(want["methods"][m])
    assert res["setup"]["prompts"] == 2 and res["setup"]["widths"] == [4, 10] and res["setup"]["machine_warnings"] == []
    assert res["setup"]["oracle_sizes"] == list(DEFAULT_SIZES)
    # method flags reach every method; every V for the oracle; another token limit
    assert main(argv[:6] + ["static", "-W", "4", "-D", "3", "-V", "10", "--sizes", "all", "--max-new-tokens", "9",
                            "--out", str(out), "--quiet"]) == 0
    res = json.loads(out.read_text())
    sim = simulate(StaticController(StaticConfig(4, 3, 10)), traces, lat, max_new_tokens=9, measure_policy=False)
    assert res["methods"]["static"]["modelled_speedup"] == sim.speedup and res["setup"]["oracle_sizes"] == "all"
    assert res["oracle"]["modelled_speedup"] == oracle_all(traces, lat, sizes="all", max_new_tokens=9).speedup
    capsys.readouterr()
    # bad input, each named
    assert main(argv[:6] + ["static,nope", "--out", "", "--quiet"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert main(argv[:6] + ["static,static", "--out", "", "--quiet"]) == 2
    assert "listed twice" in capsys.readouterr().err
    assert main(argv[:6] + ["static", "-W", "8", "--out", "", "--quiet"]) == 2
    assert "W=8 was not recorded" in capsys.readouterr().err
    assert main(argv[:6] + ["static", "--static-sizes", "all", "--out", "", "--quiet"]) == 2
    assert "--static-sizes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv[:6] + ["static", "--sizes", "some", "--out", "", "--quiet"])
    assert "expected 'default', 'all'" in capsys.readouterr().err
    assert main(["oracle", "--traces", str(tmp_path / "nothing"), "--latency", str(tmp_path / "lat.json")]) == 2
    assert "no trace manifest" in capsys.readouterr().err
    # a latency model measured elsewhere: a warning naming both machines, in the output JSON too
    LatencyModel(cpu.draft, cpu.verify, cpu.other_s, meta={"machine": {**machine_meta(), "torch_threads": 99}}).save(
        tmp_path / "other.json")
    assert main(["oracle", "--traces", str(tmp_path / "tr"), "--latency", str(tmp_path / "other.json"),
                 "--methods", "static", "--out", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "torch threads 99" in err and f"torch threads {machine_meta()['torch_threads']!r}" in err
    assert len(json.loads(out.read_text())["setup"]["machine_warnings"]) == 1


# ------------------------------------------------------------------------------------------ context chains


@pytest.mark.parametrize("lat_name", ["cpu", "gpu", "cpu_knots"])
def test_chain_oracle_replays_exactly_and_bounds_the_chain_methods(traces, small_traces, lat_name):
    """With chains the oracle's schedule replays to the same cycles (the chain's length, the nodes it added
    beyond the head's selected tree: computed by the simulator through add_chain) and the same time; it is at
    most the head-only oracle's time and a lower bound on ngram's and hybrid's modelled times."""
    from adaptree.methods.costaware import AcceptanceCalibration
    from adaptree.methods.common import ChainCalibration
    from adaptree.methods.hybrid import HybridConfig, HybridController

    lat = LATENCIES[lat_name]
    chained = 0
    for tr in traces + small_traces:
        for kwargs in [{"chains": 6}, {"chains": 3, "sizes": "all"}, {"chains": 8, "widths": (3,), "depths": (1, 2)}]:
            run = oracle(tr, lat, **kwargs)
            ctl = ScheduleController(run.schedule(), chains=kwargs["chains"])
            sim = simulate(ctl, tr, lat, measure_policy=False).runs[0]
            tuples = lambda cs: [(c.context_len, c.width, c.depth, c.size, c.accepted, c.chain, c.chain_nodes)  # noqa: E731
                                 for c in cs]
            assert tuples(sim.cycles) == tuples(run.cycles), (tr.key, kwargs)
            assert sim.total_s == run.total_s and math.isclose(run.dp_s, run.total_s, rel_tol=1e-12)
            plain = oracle(tr, lat, **{k: v for k, v in kwargs.items() if k != "chains"})
            assert run.total_s <= plain.total_s * (1 + 1e-12)
            chained += sum(c.chain > 0 for c in run.cycles)
    assert chained > 0
    full = oracle_all(traces, lat, chains=16)
    ngram = simulate(make_controller("ngram", min_n=1), traces, lat, measure_policy=False)
    hyb = simulate(HybridController(HybridConfig(width=8, max_depth=12), lat, AcceptanceCalibration.fit(traces),
                                    ChainCalibration.fit(traces)), traces, lat, measure_policy=False)
    for sim in (ngram, hyb):
        for r, o in zip(sim.runs, full.runs):
            assert o.total_s <= r.total_s * (1 + 1e-9), (r.key, o.total_s, r.total_s)
    with pytest.raises(ValueError, match="chains must be a non-negative integer, got -1"):
        oracle(traces[0], lat, chains=-1)
