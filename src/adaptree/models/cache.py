"""adaptree's cache folder: locks, atomic writes, remembered file hashes, and the per-dtype float form of
GGUF models.

``<cache>`` is ``$ADAPTREE_CACHE`` when set, else ``$XDG_CACHE_HOME/adaptree``, else
``~/.cache/adaptree``. It holds

- ``sha256/``: the sha256 of large files, remembered against their real path, size and mtime
  (:func:`file_sha256`), so an unchanged 1 GB file is not re-hashed on every load;
- ``files/``: model files assembled from part packages (:func:`adaptree.models.assets.assemble_parts`);
- ``models/<first 16 hex digits of the source sha256>/<dtype>/``: the cached float form of a GGUF file.

**Cached float form.** Dequantizing a GGUF file and rebuilding its tokenizer is the slow part of a load; the
result is stored once as a Hugging Face folder (``config.json``, ``generation_config.json``,
``model.safetensors``, the tokenizer files written by ``save_pretrained`` with the chat template, and
``adaptree.json``, our manifest) and later loads read that folder. The cache is

- keyed by the source file's sha256: a changed file is a different key, so it is converted afresh;
- per dtype, and exact: the cached tensors are bit for bit what ``load_gguf(path, dtype)`` produces
  (dequantized in float32, then cast), so a model loaded from the cache equals the one loaded from the
  GGUF file. Each dtype gets its own folder, converted on its first use: float32 is what the lossless
  checks need (dequantized Q4_1/Q8_0 values are float32 numbers; bfloat16 rounds them), bfloat16 (the
  CLI's default) is half the size and loads without a cast (casting a float32 folder while loading is
  slower than reading a bfloat16 one, and float32-only storage doubles the disk cost of the larger models);
- written atomically: a conversion writes a temporary sibling folder and renames it into place only when
  complete (under a file lock, so concurrent processes convert once); an interrupted conversion leaves no
  folder that could be mistaken for a complete one, and its leftovers are removed by the next conversion.
  A cached folder whose manifest does not match (format version, source sha256, file sizes) or that
  fails to load is converted again.

The cached tokenizer is read with ``PreTrainedTokenizerFast``, not ``AutoTokenizer`` (which reads
config.json and imports transformers' model classes). The sizes and load times, first use and cached, are in
docs/performance.md ("Loading a model").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from adaptree.core.files import file_lock, remove_stale_tmp, tmp_name
from adaptree.models.config import ModelConfig
from adaptree.models.gguf_file import (
    gguf_config,
    gguf_state_dict,
    gguf_tokenizer_bundle,
    read_gguf,
)
from adaptree.models.hf import check_state_dict, load_hf_folder
from adaptree.models.llama import Transformer
from adaptree.models.tokenizer import TokenizerBundle

__all__ = [
    "CACHE_ENV",
    "CACHE_FORMAT",
    "DTYPES",
    "cache_dir",
    "discard_float_folder",
    "dtype_name",
    "file_lock",
    "file_sha256",
    "float_folder",
    "load_float_folder",
    "remember_sha256",
    "remove_stale_tmp",
    "sha256_file",
    "tmp_name",
]

log = logging.getLogger(__name__)

CACHE_ENV = "ADAPTREE_CACHE"
CACHE_FORMAT = 1
"""Version of the cached folder layout and of the conversion; bump it to invalidate old caches."""
MANIFEST = "adaptree.json"


def cache_dir() -> Path:
    """``$ADAPTREE_CACHE``, else ``$XDG_CACHE_HOME/adaptree``, else ``~/.cache/adaptree`` (not created)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "adaptree"


# ------------------------------------------------------------------------------------------------
# Locks and atomic writes (:mod:`adaptree.core.files`: file_lock, tmp_name, remove_stale_tmp)
# ------------------------------------------------------------------------------------------------

def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# ------------------------------------------------------------------------------------------------
# File hashes
# ------------------------------------------------------------------------------------------------

def sha256_file(path: str | Path, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (never the whole file in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


def _stamp_path(path: Path) -> Path:
    return cache_dir() / "sha256" / (hashlib.sha256(str(path.resolve()).encode("utf-8", "surrogateescape"))
                                     .hexdigest()[:32] + ".json")


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, remembered in ``<cache>/sha256/`` against its real path, size and mtime: an
    unchanged file is hashed once, not at every load."""
    path = Path(path).resolve()
    st = path.stat()
    try:
        rec = json.loads(_stamp_path(path).read_text())
        if rec.get("path") == str(path) and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
            return str(rec["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    digest = sha256_file(path)
    remember_sha256(path, digest, st)
    return digest


def remember_sha256(path: Path, digest: str, st: os.stat_result | None = None) -> None:
    """Record ``digest`` as the sha256 of ``path`` as it is now (``st``: its stat, taken when hashed)."""
    path = path.resolve()
    st = st if st is not None else path.stat()
    stamp = _stamp_path(path)
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(tmp_name("stamp"))
        tmp.write_text(json.dumps({"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                   "sha256": digest}))
        os.replace(tmp, stamp)
    except OSError as e:  # a read-only cache only costs a re-hash next time
        log.debug("cannot remember the sha256 of %s: %s", path, e)


# ------------------------------------------------------------------------------------------------
# The cached float form of GGUF files
# ------------------------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes by name: those :func:`adaptree.load` and the head trainer take, and the float forms the cache holds."""

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The folder name of a cacheable dtype; ``ValueError`` for any other dtype."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(_DTYPE_NAMES.values())}")
    return _DTYPE_NAMES[dtype]


def _cache_root(sha: str) -> Path:
    return cache_dir() / "models" / sha[:16]


def _manifest_ok(folder: Path, sha: str) -> bool:
    """A complete cached folder for source ``sha`` in the current format (files present, sizes right)."""
    try:
        man = json.loads((folder / MANIFEST).read_text())
        if man.get("format") != CACHE_FORMAT or man.get("source_sha256") != sha:
            return False
        return all((folder / name).stat().st_size == size for name, size in man["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _cached_folder(sha: str, dtype: torch.dtype) -> Path | None:
    """The existing, valid cache folder of source ``sha`` in ``dtype``, or None."""
    folder = _cache_root(sha) / dtype_name(dtype)
    return folder if _manifest_ok(folder, sha) else None


def _write_float_folder(src: Path, sha: str, dtype: torch.dtype, out: Path) -> None:
    """Dequantize ``src`` and write the complete cache folder contents into ``out`` (an empty folder)."""
    from safetensors.torch import save_file

    reader = read_gguf(src)
    cfg = gguf_config(reader, src)
    hf_cfg = cfg.to_hf_dict()
    if ModelConfig.from_hf_dict(hf_cfg) != cfg:
        raise ValueError(f"{src}: internal error, its config does not survive the config.json round trip")
    sd = gguf_state_dict(reader, cfg, dtype, src)
    check_state_dict(cfg, sd, str(src))  # the strict loader's check, before anything is written
    bundle = gguf_tokenizer_bundle(reader, src, cfg)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt", "source_sha256": sha})
    del sd
    (out / "config.json").write_text(json.dumps({**hf_cfg, "torch_dtype": dtype_name(dtype)}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": bundle.eos_token_ids}, indent=2))
    bundle.tokenizer.save_pretrained(str(out))
    for p in out.iterdir():
        if p.is_file():
            _fsync(p)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {"format": CACHE_FORMAT, "source_sha256": sha, "source": str(src), "dtype": dtype_name(dtype),
                "eos_token_ids": bundle.eos_token_ids, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _fsync(out / MANIFEST)


def _convert(src: Path, sha: str, dtype: torch.dtype) -> Path:
    """Convert ``src`` into ``<cache>/models/<sha16>/<dtype>/`` unless a valid folder appeared meanwhile."""
    root = _cache_root(sha)
    final = root / dtype_name(dtype)
    with file_lock(root / ".lock"):
        found = _cached_folder(sha, dtype)
        if found is not None:
            return found  # another process converted it while we waited for the lock
        remove_stale_tmp(root)
        tmp = root / tmp_name(dtype_name(dtype))
        t0 = time.perf_counter()
        try:
            tmp.mkdir(parents=True)
            _write_float_folder(src, sha, dtype, tmp)
            if final.exists():  # an outdated or broken folder: move it aside, then swap
                _discard_locked(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("converted %s to %s in %.1f s", src, final, time.perf_counter() - t0)
        return final


def _discard_locked(folder: Path) -> None:
    old = folder.parent / tmp_name("old")
    os.rename(folder, old)
    shutil.rmtree(old, ignore_errors=True)


def discard_float_folder(folder: Path) -> None:
    """Remove a cached folder that fails to load (under the lock, so no reader sees half of it)."""
    with file_lock(folder.parent / ".lock"):
        if folder.exists():
            _discard_locked(folder)


def float_folder(sha: str, dtype: torch.dtype, source: Callable[[], Path]) -> Path:
    """The cached float folder of the GGUF file whose sha256 is ``sha``, in ``dtype``; on a miss it is
    converted from ``source()`` (called only then: a cached model needs no source file)."""
    found = _cached_folder(sha, dtype)
    return found if found is not None else _convert(source(), sha, dtype)


def load_float_folder(folder: Path, dtype: torch.dtype,
                      max_seq_len: int | None) -> tuple[Transformer, TokenizerBundle]:
    """A cached folder: weights through the strict HF-folder loader; the tokenizer straight from its files
    (``AutoTokenizer`` would read config.json and import transformers' model classes, which is slower)."""
    model, _ = load_hf_folder(folder, dtype=dtype, max_seq_len=max_seq_len, with_tokenizer=False)
    try:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
        eos = [int(x) for x in json.loads((folder / MANIFEST).read_text())["eos_token_ids"]]
    except Exception as e:  # any failure: reported as a broken cache
        raise ValueError(f"{folder}: cannot load the cached tokenizer ({type(e).__name__}: {e})") from e
    return model, TokenizerBundle(tok, getattr(tok, "chat_template", None) or None, eos)
