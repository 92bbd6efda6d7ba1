"""adaptree inside real vLLM (docs/vllm.md): the exported head and adaptree's scheduler keep vLLM's greedy text, on the
real default model in float32. Skipped where vLLM is not installed (``bash scripts/setup.sh --vllm``; CI's second
pass installs it)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from adaptree.bench.isolation import ArmRecipe, ArmWorker
from adaptree.core.verify import SamplingConfig
from adaptree.vllm_plugin.control import StepCosts
from adaptree.vllm_plugin.engine import vllm_available

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (bash scripts/setup.sh --vllm)")]

QUESTIONS = ["Explain what a KV cache is in two sentences.",
             "Write a Python function that returns the n-th Fibonacci number.",
             "Name three prime numbers and say why they are prime."]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from adaptree.models import default_model_path, load_model
    from adaptree.vllm_plugin.export import export_for_vllm

    try:
        default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("vllm")
    head, target = export_for_vllm(root / "head", dtype=torch.float32)
    _, tok = load_model(None, torch.float32)
    prompts = [tok.apply_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    # rows nearly free at one request, a whole token's time each from three on: the controller drafts at B=1 and
    # backs off at B=3, so both of its decisions run
    # the grid search (static-gs): 2 drafts fastest at one request, none at three
    costs = StepCosts([1, 3], [[0.030 + 0.001 * k for k in range(4)], [0.030 + 0.030 * k for k in range(4)]], {},
                      [[30.0, 35.0, 40.0, 38.0], [90.0, 80.0, 70.0, 60.0]])
    costs.save(root / "costs.json")
    return target, head, prompts, root / "costs.json"


def _run(setup, arms, batches):
    from adaptree.bench.vllm_bench import build_arms
    from adaptree.models.assets import shipped_head

    target, head, _, costs = setup
    out = {}
    for arm in arms:
        worker = ArmWorker(ArmRecipe(build_arms, {"target": str(target), "model": None, "head_export": str(head),
                                                  "head": str(shipped_head(None)), "dtype": "float32",
                                                  "threads": None,
                                                  "max_num_seqs": 4, "step_costs": str(costs)}), [arm])
        try:
            out[arm] = [worker.run(arm, (b, len(b)), 48, SamplingConfig()) for b in batches]
        finally:
            worker.close()
    return out


CONTROLLED = ("vllm_static-gs:3", "vllm_costaware:3", "vllm_hybrid:3", "vllm_deagle:3", "vllm_radar:3",
              "vllm_ltd:3")


def test_exported_head_and_adaptrees_scheduler_keep_vllms_greedy_text(setup):
    _, _, prompts, _ = setup
    batches = [[p] for p in prompts] + [prompts]  # one stream each, then three at once
    runs = _run(setup, ["vllm", "vllm_eagle3:3", *CONTROLLED], batches)
    for arm in ("vllm_eagle3:3", *CONTROLLED):
        for got, ref in zip(runs[arm], runs["vllm"]):
            assert got.outputs == ref.outputs, arm
    # the stop rules read the drafter's log-probs (adaptree's worker records them, vLLM's synchronous engine hands
    # them to the scheduler) and left drafts unverified; the shipped RADAR policy stops at the first draft
    for arm in ("vllm_deagle:3", "vllm_radar:3"):
        assert sum(r.stopped for r in runs[arm][:3]) > 0 and sum(r.accepted_tokens for r in runs[arm][:3]) > 0, arm
    # static-gs: the grid's 2 drafts per step at one stream, none at three (the drafter off)
    grid = runs["vllm_static-gs:3"]
    assert all(r.drafts < r.draft_tokens <= 2 * r.drafts for r in grid[:3]) and grid[3].draft_tokens == 0
    assert grid[3].drafter_skips > 0
    # the hybrid verified context chains in place of the head's drafts (the answers repeat their context), under
    # vLLM's synchronous scheduler
    assert sum(r.chains for r in runs["vllm_hybrid:3"]) > 0
    single = [r for r in runs["vllm_costaware:3"][:3]]
    assert sum(r.draft_tokens for r in single) > 0 and sum(r.accepted_tokens for r in single) > 0
    # its drafts are as good as the fixed arm's: the drafter saw every prompt (a step with prompt tokens always runs
    # it) and every decoded token. How deep it drafts follows the step times it measures as it runs (LiveCosts), so
    # the measure is the share of drafts accepted, which a shorter chain can only raise (a draft is accepted only
    # after all before it were)
    fixed_single = runs["vllm_eagle3:3"][:3]
    share = [sum(r.accepted_tokens for r in rs) / sum(r.draft_tokens for r in rs) for rs in (single, fixed_single)]
    assert share[0] >= 0.9 * share[1], share
    # at three streams the costs make every row cost a token: adaptree's scheduler drafts less than a fixed K=3
    crowded, fixed = runs["vllm_costaware:3"][3], runs["vllm_eagle3:3"][3]
    assert crowded.draft_tokens < fixed.draft_tokens / 2
    # ... and its worker leaves the drafter off in the steps that draft nothing (vLLM's own runs it in every step)
    assert crowded.drafter_skips > 0 and fixed.drafter_skips == 0


def test_step_costs_are_measured_in_a_process_of_their_own_with_the_grid(setup, tmp_path):
    """The step costs (and the grid search static-gs reads) measured by a spawned process, whose progress reaches this
    one; what it saved is what is returned."""
    from adaptree.vllm_plugin.engine import measure_step_costs_to

    target, head, prompts, _ = setup
    seen = []
    costs = measure_step_costs_to(tmp_path / "c.json", target, head, prompts[:1], batch_sizes=(1, 2), k_max=1,
                                  dtype="float32", new_tokens=16, repeats=1, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (4, 4) and StepCosts.load(tmp_path / "c.json") == costs
    assert costs.batch_sizes == [1, 2] and costs.k_max == 1 and costs.machine["engine"] == "vllm"
    assert all(t > 0 for row in costs.tokens_per_s for t in row) and costs.best_fixed(2) in (0, 1)


def test_the_plugin_is_registered_and_sets_vllms_cpu_threads(monkeypatch):
    from adaptree.vllm_plugin import register

    names = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert names.get("adaptree") == "adaptree.vllm_plugin:register"
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    register()
    import os

    cores = sorted(os.sched_getaffinity(0))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores))
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"  # the user's setting stays
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ  # vllm serve keeps its engine-core process


def test_serve_engine_vllm_answers_the_openai_api_and_names_bad_fields(setup, tmp_path):
    """``adaptree serve --engine vllm --method hybrid``: vLLM's server with adaptree's head, scheduler (the
    synchronous one, which the hybrid needs) and worker answers a chat request with plain vLLM's greedy text, and a
    bad field gets a 4xx naming it, no traceback."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    _, _, prompts, costs = setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "adaptree.cli", "serve", "--engine", "vllm",
                             "--method", "hybrid", "--depth", "3", "--dtype", "float32", "--step-costs", str(costs),
                             "--port", str(port),
                             "--max-num-seqs", "4", "--max-seq-len", "2048", "--served-model-name", "smol"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "ADAPTREE_ADAPT": "0"})

    def post(body):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "vLLM's server did not come up"
                time.sleep(2)
        question = {"role": "user", "content": QUESTIONS[1]}
        status, body = post({"model": "smol", "messages": [question], "max_tokens": 48, "temperature": 0})
        assert status == 200, body
        ids = body["choices"][0]["message"]["content"]
        runs = _run(setup, ["vllm"], [[prompts[1]]])
        from adaptree.models import load_model

        _, tok = load_model(None, torch.float32)
        assert ids == tok.tokenizer.decode(runs["vllm"][0].outputs[0], skip_special_tokens=True)
        for bad, field in (({"max_tokens": -1}, "max_tokens"), ({"temperature": "hot"}, "temperature")):
            status, text = post({"model": "smol", "messages": [question], **bad})
            assert 400 <= status < 500 and field in text and "Traceback" not in text, (status, text)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_vllm_arms_of_adaptree_bench_keep_plain_vllms_text(tmp_path):
    """``adaptree bench --methods ar,vllm,vllm_eagle3 --streams 2``: vLLM's arms run in their workers beside the
    engine, one prompt at a time and then two at once, and the exported head's greedy text (float32) is plain
    vLLM's in both."""
    import json

    import adaptree
    from adaptree.bench.runner import BenchConfig, run_bench

    pipe = adaptree.load(None, dtype="float32", adapt=False)
    summary = run_bench(BenchConfig(methods=["ar", "vllm", "vllm_eagle3"], datasets=["humaneval"], limit=2,
                                    max_new_tokens=32, turns=1, streams=2, out=str(tmp_path / "b")), pipe)
    records = [json.loads(line) for line in (tmp_path / "b" / "results.jsonl").read_text().splitlines()]
    ids = {(r["method"], r["prompt_id"]): r["token_ids"] for r in records}
    prompts = {p for _, p in ids}
    assert len(prompts) == 2 and all(len(ids[("vllm", p)]) == 32 for p in prompts)
    assert all(ids[("vllm_eagle3", p)] == ids[("vllm", p)] for p in prompts)
    batches = {r["arm"]: r for r in map(json.loads, (tmp_path / "b" / "streams.jsonl").read_text().splitlines())}
    assert set(batches) == {"vllm", "vllm_eagle3"}
    assert len(batches["vllm"]["outputs"]) == 4 and batches["vllm_eagle3"]["outputs"] == batches["vllm"]["outputs"]
    # the same text as one stream at a time: the requests are the prompts cycled
    assert sorted(map(tuple, batches["vllm"]["outputs"][:2])) == sorted(tuple(ids[("vllm", p)]) for p in prompts)
    rows = {r["arm"]: r for r in summary["streams"]["rows"]}
    assert rows["vllm_eagle3"]["outputs_differing"] == 0 and rows["vllm"]["tokens"] == 4 * 32
    assert "## 2 streams (vLLM arms)" in (tmp_path / "b" / "report.md").read_text()
