"""SpecDec++ and C2T on tiny random models: their samples and labels from traces, training (resumable, strict files),
replay against the live engine, and losslessness."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import N_NEW, PROMPTS, record_tiny_traces
from ties import assert_mostly_exact, draft_ids, replay_against_live

from adaptree.core.controller import StaticConfig, StaticController
from adaptree.core.engine import Engine
from adaptree.methods import make_controller
from adaptree.methods.c2t import C2TConfig, C2TController, candidate_features
from adaptree.methods.c2t import samples as c2t_samples
from adaptree.methods.c2t import train_c2t
from adaptree.methods.common.classifier import (
    AcceptanceClassifier,
    ClassifierConfig,
    ClassifierTrainConfig,
    balance,
    visited_roots,
)
from adaptree.methods.specdec import SpecDecConfig, SpecDecController, train_specdec
from adaptree.methods.specdec import samples as specdec_samples
from adaptree.offline.simulator import simulate
from adaptree.offline.traces import TraceSettings, acceptance_table, load_trace, save_trace

SETTINGS = TraceSettings(widths=(10,), max_depth=12, max_new_tokens=N_NEW, feature_dtype="none",
                         hidden_dtype="float32")


@pytest.fixture(scope="module")
def traces(models):
    return record_tiny_traces(models, SETTINGS)


@pytest.fixture(scope="module")
def trained(traces, tmp_path_factory):
    """Both classifiers trained for 2 epochs on the tiny traces (every prompt in training)."""
    root = tmp_path_factory.mktemp("classifiers")
    cfg = ClassifierTrainConfig(epochs=2, batch=64, lr=1e-3, val_fraction=0.0)
    spec = train_specdec(traces, dataclasses.replace(cfg, out=str(root / "specdec")), progress=False)
    c2t = train_c2t(traces, dataclasses.replace(cfg, out=str(root / "c2t")), progress=False)
    return spec, c2t


def test_hidden_states_are_optional_and_keep_old_fingerprints(traces, tmp_path):
    plain = dataclasses.replace(SETTINGS, hidden_dtype="none")
    assert "hidden_dtype" not in plain.to_dict() and "hidden_dtype" in SETTINGS.to_dict()
    assert plain.fingerprint() != SETTINGS.fingerprint()
    assert TraceSettings.from_dict(plain.to_dict()) == plain and TraceSettings.from_dict(SETTINGS.to_dict()) == SETTINGS
    t = traces[2]
    wt = t.width(10)
    assert wt.hidden.shape == (t.end, 12, 32) and wt.hidden.dtype == np.float32
    save_trace(t, tmp_path / "t.safetensors")
    back = load_trace(tmp_path / "t.safetensors")
    assert np.array_equal(back.width(10).hidden, wt.hidden)
    with pytest.raises(ValueError, match="bad_dtype|hidden_dtype"):
        TraceSettings(hidden_dtype="bad_dtype")


def test_recorded_hidden_states_are_the_live_trees(models, traces):
    """The hidden state a trace keeps per level is what DraftTree.best_hidden gives the live controller there (a static
    W=10 run; near-tied beams may pick another best node, so most, not all)."""
    target, head = models
    seen = []

    class Capture(StaticController):
        def begin_cycle(self, ctx):
            self.ctx = ctx.context_len
            return self.plan

        def continue_drafting(self, step):
            seen.append((self.ctx, step.depth, step.tree.best_hidden().clone()))
            return True

    eng = Engine(target, head)
    close = total = 0
    for prompt, tr in zip(PROMPTS, traces):
        seen.clear()
        eng.generate(prompt, Capture(StaticConfig(10, 8, 60)), max_new_tokens=N_NEW)
        for ctx, d, h in seen:
            j = ctx - len(prompt)
            if j < tr.end:
                total += 1
                close += bool(torch.allclose(h, torch.from_numpy(tr.width(10).hidden[j, d - 1]), atol=1e-4))
    assert total > 20 and close >= 0.9 * total


def test_visited_roots_are_the_static_trees_cycles(traces):
    for tr in traces:
        sim = simulate(StaticController(StaticConfig(10, 8, 60)), [tr])
        roots = [c.context_len - tr.prompt_len for c in sim.runs[0].cycles]
        assert visited_roots(tr).tolist() == roots


def test_labels_follow_the_greedy_continuation(traces):
    """C2T: a root's positive candidates are its accepted path, one per level matched; SpecDec++: the best beam
    node's label at depth d is whether its path is the continuation."""
    for tr in traces:
        roots = visited_roots(tr)
        wt = tr.width(10)
        x, y = c2t_samples(tr)
        c = 10 + 7 * 100
        assert x.shape == (len(roots) * c, 3) and y.shape == (len(roots) * c,)
        full = acceptance_table(wt, tr.output, 8)[roots, -1]
        assert np.array_equal(y.reshape(len(roots), c).sum(1), full)
        assert np.array_equal(x[:c, 2], wt.depths()[:c])
        xs, ys = specdec_samples(tr)
        assert xs.shape == (len(roots) * 12, 32)
        for k, j in enumerate(roots):
            for d in range(1, 13):
                best = (10 if d > 1 else 0) + (d - 2) * 100 * (d > 1) + int(wt.beam[j, d - 1, 0])
                path, node = [], best
                parents = wt.parents()[j]
                while node >= 0:
                    path.append(int(wt.tokens[j, node]))
                    node = int(parents[node])
                want = list(tr.output[j + 1:j + 1 + d])[::-1]
                assert bool(ys[k * 12 + d - 1]) == (path == want and len(want) == d)
    assert any(specdec_samples(tr)[1].any() for tr in traces)


def test_candidate_features():
    scores = torch.tensor([-0.5, -1.0, -0.7, -2.0])
    parents = torch.tensor([-1, -1, 0, 2])
    depths = torch.tensor([1, 1, 2, 3])
    x = candidate_features(scores, parents, depths)
    assert torch.allclose(x, torch.tensor([[-0.5, -0.5, 1], [-1.0, -1.0, 1], [-0.7, -0.2, 2], [-2.0, -1.3, 3]]))


def test_balance_is_seeded_and_even():
    x = np.arange(100, dtype=np.float32)[:, None]
    y = np.arange(100) < 13
    xb, yb = balance(x, y, 3)
    assert yb.sum() == 13 and len(yb) == 26 and set(xb[yb, 0]) == set(range(13))
    assert np.array_equal(balance(x, y, 3)[0], xb) and not np.array_equal(balance(x, y, 4)[0], xb)


def test_training_exports_strict_files_and_resumes(traces, tmp_path, trained):
    spec, c2t = trained
    for s, kind, inputs in ((spec, "specdec", 32), (c2t, "c2t", 3)):
        model = AcceptanceClassifier.load(s["export"], kind)
        assert model.config.inputs == inputs and len(s["history"]) == 2
        cfg = json.loads(open(f"{s['export']}/config.json").read())
        assert cfg["kind"] == kind and cfg["training"]["samples"] == s["samples"]
        other = "c2t" if kind == "specdec" else "specdec"
        with pytest.raises(ValueError, match=f"a '{kind}' classifier, not a '{other}' one"):
            AcceptanceClassifier.load(s["export"], other)
    assert spec["samples"] % 2 == 0 and c2t["samples"] % 2 == 0  # balanced
    # resume: one epoch, then the same command asked for two continues from the checkpoint
    cfg = ClassifierTrainConfig(epochs=1, batch=64, lr=1e-3, val_fraction=0.0, out=str(tmp_path / "run"))
    first = train_c2t(traces, cfg, progress=False)
    second = train_c2t(traces, dataclasses.replace(cfg, epochs=2), progress=False)
    assert second["history"][0] == first["history"][0] and len(second["history"]) == 2
    fresh = train_c2t(traces, dataclasses.replace(cfg, epochs=2, out=str(tmp_path / "fresh")), progress=False)
    assert second["history"] == fresh["history"]  # the resumed run is the uninterrupted one
    with pytest.raises(ValueError, match="other settings"):
        train_c2t(traces, dataclasses.replace(cfg, lr=5e-4), progress=False)
    # strict loading: a tensor of the wrong shape is named
    from safetensors.torch import load_file, save_file

    w = f"{c2t['export']}/model.safetensors"
    t = load_file(w)
    t["first.weight"] = torch.zeros(4, 4)
    save_file(t, str(tmp_path / "bad.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((tmp_path / "bad.safetensors").read_bytes())
    (bad / "config.json").write_text(open(f"{c2t['export']}/config.json").read())
    with pytest.raises(ValueError, match="first.weight"):
        AcceptanceClassifier.load(bad, "c2t")


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="threshold"):
        SpecDecConfig(threshold=1.5)
    with pytest.raises(ValueError, match="threshold"):
        C2TConfig(threshold=0.0)
    with pytest.raises(ValueError, match="blocks"):
        ClassifierConfig("specdec", blocks=-1)
    with pytest.raises(ValueError, match="no SpecDec\\+\\+ classifier given.*--specdec-policy"):
        SpecDecController()
    with pytest.raises(ValueError, match="no C2T classifier given.*--c2t-policy"):
        C2TController()
    with pytest.raises(ValueError, match="method 'c2t' needs a C2T classifier.*--c2t-policy"):
        make_controller("c2t")


@pytest.mark.parametrize("kind", ["specdec", "c2t"])
def test_replay_equals_live_and_output_equals_ar(models, traces, trained, kind):
    """Both controllers replay the live engine's cycles from the traces, shape the tree (SpecDec++ stops at several
    depths, C2T verifies several sizes) and leave the greedy output AR's."""
    target, head = models
    spec, c2t = trained
    folder = spec["export"] if kind == "specdec" else c2t["export"]
    cls = SpecDecController if kind == "specdec" else C2TController
    conf = SpecDecConfig if kind == "specdec" else C2TConfig
    make = lambda: cls(conf(policy=str(folder)))  # noqa: E731
    eng = Engine(target, head)
    checks = [replay_against_live(eng, make(), make(), p, tr, N_NEW, draft_ids(head)) for p, tr in zip(PROMPTS, traces)]
    assert_mostly_exact(checks)
    for p in PROMPTS:
        ar = eng.generate(p, None, max_new_tokens=N_NEW).token_ids
        assert eng.generate(p, make(), max_new_tokens=N_NEW).token_ids == ar
    sim = simulate(make(), traces)
    shape = {c.depth for r in sim.runs for c in r.cycles} if kind == "specdec" else \
        {c.size for r in sim.runs for c in r.cycles}
    assert len(shape) > 1, shape
