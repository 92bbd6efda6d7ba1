"""Greedy traces and the replay simulator on tiny random models: replay equals the live engine."""

from __future__ import annotations

import bisect
import json
import math
import os

import numpy as np
import pytest
import torch
from conftest import N_NEW, PROMPTS, TRACE_SETTINGS, record_tiny_traces, tiny_head, tiny_target
from ties import TIE, PathTree, assert_mostly_exact, compare_trees, draft_ids, replay_against_live, replay_tree

from adaptree.core.batched import batched_decode as greedy_outputs
from adaptree.core.engine import Engine
from adaptree.methods import (LEARNED, METHODS, REGISTRY, Controller, StaticConfig, StaticController, TreePlan,
                              make_controller)
from adaptree.offline.latency import LatencyModel, calibrate
from adaptree.offline.simulator import ReplayTree, simulate
from adaptree.offline.traces import (
    PromptTrace,
    TraceSettings,
    TraceStore,
    acceptance_table,
    accepted_length,
    head_fingerprint,
    load_trace,
    match_mask,
    model_fingerprint,
    num_candidates,
    open_store_for,
    record_trace,
    save_trace,
)

SETTINGS = TRACE_SETTINGS


@pytest.fixture(scope="module")
def traces(models):
    return record_tiny_traces(models, SETTINGS)


def cycle_tuples(cycles):
    return [(c.cycle, c.context_len, c.width, c.depth, c.size, c.candidates, c.accepted, c.emitted) for c in cycles]


def assert_replays_live(models, traces, make, eos=(), max_new_tokens=N_NEW, max_seq_len=None):
    """Every prompt generated live and replayed from its trace: the same cycles up to near-ties (ties.py)."""
    target, head = models
    eng = Engine(target, head, eos_token_ids=eos, max_seq_len=max_seq_len)
    draft_id = draft_ids(head)
    checks = [replay_against_live(eng, make(), make(), prompt, tr, max_new_tokens, draft_id)
              for prompt, tr in zip(PROMPTS, traces)]
    for c in checks:
        if c.left_at is None:
            assert c.sim.tau == c.live.tau
    assert_mostly_exact(checks)


# ---------------------------------------------------------------- controllers for the replay tests


class ThresholdStop(Controller):
    """Data-dependent early stop and size: stop when the best beam node leads the second by less than
    ``margin * depth`` or its log-prob falls below ``stop_below * depth``; verify the candidates
    scoring above ``keep_above * depth``. (The tiny head is nearly uniform over its 12 draft tokens,
    about -2.27 per level with margins of 0.01-0.1: the decisions hinge on small score differences.)"""

    name = "threshold"

    def __init__(self, width=8, margin=0.012, stop_below=-2.3, keep_above=-2.4, cap=50):
        self.plan = TreePlan(width, 12, cap)
        self.margin, self.stop_below, self.keep_above = margin, stop_below, keep_above

    def begin_cycle(self, ctx):
        return self.plan

    def continue_drafting(self, step):
        assert step.child_scores.shape == ((1 if step.depth == 1 else step.width), step.width)
        assert torch.equal(step.tree.candidate_scores()[-step.child_scores.numel():], step.child_scores.reshape(-1))
        best, second = float(step.beam_scores[0]), float(step.beam_scores[1])
        return best - second >= self.margin * step.depth and best >= self.stop_below * step.depth

    def choose_size(self, tree, plan):
        return min(plan.size, int((tree.candidate_scores() > self.keep_above * tree.depth).sum()))


class AdaptiveDepth(Controller):
    """State carried across cycles through end_cycle: deeper after a full acceptance, shallower after
    a miss; the width alternates with the parity of the last accepted length; uses the features too."""

    name = "adaptive"

    def reset(self):
        self.depth, self.width = 4, 8

    def begin_cycle(self, ctx):
        assert ctx.features is not None and ctx.features.shape == (96,)
        w = self.width if float(ctx.features[:8].sum()) > 0 else 3
        return TreePlan(w, self.depth, 6 * self.depth)

    def end_cycle(self, record):
        if record.accepted >= record.depth - 1:
            self.depth = min(12, self.depth + 1)
        else:
            self.depth = max(1, self.depth - 1)
        self.width = 3 if record.accepted % 2 else 10


# ------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("wdv", [(8, 8, 60), (3, 5, 10), (10, 12, 500), (3, 1, 1), (8, 4, 30), (10, 8, 60)])
def test_static_replay_equals_live(models, traces, wdv):
    assert_replays_live(models, traces, lambda: StaticController(StaticConfig(*wdv)))


def test_early_stop_and_data_dependent_size_replay_equals_live(models, traces):
    for args in [(8, 0.012, -2.3, -2.4, 50), (3, 0.02, -2.5, -2.35, 20), (10, 0.008, -2.27, -2.5, 200)]:
        assert_replays_live(models, traces, lambda: ThresholdStop(*args))
    # the stop rule stopped at several depths, V varied
    sim = simulate(ThresholdStop(), traces)
    depths = {c.depth for r in sim.runs for c in r.cycles}
    assert len(depths) > 2 and min(depths) < 12
    assert len({c.size for r in sim.runs for c in r.cycles}) > 2


def test_end_cycle_state_replay_equals_live(models, traces):
    assert_replays_live(models, traces, AdaptiveDepth)
    sim = simulate(AdaptiveDepth(), traces)
    assert len({c.depth for r in sim.runs for c in r.cycles}) > 2
    assert len({c.width for r in sim.runs for c in r.cycles}) == 3


# static-gs = static + a file; learned methods need trained policy files (their replay tests: test_radar.py,
# test_ltd.py); costaware and hybrid need this machine's files (their replay tests: test_costaware.py, test_hybrid.py);
# draft-model drafts with a second model, which a trace does not hold
@pytest.mark.parametrize("method", [m for m in METHODS
                                    if m not in ("static", "static-gs", "costaware", "hybrid") + LEARNED
                                    and not REGISTRY[m].needs_draft_model])
def test_every_registered_method_replays_live(models, traces, method):
    assert_replays_live(models, traces, lambda: make_controller(method))


def test_eos_and_token_limit_replay(models):
    target, head = models
    ar = Engine(target, head).generate(PROMPTS[0], None, max_new_tokens=N_NEW).token_ids
    eos = (ar[7],)
    s = TraceSettings(widths=(8,), max_depth=8, max_new_tokens=N_NEW, eos_token_ids=eos)
    trs = [record_trace(target, head, p, settings=s) for p in PROMPTS]
    assert trs[0].stop_reason == "eos" and trs[0].end == ar.index(eos[0]) + 1
    assert len(trs[0].output) >= trs[0].end + s.max_depth  # the look-ahead past EOS
    assert_replays_live(models, trs, lambda: StaticController(StaticConfig(8, 8, 60)), eos=eos)
    # a smaller token limit than recorded
    assert_replays_live(models, trs, lambda: StaticController(StaticConfig(8, 6, 40)), eos=eos, max_new_tokens=11)


def test_context_limit_replay(models):
    target, head = models
    s = TraceSettings(widths=(8,), max_depth=8, max_new_tokens=100, max_seq_len=28)
    trs = [record_trace(target, head, p, settings=s) for p in PROMPTS]
    assert {t.stop_reason for t in trs} == {"context_limit"}
    assert_replays_live(models, trs, lambda: StaticController(StaticConfig(8, 8, 60)), max_new_tokens=100,
                        max_seq_len=28)


def test_replay_tree_equals_live_tree(models, traces):
    """Every tree a live static run drafts is the tree replayed from the trace: the same candidates (by
    root-to-node token path: tokens, parents, depths), beams and selected top-60, with scores equal to
    1e-4 (chunked vs single-prefill head cache, tree-verify vs full forward features). The two round
    differently, so near-tied candidates (closer than TIE) may come in another order or, at a cut-off
    (beam, a parent's top-W children, V), swap membership: compare_trees (tests/ties.py) accepts exactly that."""
    target, head = models
    eng = Engine(target, head)
    draft_id = draft_ids(head)
    seen = []

    class Capture(StaticController):
        def continue_drafting(self, step):
            seen[-1][1].append((step.beam_tokens.clone(), step.beam_scores.clone(), step.logp.clone()))
            return True

        def begin_cycle(self, ctx):
            seen.append((ctx.context_len, []))
            return self.plan

        def choose_size(self, tree, plan):
            seen[-1][1].append(tuple(x.clone() for x in (tree.candidate_tokens(), tree.candidate_scores(),
                                                         tree.candidate_parents(), tree.candidate_depths(),
                                                         tree.level_logp)))
            return plan.size

    worst = 0.0
    for prompt, tr in zip(PROMPTS, traces):
        seen.clear()
        eng.generate(prompt, Capture(StaticConfig(8, 12, 60)), max_new_tokens=N_NEW)
        for L, steps in seen:
            j = L - len(prompt)
            (tok, sc, par, dep, last_logp), steps = steps[-1], steps[:-1]
            assert len(steps) == 11
            live = PathTree(tok, sc, par, dep, 8, [s[:2] for s in steps])
            sel_live = {live.paths[i] for i in torch.sort(sc, descending=True, stable=True).indices[:60].tolist()}
            rt = ReplayTree(tr.width(8), j, int(tr.output[j]), L)
            rsteps = [rt.first_step()] + [rt.step() for _ in range(11)]
            rep = PathTree(rt.candidate_tokens(), rt.candidate_scores(), rt.candidate_parents(),
                           rt.candidate_depths(), 8, [(s.beam_tokens, s.beam_scores) for s in rsteps])
            vt = rt.select(60)
            assert int(vt.tokens[0]) == int(tr.output[j])
            vpaths = [()]
            for t, p, dd in zip(vt.tokens[1:].tolist(), vt.parents[1:].tolist(), vt.depth[1:].tolist()):
                vpaths.append(vpaths[p] + (t,))
                assert len(vpaths[-1]) == dd
            worst = max(worst, compare_trees(live, rep, [s[2] for s in steps] + [last_logp], draft_id,
                                             sel_live, set(vpaths[1:])))
    assert worst < TIE


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_trees_do_not_depend_on_how_many_roots_grow_together(models, traces, batch):
    """grow_trees with 1 root per forward (DraftTree's case), a chunk that does not divide the output,
    and one chunk for all: the same trees, scores to the last float bits. Matrix shapes change the
    float rounding, so a near-tie may rank the other way at a rare position (1 in 30 on AVX-512, batch 1):
    such a tree must equal the other up to near-ties (compare_trees, by token path)."""
    target, head = models
    same = total = 0
    for prompt, tr in zip(PROMPTS, traces):
        other = record_trace(target, head, prompt, settings=SETTINGS, batch=batch)
        assert other.end == tr.end and np.array_equal(other.output, tr.output)
        for w, wt in tr.widths.items():
            ot = other.width(w)
            equal = (ot.tokens == wt.tokens).all(1) & (ot.beam == wt.beam).all((1, 2))
            same, total = same + int(equal.sum()), total + equal.size
            assert np.allclose(ot.scores[equal], wt.scores[equal], atol=1e-5, rtol=0)
            assert np.allclose(ot.entropy[equal], wt.entropy[equal], atol=1e-5, rtol=0, equal_nan=True)
            for j in np.flatnonzero(~equal).tolist():
                a, _ = replay_tree(tr, w, tr.max_depth, tr.prompt_len + j)
                b, _ = replay_tree(other, w, tr.max_depth, tr.prompt_len + j)
                compare_trees(a, b, None, None, a.top(60), b.top(60))
    assert same >= 0.5 * total  # near-ties are rare: the exact comparison above covers most trees


def test_batched_greedy_outputs_equal_the_engines(models, traces):
    """greedy_outputs (prompts of different lengths left-padded into one batch) gives each prompt the
    engine's output, end and stop reason: the token limit, EOS (a token the outputs contain), the
    context limit (with and without room for the look-ahead)."""
    target, head = models
    eos = (int(traces[0].output[4]), int(traces[2].output[9]))
    for s in (SETTINGS, TraceSettings(widths=(3,), max_depth=4, max_new_tokens=40, eos_token_ids=eos),
              TraceSettings(widths=(3,), max_depth=4, max_new_tokens=100, max_seq_len=28)):
        outs = greedy_outputs(target, PROMPTS, s.max_new_tokens, s.eos_token_ids, s.max_seq_len, s.max_depth + 1)
        refs = traces if s is SETTINGS else [record_trace(target, head, p, settings=s) for p in PROMPTS]
        for ref, (tokens, end, stop) in zip(refs, outs):
            assert (tokens, end, stop) == (ref.output.tolist(), ref.end, ref.stop_reason)
        if s.eos_token_ids:
            assert {r.stop_reason for r in refs} >= {"eos"}
        if s.max_seq_len:
            assert {r.stop_reason for r in refs} == {"context_limit"}
        # the recorded trace is the same whichever way its output was computed
        for p, ref, o in zip(PROMPTS, refs, outs):
            other = record_trace(target, head, p, settings=s, output=o)
            assert all(np.array_equal(other.width(w).tokens, ref.width(w).tokens) for w in s.widths)
    with pytest.raises(ValueError, match="context limit is 28"):
        greedy_outputs(target, [[1] * 28], 4, max_len=28)


def test_features_recorded(models, traces):
    target, head = models
    seen = []

    class Capture(StaticController):
        def begin_cycle(self, ctx):
            seen.append((ctx.context_len, ctx.features.clone()))
            return self.plan

    Engine(target, head).generate(PROMPTS[3], Capture(), max_new_tokens=N_NEW)
    tr = traces[3]
    for L, f in seen:
        assert torch.allclose(torch.from_numpy(tr.features[L - len(PROMPTS[3])]), f, atol=1e-5)
    f16 = record_trace(target, head, PROMPTS[3], settings=TraceSettings(widths=(3,), max_depth=2,
                                                                          max_new_tokens=N_NEW))
    assert f16.features.dtype == np.float16
    assert np.allclose(f16.features.astype(np.float32), tr.features, atol=1e-2, rtol=1e-2)
    assert record_trace(target, head, [1], settings=TraceSettings(widths=(3,), max_depth=2, max_new_tokens=4,
                                                                  feature_dtype="none")).features is None


def brute_accepted(trace: PromptTrace, width: int, j: int, depth: int, v: int) -> int:
    """The verified tree's nodes walked one by one; a node is accepted when its whole path equals the output."""
    rt = ReplayTree(trace.width(width), j, int(trace.output[j]), trace.prompt_len + j)
    rt.first_step()
    while rt.depth < depth:
        rt.step()
    vt = rt.select(v)
    best = 0
    toks, par = vt.tokens.tolist(), vt.parents.tolist()
    for node in range(1, len(toks)):
        path, k = [], node
        while k > 0:
            path.append(toks[k])
            k = par[k]
        path.reverse()
        if path == trace.output[j + 1:j + 1 + len(path)].tolist():
            best = max(best, len(path))
    return best


def test_accepted_length_vs_brute_force(traces):
    rng = np.random.default_rng(0)
    for tr in traces:
        for w in (3, 8):
            wt = tr.width(w)
            tables = {d: acceptance_table(wt, tr.output, d) for d in (1, 2, 5, 12)}
            for _ in range(12):
                j = int(rng.integers(0, tr.end))
                d = int(rng.choice([1, 2, 5, 12]))
                c = num_candidates(w, d)
                for v in {0, 1, 2, int(rng.integers(1, c + 1)), c, c + 5}:
                    want = brute_accepted(tr, w, j, d, v)
                    assert accepted_length(wt, tr.output, j, d, v) == want
                    assert tables[d][j, min(v, c)] == want
    # sanity: acceptance happens on these models
    assert max(acceptance_table(tr.width(8), tr.output, 12)[:, -1].max() for tr in traces) >= 2


def test_match_mask_levels(traces):
    tr = traces[2]
    wt = tr.width(3)
    m = match_mask(wt, tr.output)
    par = wt.parents()
    depth = wt.depths()
    for j in range(tr.end):
        for c in np.nonzero(m[j])[0]:
            assert wt.tokens[j, c] == tr.output[j + depth[c]]
            assert par[j, c] < 0 or m[j, par[j, c]]
        assert m[j, depth == 1].sum() <= 1  # siblings carry distinct tokens


def test_save_load_round_trip(tmp_path, traces):
    tr = traces[1]
    path = tmp_path / "t.safetensors"
    save_trace(tr, path)
    back = load_trace(path, expect={"model": tr.fingerprints["model"], "head": tr.fingerprints["head"]})
    assert back.key == tr.key and back.end == tr.end and back.stop_reason == tr.stop_reason
    assert back.settings == tr.settings and back.fingerprints == tr.fingerprints and back.max_len == tr.max_len
    for name in ("prompt", "output", "features"):
        assert np.array_equal(getattr(back, name), getattr(tr, name))
    for w, wt in tr.widths.items():
        for name in ("tokens", "scores", "beam"):
            assert np.array_equal(getattr(back.widths[w], name), getattr(wt, name))
        assert (wt.entropy is None) == (back.widths[w].entropy is None)
    ctl = lambda: StaticController(StaticConfig(8, 8, 60))  # noqa: E731
    assert cycle_tuples(simulate(ctl(), back).runs[0].cycles) == cycle_tuples(simulate(ctl(), tr).runs[0].cycles)
    with open(path, "rb") as f:  # safetensors: an 8-byte header length, then a JSON header; no pickle
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    assert "adaptree_trace" in header["__metadata__"]


def test_trace_from_another_head_or_model_is_refused(tmp_path, models, traces):
    target, head = models
    other_head = tiny_head(target, draft_vocab=12, seed=7)
    other_target = tiny_target(seed=5)
    assert head_fingerprint(other_head) != head_fingerprint(head)
    assert model_fingerprint(other_target) != model_fingerprint(target)
    path = tmp_path / "t.safetensors"
    save_trace(traces[0], path)
    with pytest.raises(ValueError, match="different draft head"):
        load_trace(path, expect={"head": head_fingerprint(other_head)})
    with pytest.raises(ValueError, match="different target model"):
        load_trace(path, expect={"model": model_fingerprint(other_target)})
    s = TraceSettings(widths=(3,), max_depth=2, max_new_tokens=5)
    open_store_for(tmp_path / "store", target, head, s)
    with pytest.raises(ValueError, match="different draft head"):
        open_store_for(tmp_path / "store", target, other_head, s)
    with pytest.raises(ValueError, match="other settings"):
        open_store_for(tmp_path / "store", target, head, TraceSettings(widths=(3,), max_depth=3, max_new_tokens=5))
    mixed = [traces[0], record_trace(target, other_head, [1, 2], settings=s)]
    with pytest.raises(ValueError, match="another model or head"):
        simulate(StaticController(), mixed)


def test_store_resume(tmp_path, models):
    target, head = models
    s = TraceSettings(widths=(3, 8), max_depth=4, max_new_tokens=12)
    store = open_store_for(tmp_path, target, head, s)
    items = [(f"ds/{i}", p) for i, p in enumerate(PROMPTS)]
    assert store.record(target, head, items[:2], progress=False) == {"recorded": 2, "skipped": 0}
    mtimes = {p: os.stat(p).st_mtime_ns for p in store.keys_on_disk()}
    store = open_store_for(tmp_path, target, head, s)  # a new session over the same folder
    assert store.record(target, head, items, progress=False) == {"recorded": 2, "skipped": 2}
    assert all(os.stat(p).st_mtime_ns == t for p, t in mtimes.items())
    # a prompt whose ids changed under the same key is recorded again
    assert store.record(target, head, [("ds/0", [9, 9])], progress=False)["recorded"] == 1
    loaded = TraceStore(tmp_path).load_all()
    assert len(loaded) == 4 and {t.key for t in loaded} == {k for k, _ in items}
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".tmp-*"))  # no temporary file left
    res = simulate(StaticController(StaticConfig(3, 4, 10)), loaded)
    assert len(res.runs) == 4 and res.tau >= 1.0


def test_width_and_depth_outside_the_trace_are_named(traces):
    with pytest.raises(ValueError, match="W=5 was not recorded"):
        simulate(StaticController(StaticConfig(5, 4, 10)), traces[0])
    shallow = TraceSettings(widths=(3,), max_depth=2, max_new_tokens=N_NEW)
    tr = traces[0]
    short = PromptTrace(tr.key, tr.prompt, tr.output, tr.end, tr.stop_reason, tr.max_len, shallow,
                        {3: type(tr.width(3))(3, 2, tr.width(3).tokens[:, :12], tr.width(3).scores[:, :12],
                                              tr.width(3).beam[:, :2])}, None, tr.fingerprints)
    simulate(StaticController(StaticConfig(3, 2, 10)), short)
    with pytest.raises(ValueError, match="max_depth=2"):
        simulate(StaticController(StaticConfig(3, 3, 10)), short)


def test_latency_model_fit_and_json(tmp_path, traces):
    true = LatencyModel([1e-3, 2e-4, 1e-6, 3e-8], [5e-3, 1e-5, 2e-6, 1e-9], other_s=1e-4)
    d = [(w, L, true.draft_step(w, L)) for w in (2, 4, 8, 16) for L in (10, 100, 500)]
    v = [(s, L, true.verify_time(s, L)) for s in (0, 10, 60, 200) for L in (10, 100, 500)]
    fit = LatencyModel.fit(d, v, other_s=1e-4)
    assert np.allclose(fit.draft, true.draft, rtol=1e-6, atol=1e-12)
    assert np.allclose(fit.verify, true.verify, rtol=1e-6, atol=1e-12)
    fit.save(tmp_path / "lat.json")
    back = LatencyModel.load(tmp_path / "lat.json")
    assert back == fit
    res = simulate(StaticController(StaticConfig(8, 8, 60)), traces, back, measure_policy=False)
    cyc = [c for r in res.runs for c in r.cycles]
    want = sum(back.cycle_time(c.width, c.depth, c.size, c.context_len) for c in cyc)
    assert math.isclose(res.total_s, want, rel_tol=1e-9)
    ar = sum(back.verify_time(0, r.prompt_len + i) + back.other_s for r in res.runs for i in range(len(r.token_ids) - 1))
    assert math.isclose(res.ar_s, ar, rel_tol=1e-9) and res.speedup > 0
    assert all(c.policy_s == 0.0 for c in cyc)
    rec_fit = LatencyModel.fit_records(cyc)
    assert np.allclose([rec_fit.draft_step(8, L) for L in (20, 40)], [back.draft_step(8, L) for L in (20, 40)],
                       rtol=1e-6)


def test_calibrate_runs_on_tiny_models(models):
    target, head = models
    lat = calibrate(target, head, widths=(2, 4, 8), sizes=(0, 8, 16), lengths=(8, 32), repeats=1)
    assert len(lat.meta["draft_samples"]) == 6 and len(lat.meta["verify_samples"]) == 6
    assert lat.verify_time(8, 32) > 0 and lat.draft_step(4, 32) > 0
    assert lat.verify_knots == [1, 9, 17]  # a knot per timed size (N = V + 1)
    assert np.all(np.diff(lat.verify_times(np.arange(40), 20)) >= -1e-15)  # made non-decreasing in V
    bil = calibrate(target, head, widths=(2, 4), sizes=(0, 8), lengths=(8, 32), repeats=1, knots=False)
    assert bil.verify_knots is None and len(bil.verify) == 4


def test_calibrate_times_the_buckets_of_a_graphed_engine(models):
    """Timed through fixed-shape steps (on the CPU: uncaptured), the verification knots are the buckets up to the
    one holding the largest size, widths are recorded as their buckets, and the model prices sizes by bucket."""
    target, head = models
    lat = calibrate(target, head, widths=(2, 3), sizes=(0, 5), lengths=(8, 32), repeats=1, graphs=True)
    assert lat.buckets == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert lat.verify_knots == [1, 2, 4, 8]  # V + 1 = 6 lies in the bucket of 8
    assert sorted({w for w, _, _ in lat.meta["draft_samples"]}) == [2, 4]
    assert lat.verify_time(2, 20) == lat.verify_time(3, 20) and lat.draft_step(3, 20) == lat.draft_step(4, 20)
    assert LatencyModel.from_dict(lat.to_dict()).buckets == lat.buckets
    assert "buckets" in "\n".join(lat.describe())


def test_latency_buckets_price_a_size_at_its_bucket():
    lat = LatencyModel(draft=[1e-3, 1e-4, 0, 0], verify=[2e-3, 1e-4, 0, 0], buckets=[1, 2, 4, 8])
    assert lat.verify_time(0, 10) == lat.verify_times(0, 10)  # N = 1
    assert math.isclose(lat.verify_time(2, 10), 2e-3 + 4e-4) and lat.verify_time(3, 10) == lat.verify_time(2, 10)
    assert math.isclose(lat.verify_time(9, 10), 2e-3 + 10e-4)  # past the last bucket: the rows themselves
    assert math.isclose(lat.draft_step(5, 10), 1e-3 + 8e-4)
    with pytest.raises(ValueError, match=r"buckets must be increasing sizes >= 1, got \[4, 2\]"):
        LatencyModel(buckets=[4, 2])


# Verification cost of a CPU-like machine: a step from 1 to 2 rows, then a gentle slope; linear in L per knot.
KNOTS = [1, 2, 5, 17, 61, 241]
KNOT_AT = {1: (0.040, 2e-5), 2: (0.060, 2e-5), 5: (0.064, 2.2e-5), 17: (0.080, 3e-5), 61: (0.150, 6e-5),
           241: (0.400, 2e-4)}


def knot_truth(n, L):
    """Independent piecewise-linear reference: interpolate the knot lines in N (extrapolate past the ends)."""
    i = min(len(KNOTS) - 2, max(0, bisect.bisect_right(KNOTS, n) - 1))
    a, b = KNOTS[i], KNOTS[i + 1]
    ya, yb = KNOT_AT[a][0] + KNOT_AT[a][1] * L, KNOT_AT[b][0] + KNOT_AT[b][1] * L
    return max(0.0, ya + (n - a) / (b - a) * (yb - ya))


def test_knot_latency_model_fits_interpolates_and_round_trips(tmp_path):
    d = [(w, L, 1e-3 + 1e-4 * w) for w in (2, 8) for L in (10, 500)]
    v = [(n - 1, L, knot_truth(n, L)) for n in KNOTS for L in (10, 200, 900)]
    fit = LatencyModel.fit(d, v, other_s=1e-4, knots=True)
    assert fit.verify_knots == KNOTS
    for n in [1, 2, 3, 4, 5, 9, 17, 30, 61, 100, 241, 300]:  # knots, between them and past the last one
        for L in (0, 37, 500, 1500):
            assert math.isclose(fit.verify_time(n - 1, L), knot_truth(n, L), rel_tol=1e-9), (n, L)
    grid = fit.verify_times(np.arange(300)[None, :], np.array([[5.0], [800.0]]))
    assert grid.shape == (2, 300) and np.allclose(grid[1, 7], fit.verify_time(7, 800))
    fit.save(tmp_path / "k.json")
    back = LatencyModel.load(tmp_path / "k.json")
    assert back == fit and back.verify_time(3, 100) == fit.verify_time(3, 100)
    assert "N=5: 64.00" in back.describe()[1]
    # a timing dip (noise) is pooled away: a larger tree never costs less than a smaller one
    noisy = [(s, L, t * (0.7 if s == 4 else 1.0)) for s, L, t in v]
    mono = LatencyModel.fit(d, noisy, knots=True)
    for L in (10, 200, 900):
        assert np.all(np.diff(mono.verify_times(np.arange(300), L)) >= -1e-15)
    assert mono.verify_time(1, 200) == pytest.approx(mono.verify_time(4, 200))  # N=2 and N=5 pooled
    with pytest.raises(ValueError, match="increasing row counts"):
        LatencyModel([0, 0, 0, 0], [0, 0, 0, 0], verify_knots=[2, 2])
    with pytest.raises(ValueError, match="2 coefficients .* per knot"):
        LatencyModel([0, 0, 0, 0], [0, 0, 0], verify_knots=[1, 2])
    with pytest.raises(ValueError, match="V=4 was timed at fewer than 2 context lengths"):
        LatencyModel.fit(d, [x for x in v if not (x[0] == 4 and x[1] != 10)], knots=True)


def test_simulate_cli(tmp_path, models, capsys):
    from adaptree.cli import main

    target, head = models
    store = open_store_for(tmp_path, target, head, TraceSettings(widths=(4,), max_depth=5, max_new_tokens=15))
    store.record(target, head, [("q/0", PROMPTS[0]), ("q/1", PROMPTS[3])], progress=False)
    LatencyModel([1e-3, 1e-4, 0, 0], [5e-3, 1e-5, 0, 0]).save(tmp_path / "lat.json")
    assert main(["simulate", "--traces", str(tmp_path), "--method", "static", "-W", "4", "-D", "5", "-V", "12",
                 "--latency", str(tmp_path / "lat.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sim = simulate(StaticController(StaticConfig(4, 5, 12)), TraceStore(tmp_path).load_all())
    assert out["tau"] == sim.tau and out["cycles"] == sim.cycles and out["prompts"] == 2
    assert out["modelled_speedup"] > 0
    assert out["replay_s"] > 0 and out["modelled_over_replay"] == pytest.approx(out["modelled_s"] / out["replay_s"])
    assert main(["simulate", "--traces", str(tmp_path), "--method", "static", "-W", "4", "-D", "5", "-V", "12",
                 "--latency", str(tmp_path / "lat.json")]) == 0
    assert "faster than the generation it models" in capsys.readouterr().out
    assert main(["simulate", "--traces", str(tmp_path), "--method", "static", "-W", "9"]) == 2  # width not recorded


def test_traces_record_cli_resumes(tmp_path, models, monkeypatch, capsys):
    import adaptree.cli as cli
    from adaptree.api import Pipeline
    from adaptree.cli import common

    target, head = models

    class Tok:  # what the record command needs of a TokenizerBundle
        chat_template = None
        eos_token_ids = [15]

        class tokenizer:
            @staticmethod
            def get_vocab():
                return {str(i): i for i in range(16)}

        @staticmethod
        def encode(text, add_special_tokens=True):
            return [ord(c) % 16 for c in text]

    def fake_load_pipeline(args):
        assert args.dtype == "float32"  # the record command's default
        return Pipeline(target, Tok(), head)

    monkeypatch.setattr(common, "load_pipeline", fake_load_pipeline)
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(["abc", "hello", "xyz"])))
    out = tmp_path / "traces"
    argv = ["traces", "record", "--datasets", "", "--question-file", str(q), "--limit", "2", "--max-new-tokens", "8",
            "--width", "3,4", "--max-depth", "3", "--out", str(out), "--quiet"]
    assert cli.main(argv) == 0
    assert "2 recorded, 0 already there" in capsys.readouterr().out
    assert cli.main(argv[:7] + ["3"] + argv[8:]) == 0
    assert "1 recorded, 2 already there" in capsys.readouterr().out
    store = TraceStore(out)
    assert store.settings.widths == (3, 4) and store.settings.eos_token_ids == (15,)
    assert dict(store.settings.extra)["chat"] == "False"
    loaded = store.load_all()
    assert sorted(t.key for t in loaded) == ["q/0", "q/1", "q/2"]
    assert [int(x) for x in next(t for t in loaded if t.key == "q/1").prompt] == Tok.encode("hello")
    # another max depth into the same folder is refused, naming the difference
    assert cli.main(argv[:-4] + ["4", "--out", str(out), "--quiet"]) == 2
    assert "max_depth" in capsys.readouterr().err


def test_acceptance_tables_are_kept_per_trace_and_equal_fresh_ones(traces):
    from adaptree.offline.traces import _acceptance_table

    tr = traces[0]
    wt = tr.width(8)
    pos = np.arange(tr.end)
    first = acceptance_table(wt, tr.output, 5, pos)
    assert (5, len(pos), id(tr.output)) in wt._tables  # kept
    again = acceptance_table(wt, tr.output, 5, pos)
    assert again.dtype == first.dtype and np.array_equal(again, first)
    assert np.array_equal(first, _acceptance_table(wt, tr.output, 5, pos))
    other = tr.output.copy()  # another output under the same id is never served from the cache
    assert np.array_equal(acceptance_table(wt, other, 5, pos), first)
    some = np.array([0, 2, 3])  # not a prefix: computed, not kept
    assert np.array_equal(acceptance_table(wt, tr.output, 5, some), first[some])
    assert all(k[1] == len(pos) for k in wt._tables)


def test_a_trace_folder_with_more_than_a_trainer_needs_is_reused(tmp_path, models):
    from types import SimpleNamespace

    from adaptree.offline.recording import sufficient_traces

    target, head = models
    pipe = SimpleNamespace(target=target, head=head)
    s = TraceSettings(widths=(3, 8), max_depth=4, max_new_tokens=12, feature_dtype="float16")
    store = open_store_for(tmp_path, target, head, s)
    store.record(target, head, [(f"ds/{i}", p) for i, p in enumerate(PROMPTS[:2])], progress=False)
    keys = {"ds/0", "ds/1"}
    got = sufficient_traces(pipe, tmp_path, keys, (8,), 3, 12, "none")
    assert got is not None and {t.key for t in got} == keys
    assert sufficient_traces(pipe, tmp_path, keys, (8,), 3, 12, "float16") is not None  # features were recorded
    assert sufficient_traces(pipe, tmp_path, keys | {"ds/9"}, (8,), 3, 12, "none") is None  # a prompt missing
    assert sufficient_traces(pipe, tmp_path, keys, (5,), 3, 12, "none") is None  # a width missing
    assert sufficient_traces(pipe, tmp_path, keys, (8,), 6, 12, "none") is None  # too shallow
    assert sufficient_traces(pipe, tmp_path, keys, (8,), 3, 16, "none") is None  # another token limit
    assert sufficient_traces(pipe, tmp_path / "none", keys, (8,), 3, 12, "none") is None
