"""The benchmark harness on tiny models: records, multi-turn protocol, resume, summary, report, statistics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from adaptree.bench.report import HEADER, summarize, table_rows, write_report
from adaptree.bench.runner import (
    BenchConfig,
    bench_loop,
    finish,
    read_records,
)
from adaptree.bench.stats import (
    acceptance_by_position,
    bootstrap_ratio_ci,
    bootstrap_throughput_ratio_ci,
    ratio_of_sums,
    throughput_ratio,
    wilcoxon_paired,
)
from adaptree.core.engine import Engine
from adaptree.core.verify import SamplingConfig
from adaptree.data.prompts import Prompt
from adaptree.methods import StaticConfig, StaticController, make_controller
from adaptree.offline.runs import check_out_dir


def _encode(messages):
    """A byte-level toy chat template: every message's characters mod 16, turns separated by token 0."""
    ids = []
    for m in messages:
        ids += [ord(c) % 16 for c in m["content"]][:10] + [0]
    return ids


def _decode(ids):
    return "".join(chr(ord("a") + t) for t in ids)


def _setup(tiny_pair, tmp_path, **kw):
    target, head = tiny_pair
    engine = Engine(target, head)
    prompts = [Prompt("toy", str(i), t) for i, t in
               enumerate([("abc", "and then?"), ("hello there",), ("xyz!", "more", "again"), ("q",)])]
    cfg = BenchConfig(**{"methods": ["ar", "static"], "datasets": [], "question_file": "x.jsonl", "limit": 4,
                         "max_new_tokens": 12, "out": str(tmp_path), **kw})
    ctls = {"ar": make_controller("ar"), "static": StaticController(StaticConfig(4, 3, 10))}
    arms = {m: (lambda c: lambda ids, n, s: engine.generate(ids, c, max_new_tokens=n, sampling=s))(c)
            for m, c in ctls.items() if m in cfg.methods}
    return cfg, arms, [("toy", prompts)], engine.max_len


def test_bench_records_turns_summary_and_losslessness(tiny_pair, tmp_path):
    cfg, arms, sets, max_len = _setup(tiny_pair, tmp_path)
    rows = bench_loop(cfg, arms, _encode, _decode, sets, max_len)
    assert len(rows) == 2 * (2 + 1 + 3 + 1)  # every turn of every conversation, for both arms
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(rows)
    by = {(r["prompt_id"], r["turn"], r["method"]): r for r in rows}
    # MT-bench protocol: the second turn's prompt holds the first answer, so it is longer than both questions.
    assert by[("0", 1, "ar")]["prompt_tokens"] > len(_encode([{"content": "abc"}, {"content": "and then?"}]))
    s = summarize(rows, cfg)["results"]["toy"]
    assert s["ar"]["tau"] == 1.0 and s["ar"]["speedup_total_time"] == 1.0
    assert s["static"]["differs_from_ar"] == 0 and s["static"]["mean_depth"] == 3.0
    assert s["static"]["new_tokens"] == s["ar"]["new_tokens"] == 7 * 12
    assert s["static"]["draft_forwards_per_cycle"] == 3.0 and s["static"]["depth_hist"] == {3: s["static"]["cycles"]}
    acc = s["static"]["acceptance_by_position"]
    assert len(acc["conditional"]) == 3 and all(0 <= x <= 1 for x in acc["at_least"])
    lo, hi = s["static"]["speedup_total_time_ci95"]
    assert lo <= s["static"]["speedup_total_time"] <= hi
    assert "vs_reference" in s["ar"] and "vs_reference" not in s["static"]
    s2 = summarize(rows, cfg)["results"]
    assert set(s2) == {"toy", "toy/turn2", "toy/turn3"}  # later turns reported apart; one dataset: no "all"
    assert s2["toy/turn2"]["ar"]["runs"] == sum(r["turn"] == 1 and r["method"] == "ar" for r in rows) > 0
    assert s["static"]["mean_chain"] == 0 and s["static"]["chain_accepted_per_cycle"] == 0
    table = {r[1]: dict(zip(HEADER, r)) for r in table_rows(summarize(rows, cfg)) if r[0] == "toy"}
    assert table["static"]["depth"] == "3.0" and table["static"]["chain"] == "0.0"


def test_bench_rotates_the_arm_order_per_prompt(tiny_pair, tmp_path):
    cfg, arms, sets, max_len = _setup(tiny_pair, tmp_path, warmup=False)
    calls = []
    logged = {m: (lambda m, a: lambda ids, *x: calls.append((m, tuple(ids))) or a(ids, *x))(m, a)
              for m, a in arms.items()}
    bench_loop(cfg, logged, _encode, _decode, sets, max_len)
    first = {}
    for m, ids in calls:  # each prompt's first turn: which arm ran it first
        first.setdefault(ids[:ids.index(0) + 1], m)
    assert list(first.values()) == ["ar", "static", "ar", "static"]  # the four prompts in order


def test_bench_resumes_without_duplicates_or_losses(tiny_pair, tmp_path):
    cfg, arms, sets, max_len = _setup(tiny_pair, tmp_path)
    first = bench_loop(cfg, arms, _encode, _decode, [("toy", sets[0][1][:2])], max_len)  # "interrupted"
    path = tmp_path / "results.jsonl"
    with path.open("a") as f:
        f.write('{"dataset": "toy", "prompt_id": "2", "meth')  # a record cut mid-write
    calls = []
    counting = {m: (lambda a: lambda *x: calls.append(1) or a(*x))(a) for m, a in arms.items()}
    rows = bench_loop(cfg, counting, _encode, _decode, sets, max_len)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    keys = [(r["prompt_id"], r["turn"], r["method"]) for r in lines]
    assert len(rows) == len(lines) == 14 and len(set(keys)) == 14
    assert len(calls) == 14 - len(first) + 2  # only the missing runs (+ the two warm-ups) were generated
    old = {(r["prompt_id"], r["turn"], r["method"]): r["wall_s"] for r in first}
    assert all(r["wall_s"] == old[k] for r, k in zip(lines, keys) if k in old)  # earlier records kept as they were


def test_overlong_prompt_is_skipped_with_a_reason(tiny_pair, tmp_path):
    cfg, arms, sets, _ = _setup(tiny_pair, tmp_path)
    rows = bench_loop(cfg, arms, _encode, _decode, sets, max_len=12)  # "hello there" + sep = 11 fits; turn 2 of 0 doesn't
    skipped = [r for r in rows if "skipped" in r]
    assert skipped and all("context limit is 12" in r["skipped"] or "was skipped" in r["skipped"] for r in skipped)
    s = summarize(rows, cfg)
    assert len(s["skipped"]) == len(skipped) and s["results"]["toy"]["ar"]["runs"] == len(rows) // 2 - len(skipped) // 2


def test_report_and_plots_are_written(tiny_pair, tmp_path):
    cfg, arms, sets, max_len = _setup(tiny_pair, tmp_path)
    rows = bench_loop(cfg, arms, _encode, _decode, sets, max_len)
    summary = finish(cfg, rows, tmp_path, {"model": "tiny", "dtype": "float32", "threads": 1}, "adaptree bench", None)
    write_report(summary, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| toy | static |" in report and "Acceptance by draft position" in report
    for png in ("speedup.png", "depth_v_hist.png", "time_breakdown.png"):
        assert (tmp_path / png).stat().st_size > 1000
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["machine"]["torch_threads"] >= 1 and saved["settings"]["model"] == "tiny"


def test_bench_config_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unknown method 'eagle9'.*available: ar, static"):
        BenchConfig(methods=["ar", "eagle9"])
    with pytest.raises(ValueError, match="unknown dataset 'gsm9'.*available: mt_bench"):
        BenchConfig(datasets=["gsm9"])
    with pytest.raises(ValueError, match="must include 'ar'"):
        BenchConfig(methods=["static"])
    with pytest.raises(ValueError, match="--streams 4 runs the vLLM arms .*none of the methods is one"):
        BenchConfig(methods=["ar", "static"], streams=4)
    with pytest.raises(ValueError, match="streams must be >= 1, got 0"):
        BenchConfig(methods=["ar", "vllm"], streams=0)
    with pytest.raises(ValueError, match="temperature must be >= 0, got -1"):
        BenchConfig(sampling=SamplingConfig(temperature=-1.0))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="not a writable folder"):
        check_out_dir(blocker / "sub")


def test_read_records_drops_cut_lines(tmp_path):
    p = tmp_path / "results.jsonl"
    p.write_text('{"dataset": "a", "prompt_id": "1", "turn": 0, "method": "ar", "repeat": 0}\n{"dataset": "a", "pro')
    assert len(read_records(p)) == 1 and p.read_text().count("\n") == 1


def test_ratio_ci_and_wilcoxon_statistics():
    rng = np.random.default_rng(0)
    ar = rng.uniform(8, 12, 40)
    fast = ar / 1.5 * rng.uniform(0.95, 1.05, 40)
    r = ratio_of_sums(ar, fast)
    lo, hi = bootstrap_ratio_ci(ar, fast)
    assert lo < r < hi and 1.4 < lo and hi < 1.6
    assert math.isnan(bootstrap_ratio_ci([1.0], [1.0])[0])
    w = wilcoxon_paired(ar / fast, np.ones(40))  # every ratio > 1: highly significant
    assert w["p_value"] < 1e-6 and w["wins"] == 40
    same = wilcoxon_paired([1.0, 2.0], [1.0, 2.0])
    assert same["p_value"] == 1.0
    noise = wilcoxon_paired(rng.normal(size=30), rng.normal(size=30))
    assert noise["p_value"] > 0.01


def test_speedup_is_the_throughput_ratio():
    """Equal token counts: the ratio of total times. Outputs of different lengths (sampling): tokens per second,
    not time — a method that stops earlier must not look faster for it."""
    rng = np.random.default_rng(1)
    ar_t = rng.uniform(8, 12, 30)
    m_t = ar_t / 1.3 * rng.uniform(0.9, 1.1, 30)
    n = rng.integers(50, 200, 30).astype(float)
    assert throughput_ratio(n, m_t, n, ar_t) == pytest.approx(ratio_of_sums(ar_t, m_t), rel=1e-12)
    assert bootstrap_throughput_ratio_ci(n * 0 + 1, m_t, n * 0 + 1, ar_t) == bootstrap_ratio_ci(ar_t, m_t)
    # same speed per token, half the tokens: half the time, yet no speedup
    assert throughput_ratio([50.0], [1.0], [100.0], [2.0]) == pytest.approx(1.0)
    half = n / 2
    r = throughput_ratio(half, m_t / 2, n, ar_t)
    lo, hi = bootstrap_throughput_ratio_ci(half, m_t / 2, n, ar_t)
    assert r == pytest.approx(ratio_of_sums(ar_t, m_t), rel=0.1) and lo < r < hi and lo > 1.1
    with pytest.raises(ValueError, match="differ in length"):
        bootstrap_throughput_ratio_ci([1, 2], [1, 2], [1], [1])


def test_acceptance_by_position_counts():
    a = acceptance_by_position(accepted=[0, 1, 2, 2, 3], depths=[3, 3, 3, 2, 3])
    assert a["at_least"] == [0.8, 0.6, 0.2]
    # position 3 is reachable in cycles with accepted >= 2 and depth >= 3: the 3rd and 5th; one accepted it.
    assert a["conditional"][2] == 0.5 and a["conditional"][0] == 0.8


def test_decode_speedup_leaves_each_runs_prefill_out(tiny_pair, tmp_path):
    """An arm that stops early carries its whole prefill over few tokens: its throughput ratio falls below AR's
    although it decodes twice as fast; the decode column shows the latter."""
    cfg, *_ = _setup(tiny_pair, tmp_path)
    common = {"dataset": "toy", "prompt_id": "0", "turn": 0, "repeat": 0, "cycles": 1, "accepted_plus_one": 1,
              "depth_sum": 0, "size_sum": 0, "ids_sha1": "x"}
    rows = [{**common, "method": "ar", "new_tokens": 100, "wall_s": 12.0, "prefill_s": 2.0},     # decodes 10 tok/s
            {**common, "method": "static", "new_tokens": 20, "wall_s": 3.0, "prefill_s": 2.0}]  # decodes 20 tok/s
    e = summarize(rows, cfg)["results"]["toy"]["static"]
    assert e["speedup_total_time"] == pytest.approx((20 / 3) / (100 / 12))  # 0.8x
    assert e["speedup_decode"] == pytest.approx(2.0)
    table = {r[1]: dict(zip(HEADER, r)) for r in table_rows(summarize(rows, cfg))}
    assert table["static"]["speedup"] == "0.80x" and table["static"]["decode"] == "2.00x"
