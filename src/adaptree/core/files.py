"""Files that several processes may write at once: an exclusive lock, unique temporary names and atomic
replacement.

Every cache write goes through a temporary sibling with a name no other process uses (:func:`tmp_name`: host,
pid and a random part) and a rename onto its final name, so a reader sees the old file or the new one, never half
of one, and two writers never share a temporary file. Measurements that must run once (a model conversion, the
machine setup) hold a :func:`file_lock` while they check for a result, make it and write it: the other
processes wait, then find the result and reuse it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_locks: dict[str, threading.RLock] = {}
"""Per lock file (real path): the in-process lock in front of its ``flock``."""
_depth: dict[str, int] = {}
"""Per lock file this process holds: how deep the holding thread is in it (``flock`` on a second open file of
the same path would wait for the process itself)."""
_registry = threading.Lock()


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive advisory lock (``flock``) on ``path``, held for the ``with`` block: other processes wait at
    the same lock. Re-entrant in the thread that holds it; other threads of the process wait like other
    processes. A no-op where ``fcntl`` does not exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = str(path.resolve())
    with _registry:
        inner = _locks.setdefault(key, threading.RLock())
    with inner:
        if _depth.get(key):
            _depth[key] += 1
            try:
                yield
            finally:
                _depth[key] -= 1
            return
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            _depth[key] = 1
            try:
                yield
            finally:
                del _depth[key]
                fcntl.flock(f, fcntl.LOCK_UN)


def lock_for(path: str | os.PathLike) -> Path:
    """The lock file that guards ``path`` (a file or a folder): ``.<name>.lock`` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def tmp_name(kind: str) -> str:
    """A name for a temporary sibling to be renamed into place, unique to this write (host, pid, random part);
    :func:`remove_stale_tmp` recognises it."""
    kind = kind.replace("-", "_")  # the host is read back from between the dashes
    return f".tmp-{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary sibling of ``path`` (:func:`tmp_name`) for the ``with`` block to write; renamed onto ``path``
    when the block ends normally, removed when it raises."""
    path = Path(path)
    tmp = path.with_name(tmp_name(path.name))
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def remove_stale_tmp(folder: Path, max_age_s: float = 6 * 3600) -> None:
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
