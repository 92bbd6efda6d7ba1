"""The benchmark loop on tiny models: records, resume after an interruption, summary."""

from __future__ import annotations

import json

from adaptree.bench.runner import BenchConfig, bench_loop, summarize
from adaptree.controllers import StaticConfig, StaticController, make_controller
from adaptree.data.prompts import Prompt
from adaptree.engine import Engine


def _setup(tiny_pair, tmp_path):
    target, head = tiny_pair
    engine = Engine(target, head)
    encode = lambda text: [ord(c) % 16 for c in text][:12]  # noqa: E731 (a byte-level toy tokenizer)
    prompts = [Prompt("toy", str(i), (t,)) for i, t in enumerate(["abc", "hello there", "xyz!", "q"])]
    cfg = BenchConfig(methods=["ar", "static"], datasets=[], limit=4, max_new_tokens=12, out=str(tmp_path))
    controllers = {"ar": make_controller("ar"), "static": StaticController(StaticConfig(4, 3, 10))}
    return cfg, engine, encode, controllers, [("toy", prompts)]


def test_bench_records_summary_and_losslessness(tiny_pair, tmp_path):
    cfg, engine, encode, ctls, sets = _setup(tiny_pair, tmp_path)
    rows = bench_loop(cfg, engine, encode, ctls, sets)
    assert len(rows) == 8 and len((tmp_path / "results.jsonl").read_text().splitlines()) == 8
    s = summarize(rows, cfg)["results"]["toy"]
    assert s["ar"]["tau"] == 1.0 and s["ar"]["speedup_total_time"] == 1.0
    assert s["static"]["differs_from_ar"] == 0 and s["static"]["mean_depth"] == 3.0
    assert s["static"]["new_tokens"] == s["ar"]["new_tokens"] == 4 * 12


def test_bench_resumes_without_duplicates(tiny_pair, tmp_path):
    cfg, engine, encode, ctls, sets = _setup(tiny_pair, tmp_path)
    bench_loop(cfg, engine, encode, ctls, [("toy", sets[0][1][:2])])  # "interrupted" after two prompts
    path = tmp_path / "results.jsonl"
    with path.open("a") as f:
        f.write('{"dataset": "toy", "prompt_id": "2", "meth')  # a record cut mid-write
    rows = bench_loop(cfg, engine, encode, ctls, sets)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    keys = [(r["prompt_id"], r["method"]) for r in lines]
    assert len(rows) == len(lines) == 8 and len(set(keys)) == 8
