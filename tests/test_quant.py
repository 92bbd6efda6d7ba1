"""int4 execution of GGUF blocks (adaptree.models.quant) and the attention dtype: exactness against the gguf
package's dequantiser, losslessness within the mode, the execution-mode candidates."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import PROMPTS, tiny_head
from test_registry import write_tiny_gguf

from adaptree.core.engine import Engine
from adaptree.methods import StaticConfig, StaticController
from adaptree.models.gguf_file import load_gguf, read_gguf
from adaptree.models.llama import set_attention_dtype
from adaptree.models.quant import PackedLinear, int4_groups, pack_model, weight_error

T = gguf.GGMLQuantizationType


def _blocks(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw blocks of a ``[rows, cols]`` tensor of ``kind`` and the gguf package's float32 dequantisation."""
    rng = np.random.default_rng(seed)
    if kind == "Q4_K":  # gguf-py cannot quantize Q4_K: random blocks with sane fp16 d/dmin are valid ones
        per, size = gguf.constants.GGML_QUANT_SIZES[T.Q4_K]
        raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
        d = rng.uniform(0.001, 0.02, size=(rows, cols // per, 2)).astype(np.float16)
        raw[..., 0:4] = d.view(np.uint8)
        raw = raw.reshape(rows, -1)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), T[kind])
    return raw, gguf.quants.dequantize(raw, T[kind]).reshape(rows, cols)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_int4_groups_reproduce_the_gguf_dequantisation(kind):
    raw, ref = _blocks(kind, 16, 512)
    q, scale, zero = int4_groups(raw, kind, (16, 512))
    assert q.dtype == np.uint8 and q.min() >= 0 and q.max() <= 15
    planes = q.shape[1] // 512
    assert planes == (2 if kind == "Q8_0" else 1) and scale.shape == (16, 16 * planes)
    w = (q.astype(np.float64) - 8) * np.repeat(scale, 32, axis=1) + np.repeat(zero, 32, axis=1)
    w = w.reshape(16, planes, 512).sum(axis=1)
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-7 * np.abs(ref).max())


def test_int4_groups_reject_other_types():
    raw, _ = _blocks("Q5_0", 4, 64)
    with pytest.raises(ValueError, match="Q5_0 cannot run as 4-bit groups"):
        int4_groups(raw, "Q5_0", (4, 64))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_packed_linear_float32_runs_the_file_weights(kind):
    """In float32 the executed weight is the file's dequantised weight up to float32 rounding, and each output
    row does not depend on the other rows of the batch (what makes speculative == autoregressive)."""
    raw, ref = _blocks(kind, 96, 128, seed=3)
    q, scale, zero = (torch.from_numpy(a) for a in int4_groups(raw, kind, (96, 128)))
    bias = torch.randn(96)
    lin = PackedLinear(q, scale, zero, 128, bias, torch.float32)
    ref_w = torch.from_numpy(ref)
    torch.testing.assert_close(lin.dense_weight(), ref_w, rtol=0, atol=4e-7 * float(ref_w.abs().max()))
    x = torch.randn(2, 5, 128)
    y = lin(x)
    assert y.shape == (2, 5, 96)
    torch.testing.assert_close(y, x @ ref_w.t() + bias, rtol=1e-5, atol=1e-4)
    rows = torch.cat([lin(x[:, i:i + 1]) for i in range(5)], dim=1)
    assert torch.equal(rows, y)


def test_packed_linear_bfloat16_is_close():
    raw, ref = _blocks("Q4_1", 64, 256, seed=4)
    q, scale, zero = (torch.from_numpy(a) for a in int4_groups(raw, "Q4_1", (64, 256)))
    lin = PackedLinear(q, scale, zero, 256, None, torch.bfloat16)
    x = torch.randn(3, 256)
    want = x @ torch.from_numpy(ref).t()
    got = lin(x.bfloat16()).float()
    assert float((got - want).abs().max()) < 0.02 * float(want.abs().max())


@pytest.fixture(scope="module")
def tiny_gguf_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("quant") / "tiny.gguf", seed=5)


def test_pack_model_matches_the_float_model(tiny_gguf_file):
    """Every Q4_1 projection of the tiny GGUF (llama: q/k rows un-permuted) packs; float32 logits of the packed
    model equal the dequantised model's within float32 rounding."""
    reader = read_gguf(tiny_gguf_file)
    dense, _ = load_gguf(tiny_gguf_file, torch.float32, with_tokenizer=False)
    packed, _ = load_gguf(tiny_gguf_file, torch.float32, with_tokenizer=False)
    report = pack_model(packed, reader)
    assert set(report.values()) == {"Q4_1"} and len(report) == 4 * 4 + 1
    assert all(isinstance(packed.get_submodule(n), PackedLinear) for n in report)
    err = weight_error(packed, reader)
    assert err["max_abs"] <= 4e-7 * err["max_weight"]
    ids = torch.tensor([[1, 5, 9, 200, 7, 3]])
    torch.testing.assert_close(packed(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)


def test_int4_speculative_equals_autoregressive(tiny_gguf_file):
    """Greedy losslessness within the int4 mode (float32 activations: the kernel is exact per row)."""
    target, _ = load_gguf(tiny_gguf_file, torch.float32, with_tokenizer=False)
    pack_model(target, read_gguf(tiny_gguf_file))
    head = tiny_head(target, draft_vocab=64)
    eng = Engine(target, head)
    for prompt in PROMPTS:
        ar = eng.generate(prompt, None, max_new_tokens=20)
        for cfg in (StaticConfig(), StaticConfig(width=3, depth=4, size=8)):
            assert eng.generate(prompt, StaticController(cfg), max_new_tokens=20).token_ids == ar.token_ids


def test_pack_model_refuses_a_gpu_model(tiny_gguf_file):
    target, _ = load_gguf(tiny_gguf_file, torch.float32, with_tokenizer=False)
    target.to("meta")
    with pytest.raises(ValueError, match="CPU only"):
        pack_model(target, read_gguf(tiny_gguf_file))


def test_attention_dtype_runs_cache_and_attention_in_float32(tiny_gguf_file):
    """A bfloat16 model with float32 attention: float32 caches, logits close to the float32 model's, and
    speculative output equal to autoregressive output of that mode on these prompts."""
    ref, _ = load_gguf(tiny_gguf_file, torch.float32, with_tokenizer=False)
    model, _ = load_gguf(tiny_gguf_file, torch.bfloat16, with_tokenizer=False)
    head = tiny_head(model, draft_vocab=64)
    set_attention_dtype(model, torch.float32)
    set_attention_dtype(head, torch.float32)
    assert model.attn_dtype == torch.float32 and model.dtype == torch.bfloat16
    assert model.new_cache(8).k.dtype == torch.float32 and head.new_cache(8).k.dtype == torch.float32
    ids = torch.tensor([[1, 5, 9, 200, 7, 3]])
    cache = model.new_cache(16)
    out = model(ids, cache=cache).logits
    assert out.dtype == torch.bfloat16
    want = ref(ids).logits
    assert float((out.float() - want).abs().max()) < 0.05 * float(want.abs().max())
    eng = Engine(model, head)
    res = eng.generate([1, 5, 9], StaticController(StaticConfig(width=3, depth=3, size=6)), max_new_tokens=10)
    assert len(res.token_ids) == 10


def test_execution_candidates(tiny_gguf_file, tmp_path, monkeypatch):
    from adaptree.adapt.execution import execution_candidates, fallback_dtype
    from adaptree.models import ggml

    monkeypatch.setattr(ggml, "ggml_available", lambda: "llama-cpp-python is not installed")
    assert execution_candidates(tiny_gguf_file) == ("bfloat16", "bfloat16+int4", "float32")
    # with llama.cpp: its modes with the head in the dtype this CPU runs natively
    monkeypatch.setattr(ggml, "ggml_available", lambda: None)
    native = fallback_dtype()
    modes = (f"{native}+ggml", f"{native}+ggml-q4_0")
    want = ("bfloat16", "bfloat16+int4", *modes, "float32") if native == "bfloat16" else \
        ("bfloat16", "bfloat16+int4", "float32", *modes)
    assert execution_candidates(tiny_gguf_file) == want
    assert execution_candidates(tiny_gguf_file, weights="ggml-q8_0") == (f"{native}+ggml-q8_0",)
    assert execution_candidates(tiny_gguf_file, dtype="float32", weights="ggml") == ("float32+ggml",)
    monkeypatch.setattr(ggml, "ggml_available", lambda: "llama-cpp-python is not installed")
    assert execution_candidates(tiny_gguf_file, dtype="float32") == ("float32",)
    assert execution_candidates(tiny_gguf_file, weights="int4") == ("bfloat16+int4",)
    assert execution_candidates(tiny_gguf_file, dtype="float32", weights="int4") == ("float32+int4",)
    assert execution_candidates(tiny_gguf_file, device="cuda") == ("bfloat16", "float16")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert execution_candidates(folder) == ("bfloat16", "float32")


def test_load_int4_needs_a_gguf_model(tmp_path):
    from adaptree.adapt.execution import parse_execution
    from adaptree.api import load

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load(folder, head=None, dtype="float32", weights="int4", adapt=False)
    with pytest.raises(ValueError, match="weights 'int8' is not supported"):
        load(folder, head=None, weights="int8", adapt=False)
    assert parse_execution("bfloat16+int4") == ("bfloat16", "int4")
    with pytest.raises(ValueError, match="'bf16' is not one of"):
        parse_execution("bf16")


@pytest.mark.slow
def test_default_model_int4_weights_equal_the_file():
    """Every projection of SmolLM2's file packs (Q4_1; the tied Q8_0 embedding as two planes) and executes the
    file's weights: float32 exactly up to rounding, bfloat16 within half a bfloat16 ulp of the largest weight."""
    from adaptree.models import resolve_model
    from adaptree.models.loader import load_model

    reader = read_gguf(resolve_model(None))
    model, _ = load_model(None, torch.bfloat16, weights="int4")
    kinds = {type(m).__name__ for n, m in model.named_modules() if n.endswith(("proj", "lm_head"))}
    assert kinds == {"PackedLinear"}
    err = weight_error(model, reader)
    assert err["max_abs"] <= err["max_weight"] * 2 ** -8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_copy_is_the_executed_weight(dtype):
    """A packed layer's dense copy is the weight its kernel executes (within the dtype's rounding), and under
    dense_weights() the layer multiplies by it; the Q8_0 layer (two planes) keeps none."""
    from adaptree.models.quant import dense_weights

    raw, _ = _blocks("Q4_1", 48, 128, seed=6)
    q, scale, zero = (torch.from_numpy(a) for a in int4_groups(raw, "Q4_1", (48, 128)))
    lin = PackedLinear(q, scale, zero, 128, torch.randn(48), dtype)
    ulp = 4e-7 if dtype == torch.float32 else 8e-3
    executed = lin.dense_weight().float()
    torch.testing.assert_close(lin.dense.float(), executed, rtol=0, atol=ulp * float(executed.abs().max()))
    x = torch.randn(7, 128, dtype=dtype)
    with dense_weights():
        y = lin(x)
    assert torch.equal(y, torch.nn.functional.linear(x, lin.dense, lin.bias))
    with dense_weights(False):
        assert torch.equal(lin(x), lin._matmul(x) + lin.bias)
    raw8, _ = _blocks("Q8_0", 16, 128, seed=7)
    q8, s8, z8 = (torch.from_numpy(a) for a in int4_groups(raw8, "Q8_0", (16, 128)))
    assert PackedLinear(q8, s8, z8, 128, None, dtype).dense is None


def test_dense_prefill_rows_measured_cached_and_applied(tiny_gguf_file, tmp_path, monkeypatch):
    """The rule is measured once and cached; a cached 0 drops the dense copies; a cached size makes prefills of that
    many tokens run dense (their logits are the dense_weights() forward's), shorter prefills and cached forwards
    the kernel; greedy speculative output still equals AR's (the prefill is shared)."""
    import json

    from adaptree.adapt.cache import machines_dir
    from adaptree.adapt.prefill import dense_prefill_rows
    from adaptree.models.quant import dense_weights

    monkeypatch.setenv("ADAPTREE_CACHE", str(tmp_path / "cache"))
    target, _ = load_gguf(tiny_gguf_file, torch.float32, with_tokenizer=False)
    pack_model(target, read_gguf(tiny_gguf_file))
    assert dense_prefill_rows(target, measure=False) == 0 and not list(machines_dir().glob("prefill-*.json"))
    target, _ = load_gguf(tiny_gguf_file, torch.float32, with_tokenizer=False)
    pack_model(target, read_gguf(tiny_gguf_file))
    rows = dense_prefill_rows(target, measure=True, message=lambda m: None)
    (entry,) = machines_dir().glob("prefill-*.json")
    data = json.loads(entry.read_text())
    assert data["dense_prefill_rows"] == rows and set(data["int4_ms"]) == {"16", "64", "256"}
    has_dense = any(getattr(m, "dense", None) is not None for m in target.modules())
    assert has_dense == (rows > 0)
    data["dense_prefill_rows"] = 16
    entry.write_text(json.dumps(data))
    target, _ = load_gguf(tiny_gguf_file, torch.float32, with_tokenizer=False)
    pack_model(target, read_gguf(tiny_gguf_file))
    target.dense_prefill_rows = dense_prefill_rows(target, measure=False)
    assert target.dense_prefill_rows == 16
    ids = torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    kernel_calls = []
    run_kernel = PackedLinear._matmul
    monkeypatch.setattr(PackedLinear, "_matmul", lambda self, x: kernel_calls.append(x.shape[0]) or run_kernel(self, x))
    with torch.inference_mode():
        got = target(ids, cache=target.new_cache(32)).logits
        assert kernel_calls == [20]  # the decoder layers ran dense; only the lm_head ran the kernel
        with dense_weights():
            dense = target(ids, cache=target.new_cache(32)).logits
        cache = target.new_cache(32)
        kernel_calls.clear()
        target(ids[:, :10], cache=cache)  # shorter than 16: the kernel
        target(ids[:, 10:], cache=cache)  # not a prefill: the kernel
        assert kernel_calls == [10] * 17 + [10] * 17
        target.dense_prefill_rows = 0
        kernel = target(ids, cache=target.new_cache(32)).logits
    assert torch.equal(got, dense)
    torch.testing.assert_close(got, kernel, rtol=1e-4, atol=1e-4)
    target.dense_prefill_rows = 16
    head = tiny_head(target, draft_vocab=64)
    eng = Engine(target, head)
    prompt = ids[0].tolist()
    ar = eng.generate(prompt, None, max_new_tokens=16)
    assert eng.generate(prompt, StaticController(StaticConfig(width=3, depth=4, size=8)),
                        max_new_tokens=16).token_ids == ar.token_ids
    data["dense_prefill_rows"] = 0
    entry.write_text(json.dumps(data))
    assert dense_prefill_rows(target, measure=False) == 0
    assert all(getattr(m, "dense", None) is None for m in target.modules())


def test_rounded_groups_bound_the_error_and_pack_a_draft_model():
    from conftest import tiny_target

    from adaptree.methods import make_controller
    from adaptree.models.quant import pack_dense, rtn_groups

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    q, scale, zero = rtn_groups(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == zero.shape == (48, 2)
    back = (q.float() - 8) * scale.repeat_interleave(32, dim=1) + zero.repeat_interleave(32, dim=1)
    assert bool(((back - w).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-6).all())  # half a level at most
    with pytest.raises(ValueError, match="33 inputs"):
        rtn_groups(torch.zeros(4, 33))

    target = tiny_target(vocab=32)
    draft = tiny_target(vocab=32)
    x = torch.tensor([PROMPTS[0]])
    before = draft(x).logits
    report = pack_dense(draft)
    assert set(report.values()) == {"4-bit (rounded)"} and isinstance(draft.lm_head, PackedLinear)
    after = draft(x).logits
    assert float((after - before).norm() / before.norm()) < 0.1  # an approximation of the same model
    assert set(pack_dense(draft).values()) == {"packed already"}
    # a two-plane (Q8_0) layer is rounded to one plane from the weight it executes
    raw8, _ = _blocks("Q8_0", 32, 32, seed=7)
    q8, s8, z8 = (torch.from_numpy(a) for a in int4_groups(raw8, "Q8_0", (32, 32)))
    draft.lm_head = PackedLinear(q8, s8, z8, 32, None, torch.float32)
    exact = draft.lm_head.dense_weight()
    assert pack_dense(draft)["lm_head"] == "4-bit (rounded)" and draft.lm_head.planes == 1
    assert float((draft.lm_head.dense_weight() - exact).abs().max()) <= float(exact.abs().max()) / 15
    # a rounded draft model proposes other tokens, never other output: greedy output is still AR's
    eng = Engine(target)
    ar = eng.generate(PROMPTS[0], max_new_tokens=16).token_ids
    got = eng.generate(PROMPTS[0], make_controller("draft-model", draft_model=draft, tokens=4), max_new_tokens=16)
    assert got.token_ids == ar
