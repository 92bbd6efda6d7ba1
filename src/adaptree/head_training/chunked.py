"""A self-distilled corpus that outlives a session: token ids in checksummed chunks, committed to the repository.

``adaptree corpus grow --out corpora/<name> --chunks N`` makes the target answer ShareGPT prompts and stores
what it said; ``adaptree train-head --corpus corpora/<name>`` trains on it (features are recomputed from the
ids, never stored here). Growing is resumable at two levels: a finished chunk is never redone, and inside a
chunk the generation writes whole parts to ``<folder>/.work/`` (not committed) that a rerun continues.

Layout of ``<folder>``:

- ``manifest.json``: the format version, the :class:`CorpusSettings` (fixed when the corpus is created; a
  run with other settings is refused, naming them), the target's fingerprint, and one entry per chunk:
  file name, split, the range of prompts it answers, sequence and token counts, generation seconds, the
  machine that made it, its ``target_dtype`` where it is not the corpus's (below), and the SHA-256 of its
  file (checked on every read).
- ``val-00000.npz``: the answers to ``val_prompts`` prompts of the ShareGPT ``validation`` split.
- ``train-NNNNN.npz``: chunk ``i`` answers prompts ``[i * chunk_prompts, (i + 1) * chunk_prompts)`` of the
  ``train`` split, in the fixed shuffled order of :func:`~adaptree.head_training.corpus.sharegpt_items`
  for the seed (evaluation prompts excluded), so chunk ``i`` is the same prompts on every machine.

A chunk file is a NumPy ``.npz`` (no pickles) with ``ids`` (unicode), ``prompt_len`` and ``response_len``
(int32, one per prompt; a prompt over half of ``max_len`` is kept with an empty response) and ``tokens``
(uint16 where the vocabulary fits, else uint32): every sequence's prompt ids (chat template applied, the
assistant header included) followed by the ids the target generated, concatenated. A ``sharegpt`` corpus
(whole conversations, several assistant turns) adds ``loss_mask``, the bit-packed mask of all tokens.

Determinism: a chunk's prompts are a function of the settings, and its answers of the settings and the
target's weights, up to rounding: a batch in bfloat16 can take another greedy token on a near-tie when its
rows differ (where a run started or was interrupted decides which prompts share a batch) or on another CPU,
so a chunk regenerated may differ in a few places; sampled answers also depend on those batches. The
manifest records which machine made each chunk.

A chunk may be generated in another dtype than the corpus's (``corpus grow --chunk-dtype float32``): on a CPU
without native bfloat16 (no AVX-512 BF16, no AMX), bfloat16 matmuls are emulated and several times slower than
float32 ones, so such a machine continues a bfloat16 corpus in float32. The weights are the same (the
fingerprint checksums them rounded to the corpus's dtype), the answers are the same greedy policy up to the
rounding above, and the chunk's manifest entry records its ``target_dtype``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from adaptree.core.config import at_least, check_fields, choice, positive
from adaptree.head_training.corpus import (
    ConversationItem,
    TokenSequence,
    _write_atomic,
    build_corpus,
    read_corpus,
    sharegpt_items,
)

FORMAT_VERSION = 1
SOURCES = ("self", "sharegpt")
"""Where a corpus's answers come from: the target's own (self-distillation) or ShareGPT's."""
TARGET_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes a target may generate a corpus (or train a head) in."""
STREAM_GROUP = 4
"""Chunks whose prompts are sorted by length together when a corpus grows (see :meth:`ChunkedCorpus.grow`)."""


@dataclass(frozen=True)
class CorpusSettings:
    """What a committed corpus is a function of (with the target's weights)."""

    model: str = "default"
    """The target: a registered short name, or ``default`` (SmolLM2-135M-Instruct)."""
    source: str = choice(SOURCES, "self")
    """``self``: the target's own answers to the first user turns; ``sharegpt``: the ShareGPT conversations as
    they are, all turns, rendered with the target's chat template (loss on every assistant turn; the soft
    labels still come from the target in training), no generation."""
    target_dtype: str = choice(TARGET_DTYPES, "bfloat16")
    """The target's dtype while generating."""
    temperature: float = at_least(0.0, 0.0)
    """0 = greedy answers; else sampled at this temperature (seeded per chunk from ``seed``)."""
    max_len: int = at_least(8, 1024, integer=True)
    """Longest sequence (prompt + answer); prompts over half of it get no answer."""
    max_new_tokens: int = positive(256, integer=True)
    """Longest answer."""
    chunk_prompts: int = positive(512, integer=True)
    """Prompts per training chunk: the unit that is committed (about 100k answer tokens with SmolLM2). A chunk's
    last rows decode in a thinning batch, so larger chunks waste less."""
    val_prompts: int = positive(64, integer=True)
    """Prompts of the held-out chunk (ShareGPT ``validation`` split)."""
    seed: int = 0
    """The ShareGPT shuffle (which prompts, in which order) and the sampling seeds."""
    gen_batch_size: int = positive(96, integer=True)
    """Rows decoded together (batch shapes round differently, so it is part of what a chunk is)."""

    def __post_init__(self) -> None:
        check_fields(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CorpusSettings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown corpus settings {unknown}")
        return cls(**d)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _meta(folder: Path) -> dict:
    """A corpus work folder's generation statistics (empty before it has any)."""
    path = folder / "meta.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _chunk_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.npz"


def _prompt_len(seq: TokenSequence) -> int:
    """Tokens before the first one with loss (all of them for an empty answer)."""
    return next((i for i, m in enumerate(seq.loss_mask) if m), len(seq.input_ids))


def pack_chunk(path: Path, seqs: list[TokenSequence], vocab_size: int) -> None:
    """Write ``seqs`` (in order) as one ``.npz`` chunk, atomically. ``prompt_len``/``response_len`` split each
    sequence where its loss starts; sequences whose loss mask has other gaps (several assistant turns) add a
    bit-packed ``loss_mask`` of all tokens."""
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    plens = [_prompt_len(x) for x in seqs]
    arrays = {
        "ids": np.array([x.id for x in seqs], dtype=str),
        "prompt_len": np.array(plens, dtype=np.int32),
        "response_len": np.array([len(x.input_ids) - p for x, p in zip(seqs, plens)], dtype=np.int32),
        "tokens": np.array([t for x in seqs for t in x.input_ids], dtype=dtype),
    }
    if any(sum(x.loss_mask) != len(x.input_ids) - p for x, p in zip(seqs, plens)):
        arrays["loss_mask"] = np.packbits(np.array([m for x in seqs for m in x.loss_mask], dtype=bool))
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def unpack_chunk(path: Path, split: str) -> list[TokenSequence]:
    """The sequences of a chunk (those without loss skipped)."""
    with np.load(path, allow_pickle=False) as z:
        ids, plen, rlen, tokens = z["ids"], z["prompt_len"], z["response_len"], z["tokens"]
        packed = z["loss_mask"] if "loss_mask" in z.files else None
    if int(plen.sum() + rlen.sum()) != len(tokens):
        raise ValueError(f"{path}: lengths cover {int(plen.sum() + rlen.sum())} tokens, the file holds {len(tokens)}")
    mask = np.unpackbits(packed, count=len(tokens)).tolist() if packed is not None else None
    out, pos = [], 0
    for i, p, r in zip(ids.tolist(), plen.tolist(), rlen.tolist()):
        seq = tokens[pos:pos + p + r].tolist()
        m = mask[pos:pos + p + r] if mask is not None else [0] * p + [1] * r
        pos += p + r
        if r > 0 and any(m):
            out.append(TokenSequence(str(i), seq, m, split))
    return out


class ChunkedCorpus:
    """A corpus folder (see the module docstring): its manifest, reading and growing."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        path = self.folder / "manifest.json"
        self.manifest: dict = json.loads(path.read_text()) if path.is_file() else {}
        if self.manifest and self.manifest.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path}: corpus format {self.manifest.get('format')!r}, this version reads "
                             f"{FORMAT_VERSION}")

    @property
    def settings(self) -> CorpusSettings | None:
        s = self.manifest.get("settings")
        return CorpusSettings.from_dict(s) if s else None

    def chunks(self, split: str | None = None) -> list[dict]:
        return [c for c in self.manifest.get("chunks", []) if split is None or c["split"] == split]

    def chunk_dtype(self, chunk: dict) -> str:
        """The dtype the target generated ``chunk`` in (the corpus's, unless the chunk records its own)."""
        return chunk.get("target_dtype") or self.settings.target_dtype

    def totals(self) -> dict:
        """Per split: chunks, sequences, tokens, response tokens, generation seconds, and chunks per dtype."""
        out: dict[str, dict] = {}
        for c in self.chunks():
            t = out.setdefault(c["split"], {"chunks": 0, "sequences": 0, "tokens": 0, "response_tokens": 0,
                                            "generation_seconds": 0.0, "dtypes": {}})
            for k in ("sequences", "tokens", "response_tokens", "generation_seconds"):
                t[k] += c[k]
            t["chunks"] += 1
            d = self.chunk_dtype(c)
            t["dtypes"][d] = t["dtypes"].get(d, 0) + 1
        return out

    @property
    def work(self) -> Path:
        """Where a run keeps the finished answers of chunks it has not packed yet (whole parts; git-ignored)."""
        return self.folder / ".work"

    def _work_answers(self) -> dict[str, TokenSequence]:
        return {x.id: x for d in sorted(self.work.glob("*")) if d.is_dir() for x in read_corpus(d)}

    def _work_dtype(self) -> str | None:
        path = self.work / "dtype.json"
        return json.loads(path.read_text())["dtype"] if path.is_file() else None

    def pending(self) -> dict | None:
        """The answers an interrupted run left in :attr:`work` for chunks it did not finish, or None: how many,
        their response tokens and dtype. A rerun continues from them, also on another machine when the folder
        is committed with them (``git add -f <folder>/.work``)."""
        answers = self._work_answers()
        if answers:  # a run of several chunks that packed some before it stopped left their answers there too
            for c in self.chunks():
                with np.load(self.folder / c["file"], allow_pickle=False) as z:
                    for packed in z["ids"]:
                        answers.pop(str(packed), None)
        if not answers:
            return None
        return {"answers": len(answers), "response_tokens": sum(sum(x.loss_mask) for x in answers.values()),
                "dtype": self._work_dtype()}

    def read(self, split: str | None = None, max_chunks: int | None = None) -> list[TokenSequence]:
        """The sequences of the chunks of ``split`` (all splits: None), the first ``max_chunks`` training chunks
        only if given; every file's checksum is verified against the manifest."""
        out: list[TokenSequence] = []
        train_seen = 0
        for c in self.chunks(split):
            if c["split"] == "train":
                if max_chunks is not None and train_seen >= max_chunks:
                    continue
                train_seen += 1
            path = self.folder / c["file"]
            if not path.is_file():
                raise FileNotFoundError(f"{path}: listed in the manifest but missing")
            digest = _sha256(path)
            if digest != c["sha256"]:
                raise ValueError(f"{path}: SHA-256 {digest[:12]}... does not match the manifest's "
                                 f"{c['sha256'][:12]}... (a changed or damaged chunk)")
            out.extend(unpack_chunk(path, c["split"]))
        return out

    # ---- growing ---------------------------------------------------------------------------------

    def _check_settings(self, settings: CorpusSettings, fingerprint: dict) -> None:
        from adaptree.head_training.features import _same_target

        have = self.settings
        if have is not None and have != settings:
            differ = {f.name: (getattr(have, f.name), getattr(settings, f.name)) for f in fields(settings)
                      if getattr(have, f.name) != getattr(settings, f.name)}
            raise ValueError(f"{self.folder} was made with other settings (corpus's, asked): {differ}; "
                             f"grow it with its own settings or start another folder")
        if self.manifest.get("target") and not _same_target(self.manifest["target"], fingerprint):
            raise ValueError(f"{self.folder} was generated by another target "
                             f"({self.manifest['target'].get('name')!r}); start another folder")

    def _save(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.folder / "manifest.json", json.dumps(self.manifest, indent=1) + "\n")

    def grow(self, settings: CorpusSettings, chunks: int, target, tok, *, fingerprint: dict,
             items: tuple[list[ConversationItem], list[ConversationItem]] | None = None,
             prompt_ids_fn=None, progress=None, dtype: str | None = None) -> dict:
        """Generate the held-out chunk (if missing) and training chunks until there are ``chunks``; returns
        :meth:`totals`. ``items``: (train, validation) conversations instead of ShareGPT's (tests).
        ``progress(done, wanted)`` is called after each chunk.

        ``dtype``: the dtype ``target`` generates in, where it is not the corpus's ``target_dtype`` (a machine
        on which that dtype is emulated, such as bfloat16 on a CPU without AVX-512 BF16 or AMX); each chunk
        made so records it as its own ``target_dtype``. ``fingerprint`` must then checksum the weights rounded
        to the corpus's dtype (:func:`~adaptree.head_training.features.target_fingerprint`), so that only the
        same weights continue a corpus."""
        from adaptree.core.machine import machine_profile

        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0:
            raise ValueError(f"chunks must be a non-negative integer, got {chunks!r}")
        if dtype is not None and dtype not in TARGET_DTYPES:
            raise ValueError(f"dtype must be one of {TARGET_DTYPES}, got {dtype!r}")
        made_in = dtype or settings.target_dtype
        own = None if made_in == settings.target_dtype else made_in  # recorded with each chunk it makes
        self._check_settings(settings, fingerprint)
        if not self.manifest:
            self.manifest = {"format": FORMAT_VERSION, "settings": asdict(settings), "target": fingerprint,
                             "chunks": []}
            self._save()
        have_train = len(self.chunks("train"))
        todo = [("val", 0)] if not self.chunks("val") else []
        todo += [("train", i) for i in range(have_train, chunks)]
        if not todo:
            return self.totals()
        if items is None:
            items = self._sharegpt(settings, chunks)
        train_items, val_items = items
        need = chunks * settings.chunk_prompts
        if len(train_items) < need:
            raise ValueError(f"{chunks} chunks need {need} training prompts; {len(train_items)} are available")
        vocab = target.config.vocab_size
        plan = [(split, i, val_items[:settings.val_prompts] if split == "val" else
                 train_items[i * settings.chunk_prompts:(i + 1) * settings.chunk_prompts]) for split, i in todo]
        group = {it.id: g // STREAM_GROUP for g, (_, _, chunk_items) in enumerate(plan) for it in chunk_items}
        # One stream of prompts through one continuous batch, STREAM_GROUP chunks at a time, shortest prompts
        # first within a group (the batch's attention spans its longest context, so similar lengths decode
        # cheaper; a group's last rows decode while the next group's first ones do): a chunk is packed once
        # all its prompts are answered. The finished answers wait in ``.work/`` (whole parts), which a rerun
        # reads back.
        work = self.work
        finished = self._work_answers()
        # answers of two dtypes never share a chunk: a chunk records one
        left = self._work_dtype()
        if left is not None and left != made_in and finished:
            raise ValueError(f"{work} holds answers of an interrupted run in {left}, this run generates in {made_in}: "
                             f"finish them in {left}, or delete {work} to start the unfinished chunks again")
        work.mkdir(parents=True, exist_ok=True)
        _write_atomic(work / "dtype.json", json.dumps({"dtype": made_in}) + "\n")
        stream = work / "stream"

        def pack_ready(new: list[TokenSequence] = ()) -> None:
            finished.update((x.id, x) for x in new)
            ready = []
            while plan and all(it.id in finished for it in plan[0][2]):
                ready.append(plan.pop(0))
            if not ready:
                return
            # a chunk's answers decoded among others: its seconds at the stream's average rate so far
            made = [_meta(d) for d in work.glob("*") if d.is_dir()]
            rate = sum(m.get("generated_tokens", 0) for m in made) / max(1e-9, sum(
                m.get("generation_seconds", 0.0) for m in made))
            answers = [[finished[it.id] for it in chunk_items] for *_, chunk_items in ready]
            resp = [sum(sum(x.loss_mask) for x in seqs) for seqs in answers]
            for (split, i, chunk_items), seqs, r in zip(ready, answers, resp):
                name = _chunk_name(split, i)
                pack_chunk(self.folder / name, seqs, vocab)
                secs = r / rate if rate > 0 else 0.0
                first = 0 if split == "val" else i * settings.chunk_prompts
                self.manifest["chunks"].append({
                    "file": name, "split": split, "prompts": [first, first + len(chunk_items)],
                    "sequences": sum(1 for x in seqs if sum(x.loss_mask)),
                    "tokens": sum(len(x.input_ids) for x in seqs), "response_tokens": r,
                    "skipped_long_prompts": sum(1 for x in seqs if not x.input_ids),
                    "generation_seconds": round(secs, 2),
                    "generation_tokens_per_s": round(rate, 1),
                    "machine": machine_profile(), "created": time.strftime("%Y-%m-%d"),
                    **({"target_dtype": own} if own else {}), "sha256": _sha256(self.folder / name)})
            self.manifest["chunks"].sort(key=lambda c: (c["split"] != "val", c["file"]))
            self._save()
            if progress is not None:
                progress(len(self.chunks("train")), chunks)

        pack_ready()  # chunks whose answers a killed run left complete
        rest = [it for _, _, chunk_items in plan for it in chunk_items if it.id not in finished]
        if rest:
            build_corpus(stream, target, tok, rest, settings.source, max_len=settings.max_len,
                         max_new_tokens=settings.max_new_tokens, gen_temperature=settings.temperature,
                         gen_batch_size=settings.gen_batch_size, part_size=settings.gen_batch_size,
                         seed=settings.seed * 100_003 + len(self.chunks()), prompt_ids_fn=prompt_ids_fn,
                         group_of=lambda it: group[it.id], on_part=pack_ready)
        pack_ready()
        if plan:
            raise RuntimeError(f"chunks {[_chunk_name(s, i) for s, i, _ in plan]} are incomplete after generation")
        shutil.rmtree(work, ignore_errors=True)
        return self.totals()

    @staticmethod
    def _sharegpt(settings: CorpusSettings, chunks: int) -> tuple[list[ConversationItem], list[ConversationItem]]:
        found, _ = sharegpt_items(chunks * settings.chunk_prompts, settings.val_prompts, settings.seed)
        return [it for it in found if it.split == "train"], [it for it in found if it.split == "val"]


def open_corpora(folders: str | list[str]) -> dict[str, ChunkedCorpus]:
    """The corpora of one or more folders (a comma-separated string or a list), in order; a folder without a
    manifest is refused, naming it."""
    names = [f for f in (folders.split(",") if isinstance(folders, str) else folders) if f]
    if not names:
        raise ValueError("no corpus folder given")
    out: dict[str, ChunkedCorpus] = {}
    for folder in names:
        corpus = ChunkedCorpus(folder)
        if not corpus.manifest:
            raise FileNotFoundError(f"{folder}: no corpus here (manifest.json missing); make one with "
                                    f"'adaptree corpus grow --out {folder} --chunks N'")
        out[folder] = corpus
    return out


def read_corpora(folders: str | list[str] | dict[str, ChunkedCorpus],
                 max_chunks: int | None = None) -> list[TokenSequence]:
    """The sequences of one or more corpora (folders as for :func:`open_corpora`, or its result): the
    training chunks of all (the first ``max_chunks`` of each if given) and the held-out chunk of the first
    (so validation stays the same when corpora are added). Ids are suffixed with the folder's name (the same
    prompt answered greedily and sampled are two sequences)."""
    corpora = folders if isinstance(folders, dict) else open_corpora(folders)
    out: list[TokenSequence] = []
    for n, (folder, corpus) in enumerate(corpora.items()):
        tag = Path(folder).name
        for split in ("train", "val") if n == 0 else ("train",):
            out.extend(TokenSequence(f"{s.id}@{tag}", s.input_ids, s.loss_mask, s.split)
                       for s in corpus.read(split, max_chunks=max_chunks))
    return out


__all__ = ["ChunkedCorpus", "CorpusSettings", "open_corpora", "pack_chunk", "read_corpora", "unpack_chunk"]
