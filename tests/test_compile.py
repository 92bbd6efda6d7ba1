"""torch.compile of decode steps and small trees: the compiled path computes what the eager one does, keeps
greedy speculative output equal to autoregressive output, does not recompile in steady state, and where it runs
is measured per machine and cached."""

from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo
from conftest import PROMPTS, tiny_head, tiny_target

from adaptree.adapt.cache import machines_dir
from adaptree.adapt.compile import COMPILE_SIZES, compile_tokens
from adaptree.core.engine import Engine
from adaptree.methods import StaticConfig, StaticController
from adaptree.offline.latency import random_tree


@pytest.fixture(scope="module")
def compiled_pair():
    """A tiny float32 target compiled for every size up to 16 and an eager copy of it (same weights)."""
    torch._dynamo.reset()
    eager = tiny_target()
    compiled = tiny_target().compile(16)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def _count_calls(target) -> list:
    calls = []
    inner = target._compiled

    def counted(layer, x, *args):  # llama.call_layer, compiled
        calls.append(x.shape[1])
        return inner(layer, x, *args)

    target._compiled = counted
    return calls


def _forward(target, prefix: list[int], ids: list[int], mask):
    cache = target.new_cache(64)
    with torch.inference_mode():
        target(torch.tensor([prefix]), cache=cache)
        depth = torch.arange(len(ids)) if mask is None or mask.shape[0] == 1 else mask.sum(1) - 1
        return target(torch.tensor([ids]), position_ids=depth + len(prefix), cache=cache, tree_mask=mask,
                      features=True)


def test_compiled_forward_matches_eager(compiled_pair):
    """Decode steps and trees of several sizes after several cache lengths: logits and EAGLE-3 features agree
    within float32 rounding, and the compiled graph is what ran (prefills and larger trees stay eager)."""
    eager, compiled = compiled_pair
    calls = _count_calls(compiled)
    gen = torch.Generator().manual_seed(0)
    for prefix_len, n in ((5, 1), (9, 1), (5, 4), (12, 11), (7, 16), (6, 20)):
        prefix = torch.randint(0, 16, (prefix_len,), generator=gen).tolist()
        ids = torch.randint(0, 16, (n,), generator=gen).tolist()
        _, mask = random_tree(n, gen)
        a, b = _forward(eager, prefix, ids, mask), _forward(compiled, prefix, ids, mask)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.features, a.features, atol=1e-5, rtol=1e-5)
    layers = compiled.config.num_hidden_layers
    assert calls == [n for n in (1, 1, 4, 11, 16) for _ in range(layers)]  # the 20-node tree and prefills: eager


def test_no_recompiles_in_steady_state(compiled_pair):
    """Once a decode step and a tree have compiled, other cache lengths and tree sizes reuse the graphs."""
    _, compiled = compiled_pair
    gen = torch.Generator().manual_seed(1)
    for n in (1, 3):  # warm-up: one graph per kind of step
        _forward(compiled, [1, 2, 3], list(range(n)), random_tree(n, gen)[1])
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prefix_len, n in ((4, 1), (17, 1), (30, 1), (4, 2), (8, 7), (21, 16)):
            _forward(compiled, [3] * prefix_len, [1] * n, random_tree(n, gen)[1])


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def test_compiled_speculative_equals_autoregressive(compiled_pair):
    """Greedy output of static trees on the compiled target equals eager autoregressive output; where it does
    not, the eager logits at the first difference must be a near-tie (kernels round differently)."""
    eager, compiled = compiled_pair
    head = tiny_head(eager, draft_vocab=12)
    ar_engine, spec_engine = Engine(eager, head), Engine(compiled, head)
    for prompt in PROMPTS:
        ar = ar_engine.generate(prompt, None, max_new_tokens=20).token_ids
        for cfg in (StaticConfig(width=3, depth=4, size=8), StaticConfig(width=2, depth=3, size=4)):
            out = spec_engine.generate(prompt, StaticController(cfg), max_new_tokens=20).token_ids
            i = _first_difference(out, ar)
            if i is not None:
                with torch.inference_mode():
                    logits = eager(torch.tensor([prompt + ar[:i]])).logits[0, -1]
                top = logits.topk(2).values
                assert float(top[0] - top[1]) < 1e-4, f"prompt {prompt}: differs from AR at {i} without a near-tie"


def test_compile_tokens_modes(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTREE_CACHE", str(tmp_path))
    target = tiny_target()
    assert compile_tokens(target, mode="off") == 0
    assert compile_tokens(target, mode="on") == max(COMPILE_SIZES)
    assert compile_tokens(target, measure=False) == 0  # nothing measured: eager
    with pytest.raises(ValueError, match="'sometimes'"):
        compile_tokens(target, mode="sometimes")
    with pytest.raises(ValueError, match="-1"):
        target.compile(-1)
    assert not list(tmp_path.rglob("compile-*.json"))  # explicit modes and unmeasured auto write nothing


def test_compile_tokens_measures_once_and_caches(tmp_path, monkeypatch):
    """``auto`` times eager and compiled forwards, writes its choice with the times, and a second call (another
    process would do the same) takes the cached choice without timing anything."""
    monkeypatch.setenv("ADAPTREE_CACHE", str(tmp_path))
    torch._dynamo.reset()
    target = tiny_target()
    lines = []
    n = compile_tokens(target, message=lines.append)
    assert n in (0, *COMPILE_SIZES) and target.compile_tokens == n
    (path,) = machines_dir().glob("compile-*.json")
    saved = json.loads(path.read_text())
    assert saved["compile_tokens"] == n and set(saved["eager_ms"]) == {str(s) for s in COMPILE_SIZES}
    assert saved["compile_s"] > 0 and saved["machine"]["torch_threads"] == torch.get_num_threads()
    assert saved["agrees_with_eager"] and len(lines) == 2 and "torch.compile" in lines[1]
    again = []
    assert compile_tokens(tiny_target(), message=again.append) == n and not again


def test_inductor_cache_is_kept_per_kernel_level(tmp_path, monkeypatch):
    """Kernels Inductor cached under one CPU kernel level are never reused under another (they gave NaN logits
    under ATEN_CPU_CAPABILITY=avx2 after an AVX-512 run); a folder the user chose is left alone."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("ADAPTREE_CACHE", str(tmp_path))
    level = str(torch.backends.cpu.get_cpu_capability())
    for before in (None, default_cache_dir()):  # unset, or torch's default that torch writes back on first use
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        tiny_target().compile(1)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor" / f"{torch.__version__}-{level}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    tiny_target().compile(1)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_several_models_in_one_process_keep_their_graphs():
    """Every compiled Transformer compiles the same function (llama.call_layer), so the graphs of all models in a
    process share one cache; adaptree.load's execution choice compiles three. Past Dynamo's default limit of 8
    graphs, further shapes ran eager without a word. Transformer.compile raises the limit: the variants here
    (three dtypes, decode step and tree, three grad modes: 12 graphs) all keep one (Dynamo with the eager
    backend: no Inductor build, the same cache and limit)."""
    import contextlib

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from adaptree.models import llama

    # Dynamo's default, whatever ran before; torch's own patching restores the setting (a monkeypatch of a
    # torch config module deleted it on undo under pytest 9.2, hiding it for the rest of the process)
    with torch._dynamo.config.patch(recompile_limit=8):
        torch._dynamo.reset()
        tiny_target().compile(16)
        assert torch._dynamo.config.recompile_limit >= llama.RECOMPILE_LIMIT
        step = torch.compile(llama.call_layer, backend="eager", dynamic=True)
        gen = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            target = tiny_target(dtype=dtype)
            for n in (1, 5):
                _, mask = random_tree(n, gen)
                for mode in (torch.inference_mode, torch.no_grad, contextlib.nullcontext):
                    with mode():
                        eager = _forward(target, [1, 2, 3], list(range(n)), mask)
                        target._compiled, target.compile_tokens = step, 16
                        compiled = _forward(target, [1, 2, 3], list(range(n)), mask)
                        target._compiled, target.compile_tokens = None, 0
                    torch.testing.assert_close(compiled.logits, eager.logits)
        assert len(_debug_get_cache_entry_list(llama.call_layer.__code__)) > 8  # none sent back to eager
        torch._dynamo.reset()


def test_direct_calls_skip_dynamo_once_compiled(monkeypatch):
    """After a kind of step has compiled, its calls run the compiled code directly (torch.compile is not called),
    with the compiled path's outputs; a call that no cached graph's guards take (the cache's last slot, which Dynamo
    specialised) goes through torch.compile; without the private cache-entry API every call does, unchanged."""
    import torch._dynamo.eval_frame as eval_frame

    from adaptree.models.llama import DirectLayerCall

    eager = tiny_target()
    compiled = tiny_target().compile(16)
    compiled.load_state_dict(eager.state_dict())
    direct = compiled._compiled
    assert isinstance(direct, DirectLayerCall)
    through = []
    inner = direct.compiled

    def counted(*args):
        through.append(args[1].shape[1])
        return inner(*args)

    monkeypatch.setattr(direct, "compiled", counted)
    gen = torch.Generator().manual_seed(2)
    for n in (1, 3):  # warm-up
        _forward(compiled, [1, 2, 3], list(range(n)), random_tree(n, gen)[1])
    through.clear()
    for prefix_len, n in ((4, 1), (17, 1), (8, 7), (21, 16)):
        ids, mask = [1] * n, random_tree(n, gen)[1]
        a, b = _forward(eager, [3] * prefix_len, ids, mask), _forward(compiled, [3] * prefix_len, ids, mask)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    assert through == []
    cache = compiled.new_cache(8)
    with torch.inference_mode():
        compiled(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=cache)
        compiled(torch.tensor([[1]]), cache=cache)  # writes the last slot
    assert through and set(through) == {1}
    monkeypatch.setattr(eval_frame, "_debug_get_cache_entry_list", None)
    direct._entries = []
    through.clear()
    a, b = _forward(eager, [5] * 6, [2], None), _forward(compiled, [5] * 6, [2], None)
    torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=1e-5)
    assert through == [1] * compiled.config.num_hidden_layers and direct._entries == []
