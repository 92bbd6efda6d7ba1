"""Run folders of the policy trainers: atomic JSON writes and the settings a folder is pinned to."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(obj, path: str | os.PathLike) -> None:
    """Write ``obj`` as indented JSON through a temporary file and a rename (never a half-written file)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def pin_settings(out: str | os.PathLike, settings: dict, what: str) -> None:
    """Pin the run folder ``out`` to ``settings`` (``settings.json``): the first run writes them, a rerun
    must bring the same ones; otherwise a ValueError names the keys that differ."""
    sfile = Path(out) / "settings.json"
    if not sfile.exists():
        write_json(settings, sfile)
        return
    old = json.loads(sfile.read_text())
    if old != settings:
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        raise ValueError(f"{str(out)!r} holds {what} with other settings ({', '.join(diff)}); "
                         f"use another --out or delete it")
