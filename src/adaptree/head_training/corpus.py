"""Training corpus for a draft head: token sequences with a loss mask over the response tokens.

Two sources (``TrainHeadConfig.source``):

- ``"self"`` (self-distillation): the target answers the first user turn of each training prompt itself
  (greedy, or sampled at ``gen_temperature``), ``gen_batch_size`` rows at a time with continuous batching
  (:func:`~adaptree.core.batched.batched_decode`: waiting prompts take the rows of finished ones), so
  decoding runs at a full batch until the very end. The sequence is the chat-templated prompt followed by
  exactly the ids the target produced (its EOS included), so there is no re-tokenisation mismatch; the loss
  mask covers the generated ids.
  Prompts longer than half of ``max_len`` are skipped (recorded as empty sequences).
- ``"sharegpt"``: ShareGPT conversations as they are, rendered with the target's chat template
  (:func:`render_conversation`); the loss mask covers every assistant turn (content and end-of-turn).

Prompts come from the ``train`` split of :mod:`adaptree.data.splits` (validation sequences from its
``validation`` split), and any conversation with a user turn equal to an MT-bench or HumanEval prompt, or
containing one (whitespace-normalised), is dropped, so evaluation prompts are never trained on.

A corpus lives in ``<out>/corpus/`` as ``part-NNNNN.jsonl`` files of finished sequences, each written to
a temporary name and renamed, so an interrupted run leaves only whole parts; a rerun generates only the
prompts not yet in a part (at most one part's worth of work is lost). ``corpus/meta.json`` accumulates
generation statistics (tokens, seconds) across runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from adaptree.core.batched import batched_decode

log = logging.getLogger(__name__)

Message = dict[str, str]


@dataclass
class ConversationItem:
    """One training or validation conversation before tokenisation."""

    id: str
    messages: list[Message]
    split: str = "train"
    """``"train"`` or ``"val"``."""


@dataclass
class TokenSequence:
    """One rendered sequence: ``input_ids`` with ``loss_mask[i] = 1`` where token i is a response token."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]
    split: str = "train"

    def to_json(self) -> str:
        return json.dumps({"id": self.id, "split": self.split, "input_ids": self.input_ids,
                           "loss_mask": self.loss_mask}, separators=(",", ":"))

    def cut(self, max_len: int) -> "TokenSequence":
        """The first ``max_len`` tokens (this sequence if it is no longer)."""
        if len(self.input_ids) <= max_len:
            return self
        return TokenSequence(self.id, self.input_ids[:max_len], self.loss_mask[:max_len], self.split)

    @classmethod
    def from_dict(cls, d: dict) -> "TokenSequence":
        return cls(str(d["id"]), list(d["input_ids"]), list(d["loss_mask"]), d.get("split", "train"))


def _normalize(text: str) -> str:
    return " ".join(text.split())


def conversation_id(messages: Sequence[Message]) -> str:
    """A stable id from the content (the same conversation always gets the same id)."""
    h = hashlib.sha1()
    for m in messages:
        h.update(m["role"].encode() + b"\0" + m["content"].encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------


def evaluation_texts() -> set[str]:
    """Whitespace-normalised user turns of every evaluation prompt we can load (MT-bench, HumanEval)."""
    from adaptree.data import prompts as P

    texts: set[str] = set()
    for loader in (P.mt_bench, P.humaneval):
        try:
            for p in loader():
                texts.update(_normalize(t) for t in p.turns)
        except FileNotFoundError as exc:  # not installed: nothing of it can leak into training
            log.info("evaluation set not installed (%s); nothing to exclude from it", exc)
    return texts


_MIN_CONTAINED = 40
"""Evaluation prompts at least this long (normalised characters) also count when pasted inside a longer turn."""


def mentions_evaluation(messages: Sequence[Message], banned: set[str]) -> bool:
    """Whether a user turn is an evaluation prompt, or contains one of at least ``_MIN_CONTAINED`` characters
    (whitespace-normalised; e.g. a HumanEval problem pasted with a request around it)."""
    long = [b for b in banned if len(b) >= _MIN_CONTAINED]
    for m in messages:
        if m["role"] != "user":
            continue
        text = _normalize(m["content"])
        if text in banned or any(b in text for b in long):
            return True
    return False


def drop_evaluation_prompts(items: Iterable[ConversationItem], banned: set[str] | None = None
                            ) -> tuple[list[ConversationItem], int]:
    """``items`` without the conversations that :func:`mentions_evaluation` flags."""
    banned = evaluation_texts() if banned is None else banned
    kept, dropped = [], 0
    for it in items:
        if mentions_evaluation(it.messages, banned):
            dropped += 1
        else:
            kept.append(it)
    return kept, dropped


def sharegpt_items(num_train: int, num_val: int, seed: int) -> tuple[list[ConversationItem], dict]:
    """``num_train`` + ``num_val`` ShareGPT conversations: the train items from the ``train`` split, the
    validation items from the ``validation`` split of :mod:`adaptree.data.splits` (never its ``eval``
    split), no evaluation prompt, no two items with the same first user turn.

    The order is a fixed shuffle of the whole file for the seed, so a larger ``num_train`` extends the
    list of a smaller one (a resumed or extended run reuses the prompts it already has)."""
    try:
        from adaptree.data import sharegpt_conversations, split_of
        from adaptree.data.splits import prompt_key
    except ImportError as exc:  # the loader is developed alongside; say what is missing
        raise ValueError(f"ShareGPT loading is unavailable ({exc}); adaptree.data.sharegpt_conversations "
                         f"is required for --source self/sharegpt") from None
    convs = sharegpt_conversations(None, seed)
    banned = evaluation_texts()
    seen: set[str] = set()
    out: list[ConversationItem] = []
    counts = {"train": 0, "val": 0}
    want = {"train": num_train, "val": num_val}
    stats = {"sharegpt_conversations": len(convs), "dropped_eval_overlap": 0, "dropped_duplicates": 0}
    for messages in convs:
        if counts["train"] >= num_train and counts["val"] >= num_val:
            break
        key = prompt_key(messages)
        split = {"train": "train", "validation": "val"}.get(split_of(key))
        if split is None or counts[split] >= want[split]:
            continue
        if key in seen:
            stats["dropped_duplicates"] += 1
            continue
        if mentions_evaluation(messages, banned):
            stats["dropped_eval_overlap"] += 1
            continue
        seen.add(key)
        out.append(ConversationItem(conversation_id(messages), [dict(m) for m in messages], split))
        counts[split] += 1
    stats.update(train_items=counts["train"], val_items=counts["val"])
    return out, stats


# ------------------------------------------------------------------------------------------------
# Rendering
# ------------------------------------------------------------------------------------------------


def render_conversation(tok, messages: Sequence[Message], max_len: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation through the chat template, and a mask that is 1 on every token
    of the assistant turns (content and end-of-turn marker, not the role header).

    The conversation is rendered prefix by prefix; each new piece of text is tokenised on its own (the
    pieces meet at special tokens or line breaks, which is also where generation starts). Templates whose
    renderings are not prefixes of one another (e.g. ones that rewrite earlier turns) are refused."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""

    def add(text: str, m: int) -> None:
        nonlocal done
        if not text.startswith(done):
            raise ValueError("the chat template does not render conversations incrementally (a later "
                             "rendering is not an extension of an earlier one); cannot locate the responses")
        piece = text[len(done):]
        if piece:
            new = tok.encode(piece, add_special_tokens=False)
            ids.extend(new)
            mask.extend([m] * len(new))
        done = text

    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            add(tok.render_chat(list(messages[:i]), add_generation_prompt=True), 0)
            add(tok.render_chat(list(messages[: i + 1]), add_generation_prompt=False), 1)
        else:
            add(tok.render_chat(list(messages[: i + 1]), add_generation_prompt=False), 0)
        if max_len is not None and len(ids) >= max_len:
            break
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


def prompt_ids(tok, messages: Sequence[Message]) -> list[int]:
    """The chat-templated ids of a prompt (the first user turn) ending with the assistant header."""
    first_user = next(m for m in messages if m["role"] == "user")
    return tok.apply_chat([{"role": "user", "content": first_user["content"]}], add_generation_prompt=True)


# ------------------------------------------------------------------------------------------------
# The corpus on disk
# ------------------------------------------------------------------------------------------------


@dataclass
class CorpusStats:
    sequences: int = 0
    tokens: int = 0
    response_tokens: int = 0
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    skipped_long_prompts: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def generation_tokens_per_s(self) -> float:
        return self.generated_tokens / self.generation_seconds if self.generation_seconds else 0.0


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_corpus(folder: str | os.PathLike) -> list[TokenSequence]:
    """Every sequence of the finished parts of a corpus folder, in part order."""
    folder = Path(folder)
    out: list[TokenSequence] = []
    for part in sorted(folder.glob("part-*.jsonl")):
        with open(part, encoding="utf-8") as f:
            out.extend(TokenSequence.from_dict(json.loads(line)) for line in f if line.strip())
    return out


def _read_meta(folder: Path) -> dict:
    p = folder / "meta.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def build_corpus(folder: str | os.PathLike, target, tok, items: Sequence[ConversationItem], source: str, *,
                 max_len: int, max_new_tokens: int = 256, gen_temperature: float = 0.0, gen_batch_size: int = 32,
                 part_size: int | None = None, seed: int = 0, limit: int | None = None,
                 prompt_ids_fn: Callable[[ConversationItem], list[int]] | None = None,
                 group_of: Callable[[ConversationItem], int] | None = None,
                 on_part: Callable[[list[TokenSequence]], None] | None = None) -> CorpusStats:
    """Tokenise (``source="sharegpt"``) or self-distil (``source="self"``) ``items`` into ``folder``.

    Items already in a finished part are skipped (resume). ``limit`` stops after that many new items (to
    simulate an interruption in tests). ``prompt_ids_fn`` replaces the chat template for prompts (tests
    with tokenizer-less tiny models). Prompts are generated shortest first, or with ``group_of`` group by
    group (shortest first within one), so that a caller's groups finish in order. ``on_part`` is called with
    the sequences of each part once it is written. Returns the statistics of the whole corpus."""
    if source not in ("self", "sharegpt"):
        raise ValueError(f"unknown corpus source {source!r}; expected 'self' or 'sharegpt'")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("*.tmp"):
        stale.unlink()
    meta = _read_meta(folder)
    if meta and meta.get("source") != source:
        raise ValueError(f"{folder} holds a {meta.get('source')!r} corpus; this run asks for {source!r} "
                         f"(use another --out)")
    meta.setdefault("source", source)
    meta.setdefault("generated_tokens", 0)
    meta.setdefault("generation_seconds", 0.0)
    meta.setdefault("skipped_long_prompts", 0)
    meta.update(max_len=max_len, max_new_tokens=max_new_tokens, gen_temperature=gen_temperature)
    have = {s.id for s in read_corpus(folder)}
    todo = [it for it in items if it.id not in have]
    if limit is not None:
        todo = todo[:limit]
    next_part = len(list(folder.glob("part-*.jsonl")))
    part_size = part_size or gen_batch_size  # finished items per part file: the unit of resumption
    gen = torch.Generator(device=target.device).manual_seed(seed) if gen_temperature > 0 else None
    max_prompt = max(1, max_len // 2)

    bar = tqdm(total=len(todo), desc=f"corpus ({source})", unit="seq", disable=not todo)
    done: list[TokenSequence] = []

    def flush(final: bool = False) -> None:
        """Write finished sequences in parts of ``part_size`` (the last one may be shorter)."""
        nonlocal next_part, done
        while len(done) >= part_size or (final and done):
            part, done = done[:part_size], done[part_size:]
            _write_atomic(folder / f"part-{next_part:05d}.jsonl", "".join(x.to_json() + "\n" for x in part))
            _write_atomic(folder / "meta.json", json.dumps(meta, indent=2))
            next_part += 1
            if on_part is not None:
                on_part(part)

    if source == "sharegpt":
        for it in todo:
            ids, mask = render_conversation(tok, it.messages, max_len)
            if sum(mask):
                done.append(TokenSequence(it.id, ids, mask, it.split))
            else:
                done.append(TokenSequence(it.id, [], [], it.split))  # nothing to learn; marks the item done
            bar.update(1)
            flush()
    else:
        queue = []  # (item, prompt ids, token limit)
        for it in todo:
            p = prompt_ids_fn(it) if prompt_ids_fn else prompt_ids(tok, it.messages)
            if len(p) > max_prompt:
                meta["skipped_long_prompts"] += 1
                done.append(TokenSequence(it.id, [], [], it.split))  # marks the item done
                bar.update(1)
                continue
            queue.append((it, list(p), min(max_new_tokens, max_len - len(p))))
        # similar lengths are prefilled together (less padding); a caller's groups in order
        queue.sort(key=lambda e: (group_of(e[0]) if group_of else 0, len(e[1])))
        eos = tok.eos_token_ids if tok is not None else list(target.config.eos_token_id)
        t_last = time.perf_counter()

        def finished(j: int, out) -> None:
            nonlocal t_last
            it, p, _ = queue[j]
            done.append(TokenSequence(it.id, p + out.tokens, [0] * len(p) + [1] * len(out.tokens), it.split))
            now = time.perf_counter()
            meta["generation_seconds"] += now - t_last
            meta["generated_tokens"] += len(out.tokens)
            t_last = now
            bar.set_postfix(gen_tok_s=f"{meta['generated_tokens'] / max(meta['generation_seconds'], 1e-9):.0f}",
                            refresh=False)
            bar.update(1)  # each answer as it finishes (a part is written every part_size of them)
            flush()

        if queue:
            batched_decode(target, [p for _, p, _ in queue], [lim for *_, lim in queue], eos,
                           temperature=gen_temperature, generator=gen, batch_size=gen_batch_size, on_done=finished)
    flush(final=True)
    bar.close()
    _write_atomic(folder / "meta.json", json.dumps(meta, indent=2))
    return corpus_stats(folder)


def corpus_stats(folder: str | os.PathLike) -> CorpusStats:
    folder = Path(folder)
    meta = _read_meta(folder)
    seqs = [s for s in read_corpus(folder) if s.input_ids]
    return CorpusStats(
        sequences=len(seqs), tokens=sum(len(s.input_ids) for s in seqs),
        response_tokens=sum(sum(s.loss_mask) for s in seqs),
        generated_tokens=meta.get("generated_tokens", 0), generation_seconds=meta.get("generation_seconds", 0.0),
        skipped_long_prompts=meta.get("skipped_long_prompts", 0),
        extra={"splits": {sp: sum(1 for s in seqs if s.split == sp) for sp in ("train", "val")}})


__all__ = ["ConversationItem", "TokenSequence", "CorpusStats", "build_corpus",
           "conversation_id", "corpus_stats", "drop_evaluation_prompts", "evaluation_texts", "prompt_ids",
           "read_corpus", "render_conversation", "sharegpt_items"]
