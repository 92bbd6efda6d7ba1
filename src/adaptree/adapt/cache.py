"""The per-machine cache that every part of adapting writes (``<cache>/machines``, ``<cache>/traces``): where it
is, how its entries are keyed (the machine's fields and a digest), the lock that lets one process measure while
the others wait, and the one-line messages adapting prints.

Every measurement follows one pattern: read the cached entry; if there is none, take the entry's lock
(:func:`measure_lock`), read it again (another process may have measured it while this one waited) and only then
measure and write it (through a temporary file of this write's own and a rename).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path


def say(message: str) -> None:
    """One line on stderr (what adapting prints; progress bars go there too)."""
    print(f"adaptree: {message}", file=sys.stderr, flush=True)


def machines_dir() -> Path:
    """``<cache>/machines`` (``$ADAPTREE_CACHE``, default ``~/.cache/adaptree``)."""
    from adaptree.models.cache import cache_dir

    return cache_dir() / "machines"


def traces_dir() -> Path:
    """``<cache>/traces``: the greedy traces of each model and head (machine-independent)."""
    from adaptree.models.cache import cache_dir

    return cache_dir() / "traces"


def digest(obj) -> str:
    """16 hex digits of the sha256 of ``obj`` as sorted JSON: the name of a cache entry keyed by ``obj``."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def machine_fields() -> dict:
    """The machine part of a fingerprint: :func:`~adaptree.core.machine.machine_profile` without the OS build
    string (a kernel update does not change which kernels torch runs)."""
    from adaptree.core.machine import machine_profile

    prof = machine_profile()
    prof.pop("platform", None)
    return prof


def read_entry(path: Path) -> dict | None:
    """The JSON object cached at ``path``; None when there is none (or it is not a JSON object)."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def read_field(path: Path, key: str, convert):
    """``convert(entry[key])`` of the entry cached at ``path``; None when there is none or the field is missing or
    malformed (an entry written by an older adaptree is measured again)."""
    entry = read_entry(path)
    try:
        return convert(entry[key]) if entry is not None else None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def measure_lock(path: Path) -> Iterator[None]:
    """Hold the lock of the cache entry ``path`` (a file or a setup folder) for the ``with`` block: one process
    measures it, the others wait here and then find it. Leftover temporary files of dead processes beside it are
    removed."""
    from adaptree.core.files import file_lock, lock_for, remove_stale_tmp

    with file_lock(lock_for(path)):
        remove_stale_tmp(path.parent)
        yield
