"""CUDA: the engine on a GPU (skipped without one) and the GPU check's refusal where there is none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, tiny_head, tiny_target

from adaptree.core.engine import Engine
from adaptree.methods import StaticConfig, StaticController, make_controller

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_gpu_check_names_the_missing_device(tmp_path):
    """Without CUDA the GPU check stops at its first step, saying why, and leaves its log and summary."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path / "gc"),
                           "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no usable device 'cuda'" in proc.stderr
    assert "sees no CUDA device" in (tmp_path / "gc" / "log.txt").read_text()
    assert (tmp_path / "gc" / "summary.md").is_file()
