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


def test_execution_candidates(tiny_gguf_file, tmp_path):
    from adaptree.adapt.execution import execution_candidates

    assert execution_candidates(tiny_gguf_file) == ("bfloat16", "bfloat16+int4", "float32")
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
