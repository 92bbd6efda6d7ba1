"""``adaptree bench --oracle-latency``: traces of the bench's first turns, the oracle section of summary.json
and report.md, on tiny random models."""

from __future__ import annotations

import json
import math
import os

import pytest
from test_bench import _decode, _encode  # the toy chat template of the bench tests

from adaptree.bench import oracle_section as osec
from adaptree.bench.report import write_report
from adaptree.bench.runner import BenchConfig, bench_loop, finish
from adaptree.core.engine import Engine
from adaptree.core.verify import SamplingConfig
from adaptree.data.prompts import Prompt
from adaptree.methods import StaticConfig, StaticController, make_controller
from adaptree.offline.latency import LatencyModel, machine_meta
from adaptree.offline.oracle import fraction_of_oracle_gain, oracle_all
from adaptree.offline.simulator import simulate

LAT = LatencyModel([2e-3, 1e-4, 1e-6, 1e-8], [8e-3, 2e-4, 2e-6, 1e-8], other_s=5e-4)


@pytest.fixture
def bench(tiny_pair, tmp_path):
    target, head = tiny_pair
    engine = Engine(target, head)
    lat_path = tmp_path / "lat.json"
    LatencyModel(LAT.draft, LAT.verify, LAT.other_s, meta={"machine": machine_meta(), "source": "micro"}).save(lat_path)
    sets = [("toy", [Prompt("toy", str(i), t) for i, t in enumerate([("abc", "and then?"), ("hello there",)])]),
            ("more", [Prompt("more", "0", ("xyz!",)), Prompt("more", "1", ("q", "again"))])]
    cfg = BenchConfig(methods=["ar", "static", "deagle"], datasets=[], question_file="x.jsonl", limit=4,
                      max_new_tokens=12, out=str(tmp_path / "b"), oracle_latency=str(lat_path), warmup=False)
    ctls = {"ar": lambda: make_controller("ar"), "static": lambda: StaticController(StaticConfig(4, 3, 10)),
            "deagle": lambda: make_controller("deagle", width=4, depth=6)}
    arms = {m: (lambda c: lambda ids, n, s: engine.generate(ids, c, max_new_tokens=n, sampling=s))(make())
            for m, make in ctls.items()}
    rows = bench_loop(cfg, arms, _encode, _decode, sets, engine.max_len)
    return cfg, rows, sets, ctls, engine.max_len, lat_path


def test_bench_oracle_section(tiny_pair, tmp_path, bench, capsys):
    target, head = tiny_pair
    cfg, rows, sets, ctls, max_len, lat_path = bench
    out = tmp_path / "b"
    prompts = osec.first_turn_prompts(sets, _encode, max_len)
    assert [k for k, _ in prompts["toy"]] == ["toy/0", "toy/1"] and prompts["more"][1][1] == _encode([{"content": "q"}])
    settings = osec.trace_settings(cfg, (), None, widths=(4,), max_depth=6)
    store = osec.record_traces(out, target, head, settings, prompts, progress=False)
    mtimes = {p: os.stat(p).st_mtime_ns for p in store.keys_on_disk()}
    assert len(mtimes) == 4
    store = osec.record_traces(out, target, head, settings, prompts, progress=False)  # resumed: nothing redone
    assert {p: os.stat(p).st_mtime_ns for p in store.keys_on_disk()} == mtimes
    factories = {**ctls, "wide": lambda: StaticController(StaticConfig(10, 3, 10))}  # W=10 was not recorded
    osec.modelled(out, store, prompts, str(lat_path), factories)
    summary = finish(cfg, rows, out, {"model": "tiny", "dtype": "float32", "threads": 1}, "adaptree bench", None)
    sec = summary["oracle"]
    assert set(sec["datasets"]) == {"toy", "more", "all"} and sec["machine_warnings"] == []
    traces = {t.key: t for t in store.load_all()}
    for ds, keys in (("toy", ["toy/0", "toy/1"]), ("more", ["more/0", "more/1"]), ("all", sorted(traces))):
        d = sec["datasets"][ds]
        trs = [traces[k] for k in keys]
        orc = oracle_all(trs, LAT).speedup
        assert math.isclose(d["oracle"]["modelled_speedup"], orc, rel_tol=1e-12) and d["prompts"] == len(keys)
        first = [r for r in rows if r["turn"] == 0 and (ds == "all" or r["dataset"] == ds)]
        for m in ("ar", "static", "deagle"):
            mine = {(r["dataset"], r["prompt_id"]): r["wall_s"] for r in first if r["method"] == m}
            ar = {(r["dataset"], r["prompt_id"]): r["wall_s"] for r in first if r["method"] == "ar"}
            meas = sum(ar.values()) / sum(mine.values())
            row = d["methods"][m]
            assert math.isclose(row["measured_speedup"], meas, rel_tol=1e-12)
            assert math.isclose(row["fraction_of_oracle_gain_measured"], fraction_of_oracle_gain(meas, orc),
                                rel_tol=1e-9)
            sim = simulate(ctls[m](), trs, LAT, measure_policy=False)
            assert math.isclose(row["simulated_speedup"], sim.speedup, rel_tol=1e-12)
            assert math.isclose(row["fraction_of_oracle_gain_simulated"], fraction_of_oracle_gain(sim.speedup, orc),
                                rel_tol=1e-9)
            assert row["fraction_of_oracle_gain_simulated"] <= 1.0 + 1e-9  # the oracle bounds every method
        assert d["best_static"]["modelled_speedup"] <= d["oracle"]["modelled_speedup"] * (1 + 1e-12)
    assert "wide" not in sec["datasets"]["toy"]["methods"]  # not a bench method
    saved = json.loads((out / osec.ORACLE_FILE).read_text())
    assert "W=10 was not recorded" in saved["datasets"]["toy"]["methods"]["wide"]["error"]
    # the tables
    write_report(summary, out)
    report = (out / "report.md").read_text()
    assert "## Oracle and best static tree (modelled)" in report and "mixes measured and modelled" in report
    assert "| toy | oracle |" in report and "| all | deagle |" in report
    from adaptree.bench.report import print_table

    print_table(summary)
    assert "frac. gain (measured)" in capsys.readouterr().out
    # rebuilt from the records again: the same section
    again = finish(cfg, rows, out, {"model": "tiny", "dtype": "float32", "threads": 1}, "adaptree bench", None)
    assert again["oracle"] == summary["oracle"]


def test_bench_oracle_section_needs_greedy_and_is_absent_without_a_latency_model(tmp_path, bench):
    cfg, rows, *_ = bench
    with pytest.raises(ValueError, match="--oracle-latency needs greedy decoding.*temperature 0.7"):
        BenchConfig(oracle_latency="lat.json", sampling=SamplingConfig(temperature=0.7))
    plain = BenchConfig(methods=cfg.methods, datasets=[], question_file="x.jsonl", out=str(tmp_path / "b"))
    s = finish(plain, rows, tmp_path / "b", {"model": "tiny"}, None, None)
    assert "oracle" not in s  # no --oracle-latency: no section, even with no file there
    s = finish(cfg, rows, tmp_path / "b", {"model": "tiny"}, None, None)
    assert "oracle" not in s  # asked for, but the modelled part was never computed (an interrupted run)


def test_modelled_refuses_missing_traces(tiny_pair, tmp_path, bench):
    target, head = tiny_pair
    cfg, rows, sets, ctls, max_len, lat_path = bench
    prompts = osec.first_turn_prompts(sets, _encode, max_len)
    settings = osec.trace_settings(cfg, (), None, widths=(4,), max_depth=3)
    store = osec.record_traces(tmp_path / "b", target, head, settings, {"toy": prompts["toy"]}, progress=False)
    with pytest.raises(ValueError, match="no trace of 'more/0'"):
        osec.modelled(tmp_path / "b", store, prompts, str(lat_path), ctls)


def test_run_oracle_builds_the_bench_methods_with_their_flags(tiny_pair, tmp_path, bench):
    from adaptree.api import Pipeline
    from adaptree.bench.runner import run_oracle

    target, head = tiny_pair
    cfg, rows, sets, ctls, max_len, lat_path = bench

    class Tok:
        eos_token_ids = [15]

    pipe = Pipeline(target, Tok(), head, model="tiny")
    pipe.encode = _encode  # the bench tests' toy chat template
    options = {m: {"width": 4} for m in cfg.methods if m != "ar"}  # as `adaptree bench -W 4` gives them
    sec = run_oracle(cfg, pipe, tmp_path / "b", sets, options)
    store_settings = json.loads((tmp_path / "b" / "traces" / "manifest.json").read_text())["settings"]
    assert store_settings["widths"] == [4] and store_settings["max_depth"] == 12
    assert store_settings["eos_token_ids"] == [15] and store_settings["max_new_tokens"] == cfg.max_new_tokens
    toy = sec["datasets"]["toy"]["methods"]
    assert set(toy) == {"ar", "static", "deagle"} and all("error" not in r for r in toy.values())
    from adaptree.offline.traces import TraceStore

    trs = [t for t in TraceStore(tmp_path / "b" / "traces").load_all() if t.key.startswith("toy/")]
    sim = simulate(make_controller("static", width=4), trs, LAT, measure_policy=False)  # -W 4, default D and V
    assert math.isclose(toy["static"]["modelled_speedup"], sim.speedup, rel_tol=1e-12)
    assert toy["ar"]["modelled_speedup"] == pytest.approx(1.0)
