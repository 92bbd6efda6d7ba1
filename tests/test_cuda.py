"""CUDA: the engine and head training on a GPU (skipped without one) and the GPU check's refusal where there is none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, tiny_head, tiny_prompt_items, tiny_target, tiny_train_cfg

from adaptree.core.engine import Engine
from adaptree.methods import StaticConfig, StaticController, make_controller
from adaptree.models.eagle3 import Eagle3Head

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
def test_greedy_trees_on_cuda_equal_ar_there_and_on_the_cpu():
    """fp32 greedy on the GPU: static trees give AR's ids, and AR's ids are the CPU's (the tiny model is peaky)."""
    cpu_target = tiny_target()
    target = tiny_target().cuda()
    head = tiny_head(target)
    eng, cpu = Engine(target, head), Engine(cpu_target, tiny_head(cpu_target))
    for prompt in PROMPTS:
        ar = eng.generate(prompt, make_controller("ar"), max_new_tokens=24)
        assert ar.token_ids == cpu.generate(prompt, make_controller("ar"), max_new_tokens=24).token_ids
        for cfg in (StaticConfig(width=3, depth=5, size=10), StaticConfig(width=8, depth=8, size=60)):
            assert eng.generate(prompt, StaticController(cfg), max_new_tokens=24).token_ids == ar.token_ids


@cuda
@torch.inference_mode()
def test_captured_steps_equal_plain_forwards_on_cuda():
    """CUDA graphs per size bucket: logits within 1e-4 (plus 1e-5 relative) of the plain forward in fp32, for trees that fill a bucket and
    trees that leave padding rows, replayed again with other inputs; and the engine's ids with graphs on and off."""
    from adaptree.core.graphs import StepGraphs
    from adaptree.offline.latency import random_tree

    target = tiny_target().cuda()
    cache = target.new_cache(128)
    target(torch.randint(0, 16, (1, 20), device="cuda"), cache=cache)
    steps = StepGraphs(target, cache)
    assert steps.capture
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 4, 16, 3, 1):  # the second 3 and 1 replay captured buckets
        depth, mask = random_tree(n, gen, "cuda")
        ids = torch.randint(0, 16, (1, n), generator=gen).cuda()
        cache.length = 20
        plain = target(ids, position_ids=depth + 20, cache=cache, tree_mask=mask, features=True)
        cache.length = 20
        fixed = steps.forward(ids, depth + 20, mask)
        assert cache.length == 20 + n
        torch.testing.assert_close(fixed.logits, plain.logits, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(fixed.features, plain.features, rtol=1e-5, atol=1e-4)
    head = tiny_head(target)
    graphed, plain_engine = Engine(target, head), Engine(target, head, graphs=False)
    assert graphed.steps is not None and graphed.steps.capture and graphed.draft_steps.capture
    for prompt in PROMPTS:
        for make in (lambda: make_controller("ar"), lambda: StaticController(StaticConfig(width=8, depth=8, size=60))):
            want = plain_engine.generate(prompt, make(), max_new_tokens=24).token_ids
            assert graphed.generate(prompt, make(), max_new_tokens=24).token_ids == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_gpu_check_names_the_missing_device(tmp_path):
    """Without CUDA the GPU check stops at its first step, saying why, and leaves its log and summary."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "gc"),
                           "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no usable device 'cuda'" in proc.stderr
    assert "sees no CUDA device" in (tmp_path / "gc" / "log.txt").read_text()
    assert (tmp_path / "gc" / "summary.md").is_file()


@cuda
def test_head_training_on_cuda_lowers_the_loss_and_exports(tmp_path):
    """A head trains on the GPU as a pass there runs (scripts/gpu_head_pass.sh): the target's features computed in
    the loop (online), bfloat16 autocast, validation's chain acceptance picking the export; the export loads."""
    from adaptree.head_training import train_head

    target = tiny_target(vocab=48, seed=7).cuda()
    items, prompts = tiny_prompt_items(24, 6, seed=1, vocab=48)
    cfg = tiny_train_cfg(tmp_path, epochs=4, max_steps=16, val_every=8, train_dtype="bfloat16", features="online",
                         device="cuda", select="chain_tau")
    summary = train_head(cfg, target=target, items=items, prompt_ids_fn=lambda it: prompts[it.id])
    train = [r for r in map(json.loads, (tmp_path / "train_log.jsonl").read_text().splitlines())
             if r["type"] == "train"]
    assert len(train) == 16
    assert sum(r["loss"] for r in train[-3:]) < 0.9 * sum(r["loss"] for r in train[:3])
    val = summary["validation"]["final"]
    assert val["positions"] > 0 and val["chain_tau"] >= 1.0
    assert summary["validation"]["selected"]["by"] == "chain_tau"
    loaded = Eagle3Head.from_pretrained(tmp_path / "head", target=target.cpu(), dtype=torch.float32)
    assert loaded.config.draft_vocab_size == 40
