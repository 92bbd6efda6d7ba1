"""A fingerprinted store: a folder of per-key safetensors records pinned to the model, head and settings
they were recorded with. Greedy traces (:class:`~adaptree.offline.traces.TraceStore`) and RADAR's
dataset (:class:`~adaptree.methods.radar.dataset.RadarStore`) are such stores.

On disk:

- ``manifest.json``: ``version``, ``fingerprints`` (sha256 digests, e.g. of the target and the draft
  head: :func:`model_fingerprint`, :func:`head_fingerprint`), ``settings`` (the recording settings as
  JSON) and ``settings_sha256``. Opening a folder with other fingerprints or settings raises a
  ``ValueError`` naming the field that differs; opening it without them reads what is pinned.
- one ``<safe name of key>.safetensors`` per key (numpy arrays, no pickles) whose metadata entry
  ``format.meta_key`` holds a JSON header with at least ``version``, ``key`` and ``fingerprints``.
  Files are written to a temporary name, synced and renamed, so an interrupted recording leaves whole
  records only; recording skips the keys already stored (resume).

What a record holds is up to its format (:class:`StoreFormat`); the folder machinery is shared.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from adaptree.core.files import atomic_path
from adaptree.offline.runs import write_json

# --------------------------------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------------------------------


def _hash_state(h, module: torch.nn.Module, skip: Iterable[str] = ()) -> None:
    skip = set(skip)
    for name, t in sorted(module.state_dict().items()):
        if name in skip:
            continue
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def model_fingerprint(target: torch.nn.Module) -> str:
    """sha256 of a target's configuration and weights (dtype included: bf16 and fp32 records differ)."""
    h = hashlib.sha256(b"adaptree-target|")
    h.update(repr(target.config).encode())
    if getattr(target, "backend", "torch") != "torch":  # weights outside PyTorch (llama.cpp's): the file and backend
        h.update(f"|{target.backend}|{target.weights_id}".encode())
    _hash_state(h, target)
    return h.hexdigest()


def head_fingerprint(head: torch.nn.Module) -> str:
    """sha256 of a draft head's configuration and weights (own embeddings included, borrowed ones not:
    those are the target's, covered by :func:`model_fingerprint`)."""
    h = hashlib.sha256(b"adaptree-head|")
    h.update(repr(head.config).encode())
    _hash_state(h, head)
    return h.hexdigest()


class StoreSettings:
    """Mixin for the frozen settings dataclass pinned in a store: a JSON round trip (tuples are JSON
    lists; the free-form ``extra`` pairs a JSON object) and a sha256 :meth:`fingerprint` of it."""

    added: ClassVar[Mapping[str, Any]] = {}
    """Fields added after the format's first settings, with their defaults: left out of :meth:`to_dict` (so of the
    fingerprint) at their default, so that folders recorded before them keep their fingerprints."""

    def to_dict(self) -> dict:
        d = asdict(self)  # type: ignore[call-overload]
        return {k: dict(v) if k == "extra" else list(v) if isinstance(v, tuple) else v for k, v in d.items()
                if k not in self.added or v != self.added[k]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        return cls(**{k: tuple(dict(v or {}).items()) if k == "extra" else tuple(v) if isinstance(v, list) else v
                      for k, v in d.items()})

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreFormat:
    """What distinguishes one kind of store: its header key, version, settings and wording."""

    meta_key: str
    """safetensors metadata entry holding a record's JSON header."""
    version: int
    """Format version, in the manifest and every header; another version is refused."""
    settings_type: type
    """The settings class (a :class:`StoreSettings` dataclass)."""
    record: str
    """What one file is called in messages (``"trace"``)."""
    folder: str
    """What the folder is called in messages (``"trace folder"``)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Words for fingerprint fields in messages (``{"head": "draft head"}``); default: the field name."""
    remedy: str = "use another folder"
    """The advice after a fingerprint mismatch; ``{what}`` stands for the label of the field that differs."""


def safe_name(key: str) -> str:
    """A file name for ``key``: its safe characters (at most 80) and 8 hex digits of its sha1."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._") or "prompt"
    return name[:80] + "-" + hashlib.sha1(key.encode()).hexdigest()[:8]


def write_record(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], meta_key: str, header: dict) -> None:
    """Write ``arrays`` as safetensors with ``header`` as JSON under ``meta_key``, atomically (a
    temporary file, synced, renamed into place)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp),
                  metadata={meta_key: json.dumps(header, sort_keys=True)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())


def read_header(path: str | os.PathLike, fmt: StoreFormat) -> dict:
    """The JSON header of a record; ``ValueError`` for a file of another kind or version."""
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        meta = f.metadata() or {}
    if fmt.meta_key not in meta:
        raise ValueError(f"{path} is not an adaptree {fmt.record} (no {fmt.meta_key!r} header)")
    header = json.loads(meta[fmt.meta_key])
    if header.get("version") != fmt.version:
        raise ValueError(f"{path}: {fmt.record} format version {header.get('version')!r}, this adaptree reads "
                         f"{fmt.version}")
    return header


def read_record(path: str | os.PathLike, fmt: StoreFormat, expect: Mapping[str, str | None] | None = None
                ) -> tuple[dict, dict[str, np.ndarray]]:
    """``(header, arrays)`` of a record; ``expect`` (fingerprint digests) refuses one recorded with anything else."""
    from safetensors.numpy import load_file

    header = read_header(path, fmt)
    check_fingerprints(header.get("fingerprints", {}), expect, f"{fmt.record} {path}", fmt)
    return header, load_file(str(path))


def check_fingerprints(found: Mapping[str, str], expect: Mapping[str, str | None] | None, where: str,
                       fmt: StoreFormat) -> None:
    """Raise a ``ValueError`` naming the field that differs when ``found`` does not match ``expect``
    (fields of ``expect`` whose value is not None)."""
    for k, v in (expect or {}).items():
        if v is not None and found.get(k) != v:
            what = fmt.labels.get(k, k)
            raise ValueError(f"{where} was recorded with a different {what} (sha256 {str(found.get(k))[:12]}..., "
                             f"expected {v[:12]}...); {fmt.remedy.format(what=what)}")


# --------------------------------------------------------------------------------------------------
# the folder
# --------------------------------------------------------------------------------------------------


class FingerprintedStore:
    """A folder of records of :attr:`format` (see the module docstring). Subclasses set ``format`` and
    add what their records mean (reading them back, recording them).

    :param fingerprints: digests the folder must have been recorded with (a new folder pins them).
    :param settings: the settings it must have been recorded with (a new folder pins them).
    Without either, an existing folder is opened as it is.
    """

    format: ClassVar[StoreFormat]

    def __init__(self, folder: str | os.PathLike, fingerprints: Mapping[str, str] | None = None,
                 settings: StoreSettings | None = None) -> None:
        fmt = self.format
        self.folder = Path(folder)
        self.manifest_path = self.folder / "manifest.json"
        if not self.manifest_path.exists():
            if fingerprints is None or settings is None:
                raise FileNotFoundError(f"no {fmt.record} manifest in {self.folder}")
            self.folder.mkdir(parents=True, exist_ok=True)
            manifest = {"version": fmt.version, "fingerprints": dict(fingerprints), "settings": settings.to_dict(),
                        "settings_sha256": settings.fingerprint()}
            write_json(manifest, self.manifest_path, sort_keys=True)
        else:
            manifest = json.loads(self.manifest_path.read_text())
            if manifest.get("version") != fmt.version:
                raise ValueError(f"{self.manifest_path}: {fmt.record} format version {manifest.get('version')!r}, "
                                 f"this adaptree reads {fmt.version}")
            if settings is not None:
                old = fmt.settings_type.from_dict(manifest["settings"]).to_dict()
                diff = {k: (old.get(k), v) for k, v in settings.to_dict().items() if old.get(k) != v}
                if diff:
                    raise ValueError(f"{fmt.folder} {self.folder} was recorded with other settings "
                                     f"(recorded vs requested: {diff}); use another folder")
            check_fingerprints(manifest["fingerprints"], fingerprints, f"{fmt.folder} {self.folder}", fmt)
        self.fingerprints: dict[str, str] = manifest["fingerprints"]
        self.settings = fmt.settings_type.from_dict(manifest["settings"])

    def path(self, key: str) -> Path:
        return self.folder / (safe_name(key) + ".safetensors")

    def files(self) -> list[Path]:
        """The record files, sorted by name."""
        return sorted(self.folder.glob("*.safetensors"))

    def has(self, key: str, same: Mapping[str, Iterable[int]] | None = None) -> bool:
        """Whether ``key`` is stored (a torn or foreign file is not; one recorded with other fingerprints
        raises). ``same``: arrays the record must hold as given (e.g. its prompt ids), else it is not."""
        p = self.path(key)
        if not p.exists():
            return False
        from safetensors import SafetensorError

        try:
            header = read_header(p, self.format)
        except (SafetensorError, OSError, ValueError):  # a torn or foreign file: record again
            return False
        if header.get("key") != key:
            return False
        check_fingerprints(header.get("fingerprints", {}), self.fingerprints, f"{self.format.record} {p}",
                           self.format)
        if same:
            from safetensors import safe_open

            with safe_open(str(p), "np") as f:
                if any(f.get_tensor(name).tolist() != [int(t) for t in want] for name, want in same.items()):
                    return False
        return True

    def save(self, key: str, arrays: Mapping[str, np.ndarray], header: Mapping[str, Any],
             fingerprints: Mapping[str, str] | None = None) -> Path:
        """Write the record of ``key`` (``header`` gains ``version``, ``key`` and ``fingerprints``: the
        record's own, default the store's; they must be the store's)."""
        fps = dict(self.fingerprints if fingerprints is None else fingerprints)
        check_fingerprints(fps, self.fingerprints, f"{self.format.record} {key!r}", self.format)
        p = self.path(key)
        write_record(p, arrays, self.format.meta_key,
                     {**header, "version": self.format.version, "key": key, "fingerprints": fps})
        return p

    def read(self, path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
        """``(header, arrays)`` of one record of this store (checked against its fingerprints)."""
        return read_record(path, self.format, self.fingerprints)


__all__ = ["FingerprintedStore", "StoreFormat", "StoreSettings", "check_fingerprints", "head_fingerprint",
           "model_fingerprint", "read_header", "read_record", "safe_name", "write_record"]
