"""EAGLE-3 draft head: layout, strict loading, cache/tree semantics, vocabulary mapping."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from adaptree.models.config import ModelConfig
from adaptree.models.eagle3 import (
    ARCHITECTURE,
    Eagle3Config,
    Eagle3Head,
    build_vocab_map,
)
from adaptree.models.llama import Transformer

VOCAB, HID, DRAFT_VOCAB = 64, 32, 24


def make_target(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    cfg = dict(arch="llama", vocab_size=VOCAB, hidden_size=HID, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2)
    cfg.update(kw)
    return Transformer(ModelConfig(**cfg)).eval()


def make_head(target: Transformer, seed: int = 1, counts: torch.Tensor | None = None) -> Eagle3Head:
    if counts is None:
        counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(seed))
    head = Eagle3Head.init_for_target(target, DRAFT_VOCAB, counts, seed=seed, init_std=0.2).eval()
    with torch.no_grad():  # non-trivial norm weights so that a swapped norm would show
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return head


def features(t: int, width: int = 3 * HID, seed: int = 5) -> torch.Tensor:
    return torch.randn(1, t, width, generator=torch.Generator().manual_seed(seed))


def ids(t: int, seed: int = 6) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def target() -> Transformer:
    return make_target()


@pytest.fixture
def head(target) -> Eagle3Head:
    return make_head(target)


# ---- layout and math -------------------------------------------------------------------------------


RELEASED_KEYS = {
    "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d",
}


def test_state_dict_layout(head, target):
    sd = head.state_dict()
    assert set(sd) == RELEASED_KEYS  # embeddings borrowed from the target: not part of the head's state
    assert sd["fc.weight"].shape == (HID, 3 * HID)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (HID, 2 * HID)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 8, 2 * HID)  # 2 kv heads * head_dim 8
    assert sd["lm_head.weight"].shape == (DRAFT_VOCAB, HID)
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (DRAFT_VOCAB,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (VOCAB,)
    assert head.embedding_weight is target.model.embed_tokens.weight
    assert all(p is not target.model.embed_tokens.weight for p in head.parameters())
    own = Eagle3Head(head.config)
    assert set(own.state_dict()) == RELEASED_KEYS | {"embed_tokens.weight"}


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference(head: Eagle3Head, feats: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 draft layer written out by hand: cat([input_layernorm(emb), hidden_norm(h)]), residual h."""
    sd = {k: v.double() for k, v in head.state_dict().items() if v.is_floating_point()}
    cfg = head.config
    eps, hd, nh, nkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    t = input_ids.shape[1]
    emb = head.embedding_weight.double()[input_ids[0]]
    h = feats[0].double() @ sd["fc.weight"].T
    x = torch.cat([_rms(emb, sd["midlayer.input_layernorm.weight"], eps),
                   _rms(h, sd["midlayer.hidden_norm.weight"], eps)], dim=-1)
    q = (x @ sd["midlayer.self_attn.q_proj.weight"].T).view(t, nh, hd)
    k = (x @ sd["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, hd)
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, hd)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]

    def rot(z):
        return z * cos + torch.cat([-z[..., hd // 2:], z[..., :hd // 2]], -1) * sin

    q, k = rot(q), rot(k)
    rep = nh // nkv
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, nh * hd)
    h = h + attn @ sd["midlayer.self_attn.o_proj.weight"].T
    y = _rms(h, sd["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(y @ sd["midlayer.mlp.gate_proj.weight"].T) * (y @ sd["midlayer.mlp.up_proj.weight"].T))
    return h + mlp @ sd["midlayer.mlp.down_proj.weight"].T


def test_forward_matches_released_layer_math(head):
    feats, tok = features(7), ids(7)
    out, logits = head(feats, tok)
    ref = _reference(head, feats, tok)
    torch.testing.assert_close(out[0].double(), ref, rtol=1e-4, atol=1e-4)
    ref_logits = _rms(ref, head.norm.weight.double(), head.config.rms_norm_eps) @ head.lm_head.weight.double().T
    torch.testing.assert_close(logits[0].double(), ref_logits, rtol=1e-4, atol=1e-4)
    # the swapped order (SPEC.md's wording) would give a different result
    with torch.no_grad():
        w = head.midlayer.self_attn.qkv_proj.weight  # q/k/v rows fused; swap the two input halves
        w.copy_(torch.cat([w[:, HID:], w[:, :HID]], dim=1))
    swapped, _ = head(feats, tok)
    assert not torch.allclose(swapped, out, atol=1e-3)


def test_own_hidden_skips_fc(head):
    own = torch.randn(1, 3, HID)
    out, logits = head(own, ids(3))
    assert out.shape == (1, 3, HID) and logits.shape == (1, 3, DRAFT_VOCAB)
    with pytest.raises(ValueError, match="hidden width 17"):
        head(torch.randn(1, 3, 17), ids(3))
    _, last = head(features(5), ids(5), logits_at=slice(-1, None))
    assert last.shape == (1, 1, DRAFT_VOCAB)


# ---- KV cache and tree attention -------------------------------------------------------------------


def test_cached_steps_equal_full_causal(head):
    t = 9
    feats, tok = features(t), ids(t)
    full_out, full_logits = head(feats, tok)
    cache = head.new_cache(32)
    out0, _ = head(feats[:, :4], tok[:, :4], cache=cache)  # prefill of 4, then one at a time
    outs = [out0]
    for i in range(4, t):
        o, _ = head(feats[:, i:i + 1], tok[:, i:i + 1], cache=cache)
        outs.append(o)
    assert cache.length == t
    torch.testing.assert_close(torch.cat(outs, dim=1), full_out, rtol=1e-5, atol=1e-5)
    cache2 = head.new_cache(32)
    o2, l2 = head(feats, tok, cache=cache2)
    torch.testing.assert_close(o2, full_out)
    torch.testing.assert_close(l2, full_logits)


def test_tree_mask_with_throwaway_kv_equals_sequential_paths(head):
    """EAGLE-style drafting: committed prefix, then 2 levels of W=2 nodes whose KV is kept as throw-away
    entries after the committed cache and masked with K > T tree masks."""
    p = 6
    feats, tok = features(p), ids(p)
    cache = head.new_cache(32)
    prefix_out, _ = head(feats, tok, cache=cache)
    last = prefix_out[:, -1:]
    # level 1: two children of the root, both at position p, attending the prefix and themselves
    lvl1_tok = torch.tensor([[3, 17]])
    lvl1_hidden = last.expand(1, 2, HID)
    out1, _ = head(lvl1_hidden, lvl1_tok, position_ids=torch.tensor([p, p]), cache=cache,
                   tree_mask=torch.eye(2, dtype=torch.bool))
    # level 2: node 0 is a child of level-1 node 1, node 1 a child of level-1 node 0 (crossed on purpose)
    parents = [1, 0]
    lvl2_tok = torch.tensor([[40, 9]])
    lvl2_hidden = out1[:, parents]
    mask2 = torch.zeros(2, 4, dtype=torch.bool)  # covers [lvl1 node 0, lvl1 node 1, lvl2 node 0, lvl2 node 1]
    for i, par in enumerate(parents):
        mask2[i, par] = True
        mask2[i, 2 + i] = True
    out2, logits2 = head(lvl2_hidden, lvl2_tok, position_ids=torch.tensor([p + 1, p + 1]), cache=cache,
                         tree_mask=mask2)
    assert cache.length == p + 4
    for i, par in enumerate(parents):
        seq = head.new_cache(32)
        head(feats, tok, cache=seq)
        o1, _ = head(last, lvl1_tok[:, par:par + 1], cache=seq)
        torch.testing.assert_close(o1, out1[:, par:par + 1], rtol=1e-5, atol=1e-5)
        o2, l2 = head(o1, lvl2_tok[:, i:i + 1], cache=seq)
        torch.testing.assert_close(o2, out2[:, i:i + 1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l2, logits2[:, i:i + 1], rtol=1e-5, atol=1e-5)


# ---- save / load -----------------------------------------------------------------------------------


def test_round_trip_fp32_identical(head, target, tmp_path):
    head.save_pretrained(tmp_path, dtype=torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and "target_hidden_size" not in cfg
    loaded = Eagle3Head.from_pretrained(tmp_path, target=target).eval()
    assert loaded.config == head.config
    a, b = head.state_dict(), loaded.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
    feats, tok = features(8), ids(8)
    out_a, log_a = head(feats, tok)
    out_b, log_b = loaded(feats, tok)
    assert torch.equal(out_a, out_b) and torch.equal(log_a, log_b)
    assert loaded.embedding_weight is target.model.embed_tokens.weight


def test_bf16_save_load(head, target, tmp_path):
    head.save_pretrained(tmp_path)  # bf16 by default
    from safetensors.torch import load_file
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.bfloat16 and stored["d2t"].dtype == torch.int64
    assert stored["t2d"].dtype == torch.bool and "embed_tokens.weight" not in stored
    loaded = Eagle3Head.from_pretrained(tmp_path, target=target, dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16
    out, logits = loaded(features(5), ids(5))
    assert out.dtype == torch.bfloat16 and logits.shape == (1, 5, DRAFT_VOCAB)
    ref_out, _ = head(features(5), ids(5))
    torch.testing.assert_close(out.float(), ref_out, rtol=0.1, atol=0.1)
    loaded32 = Eagle3Head.from_pretrained(tmp_path, target=target, dtype=torch.float32)
    assert torch.equal(loaded32.d2t, head.d2t) and torch.equal(loaded32.t2d, head.t2d)


def test_int8_rows_save_load(head, target, tmp_path):
    from safetensors.torch import load_file, save_file

    head.save_pretrained(tmp_path, dtype=torch.int8)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.int8 and stored["fc.weight_scale"].dtype == torch.float32
    assert stored["norm.weight"].dtype == torch.bfloat16 and stored["d2t"].dtype == torch.int64
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["adaptree_storage"] == "int8 rows" and cfg["torch_dtype"] == "bfloat16"
    loaded = Eagle3Head.from_pretrained(tmp_path, target=target, dtype=torch.float32)
    for k, w in head.state_dict().items():
        if w.is_floating_point() and w.dim() == 2 and k != "embed_tokens.weight":
            step = w.abs().amax(dim=1, keepdim=True) / 127
            assert bool(((loaded.state_dict()[k] - w).abs() <= step / 2 + 1e-7).all()), k  # half a step at most
    assert torch.equal(loaded.d2t, head.d2t)
    out, _ = loaded(features(5), ids(5))
    ref, _ = head(features(5), ids(5))
    assert float((out - ref).detach().norm() / ref.detach().norm()) < 0.02
    # a matrix without its scale, and a scale of the wrong length, are named
    del stored["fc.weight_scale"]
    save_file(stored, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="without a _scale entry.*fc.weight"):
        Eagle3Head.from_pretrained(tmp_path, target=target)
    stored["fc.weight_scale"] = torch.ones(3)
    save_file(stored, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight_scale"):
        Eagle3Head.from_pretrained(tmp_path, target=target)


def test_embeddings_in_checkpoint_kept_and_loadable_without_target(head, target, tmp_path):
    head.save_pretrained(tmp_path, dtype=torch.float32, include_embeddings=True)
    alone = Eagle3Head.from_pretrained(tmp_path)
    assert alone.has_own_embeddings
    assert torch.equal(alone.embed_tokens.weight, target.model.embed_tokens.weight)
    other = make_target(seed=9)
    kept = Eagle3Head.from_pretrained(tmp_path, target=other)
    assert kept.has_own_embeddings  # the checkpoint's, not the (different) target's
    assert torch.equal(kept.embedding_weight, target.model.embed_tokens.weight)
    assert not kept.embed_tokens.weight.requires_grad


def _write_released(folder, sd: dict, cfg: dict, fmt: str = "safetensors") -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(folder, "model.safetensors"))
    else:
        torch.save(sd, os.path.join(folder, "pytorch_model.bin"))


def _released_config() -> dict:
    # the shape of yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config.json, scaled down
    return {"architectures": [ARCHITECTURE], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": HID, "initializer_range": 0.02, "intermediate_size": 64,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1",
            "use_cache": True, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB}


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_released_layout_without_embeddings_uses_target(head, target, tmp_path, fmt):
    sd = {k: v.to(torch.float16) if v.is_floating_point() else v for k, v in head.state_dict().items()}
    _write_released(tmp_path, sd, _released_config(), fmt)
    loaded = Eagle3Head.from_pretrained(tmp_path, target=target, dtype=torch.float32)
    assert loaded.config.rope_theta == 10000.0 and loaded.config.rms_norm_eps == 1e-5
    assert loaded.embedding_weight is target.model.embed_tokens.weight
    out, logits = loaded(features(4), ids(4))
    assert logits.shape == (1, 4, DRAFT_VOCAB)
    with pytest.raises(ValueError, match="no embed_tokens.weight and no target"):
        Eagle3Head.from_pretrained(tmp_path)


# ---- strict loading failures -------------------------------------------------------------------------


@pytest.fixture
def saved(head, tmp_path):
    sd = {k: v.clone() for k, v in head.state_dict().items()}
    return sd, _released_config()


def _expect_error(tmp_path, sd, cfg, target, match):
    folder = tmp_path / "bad"
    _write_released(folder, sd, cfg)
    with pytest.raises(ValueError, match=match):
        Eagle3Head.from_pretrained(folder, target=target)


def test_missing_key(saved, target, tmp_path):
    sd, cfg = saved
    del sd["midlayer.hidden_norm.weight"]
    _expect_error(tmp_path, sd, cfg, target, r"missing keys \['midlayer.hidden_norm.weight'\]")


def test_unexpected_key(saved, target, tmp_path):
    sd, cfg = saved
    sd["midlayer.self_attn.q_proj.bias"] = torch.zeros(HID)
    _expect_error(tmp_path, sd, cfg, target, r"unexpected keys \['midlayer.self_attn.q_proj.bias'\]")


def test_wrong_shape(saved, target, tmp_path):
    sd, cfg = saved
    sd["midlayer.mlp.up_proj.weight"] = torch.zeros(65, HID)
    _expect_error(tmp_path, sd, cfg, target, r"midlayer.mlp.up_proj.weight: checkpoint \(65, 32\)")


def test_lm_head_rows_vs_draft_vocab(saved, target, tmp_path):
    sd, cfg = saved
    cfg["draft_vocab_size"] = DRAFT_VOCAB + 1
    _expect_error(tmp_path, sd, cfg, target, r"lm_head.weight.*draft_vocab_size=25")


def test_target_hidden_mismatch(saved, tmp_path):
    sd, cfg = saved
    wide = make_target(hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    _expect_error(tmp_path, sd, cfg, wide, r"target_hidden_size \(32\).*hidden_size \(48\)")


def test_vocab_mismatch(saved, tmp_path):
    sd, cfg = saved
    bigger = make_target(vocab_size=80)
    _expect_error(tmp_path, sd, cfg, bigger, r"vocab_size \(64\).*vocab_size \(80\)")


def test_t2d_length_mismatch(saved, target, tmp_path):
    sd, cfg = saved
    sd["t2d"] = torch.ones(VOCAB + 3, dtype=torch.bool)
    _expect_error(tmp_path, sd, cfg, target, r"t2d: checkpoint \(67,\)")


def test_d2t_out_of_range(saved, target, tmp_path):
    sd, cfg = saved
    sd["d2t"] = sd["d2t"].clone()
    sd["d2t"][5] = VOCAB  # draft id 5 -> 5 + 64, beyond the vocabulary
    _expect_error(tmp_path, sd, cfg, target, r"d2t maps draft id 5 to target id 69, outside \[0, vocab_size=64\)")


def test_unsupported_config(saved, target, tmp_path):
    sd, cfg = saved
    _expect_error(tmp_path, sd, dict(cfg, num_hidden_layers=2), target, "exactly 1 decoder layer")
    _expect_error(tmp_path, sd, dict(cfg, architectures=["Qwen3ForCausalLMEagle3"]), target,
                  "unsupported draft architecture")


# ---- config --------------------------------------------------------------------------------------------


def test_config_round_trip_and_validation():
    cfg = Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=100, draft_vocab_size=50, target_hidden_size=96, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    d = cfg.to_hf_dict()
    assert d["target_hidden_size"] == 96 and d["head_dim"] == 16
    assert Eagle3Config.from_hf_dict(json.loads(json.dumps(d))) == cfg
    assert Eagle3Config.from_hf_dict(_released_config()).target_hidden_size == HID
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Eagle3Config(num_attention_heads=4, num_key_value_heads=3, hidden_size=32)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config(vocab_size=10, draft_vocab_size=11)
    with pytest.raises(ValueError, match="hidden_size"):
        Eagle3Config(hidden_size=0)
    with pytest.raises(ValueError, match="rope_scaling"):
        Eagle3Config(rope_scaling={"rope_type": "yarn", "factor": 2.0})


def test_config_loads_in_transformers():
    transformers = pytest.importorskip("transformers")
    d = Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=100, draft_vocab_size=50).to_hf_dict()
    lc = transformers.LlamaConfig.from_dict(d)
    assert lc.num_hidden_layers == 1 and lc.draft_vocab_size == 50 and lc.hidden_size == 64


# ---- vocabulary mapping ------------------------------------------------------------------------------


def test_build_vocab_map_invariants():
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 50, (200,), generator=g)
    counts[[7, 150, 199]] = 1000  # certainly chosen
    d2t, t2d = build_vocab_map(counts, 40)
    assert d2t.dtype == torch.int64 and d2t.shape == (40,)
    assert t2d.dtype == torch.bool and t2d.shape == (200,) and int(t2d.sum()) == 40
    chosen = torch.arange(40) + d2t
    assert torch.equal(chosen, t2d.nonzero().flatten())  # ascending ids, exactly the marked ones
    assert bool((chosen[1:] > chosen[:-1]).all())
    assert {7, 150, 199} <= set(chosen.tolist())
    # most frequent: every chosen count >= every unchosen count
    assert int(counts[t2d].min()) >= int(counts[~t2d].max())


def test_build_vocab_map_ties_and_errors():
    d2t, t2d = build_vocab_map(torch.zeros(10), 4)
    assert torch.equal(d2t, torch.zeros(4, dtype=torch.int64)) and t2d[:4].all() and not t2d[4:].any()
    d2t, _ = build_vocab_map(torch.tensor([0, 5, 0, 5, 1]), 3)
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 4]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(torch.ones(5), 6)
    with pytest.raises(ValueError, match="negative"):
        build_vocab_map(torch.tensor([1, -1, 2]), 2)


def test_init_for_target_and_draft_to_target(target):
    counts = torch.zeros(VOCAB)
    counts[[2, 11, 30, 63]] = torch.tensor([5.0, 9.0, 7.0, 8.0])
    head = Eagle3Head.init_for_target(target, 4, counts)
    assert head.config.target_hidden_size == HID and head.config.hidden_size == HID
    assert head.config.intermediate_size == target.config.intermediate_size
    assert head.draft_to_target(torch.arange(4)).tolist() == [2, 11, 30, 63]
    assert head.t2d.nonzero().flatten().tolist() == [2, 11, 30, 63]
    assert not head.has_own_embeddings and head.embedding_weight is target.model.embed_tokens.weight
    plain = Eagle3Head.init_for_target(target, 8)
    assert plain.draft_to_target(torch.arange(8)).tolist() == list(range(8))
    narrow = Eagle3Head.init_for_target(target, 8, hidden_size=16, num_attention_heads=2, num_key_value_heads=1)
    assert narrow.has_own_embeddings and narrow.fc.weight.shape == (16, 3 * HID)
    out, logits = narrow(features(3), ids(3))
    assert out.shape == (1, 3, 16) and logits.shape == (1, 3, 8)


def test_target_features_drive_the_head(target, head):
    """The target's EAGLE-3 feature taps have the width fc expects."""
    tok = ids(6)
    feats = target(tok, features=True, logits=False).features
    out, logits = head(feats[:, :-1], tok[:, 1:])
    assert out.shape == (1, 5, HID) and torch.isfinite(logits).all()


def test_rope_grows_beyond_initial_table(head):
    cache = head.new_cache(8)
    out, _ = head(features(2), ids(2), position_ids=torch.tensor([5000, 5001]), cache=cache)
    assert torch.isfinite(out).all() and head.rotary.cos.shape[0] > 5001
