"""GGUF files (llama.cpp's format): reading, the model config from the metadata, dequantization, the
tokenizer, and :func:`load_gguf`.

- the file is parsed by ``gguf.GGUFReader`` (a subclass that parses the same fields faster, see
  :func:`_reader_class`).
- tensors are dequantized to float32 by ``gguf.quants.dequantize`` and then cast to the requested dtype.
- llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of *llama*-architecture models
  (interleaved rotary halves, its own rope layout); that permutation is reversed here. Qwen2/Qwen3
  files are written without it.
- the tokenizer is rebuilt from the already-parsed metadata with transformers' GGUF tokenizer converter
  (``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` builds the same tokenizer but parses the
  file twice more); that call is the fallback.
- the model config comes from ``{arch}.*`` metadata; no ``output.weight`` means tied embeddings; a
  ``rope_freqs.weight`` tensor (llama.cpp's form of Llama-3 rope scaling) is turned back into a
  ``rope_scaling`` dict.

A truncated or corrupt file, an unsupported architecture or rope scheme, and tensors that do not fit
the config raise a ``ValueError`` naming the file. :mod:`adaptree.models.cache` keeps the dequantized form,
so a file is read this way once per model and dtype; docs/performance.md ("Loading a model") has the times of
each step against the stock route.
"""

from __future__ import annotations

import functools
import inspect
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaptree.models.config import ModelConfig
from adaptree.models.hf import model_from_state_dict
from adaptree.models.llama import Transformer, rope_inv_freq
from adaptree.models.tokenizer import TokenizerBundle, unique_ids

__all__ = [
    "dequantize_gguf_tensor",
    "gguf_config",
    "gguf_state_dict",
    "gguf_tokenizer_bundle",
    "is_gguf_file",
    "load_gguf",
    "read_gguf",
]


def is_gguf_file(path: str | Path) -> bool:
    """A file named ``*.gguf`` or starting with the GGUF magic bytes (never a folder)."""
    path = Path(path)
    if path.is_dir():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@functools.cache
def _reader_class():
    """``gguf.GGUFReader``, sped up where its internals are the ones we know (else the stock class).

    The stock reader slices its ``np.memmap`` once or twice per metadata value, and every memmap slice
    runs Python-level ``__array_finalize__``; with a recursive call per string, parsing the ~100k-entry
    vocabulary and merge lists takes seconds. Slicing a plain-ndarray view of the same mapping, and walking
    string arrays in one loop, builds identical fields (checked against the stock reader in the tests) several
    times faster (docs/performance.md, "Loading a model").
    """
    import gguf

    base = gguf.GGUFReader
    try:
        get_params = list(inspect.signature(base._get).parameters)
        parts_params = list(inspect.signature(base._get_field_parts).parameters)
    except (AttributeError, TypeError, ValueError):
        return base
    if (get_params != ["self", "offset", "dtype", "count", "override_order"]
            or parts_params != ["self", "orig_offs", "raw_type"]):
        return base
    ARRAY, STRING = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING
    u32, u64 = np.dtype(np.uint32), np.dtype(np.uint64)

    class _FastGGUFReader(base):  # type: ignore[misc, valid-type]
        def _plain(self) -> np.ndarray:
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self._plain_data = self.data.view(np.ndarray)
            return plain

        def _get(self, offset, dtype, count=1, override_order=None):
            count = int(count)
            dt = np.dtype(dtype)
            arr = self._plain()[offset:offset + dt.itemsize * count].view(dt)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

        def _get_field_parts(self, orig_offs, raw_type):
            # Arrays of strings (vocabularies, merge lists: 10^5 entries) in one tight loop; the result
            # (parts, data indices, types) is exactly what the generic recursion builds.
            plain = self._plain()
            if self.byte_order != "I" or int(raw_type) != int(ARRAY):
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = plain[orig_offs:orig_offs + 4].view(u32)
            if int(raw_itype[0]) != int(STRING):
                return super()._get_field_parts(orig_offs, raw_type)
            alen = plain[orig_offs + 4:orig_offs + 12].view(u64)
            parts: list = [raw_itype, alen]
            idxs: list[int] = []
            pos = orig_offs + 12
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(int(alen[0])):
                (n,) = unpack(plain, pos)
                parts.append(plain[pos:pos + 8].view(u64))
                parts.append(plain[pos + 8:pos + 8 + n])
                idxs.append(len(parts) - 1)
                pos += 8 + n
            if pos > plain.shape[0]:
                raise ValueError("string array runs past the end of the file")
            types = [ARRAY, STRING] if idxs else [ARRAY]
            return pos - orig_offs, parts, idxs, types

    return _FastGGUFReader


def read_gguf(path: str | Path):
    """Open a GGUF file with ``gguf.GGUFReader``; a truncated or corrupt file raises ``ValueError``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (bad magic bytes {magic!r})"
                         + ("; the file is empty or truncated" if len(magic) < 4 else ""))
    try:
        # mode "c" (copy-on-write) maps the file writable in memory, so torch.from_numpy needs no copy.
        reader = _reader_class()(str(path), "c")
    except Exception as e:
        raise ValueError(f"{path}: cannot parse this GGUF file, it looks truncated or corrupt "
                         f"({type(e).__name__}: {e})") from e
    if getattr(reader, "byte_order", "I") != "I":
        raise ValueError(f"{path}: big-endian GGUF files are not supported")
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise ValueError(f"{path}: tensor {t.name} extends past the end of the file; "
                             "the file looks truncated")
    return reader


def _field_value(reader, key: str, default: Any = None) -> Any:
    """A metadata value as Python data (str, int, float, bool or a list of them)."""
    from gguf import GGUFValueType

    fld = reader.fields.get(key)
    if fld is None:
        return default

    def scalar(part, vtype):
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        v = part[0]
        if vtype == GGUFValueType.BOOL:
            return bool(v)
        if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            return float(v)
        return int(v)

    types = list(fld.types)
    if types and types[0] == GGUFValueType.ARRAY:
        if len(types) < 2:
            return []
        sub = types[1]
        if sub == GGUFValueType.STRING:
            return [bytes(fld.parts[i]).decode("utf-8", errors="replace") for i in fld.data]
        if sub == GGUFValueType.ARRAY:
            raise ValueError(f"GGUF metadata {key}: nested arrays are not supported")
        if not fld.data:
            return []
        values = np.concatenate([fld.parts[i] for i in fld.data]).tolist()  # Python ints/floats/bools
        return [bool(v) for v in values] if sub == GGUFValueType.BOOL else values
    return scalar(fld.parts[fld.data[0]], types[0])


_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GGUF_TOP = re.compile(r"^([a-z_0-9]+)\.(weight|bias)$")


def _hf_name(gguf_name: str) -> str | None:
    m = _GGUF_BLOCK.match(gguf_name)
    if m and m.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = _GGUF_TOP.match(gguf_name)
    if m and m.group(1) in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def _llama3_scaling_from_rope_freqs(freqs: torch.Tensor, head_dim: int, theta: float,
                                    orig_ctx: int | None, path: Path) -> dict | None:
    """llama.cpp stores Llama-3 rope scaling as per-frequency divisors (``rope_freqs.weight``); recover
    the ``rope_scaling`` dict that produces them, or refuse the file."""
    freqs = freqs.float().flatten()
    if freqs.numel() != head_dim // 2:
        raise ValueError(f"{path}: rope_freqs has {freqs.numel()} entries, expected {head_dim // 2}")
    if torch.allclose(freqs, torch.ones_like(freqs)):
        return None
    factor = float(freqs.max())
    base = rope_inv_freq(head_dim, theta, None)
    for ctx in ([orig_ctx] if orig_ctx else []) + [8192, 4096, 2048, 16384, 32768]:
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0)):
            scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                       "high_freq_factor": high, "original_max_position_embeddings": int(ctx)}
            implied = base / rope_inv_freq(head_dim, theta, scaling)
            if torch.allclose(implied, freqs, rtol=1e-3, atol=1e-5):
                return scaling
    raise ValueError(f"{path}: its rope_freqs tensor matches no Llama-3 rope scaling; unsupported rope scheme")


def gguf_config(reader, path: str | Path = "<gguf>") -> ModelConfig:
    """A :class:`ModelConfig` from a GGUF file's metadata (``{arch}.block_count`` and friends)."""
    path = Path(path)
    arch = _field_value(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHS)}")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        v = _field_value(reader, f"{arch}.{key}", default)
        if v is None and required:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return v

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    n_heads = int(get("attention.head_count", required=True))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        if len(set(n_kv)) != 1:
            raise ValueError(f"{path}: per-layer KV head counts {sorted(set(n_kv))} are not supported")
        n_kv = n_kv[0]
    hidden = int(get("embedding_length", required=True))
    head_dim = get("attention.key_length")
    value_len = get("attention.value_length")
    if head_dim is not None and value_len is not None and value_len != head_dim:
        raise ValueError(f"{path}: key length {head_dim} != value length {value_len} is not supported")
    if head_dim is None:
        head_dim = hidden // n_heads
    rope_dims = get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != int(head_dim):
        raise ValueError(f"{path}: partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens_field.data) if tokens_field is not None else get("vocab_size")
    embd_shape = [int(x) for x in tensors["token_embd.weight"].shape]  # ggml order: [hidden, vocab]
    if vocab is None:
        vocab = embd_shape[-1]
    theta = float(get("rope.freq_base", 10000.0))
    scaling = None
    kind = get("rope.scaling.type")
    if kind not in (None, "none"):
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", 1.0))}
        else:
            raise ValueError(f"{path}: rope scaling type {kind!r} is not supported (only linear and llama3)")
    if "rope_freqs.weight" in tensors:
        if scaling is not None:
            raise ValueError(f"{path}: both rope_freqs and {kind} rope scaling; unsupported")
        scaling = _llama3_scaling_from_rope_freqs(
            dequantize_gguf_tensor(tensors["rope_freqs.weight"]), int(head_dim), theta,
            get("rope.scaling.original_context_length"), path)
    eos = unique_ids(_field_value(reader, "tokenizer.ggml.eos_token_id"))
    try:
        return ModelConfig(
            arch=_GGUF_ARCHS[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_hidden_layers=int(get("block_count", required=True)),
            num_attention_heads=n_heads,
            num_key_value_heads=int(n_kv),
            head_dim=int(head_dim),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            qk_norm=arch == "qwen3",
            bos_token_id=_field_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=eos,
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


# gguf.quants.dequantize for every type: bit-identical to the hand-written numpy code it replaced and a little
# slower, but only once per model and dtype, when the float cache is written, so the hand-written code was not
# worth keeping (docs/performance.md, "Loading a model", has the times).
def dequantize_gguf_tensor(t) -> torch.Tensor:
    """A GGUF reader tensor as a float32 torch tensor in PyTorch (row-major ``[out, in]``) shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed([int(d) for d in t.shape]))
    data = np.asarray(t.data).view(np.ndarray)
    out = dequantize(data, GGMLQuantizationType(int(t.tensor_type)))
    if np.may_share_memory(out, data):  # F32 comes back as a view of the file mapping: own the memory
        out = out.copy()
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)


def _unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: per head it stores rows (half, i) as (i, half), i.e. the two rotary
    halves interleaved; HF (and our rotate_half rope) keep them as two contiguous halves."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows over {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_rows(w: torch.Tensor, cfg: ModelConfig, name: str) -> torch.Tensor:
    """A GGUF tensor's rows in Hugging Face order: llama-architecture q/k projections un-permuted
    (:func:`_unpermute_rope_rows`), anything else as it is. ``name`` is the Hugging Face key."""
    if cfg.arch == "llama":
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return _unpermute_rope_rows(w, cfg.num_attention_heads)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return _unpermute_rope_rows(w, cfg.num_key_value_heads)
    return w


def gguf_state_dict(reader, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                    path: str | Path = "<gguf>") -> dict[str, torch.Tensor]:
    """The file's tensors under Hugging Face names, dequantized and cast to ``dtype``.

    Tensors with no Hugging Face counterpart keep their GGUF name prefixed ``gguf:`` so strict loading
    reports them as unexpected.
    """
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into cfg.rope_scaling by gguf_config
        name = _hf_name(t.name)
        key = name if name is not None else f"gguf:{t.name}"
        if key in sd:
            raise ValueError(f"{path}: tensor {t.name} appears twice")
        try:
            w = dequantize_gguf_tensor(t)
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantize tensor {t.name} "
                             f"({getattr(t.tensor_type, 'name', t.tensor_type)}): {e}") from e
        if name is not None:
            w = hf_rows(w, cfg, name)
        sd[key] = w.to(dtype)
    return sd


def _gguf_tokenizer_metadata(reader) -> dict[str, Any]:
    return {k: _field_value(reader, k) for k in reader.fields if k.startswith("tokenizer.")}


def _gguf_tokenizer_fast(reader, arch: str):
    """Rebuild the tokenizer from metadata this process already parsed, with transformers' own GGUF
    tokenizer converter. ``AutoTokenizer.from_pretrained(folder, gguf_file=...)`` builds the same
    tokenizer but parses the file twice more, which takes seconds. Returns None when this transformers
    version lacks the converter."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:
        return None
    meta = _gguf_tokenizer_metadata(reader)
    tokenizer_dict: dict[str, Any] = {}
    tok_config: dict[str, Any] = {}
    for group, target in (("tokenizer", tokenizer_dict), ("tokenizer_config", tok_config)):
        for key, name in GGUF_TOKENIZER_MAPPING[group].items():
            if f"tokenizer.{key}" in meta:
                target[name] = meta[f"tokenizer.{key}"]
    if "tokens" not in tokenizer_dict:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens")
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tok_config.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece vocabularies
    tokens = tokenizer_dict["tokens"]
    for special, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                         ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        idx = meta.get(f"tokenizer.ggml.{key}")
        tok_config[special] = tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None
    backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **extra)


def _gguf_tokenizer(reader, path: Path, arch: str):
    try:
        tok = _gguf_tokenizer_fast(reader, arch)
        if tok is not None:
            return tok
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:
        raise ValueError(f"{path}: cannot build the tokenizer from the GGUF metadata "
                         f"({type(e).__name__}: {e})") from e


def gguf_tokenizer_bundle(reader, path: str | Path, cfg: ModelConfig) -> TokenizerBundle:
    """The tokenizer, chat template and end-of-reply ids (eos, end-of-turn, end-of-message) of a GGUF file."""
    path = Path(path)
    tok = _gguf_tokenizer(reader, path, _field_value(reader, "general.architecture"))
    template = _field_value(reader, "tokenizer.chat_template") or getattr(tok, "chat_template", None) or None
    if template:
        tok.chat_template = template
    eos = unique_ids(cfg.eos_token_id, _field_value(reader, "tokenizer.ggml.eot_token_id"),
                     _field_value(reader, "tokenizer.ggml.eom_token_id"))
    return TokenizerBundle(tok, template, eos)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, max_seq_len: int | None = None,
              with_tokenizer: bool = True) -> tuple[Transformer, TokenizerBundle | None]:
    """Load a llama/qwen2/qwen3 GGUF file: dequantize, map llama.cpp names, undo the q/k permutation."""
    path = Path(path)
    reader = read_gguf(path)
    cfg = gguf_config(reader, path)
    sd = gguf_state_dict(reader, cfg, dtype, path)
    model = model_from_state_dict(cfg, sd, str(path), max_seq_len, dtype)
    del sd
    if not with_tokenizer:
        return model, None
    return model, gguf_tokenizer_bundle(reader, path, cfg)
