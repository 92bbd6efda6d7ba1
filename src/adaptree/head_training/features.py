"""Target features on disk: what the draft head is trained on, computed once per sequence.

For every token position ``p`` of a sequence the store holds

- ``feats``   ``[N, 3H]`` the target's low/mid/high features (outputs of ``config.feature_layers``),
- ``hidden``  ``[N, H]``  the target's final normed hidden state: the target's logits over the draft
  vocabulary are recomputed from it in training as ``hidden @ lm_head.weight[t2d].T`` (storing logits
  would take ``vocab`` values per token; this takes ``H``),
- ``tokens``  ``[N]`` int32 token ids, ``loss_mask`` ``[N]`` uint8 (1 on response tokens),
- ``argmax``  ``[N]`` int32 the target's argmax over its FULL vocabulary at ``p`` (its greedy next
  token): what greedy verification accepts, used for validation acceptance and the vocabulary counts.

Floats are stored as bfloat16 bit patterns in ``uint16`` ``.npy`` files (numpy has no bfloat16; bfloat16
keeps float32's range, so no overflow from a large residual stream, and it is what the target computes
at inference in its default dtype). A shard is a folder ``shard-NNNNN`` with those files and an
``index.json`` (sequence ids, splits, offsets, lengths); it is written as ``shard-NNNNN.tmp`` and renamed
when complete, so an interrupted extraction never leaves a partial shard, and a rerun skips the sequences
that are already in a shard. ``store.json`` records the target the features came from; a store made
from another target is refused. Disk: ``(4H * 2 + 9)`` bytes per token (4,617 for H = 576).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from adaptree.head_training.corpus import TokenSequence, _write_atomic

FORMAT_VERSION = 1
_SHARD = re.compile(r"^shard-(\d{5,})$")
_ARRAYS = ("feats", "hidden", "tokens", "loss_mask", "argmax")


def target_fingerprint(target, name: str | None = None, dtype: torch.dtype | None = None) -> dict:
    """What identifies the target a store was made from (shapes, feature layers, a weight checksum).

    ``dtype``: checksum the weights rounded to this dtype, so a target loaded in float32 and the same file loaded
    in bfloat16 (whose weights are the float32 ones rounded) have one fingerprint."""
    c = target.config
    h = hashlib.sha1()
    for t in (target.model.norm.weight, target.model.embed_tokens.weight[:256], target.lm_head.weight[-256:],
              target.model.layers[c.feature_layers[1]].mlp.down_proj.weight[:64]):
        t = t.detach() if dtype is None else t.detach().to(dtype)
        h.update(t.float().cpu().numpy().tobytes())
    return {"name": name, "arch": c.arch, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers, "feature_layers": list(c.feature_layers),
            "weights_sha1": h.hexdigest()}


def _same_target(a: dict | None, b: dict) -> bool:
    """Fingerprints equal up to the name the model was given (a path or a short name for the same file)."""
    strip = lambda d: {k: v for k, v in (d or {}).items() if k != "name"}  # noqa: E731
    return strip(a) == strip(b)


def _to_u16(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def u16_to_bf16(a: np.ndarray) -> torch.Tensor:
    """A bfloat16 tensor with the bit patterns of a uint16 array (copied: memory maps are read-only)."""
    return torch.from_numpy(np.array(a, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


@dataclass(frozen=True)
class SeqRef:
    id: str
    split: str
    shard: int
    offset: int
    length: int


class FeatureStore:
    """Read access to an extracted feature folder (memory-mapped)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        meta_path = self.folder / "store.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"no feature store in {self.folder} (store.json missing)")
        self.meta = json.loads(meta_path.read_text())
        self.hidden_size = int(self.meta["hidden_size"])
        self.seqs: list[SeqRef] = []
        self._shards: dict[int, Path] = {}
        self._maps: dict[int, dict[str, np.ndarray]] = {}
        for path in sorted(self.folder.iterdir()):
            m = _SHARD.match(path.name)
            if not m or not path.is_dir():
                continue
            n = int(m.group(1))
            self._shards[n] = path
            idx = json.loads((path / "index.json").read_text())
            for sid, split, off, ln in zip(idx["ids"], idx["splits"], idx["offsets"], idx["lengths"]):
                self.seqs.append(SeqRef(sid, split, n, off, ln))

    def __len__(self) -> int:
        return len(self.seqs)

    def ids(self) -> set[str]:
        return {s.id for s in self.seqs}

    def split(self, name: str) -> list[SeqRef]:
        return [s for s in self.seqs if s.split == name]

    def arrays(self, shard: int) -> dict[str, np.ndarray]:
        if shard not in self._maps:
            p = self._shards[shard]
            self._maps[shard] = {k: np.load(p / f"{k}.npy", mmap_mode="r") for k in _ARRAYS}
        return self._maps[shard]

    def get(self, ref: SeqRef) -> dict[str, torch.Tensor]:
        """One sequence: ``feats``/``hidden`` bfloat16, ``tokens``/``argmax`` int64, ``loss_mask`` bool."""
        a = self.arrays(ref.shard)
        sl = slice(ref.offset, ref.offset + ref.length)
        return {
            "feats": u16_to_bf16(a["feats"][sl]), "hidden": u16_to_bf16(a["hidden"][sl]),
            "tokens": torch.from_numpy(a["tokens"][sl].astype(np.int64)),
            "argmax": torch.from_numpy(a["argmax"][sl].astype(np.int64)),
            "loss_mask": torch.from_numpy(a["loss_mask"][sl].astype(bool)),
        }

    def get_many(self, refs: Sequence[SeqRef]) -> list[dict[str, torch.Tensor]]:
        """:meth:`get` of each of ``refs`` (the interface :class:`OnlineFeatures` batches)."""
        return [self.get(r) for r in refs]

    def token_counts(self, vocab_size: int, refs: str | Sequence[SeqRef] = "train") -> torch.Tensor:
        """How often each target id is the target's greedy next token at a position whose next token is a
        response token: the tokens the draft head has to propose (input of ``build_vocab_map``). ``refs``:
        a split name or the sequences to count."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for ref in (self.split(refs) if isinstance(refs, str) else refs):
            a = self.arrays(ref.shard)
            am = a["argmax"][ref.offset:ref.offset + ref.length - 1]
            nxt_resp = a["loss_mask"][ref.offset + 1:ref.offset + ref.length].astype(bool)
            counts += np.bincount(am[nxt_resp], minlength=vocab_size)[:vocab_size]
        return torch.from_numpy(counts)

    def num_tokens(self, split: str | None = None) -> int:
        return sum(s.length for s in self.seqs if split is None or s.split == split)

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for p in self._shards.values() for f in p.iterdir())


def _write_shard(folder: Path, n: int, rows: list[tuple[TokenSequence, dict[str, np.ndarray]]]) -> None:
    tmp = folder / f"shard-{n:05d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    index = {"ids": [], "splits": [], "offsets": [], "lengths": []}
    off = 0
    for seq, _ in rows:
        index["ids"].append(seq.id)
        index["splits"].append(seq.split)
        index["offsets"].append(off)
        index["lengths"].append(len(seq.input_ids))
        off += len(seq.input_ids)
    for k in _ARRAYS:
        np.save(tmp / f"{k}.npy", np.concatenate([r[k] for _, r in rows]))
    (tmp / "index.json").write_text(json.dumps(index))
    for f in tmp.iterdir():  # durable before the rename makes the shard visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    os.rename(tmp, folder / f"shard-{n:05d}")


@torch.inference_mode()
def target_pass(target, batch: Sequence[Sequence[int]], *, argmax: bool = True) -> list[dict[str, np.ndarray]]:
    """Run the target once over right-padded sequences; per sequence the arrays of the store (``argmax``
    False: without the argmax over the whole vocabulary, a product with the whole ``lm_head``: ~20% of the
    pass for SmolLM2-135M's 49k-token vocabulary)."""
    dev = target.device
    width = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long, device=dev)
    for i, s in enumerate(batch):
        ids[i, :len(s)] = torch.tensor(list(s), dtype=torch.long)
    last: dict[str, torch.Tensor] = {}
    hook = target.model.layers[-1].register_forward_hook(lambda mod, inp, out: last.__setitem__("x", out))
    try:
        out = target(ids, features=True, logits=False)  # causal: right padding never reaches real tokens
    finally:
        hook.remove()
    normed = target.model.norm(last["x"])
    rows = []
    for i, s in enumerate(batch):
        n = len(s)
        h = normed[i, :n]
        row = {"feats": _to_u16(out.features[i, :n]), "hidden": _to_u16(h)}
        if argmax:
            am = torch.cat([target.lm_head(h[j:j + 512]).argmax(-1) for j in range(0, n, 512)])
            row["argmax"] = am.to("cpu", torch.int32).numpy()
        rows.append(row)
    return rows


def extract_features(folder: str | os.PathLike, target, sequences: Sequence[TokenSequence], *,
                     fingerprint: dict | None = None, batch_tokens: int = 4096, shard_tokens: int = 65536,
                     limit: int | None = None) -> dict:
    """Run ``target`` over every sequence not yet in the store at ``folder`` and append shards.

    Sequences are processed in length order, batched up to ``batch_tokens`` padded tokens. ``limit``
    stops after that many sequences (simulates an interruption). Returns timing statistics of this call."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fp = fingerprint or target_fingerprint(target)
    meta_path = folder / "store.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if not _same_target(meta.get("target"), fp):
            raise ValueError(f"the features in {folder} were extracted from another target "
                             f"({meta.get('target')}); use another --out for this target ({fp})")
    else:
        meta = {"format": FORMAT_VERSION, "hidden_size": target.config.hidden_size,
                "feature_dim": 3 * target.config.hidden_size, "dtype": "bfloat16", "target": fp}
        meta_path.write_text(json.dumps(meta, indent=2))
    for stale in folder.glob("shard-*.tmp"):
        shutil.rmtree(stale)
    store = FeatureStore(folder)
    done = store.ids()
    next_shard = max(store._shards, default=-1) + 1
    todo = [s for s in sequences if s.input_ids and s.id not in done]
    todo = list({s.id: s for s in todo}.values())  # one copy per id
    if limit is not None:
        todo = todo[:limit]
    todo.sort(key=lambda s: len(s.input_ids))
    stats = {"sequences": len(todo), "tokens": sum(len(s.input_ids) for s in todo), "seconds": 0.0}
    pending: list[tuple[TokenSequence, dict[str, np.ndarray]]] = []
    pending_tokens = 0
    bar = tqdm(total=stats["tokens"], desc="features", unit="tok", unit_scale=True, disable=not todo)
    t_start = time.perf_counter()
    i = 0
    while i < len(todo):
        width = len(todo[i].input_ids)
        j = i + 1
        while j < len(todo) and (j - i + 1) * len(todo[j].input_ids) <= max(batch_tokens, width):
            j += 1
        batch = todo[i:j]
        for seq, arrays in zip(batch, target_pass(target, [s.input_ids for s in batch])):
            arrays["tokens"] = np.asarray(seq.input_ids, dtype=np.int32)
            arrays["loss_mask"] = np.asarray(seq.loss_mask, dtype=np.uint8)
            pending.append((seq, arrays))
            pending_tokens += len(seq.input_ids)
        bar.update(sum(len(s.input_ids) for s in batch))
        i = j
        if pending_tokens >= shard_tokens or i == len(todo):
            _write_shard(folder, next_shard, pending)
            next_shard += 1
            pending, pending_tokens = [], 0
    bar.close()
    stats["seconds"] = time.perf_counter() - t_start
    stats["tokens_per_s"] = stats["tokens"] / stats["seconds"] if stats["seconds"] > 0 else 0.0
    if todo:  # totals over every run that added to this store
        meta["extraction_seconds"] = meta.get("extraction_seconds", 0.0) + stats["seconds"]
        meta["extracted_tokens"] = meta.get("extracted_tokens", 0) + stats["tokens"]
        _write_atomic(meta_path, json.dumps(meta, indent=2))
    return stats


class OnlineFeatures:
    """The :class:`FeatureStore` interface over token sequences, with the features computed by the target
    when a training batch asks for them (``train-head --features online``). Nothing goes to disk and a
    run resumes on a machine that has only the corpus; each epoch pays the target's forward again (a
    stored feature pays it once). The sequences of ``keep_splits`` (validation, re-read at every
    validation) are computed once and kept in memory.

    Only those have ``argmax`` (the target's argmax over its whole vocabulary: validation's greedy acceptance).
    A training batch's loss never uses it, and its greedy accuracy is counted against the target's argmax over
    the draft vocabulary instead (:func:`~adaptree.head_training.ttt.ttt_loss`), which saves a product with the
    whole ``lm_head`` per batch (~13% of a training step on SmolLM2-135M).

    The draft vocabulary's counts (:meth:`token_counts`) come from the corpus's own response tokens, not the
    target's argmax: identical for a greedy self-distilled corpus (each response token is the target's
    greedy next token, up to near-ties), the sampled frequencies for a temperature-1 one."""

    def __init__(self, target, sequences: Sequence[TokenSequence], *, fingerprint: dict | None = None,
                 keep_splits: tuple[str, ...] = ("val",)) -> None:
        self.target = target
        self.folder = None
        self.hidden_size = int(target.config.hidden_size)
        self.meta = {"online": True, "hidden_size": self.hidden_size,
                     "target": fingerprint or target_fingerprint(target)}
        self._seqs: dict[str, TokenSequence] = {}
        self.seqs: list[SeqRef] = []
        for s in sequences:
            if s.input_ids and s.id not in self._seqs:
                self.seqs.append(SeqRef(s.id, s.split, -1, len(self.seqs), len(s.input_ids)))
                self._seqs[s.id] = s
        self.keep_splits = keep_splits
        self._kept: dict[str, dict[str, torch.Tensor]] = {}
        self.seconds = 0.0
        """Seconds spent in the target's forward (this process)."""
        self.tokens = 0
        """Tokens it went over (this process)."""

    def __len__(self) -> int:
        return len(self.seqs)

    def ids(self) -> set[str]:
        return set(self._seqs)

    def split(self, name: str) -> list[SeqRef]:
        return [s for s in self.seqs if s.split == name]

    def get_many(self, refs: Sequence[SeqRef]) -> list[dict[str, torch.Tensor]]:
        """The sequences' arrays as :meth:`FeatureStore.get` gives them, from one target pass over those not
        kept (batch sequences of similar length: the pass pads to the longest)."""
        todo = [r for r in refs if r.id not in self._kept]
        got: dict[str, dict[str, torch.Tensor]] = {}
        if todo:
            t0 = time.perf_counter()
            rows = target_pass(self.target, [self._seqs[r.id].input_ids for r in todo],
                               argmax=any(r.split in self.keep_splits for r in todo))
            for r, row in zip(todo, rows):
                seq = self._seqs[r.id]
                got[r.id] = {"feats": u16_to_bf16(row["feats"]), "hidden": u16_to_bf16(row["hidden"]),
                             "tokens": torch.tensor(seq.input_ids, dtype=torch.int64),
                             "loss_mask": torch.tensor(seq.loss_mask, dtype=torch.bool)}
                if "argmax" in row:
                    got[r.id]["argmax"] = torch.from_numpy(row["argmax"].astype(np.int64))
                if r.split in self.keep_splits:
                    self._kept[r.id] = got[r.id]
            self.seconds += time.perf_counter() - t0
            self.tokens += sum(r.length for r in todo)
        return [self._kept[r.id] if r.id in self._kept else got[r.id] for r in refs]

    def get(self, ref: SeqRef) -> dict[str, torch.Tensor]:
        return self.get_many([ref])[0]

    def token_counts(self, vocab_size: int, refs: str | Sequence[SeqRef] = "train") -> torch.Tensor:
        """How often each id is a response token of ``refs`` (a split name or sequences)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for ref in (self.split(refs) if isinstance(refs, str) else refs):
            seq = self._seqs[ref.id]
            ids = np.asarray(seq.input_ids[1:], dtype=np.int64)
            counts += np.bincount(ids[np.asarray(seq.loss_mask[1:], dtype=bool)], minlength=vocab_size)[:vocab_size]
        return torch.from_numpy(counts)

    def num_tokens(self, split: str | None = None) -> int:
        return sum(s.length for s in self.seqs if split is None or s.split == split)

    def disk_bytes(self) -> int:
        return 0


__all__ = ["FeatureStore", "OnlineFeatures", "SeqRef", "extract_features", "target_fingerprint", "target_pass",
           "u16_to_bf16"]
