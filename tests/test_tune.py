"""tune-static: the successive-halving search finds the fastest config, resumes, validates its grid."""

from __future__ import annotations

import json

import pytest

from adaptree.core.engine import Engine
from adaptree.core.records import GenerationResult
from adaptree.methods import StaticConfig, StaticController
from adaptree.methods.static.tune import TuneConfig, successive_halving


def _fake(best=(10, 4, 40)):
    """A generator whose 'wall time' is smallest at ``best`` and grows with the distance from it."""
    calls = []

    def generate(conf, ids):
        calls.append(conf)
        w, d, v = conf or (0, 0, 0)
        dist = 0.0 if conf is None else abs(d - best[1]) + abs(v - best[2]) / 20
        return GenerationResult(prompt_len=len(ids), token_ids=[1] * 10, wall_time_s=1.0 + 0.1 * dist - 0.3 * (conf is not None))
    return generate, calls


def test_successive_halving_picks_the_fastest_and_shrinks(tmp_path):
    cfg = TuneConfig(depths=[2, 4, 6, 8], sizes=[20, 40, 80], prompts=6, first_round_prompts=2, eta=3)
    generate, calls = _fake()
    prompts = [(str(i), [1, 2, 3]) for i in range(6)]
    choice = successive_halving(cfg, generate, prompts, tmp_path / "tune.jsonl")
    assert (choice["width"], choice["depth"], choice["size"]) == (10, 4, 40)
    assert [r["prompts"] for r in choice["rounds"]] == [2, 6]
    assert len(choice["rounds"][0]["configs"]) == 12 and len(choice["rounds"][1]["configs"]) == 4
    assert choice["speedup_vs_ar"] == pytest.approx(1.0 / 0.7)
    n = len(calls)
    assert n == 2 * 13 + 6 * 5 - 2 * 5  # round 2 re-measures nothing already measured
    again, calls2 = _fake()
    assert successive_halving(cfg, again, prompts, tmp_path / "tune.jsonl")["depth"] == 4 and not calls2  # resumed
    assert len((tmp_path / "tune.jsonl").read_text().splitlines()) == n


def test_tune_config_rejects_bad_grid():
    with pytest.raises(ValueError, match="depths must be >= 1, got 0"):
        TuneConfig(depths=[0, 4])
    with pytest.raises(ValueError, match="sizes is empty"):
        TuneConfig(sizes=[])
    with pytest.raises(ValueError, match="first_round_prompts \\(5\\) exceeds prompts \\(2\\)"):
        TuneConfig(prompts=2, first_round_prompts=5)


def test_search_runs_on_the_real_engine(tiny_pair, tmp_path):
    target, head = tiny_pair
    eng = Engine(target, head)
    cfg = TuneConfig(depths=[1, 3], sizes=[4, 12], widths=[2, 4], prompts=2, first_round_prompts=1, max_new_tokens=8)

    def generate(conf, ids):
        return eng.generate(ids, StaticController(StaticConfig(*conf)) if conf else None, max_new_tokens=8)

    choice = successive_halving(cfg, generate, [("a", [1, 2, 3]), ("b", [4, 5])], tmp_path / "t.jsonl")
    assert (choice["width"], choice["depth"], choice["size"]) in cfg.grid()
    rows = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert all(r["new_tokens"] == 8 for r in rows)


def test_static_gs_reads_the_tuned_choice(tmp_path):
    from adaptree.methods import make_controller

    path = tmp_path / "static_gs.json"
    path.write_text(json.dumps({"width": 6, "depth": 3, "size": 16, "tokens_per_s": 10.0}))
    ctl = make_controller("static-gs", tuned=str(path))
    assert ctl.name == "static-gs" and (ctl.config.width, ctl.config.depth, ctl.config.size) == (6, 3, 16)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        make_controller("static-gs", tuned=str(tmp_path / "nope.json"))
    path.write_text(json.dumps({"width": 6}))
    with pytest.raises(ValueError, match="not a static_gs.json"):
        make_controller("static-gs", tuned=str(path))
    path.write_text(json.dumps({"width": 6, "depth": 0, "size": 16}))
    with pytest.raises(ValueError, match="depth \\(D\\) must be in 1..64, got 0"):
        make_controller("static-gs", tuned=str(path))
