"""The bench's running table: after the first prompt of every arm and after each dataset but the last, the records
so far are summarised and printed while the bench goes on; the full table still comes at the end."""

from __future__ import annotations

from test_bench import _decode, _encode, _setup

from adaptree.bench.runner import bench_loop, print_running_table


def test_a_running_table_comes_after_the_first_prompt_and_after_each_dataset(tiny_pair, tmp_path, capsys):
    cfg, arms, sets, max_len = _setup(tiny_pair, tmp_path)
    prompts = sets[0][1]
    sets = [("toy", prompts[:2]), ("more", prompts[2:])]
    seen = []
    rows = bench_loop(cfg, arms, _encode, _decode, sets, max_len,
                      running=lambda rs, what: seen.append((list(rs), what)))
    assert [what for _, what in seen] == ["the first prompt of every arm (1 of 4 prompts)", "toy (2 of 4 prompts)"]
    first, after_toy = seen[0][0], seen[1][0]
    turns = {p.id: len(p.turns) for p in prompts}
    # the first table: both arms, every turn of the first conversation; the second: all of the first dataset
    assert sorted((r["method"], r["prompt_id"]) for r in first) == sorted(
        (m, "0") for m in ("ar", "static") for _ in range(turns["0"]))
    assert {r["dataset"] for r in after_toy} == {"toy"} and len(after_toy) == 2 * (turns["0"] + turns["1"])
    assert rows[:len(after_toy)] == after_toy and len(rows) == 2 * sum(turns.values())
    # a rerun that measures nothing new prints no running table
    seen.clear()
    assert bench_loop(cfg, arms, _encode, _decode, sets, max_len, running=lambda rs, what: seen.append(what)) == rows
    assert seen == []
    # what run_bench prints: the table of the records so far, every arm on it
    capsys.readouterr()
    print_running_table(first, cfg, "the first prompt of every arm (1 of 4 prompts)")
    out = capsys.readouterr().out
    assert "running table after the first prompt of every arm (1 of 4 prompts)" in out
    lines = out.splitlines()
    assert any("static" in line for line in lines) and any(" ar " in f" {line} " for line in lines)
