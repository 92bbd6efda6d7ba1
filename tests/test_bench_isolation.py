"""Reference arms run in worker processes: a crashing arm is dropped with one line, the bench and its summary go on;
the Hugging Face arm through its worker on a tiny model."""

from __future__ import annotations

import itertools
import json
import os
import resource
import signal

import pytest
import torch
from conftest import ToyTokenizer
from test_models import save_hf

import adaptree
from adaptree.bench import runner
from adaptree.bench.hf_arms import HFArm, hf_twin
from adaptree.bench.isolation import ArmRecipe, worker_arms
from adaptree.bench.llama_cpp_arm import llama_cpp_available
from adaptree.bench.runner import BenchConfig, bench_loop, run_bench
from adaptree.core.records import GenerationResult
from adaptree.core.verify import SamplingConfig
from adaptree.data.prompts import Prompt


@pytest.fixture(scope="module")
def tiny_pipe(tmp_path_factory):
    """A pipeline on a tiny HF model folder (no head): the HF arm's worker loads the same folder again."""
    folder = save_hf("llama", tmp_path_factory.mktemp("tiny") / "model")
    loaded = adaptree.load(folder, head=None, dtype="float32")
    return type(loaded)(loaded.target, ToyTokenizer(), None, model=str(folder), dtype=torch.float32)


@pytest.fixture
def questions(tmp_path):
    """Three prompts: a two-turn conversation, then two single turns (dataset "toyq")."""
    path = tmp_path / "toyq.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "turns": t}) + "\n" for i, t in
                            [(1, ["the cat sat", "and then what"]), (2, ["a b c d"]), (3, ["hello there"])]))
    return str(path)


def build_crashing_arms(methods, crash_on_call: int = 0, raise_on_call: int = 0, crash_on_load: bool = False):
    """Test arms (built in the worker): every arm emits ``n`` tokens 3; the worker kills itself with SIGILL (a
    real signal, as a llama.cpp built for another CPU does) on an arm's ``crash_on_call``-th call, or with SIGKILL
    while loading; ``raise_on_call`` makes the first arm raise instead."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the signal leaves no core file behind
    if crash_on_load:
        os.kill(os.getpid(), signal.SIGKILL)

    def make(m):
        calls = itertools.count(1)

        def arm(ids, n, sampling):
            call = next(calls)
            if call == crash_on_call:
                os.kill(os.getpid(), signal.SIGILL)
            if call == raise_on_call and m == methods[0]:
                raise RuntimeError("no more tokens today")
            return GenerationResult(prompt_len=len(ids), token_ids=[3] * n, wall_time_s=1e-3 * n,
                                    stop_reason="max_new_tokens", method=m)
        return arm

    return {m: make(m) for m in methods}


def _cfg(questions, out, methods, **kw):
    return BenchConfig(methods=methods, datasets=[], question_file=questions, limit=3, max_new_tokens=6,
                       out=str(out), **kw)


def test_a_crashing_reference_arm_is_dropped_and_the_bench_goes_on(tiny_pipe, questions, tmp_path, monkeypatch,
                                                                   capsys):
    """The arm's worker dies with SIGILL on its third generation (warm-up, turn 1, turn 2 of the first prompt):
    one line names the arm, the signal and the prompt; ar runs every prompt; the summary and the report are whole
    and say why the arm is missing. A rerun resumes and makes only the missing runs."""
    monkeypatch.setitem(runner.REFERENCE_ARMS, "crash_test",
                        lambda m, cfg, pipe: ArmRecipe(build_crashing_arms, {"crash_on_call": 3}))
    out = tmp_path / "b"
    summary = run_bench(_cfg(questions, out, ["ar", "crash_test"]), tiny_pipe)
    why = "worker died with SIGILL on prompt toyq/1 turn 2"
    assert summary["dropped_arms"] == {"crash_test": why}
    assert f"crash_test: {why}; arm dropped" in capsys.readouterr().err
    res = summary["results"]
    assert res["toyq"]["ar"]["runs"] == 4 and res["toyq/turn2"]["ar"]["runs"] == 1  # every turn of every prompt
    assert res["toyq"]["crash_test"]["runs"] == 1 and "crash_test" not in res["toyq/turn2"]  # turn 1 is kept
    assert json.loads((out / "summary.json").read_text())["dropped_arms"] == {"crash_test": why}
    assert f"- crash_test: {why}" in (out / "report.md").read_text()
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 5 and {json.loads(x)["method"] for x in lines} == {"ar", "crash_test"}
    assert runner.rebuild_report(out)["dropped_arms"] == {"crash_test": why}  # `adaptree report` says it again

    # The crash is gone (say, llama.cpp rebuilt): the rerun makes the three missing runs, nothing twice.
    monkeypatch.setitem(runner.REFERENCE_ARMS, "crash_test", lambda m, cfg, pipe: ArmRecipe(build_crashing_arms))
    summary = run_bench(_cfg(questions, out, ["ar", "crash_test"]), tiny_pipe)
    lines2 = (out / "results.jsonl").read_text().splitlines()
    assert lines2[:5] == lines and len(lines2) == 8 and summary["dropped_arms"] == {}
    assert summary["results"]["toyq"]["crash_test"]["runs"] == 4
    assert "Dropped arms" not in (out / "report.md").read_text()


def test_worker_deaths_and_errors_drop_only_their_arms(tmp_path, capsys):
    """A worker killed while loading drops its arm before the warm-up; a worker shared by two arms takes both when
    it dies; an arm that raises is dropped alone and its worker serves the other arm on."""
    prompts = [("toy", [Prompt("toy", str(i), (t,)) for i, t in enumerate(["abc", "hello there", "q"])])]
    recipes = {"loadkill": ArmRecipe(build_crashing_arms, {"crash_on_load": True}),
               "pair_a": ArmRecipe(build_crashing_arms, {"crash_on_call": 2}, group="pair"),
               "pair_b": ArmRecipe(build_crashing_arms, {"crash_on_call": 2}, group="pair"),
               "raises": ArmRecipe(build_crashing_arms, {"raise_on_call": 2}, group="mixed"),
               "calm": ArmRecipe(build_crashing_arms, {"raise_on_call": 2}, group="mixed")}
    arms = {"ar": lambda ids, n, s: GenerationResult(len(ids), [3] * n, wall_time_s=1e-3, method="ar"),
            **worker_arms(recipes)}
    cfg = BenchConfig(methods=["ar"], datasets=[], question_file="x.jsonl", limit=3, max_new_tokens=4,
                      out=str(tmp_path))
    dropped: dict[str, str] = {}
    rows = bench_loop(cfg, arms, lambda msgs: [1, 2, 3], lambda ids: "x", prompts, max_len=64, dropped=dropped)
    # After the warm-ups, prompt 0 runs the arms in order: pair_a's second call kills the worker pair_b shares.
    assert dropped == {"loadkill": "worker died with SIGKILL while loading",
                       "pair_a": "worker died with SIGILL on prompt toy/0",
                       "pair_b": "worker died with SIGILL on prompt toy/0 (running pair_a)",
                       "raises": "raised RuntimeError: no more tokens today on prompt toy/0"}
    err = capsys.readouterr().err
    assert all(f"{m}: {why}; arm dropped" in err for m, why in dropped.items())
    count = {m: sum(r["method"] == m for r in rows) for m in arms}
    assert count == {"ar": 3, "calm": 3, "raises": 0, "loadkill": 0, "pair_a": 0, "pair_b": 0}
    assert not any(w.worker.running for w in arms.values() if hasattr(w, "worker"))  # every worker closed


def test_hf_generate_runs_in_its_worker_on_the_same_weights(tiny_pipe, questions, tmp_path):
    """The real Hugging Face arm through the worker path: its records are those of the same arm run in this
    process on a transformers copy of the pipeline's model (same weights, greedy)."""
    out = tmp_path / "b"
    summary = run_bench(_cfg(questions, out, ["ar", "hf_generate"], turns=1), tiny_pipe)
    assert summary["dropped_arms"] == {} and summary["results"]["toyq"]["hf_generate"]["runs"] == 3
    here = HFArm(hf_twin(tiny_pipe.target), "hf_generate", [])
    for line in (out / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["method"] == "hf_generate":
            ids = tiny_pipe.encode([{"role": "user", "content": {"1": "the cat sat", "2": "a b c d",
                                                                   "3": "hello there"}[r["prompt_id"]]}])
            assert r["token_ids"] == here(ids, 6, SamplingConfig()).token_ids and r["new_tokens"] == 6


def test_reference_arm_bad_input_fails_in_the_bench_process(tiny_pipe, questions, tmp_path):
    """Weights that are not the model's file (changed in memory) fail the HF arm's build with a clear error, raised
    in the bench's process; without llama-cpp-python the llama.cpp arms say how to get it (setup.sh builds it)."""
    with torch.no_grad():
        w = tiny_pipe.target.lm_head.weight
        w[0, 0] += 1.0
        try:
            with pytest.raises(ValueError, match="holds other weights than the bench's model"):
                run_bench(_cfg(questions, tmp_path / "b", ["ar", "hf_generate"], turns=1), tiny_pipe)
        finally:
            w[0, 0] -= 1.0
    if llama_cpp_available():
        return
    with pytest.raises(ValueError, match=r"the llama_cpp arm needs llama-cpp-python: bash scripts/setup.sh builds it"):
        run_bench(_cfg(questions, tmp_path / "c", ["ar", "llama_cpp"]), tiny_pipe)
