"""The text of a generation as its tokens arrive (:class:`TextAssembler`): what :meth:`adaptree.api.Pipeline.stream`
and the server's streams send."""

from __future__ import annotations

import threading
from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop sequence in ``text`` begins, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could begin a stop sequence (not sent yet)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class TextAssembler:
    """The text of a generation as its tokens arrive: whole characters only, cut before the first stop sequence,
    characters that may begin a stop sequence held back until they cannot. :meth:`add` returns the next piece
    to send; the pieces add up to :meth:`finish`'s text."""

    def __init__(self, tokenizer, stops: Sequence[str] = (), lock: threading.Lock | None = None) -> None:
        self.tok, self.stops, self.lock = tokenizer, tuple(stops), lock or threading.Lock()
        self.ids: list[int] = []
        self.sent = ""
        self.stop_seen = False

    def _decode(self) -> str:
        with self.lock:
            text = self.tok.decode(self.ids)
        cut = find_stop(text, self.stops)
        if cut is not None:
            self.stop_seen = True
            return text[:cut]
        return text

    def _advance(self, text: str, end: int) -> str:
        if end > len(self.sent) and text.startswith(self.sent):
            piece, self.sent = text[len(self.sent):end], text[:end]
            return piece
        return ""

    def add(self, new: Sequence[int]) -> str:
        if self.stop_seen:
            return ""
        self.ids.extend(new)
        text = self._decode()
        if self.stop_seen:
            return self._advance(text, len(text))
        end = len(text) - held_back(text, self.stops)
        while end > len(self.sent) and text[end - 1] == "\ufffd":  # a character whose bytes are still coming
            end -= 1
        return self._advance(text, end)

    def finish(self) -> tuple[str, str]:
        """(the whole text, the last piece to send)."""
        text = self._decode()
        return text, self._advance(text, len(text))
