"""Target models and draft heads: the networks, and loading them from files, names and the cache.

- :mod:`~adaptree.models.config`: :class:`ModelConfig`, the architecture fields of a target model.
- :mod:`~adaptree.models.llama`: the target Transformer (llama, qwen2, qwen3) with tree attention.
- :mod:`~adaptree.models.eagle3`: the EAGLE-3 draft head.
- :mod:`~adaptree.models.sentence`: a small sentence encoder (state features of some policies).
- :mod:`~adaptree.models.tokenizer`: :class:`TokenizerBundle` (tokenizer, chat template, end ids).
- :mod:`~adaptree.models.hf`: Hugging Face folders, safetensors reading, strict state-dict loading.
- :mod:`~adaptree.models.gguf_file`: GGUF reading, config from metadata, dequantization, tokenizer.
- :mod:`~adaptree.models.cache`: ``$ADAPTREE_CACHE``: locks, atomic writes, remembered hashes, and the
  per-dtype float form of GGUF models.
- :mod:`~adaptree.models.assets`: registered short names, packaged files (size/sha256 checked, parts
  assembled), model checksums, shipped heads.
- :mod:`~adaptree.models.loader`: :func:`load_model` (name or path, cached) and :func:`load_target`.
"""

from adaptree.models.assets import (
    DEFAULT_MODEL_NAME,
    HEADS_DIR,
    MODELS,
    default_model_path,
    model_names,
    model_sha256,
    resolve_model,
    shipped_head,
    sibling_draft_model,
)
from adaptree.models.cache import cache_dir, file_sha256, sha256_file
from adaptree.models.config import ModelConfig
from adaptree.models.gguf_file import load_gguf
from adaptree.models.hf import load_hf_folder
from adaptree.models.loader import float_cache_folder, load_model, load_target
from adaptree.models.tokenizer import TokenizerBundle

__all__ = [
    "DEFAULT_MODEL_NAME", "HEADS_DIR", "MODELS", "ModelConfig", "TokenizerBundle", "cache_dir",
    "default_model_path", "file_sha256", "float_cache_folder", "load_gguf", "load_hf_folder", "load_model",
    "load_target", "model_names", "model_sha256", "resolve_model", "sha256_file", "shipped_head", "sibling_draft_model",
]
