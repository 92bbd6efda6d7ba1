"""Where the text being generated repeats its own context: the index behind n-gram (prompt-lookup) drafts.

A :class:`ContextIndex` holds the prompt and the tokens generated so far and, for every n-gram of up to
``max_ngram`` tokens, where it ended. :meth:`ContextIndex.match` finds the longest suffix of the context
that occurred before (tried from ``max_ngram`` tokens down; a match of ``max_ngram`` tokens is extended
backwards token by token up to ``max_match``) and returns what followed one earlier occurrence of it: the
continuation a draft can propose (always ``max_tokens`` long: past the context's end a repeat goes on with its
period), with the match length and how often the matched n-gram occurred.

Which occurrence (``select``):

* ``"longest"`` (the default): of the ``scan`` most recent occurrences of a ``max_ngram``-token suffix, the one
  whose match extends furthest backwards (the most recent among equals). A longer shared past predicts a
  longer shared future, so the chain this picks is accepted further than the most recent occurrence's
  where the answer copies its context (docs/methods.md gives the measurement).
* ``"recent"``: the most recent occurrence (prompt lookup as vLLM, SGLang and transformers do it, up to which
  occurrence they take; ``ngram``'s default, the baseline).

Both agree whenever the suffix is shorter than ``max_ngram`` (then no occurrence extends further back).

Costs: :meth:`ContextIndex.extend` is O(``max_ngram``) dictionary updates per token, so a generation pays
O(new tokens) per cycle (the prompt once, on the first cycle); :meth:`ContextIndex.match` is
O(``max_ngram`` + the extension + the continuation). Candidates are a function of the context alone, so a
greedy replay of a trace proposes exactly what the live run proposed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

SELECT = ("longest", "recent")
"""The rules :meth:`ContextIndex.match` can pick an earlier occurrence by (module docstring)."""
DEFAULT_SELECT = SELECT[0]
"""The rule of a :class:`ContextIndex`, a chain calibration and its fits unless told otherwise."""

MAX_MATCH = 64
"""A :class:`ContextIndex`'s longest match by default, and so the longest n-gram a method may ask it to index."""


@dataclass(frozen=True)
class ContextMatch:
    """The longest earlier occurrence of the context's suffix, and what followed it."""

    length: int
    """Tokens of the suffix that match (at most the index's ``max_match``)."""
    count: int
    """Earlier occurrences of the suffix's last ``min(length, max_ngram)`` tokens."""
    position: int
    """Index in the context of the first continuation token (after the earlier occurrence that proposes it)."""
    tokens: tuple[int, ...]
    """The continuation: the ``max_tokens`` tokens after that occurrence. Where they run past the context's end
    (the occurrence overlaps the suffix, as in a loop), the text is taken to go on repeating with its period."""


class ContextIndex:
    """An incrementally updated n-gram index over a growing token sequence (see the module docstring).

    :param max_ngram: longest n-gram indexed (a longer match is found by extending a ``max_ngram`` one).
    :param max_match: longest match length reported (the backwards extension stops there).
    :param select: which earlier occurrence proposes the continuation: ``"longest"`` or ``"recent"`` (module
        docstring).
    :param scan: with ``"longest"``, how many of the most recent occurrences are compared (bounds a match's
        cost at ``scan * max_match`` token comparisons).
    """

    def __init__(self, max_ngram: int = 8, max_match: int = MAX_MATCH, select: str = DEFAULT_SELECT,
                 scan: int = 64) -> None:
        if isinstance(max_ngram, bool) or not isinstance(max_ngram, int) or max_ngram < 1:
            raise ValueError(f"max_ngram must be a positive integer, got {max_ngram!r}")
        if isinstance(max_match, bool) or not isinstance(max_match, int) or max_match < max_ngram:
            raise ValueError(f"max_match must be an integer >= max_ngram ({max_ngram}), got {max_match!r}")
        if select not in SELECT:
            raise ValueError(f"select must be one of {', '.join(SELECT)}, got {select!r}")
        if isinstance(scan, bool) or not isinstance(scan, int) or scan < 1:
            raise ValueError(f"scan must be a positive integer, got {scan!r}")
        self.max_ngram, self.max_match, self.select, self.scan = max_ngram, max_match, select, scan
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._prompt_len = 0  # what sync() indexed of the prompt and of the generated tokens
        self._generated = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        """Append tokens to the context and index the n-grams that end at each of them."""
        toks, ends, n_max = self.tokens, self._ends, self.max_ngram
        for t in new:
            toks.append(int(t))
            i = len(toks) - 1
            for n in range(1, min(n_max, i + 1) + 1):
                key = tuple(toks[i - n + 1:i + 1])
                at = ends.get(key)
                if at is None:
                    ends[key] = [i]
                else:
                    at.append(i)

    def sync(self, prompt: Sequence[int], generated: Sequence[int]) -> None:
        """Make the context ``prompt + generated``, where ``generated`` only grew since the last call (the
        engine's output list): indexes the new tokens only."""
        if not self._prompt_len and not self._generated:
            self.extend(prompt)
            self._prompt_len = len(prompt)
        elif len(prompt) != self._prompt_len or len(generated) < self._generated:
            raise ValueError("ContextIndex.sync: the prompt changed or the generated tokens shrank; use a new index")
        self.extend(generated[self._generated:])
        self._generated = len(generated)

    def match(self, max_tokens: int, min_ngram: int = 1) -> ContextMatch | None:
        """The longest suffix of the context, at least ``min_ngram`` tokens, that occurred before, and up to
        ``max_tokens`` tokens that followed an earlier occurrence of it (``select``); None if there is none."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if min_ngram < 1:
            raise ValueError(f"min_ngram must be >= 1, got {min_ngram}")
        toks = self.tokens
        last = len(toks) - 1
        for n in range(min(self.max_ngram, last), min_ngram - 1, -1):
            ends = self._ends.get(tuple(toks[last - n + 1:]))
            if ends is None or len(ends) < 2:  # the suffix itself is the last entry
                continue
            p, length = ends[-2], n
            if n == self.max_ngram:
                length = self._back(p, last)
                if self.select == "longest":
                    for q in ends[-3:-2 - self.scan:-1]:  # older occurrences, most recent first
                        if length >= self.max_match:
                            break
                        lq = self._back(q, last)
                        if lq > length:
                            p, length = q, lq
            cont = toks[p + 1:p + 1 + max_tokens]
            while len(cont) < max_tokens:  # the occurrence overlaps the suffix: the text repeats with period
                cont.append(cont[len(cont) - (last - p)])  # last - p, and the continuation goes on repeating
            return ContextMatch(length, len(ends) - 1, p + 1, tuple(cont))
        return None

    def _back(self, p: int, last: int) -> int:
        """How far the occurrence ending at ``p`` matches the context's suffix, counted backwards (at most
        ``max_match``; at least ``max_ngram``, as ``p`` ends an occurrence of the suffix's last ``max_ngram``)."""
        toks, length = self.tokens, self.max_ngram
        while length < self.max_match and p - length >= 0 and toks[p - length] == toks[last - length]:
            length += 1
        return length


__all__ = ["DEFAULT_SELECT", "SELECT", "ContextIndex", "ContextMatch"]
