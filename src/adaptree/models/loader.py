"""Loading a target model and its tokenizer: :func:`load_model` (a short name or a path, through the
float cache) and :func:`load_target` (a path, read directly).

Both end in the same place: a :class:`~adaptree.models.llama.Transformer` whose state dict was loaded
strictly (:mod:`adaptree.models.hf`) and a :class:`~adaptree.models.tokenizer.TokenizerBundle`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from adaptree.models.assets import gguf_file, model_source, resolve_model
from adaptree.models.cache import (
    discard_float_folder,
    dtype_name,
    float_folder,
    load_float_folder,
)
from adaptree.models.gguf_file import is_gguf_file, load_gguf
from adaptree.models.hf import load_hf_folder
from adaptree.models.llama import ContextLimitError, Transformer
from adaptree.models.tokenizer import TokenizerBundle

__all__ = ["WEIGHT_KINDS", "float_cache_folder", "load_model", "load_target"]

WEIGHT_KINDS = ("float", "int4", "ggml", "ggml-q4_0", "ggml-q8_0")
"""How a target's weights run: dequantized to a float dtype, a GGUF file's 4-bit blocks on PyTorch's int4 kernel, or
the GGUF file on llama.cpp's kernels (``ggml``: its own types; ``ggml-q4_0`` / ``ggml-q8_0``: requantized by
llama.cpp first, :func:`adaptree.models.ggml.requantized`)."""

log = logging.getLogger(__name__)


def load_target(path: str | Path, dtype: torch.dtype = torch.float32,
                max_seq_len: int | None = None) -> tuple[Transformer, TokenizerBundle]:
    """Load a target model and its tokenizer from a Hugging Face folder or a ``.gguf`` file."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        model, bundle = load_hf_folder(path, dtype=dtype, max_seq_len=max_seq_len)
    elif is_gguf_file(path):
        model, bundle = load_gguf(path, dtype=dtype, max_seq_len=max_seq_len)
    elif path.name == "config.json":
        model, bundle = load_hf_folder(path.parent, dtype=dtype, max_seq_len=max_seq_len)
    else:
        raise ValueError(f"{path}: not a model folder (with config.json) and not a GGUF file")
    assert bundle is not None
    return model, bundle


def float_cache_folder(name_or_path: str | Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """The cached float folder (a Hugging Face checkpoint folder) of a GGUF model, converted on first use
    (see :mod:`adaptree.models.cache`).

    For a registered model the pinned sha256 is the key, so a cached model loads without touching (or
    even having) its package; the package file is located and verified only to convert it.
    """
    dtype_name(dtype)
    path, sha = model_source(name_or_path)
    if sha is None:
        raise ValueError(f"{path} is not a GGUF file; only GGUF models have a cached float form")
    return float_folder(sha, dtype, lambda: path if path is not None else resolve_model(name_or_path))


def load_model(name_or_path: str | Path | None = None, dtype: torch.dtype = torch.float32,
               max_seq_len: int | None = None, cache: bool = True,
               weights: str = "float") -> tuple[Transformer, TokenizerBundle]:
    """Load a target model and its :class:`~adaptree.models.tokenizer.TokenizerBundle` by short name or path.

    GGUF models (every registered one, or a local ``.gguf``) go through the cached float form
    (:func:`float_cache_folder`) unless ``cache=False``; Hugging Face folders load directly. ``weights="int4"``
    then runs the GGUF file's 4-bit blocks packed (:func:`adaptree.models.quant.pack_model`; GGUF models only).
    Returns ``(Transformer, TokenizerBundle)``.
    """
    if weights not in WEIGHT_KINDS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_KINDS)}, got {weights!r}")
    if weights.startswith("ggml"):  # the file on llama.cpp's kernels (GgmlUnavailable: the caller falls back)
        from adaptree.models.ggml import load_ggml, requantized

        path = gguf_file(name_or_path, f"weights={weights!r}")
        quant = weights.partition("-")[2]
        return load_ggml(requantized(path, quant) if quant else path, dtype, max_seq_len)
    if weights == "int4":
        from adaptree.models.gguf_file import read_gguf
        from adaptree.models.quant import pack_model

        path = gguf_file(name_or_path, "weights='int4'")
        model, bundle = load_model(name_or_path, dtype, max_seq_len, cache)
        pack_model(model, read_gguf(path), dtype)
        return model, bundle
    dtype_name(dtype)
    path, _ = model_source(name_or_path, hash_it=False)
    if (path is not None and not is_gguf_file(path)) or not cache:
        return load_target(path if path is not None else resolve_model(name_or_path), dtype=dtype,
                           max_seq_len=max_seq_len)
    folder = float_cache_folder(name_or_path, dtype)
    try:
        return load_float_folder(folder, dtype, max_seq_len)
    except ContextLimitError:  # the caller's value, not a broken cache: converting again would not help
        raise
    except (ValueError, OSError) as e:
        log.warning("the cached model %s does not load (%s); converting it again", folder, e)
    discard_float_folder(folder)
    return load_float_folder(float_cache_folder(name_or_path, dtype), dtype, max_seq_len)
