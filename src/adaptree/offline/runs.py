"""Run folders of the trainers (LTD, Re-SpS, RADAR, the draft head), written so that an interrupted run can
resume: atomic JSON and safetensors writes, the settings a folder is pinned to, checkpoints (a module, its
optimizer, the RNG states and a JSON state), the train / validation split by key, CSV logs and tables.
No pickles: everything is JSON or safetensors."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import shutil
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from adaptree.core.files import atomic_path

T = TypeVar("T")

STATE_FILE, OPTIMIZER_FILE, RNG_FILE = "state.json", "optimizer.safetensors", "rng.safetensors"
"""The files of a checkpoint folder besides its weights (:func:`save_checkpoint`)."""


# ---------------------------------------------------------------------------------------------- JSON


@contextmanager
def interrupt_on_terminate() -> Iterator[None]:
    """Inside the block, SIGTERM (``kill PID``) raises KeyboardInterrupt as Ctrl-C does, and so does SIGINT where
    the process was started with it ignored (``nohup cmd &`` from a script): a long job's Ctrl-C handler (save a
    checkpoint) runs for those too. Main thread only (elsewhere the block changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, raise_interrupt)
    old_int = signal.getsignal(signal.SIGINT)
    if old_int is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old_term)
        if old_int is signal.SIG_IGN:
            signal.signal(signal.SIGINT, old_int)


def write_json(obj, path: str | os.PathLike, sort_keys: bool = False) -> None:
    """Write ``obj`` as indented JSON through a temporary file and a rename (never a half-written file)."""
    with atomic_path(path) as tmp:  # a name of this write's own: concurrent writers never share it
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def read_json_as(path: str | os.PathLike, build: Callable[[Any], T], what: str) -> T:
    """``build(the JSON value in path)``; a file that is not JSON, or that ``build`` refuses with a ValueError, is a
    ValueError naming ``path`` (``what``: what the file should be, for the message)."""
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON {what} ({e})") from None
    try:
        return build(d)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def settings_of(cfg, skip: Iterable[str] = (), only: Iterable[str] | None = None, extra: Mapping | None = None) -> dict:
    """The fields of the dataclass ``cfg`` a run folder is pinned to (all but ``skip``, or ``only`` those), plus
    ``extra``, as JSON gives them back (tuples become lists): comparable with what a run folder holds."""
    d, skip = asdict(cfg), set(skip)
    keep = [k for k in d if k not in skip] if only is None else list(only)
    return json.loads(json.dumps({**{k: d[k] for k in keep}, **(extra or {})}))


def differing(old: Mapping, new: Mapping) -> dict[str, tuple[Any, Any]]:
    """``{key: (old value, new value)}`` for the keys of either mapping whose values differ (sorted)."""
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def pin_settings(out: str | os.PathLike, settings: dict, what: str, name: str = "settings.json") -> None:
    """Pin the run folder ``out`` to ``settings`` (the file ``name``): the first run writes them, a rerun
    must bring the same ones; otherwise a ValueError names the keys that differ."""
    sfile = Path(out) / name
    if not sfile.exists():
        write_json(settings, sfile)
        return
    diff = differing(json.loads(sfile.read_text()), settings)
    if diff:
        raise ValueError(f"{str(out)!r} holds {what} with other settings ({', '.join(diff)}); "
                         f"use another --out or delete it")


def dataclass_from_dict(cls: type[T], d: Mapping, what: str | None = None, allowed: Iterable[str] = ()) -> T:
    """``cls(**d)`` for the dataclass ``cls``. Keys that are not fields are dropped, or, with ``what`` (e.g.
    ``"policy"``), refused (but for ``allowed`` ones) by a ValueError that names them."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - known - set(allowed))
    if what is not None and unknown:
        raise ValueError(f"unknown {what} config fields {unknown}; known: {sorted(known)}")
    return cls(**{k: v for k, v in d.items() if k in known})


def check_out_dir(out: str | Path, for_file: str | None = None) -> Path:
    """Create ``out`` and prove it writable before any model is loaded (``for_file``: the ``--out`` file that goes
    in it, named in the error instead)."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        if for_file is not None:
            raise ValueError(f"--out {for_file!r}: cannot write in {str(out)!r}: {e.strerror or e}") from None
        raise ValueError(f"--out {str(out)!r} is not a writable folder: {e.strerror or e}") from None
    return path


# ---------------------------------------------------------------------------------------------- tensors


def save_tensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                 metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (detached, on the CPU, contiguous) as safetensors with ``metadata``, through a
    temporary file and a rename (never a half-written file)."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def tensor_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The string metadata of a safetensors file (empty if none)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return dict(f.metadata() or {})


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as ``{param}.{field}`` tensors: ``param`` is the parameter's index
    in ``optimizer.state_dict()`` or, with ``names``, ``names[index]``; plain numbers become 0-d tensors.
    The hyper-parameters (``param_groups``) are not saved: the trainer rebuilds them from its settings."""
    out = {}
    for i, st in optimizer.state_dict()["state"].items():
        for field, v in st.items():
            out[f"{i if names is None else names[i]}.{field}"] = (v if isinstance(v, torch.Tensor)
                                                                 else torch.tensor(float(v)))
    return out


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor],
                           names: Sequence[str] | None = None) -> None:
    """Restore what :func:`optimizer_tensors` gave (with the same ``names``) into ``optimizer``."""
    index = None if names is None else {n: i for i, n in enumerate(names)}
    state: dict[int, dict] = {}
    for key, t in tensors.items():
        param, field = key.rsplit(".", 1)
        if field == "step" and t.numel() == 1:
            t = t.reshape(())  # Adam's step count is 0-d (RADAR's first checkpoints stored it as [1])
        state.setdefault(int(param) if index is None else index[param], {})[field] = t.clone()
    sd = optimizer.state_dict()
    sd["state"] = state
    optimizer.load_state_dict(sd)


def rng_tensors(generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """torch's, Python's and numpy's global RNG states (and ``generator``'s, as ``rng``) as tensors."""
    version, py_state, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"torch_rng": torch.get_rng_state(),
           "python_rng": torch.tensor([version, *py_state], dtype=torch.int64),
           "python_gauss": torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64),
           "numpy_rng": torch.tensor([*keys.tolist(), pos, has_gauss], dtype=torch.int64),
           "numpy_gauss": torch.tensor([cached], dtype=torch.float64)}
    if generator is not None:
        out["rng"] = generator.get_state()
    return out


def restore_rng(tensors: Mapping[str, torch.Tensor], generator: torch.Generator | None = None) -> None:
    """Set the RNG states :func:`rng_tensors` saved (those that are in ``tensors``)."""
    if "torch_rng" in tensors:
        torch.set_rng_state(tensors["torch_rng"])
    if generator is not None and "rng" in tensors:
        generator.set_state(tensors["rng"])
    if "python_rng" in tensors:
        s, g = tensors["python_rng"].tolist(), float(tensors["python_gauss"][0])
        random.setstate((s[0], tuple(s[1:]), None if math.isnan(g) else g))
    if "numpy_rng" in tensors:
        s = tensors["numpy_rng"].tolist()
        np.random.set_state(("MT19937", np.array(s[:-2], dtype=np.uint32), s[-2], s[-1],
                             float(tensors["numpy_gauss"][0])))


# ---------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(folder: str | os.PathLike, module: torch.nn.Module, state: dict,
                    optimizer: torch.optim.Optimizer | None = None, *, weights: str = "weights.safetensors",
                    rng: bool = False, generator: torch.Generator | None = None,
                    dtype: torch.dtype | None = None) -> None:
    """A resumable checkpoint folder: ``weights`` (the module's state dict), ``optimizer.safetensors``
    (:func:`optimizer_tensors`), with ``rng`` ``rng.safetensors`` (:func:`rng_tensors`), and ``state.json``.
    ``dtype``: the floating-point tensors of the weights and the optimizer are stored in it (``bfloat16``
    halves a float32 checkpoint; :func:`load_checkpoint` casts them back to the parameters' dtype).
    Atomic: built in ``folder.tmp``, then swapped in; the previous checkpoint stays (as ``folder.old``) until
    the new one is in place (:func:`find_checkpoint` finds it)."""
    folder = Path(folder)
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    cast = lambda ts: {k: v.to(dtype) if dtype is not None and v.is_floating_point() and v.dim() else v  # noqa: E731
                       for k, v in ts.items()}
    save_tensors(cast(module.state_dict()), tmp / weights)
    if optimizer is not None:
        save_tensors(cast(optimizer_tensors(optimizer)), tmp / OPTIMIZER_FILE)
    if rng:
        save_tensors(rng_tensors(generator), tmp / RNG_FILE)
    write_json(state, tmp / STATE_FILE)
    if folder.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(folder, old)
    os.rename(tmp, folder)
    if old.exists():
        shutil.rmtree(old)


def find_checkpoint(folder: str | os.PathLike, weights: str = "weights.safetensors") -> Path | None:
    """The last complete checkpoint: ``folder``, or ``folder.old`` if a swap was interrupted; None if none."""
    folder = Path(folder)
    for p in (folder, folder.with_name(folder.name + ".old")):
        if (p / STATE_FILE).is_file() and (p / weights).is_file():
            return p
    return None


def checkpoint_state(folder: str | os.PathLike) -> dict:
    """The JSON state of a checkpoint folder (read it before loading, to check the settings)."""
    return json.loads((Path(folder) / STATE_FILE).read_text())


def load_checkpoint(folder: str | os.PathLike, module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, *, weights: str = "weights.safetensors",
                    generator: torch.Generator | None = None) -> dict:
    """Restore what :func:`save_checkpoint` wrote into ``module`` (strictly), ``optimizer`` and, if saved, the
    RNG states (and ``generator``'s); returns the JSON state."""
    from safetensors.torch import load_file

    folder = Path(folder)
    module.load_state_dict(load_file(str(folder / weights)), strict=True)
    if optimizer is not None:
        load_optimizer_tensors(optimizer, load_file(str(folder / OPTIMIZER_FILE)))
    if (folder / RNG_FILE).is_file():
        restore_rng(load_file(str(folder / RNG_FILE)), generator)
    return checkpoint_state(folder)


# ---------------------------------------------------------------------------------------------- splits


def split_by_key(items: Iterable[T], val_fraction: float, seed: int = 0, key: Callable[[T], str] = str,
                 both: str | None = None) -> tuple[list[T], list[T]]:
    """Train / validation ``items`` by a hash of ``key(item)`` (:func:`adaptree.data.splits.split_of`):
    deterministic, and an item's side does not depend on the order or on the other items. ``val_fraction``
    0 puts everything in train. With ``both`` (e.g. ``"LTD training needs at least 2 traces"``, the start of
    the error when there are fewer than 2 items) neither side is left empty: an item moves over if needed."""
    from adaptree.data.splits import split_of

    items = list(items)
    if both is not None and len(items) < 2:
        raise ValueError(f"{both} (train + validation), got {len(items)}")
    if val_fraction <= 0.0:
        return items, []
    fractions = {"train": 1.0 - val_fraction, "validation": val_fraction}
    train, val = [], []
    for item in items:
        (train if split_of(key(item), fractions, seed) == "train" else val).append(item)
    if both is not None:
        if not val:
            val, train = train[-1:], train[:-1]
        if not train:
            train, val = val[:1], val[1:]
    return train, val


# ---------------------------------------------------------------------------------------------- logs and tables


class CsvLog:
    """A CSV log that survives interruption: each row is appended (the file opened and closed) as it comes.
    Opening starts the file afresh (header only), or, to resume, keeps the rows whose column ``by`` is at
    most ``keep`` (those up to the checkpoint; the later ones are redone)."""

    def __init__(self, path: str | os.PathLike, columns: Sequence[str], keep: int | None = None,
                 by: str | None = None) -> None:
        self.path, self.columns = Path(path), list(columns)
        rows = []
        if keep and self.path.exists():
            by = by or self.columns[0]
            rows = [r for r in self.rows() if int(r[by]) <= keep]
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, self.columns)
            w.writeheader()
            w.writerows(rows)

    def append(self, row: Mapping) -> None:
        """One row (missing columns empty, other keys ignored)."""
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow({k: row.get(k, "") for k in self.columns})

    def rows(self) -> list[dict[str, str]]:
        with open(self.path, newline="") as f:
            return list(csv.DictReader(f))


def format_table(header: Sequence[str], rows: Iterable[Sequence], markdown: bool = False, left: int = 1) -> str:
    """A table of strings: markdown (``| a | b |`` rows under a ``|---|`` line), or plain text with the
    columns aligned (the first ``left`` to the left, the others to the right) and a dashed line under the
    header."""
    rows = [[str(c) for c in r] for r in rows]
    header = [str(c) for c in header]
    if markdown:
        return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                         + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(r):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(header), "-" * (sum(widths) + 2 * (len(widths) - 1))] + [line(r) for r in rows])


@dataclass(frozen=True, eq=False)
class TrainingResult(Mapping[str, Any]):
    """What a trainer returns: its run folder, the exported policy (or head) folder, and its summary (what the
    run's summary file holds). It reads as that summary too: ``result["chosen"]``, ``dict(result)``."""

    out: Path
    """The run folder (checkpoints, logs, summary file)."""
    export: Path
    """The exported policy or head folder: what to ship next to a head, or pass as a method's policy."""
    summary: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.summary)

    def __len__(self) -> int:
        return len(self.summary)

    @classmethod
    def written(cls, summary: dict[str, Any], out: str | os.PathLike, export: str | os.PathLike,
                name: str = "summary.json") -> TrainingResult:
        """Write ``summary`` to ``out/name`` (atomically) and return it as a result."""
        write_json(summary, Path(out) / name)
        return cls(Path(out), Path(export), summary)
