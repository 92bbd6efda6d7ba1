"""Facts about a config's fields kept on the field itself: ranges and closed sets of values, as dataclass field
metadata.

``prompts: int = positive(12)`` or ``timing: str = choice(TIMINGS, "model")`` declares the field, its default and
what values it takes in one place. Two readers use it: the config's own ``__post_init__`` calls
:func:`check_fields` (a ValueError naming the field and the bad value), and the command line's
:class:`~adaptree.cli.common.ConfigFlags` gives the flag an argparse type that refuses the same values and the
choices. Checks that relate several fields (``first_round_prompts <= prompts``) stay in ``__post_init__``.

A field whose default is a config of its own (a dataclass) may carry :data:`FLAG_HELP` in its metadata: help texts
of the inner fields' flags where the outer config uses them differently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass
from typing import Any

BOUNDS = "bounds"
"""Metadata key: the field's :class:`Bounds` (every item's, for a tuple or list)."""
CHOICES = "choices"
"""Metadata key: the field's values, a tuple of strings (None passes where the field's default is None)."""
LABEL = "label"
"""Metadata key: how an error names the field where its name alone does not say enough (``"interval
(--resps-interval)"``)."""
FLAG_HELP = "flag_help"
"""Metadata key of a nested config's field: inner field name -> help text of its flag in the outer config."""


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Bounds:
    """A numeric range: ``lo`` and ``hi`` (None: no bound), each closed unless ``*_open``."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    """The value must also be an ``int`` (not a bool, not a float): for configs filled from JSON (a request's
    method options, a saved file), where nothing typed the value before."""

    def describe(self) -> str:
        """The range in words: ``>= 1``, ``in 1..64``, ``in (0, 1]``, ``> 0``."""
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            if not (self.lo_open or self.hi_open or isinstance(lo, float) or isinstance(hi, float)):
                return f"in {lo}..{hi}"
            return f"in {'(' if self.lo_open else '['}{_number(lo)}, {_number(hi)}{')' if self.hi_open else ']'}"
        if lo is not None:
            return f"{'>' if self.lo_open else '>='} {_number(lo)}"
        if hi is not None:
            return f"{'<' if self.hi_open else '<='} {_number(hi)}"
        return "a number"

    def holds(self, value: Any) -> bool:
        if self.integer and (isinstance(value, bool) or not isinstance(value, int)):
            return False
        try:  # "not x >= lo" so that NaN fails too
            if self.lo is not None and not (value > self.lo if self.lo_open else value >= self.lo):
                return False
            if self.hi is not None and not (value < self.hi if self.hi_open else value <= self.hi):
                return False
        except TypeError:  # a value that is no number
            return False
        return True

    def error(self, value: Any) -> str | None:
        """``"must be >= 1, got 0"`` when ``value`` is outside the range, else None."""
        if self.holds(value):
            return None
        return f"must be {'an integer ' if self.integer else ''}{self.describe()}, got {value!r}"


def _field(default: Any, default_factory: Any, metadata: Mapping[str, Any]) -> Any:
    return dataclasses.field(default=default, default_factory=default_factory, metadata=dict(metadata))


def bounded(default: Any = MISSING, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
            hi_open: bool = False, integer: bool = False, default_factory: Any = MISSING, **metadata: Any) -> Any:
    """A dataclass field with ``default`` (or ``default_factory``) whose value (each item of a tuple or list) must lie
    in the range; None passes (an unset optional field)."""
    bounds = Bounds(lo, hi, lo_open, hi_open, integer)
    return _field(default, default_factory, {BOUNDS: bounds, **metadata})


def at_least(lo: float, default: Any = MISSING, **kw: Any) -> Any:
    """A field whose value must be >= ``lo``."""
    return bounded(default, lo=lo, **kw)


def positive(default: Any = MISSING, **kw: Any) -> Any:
    """A field whose value must be >= 1 (a count)."""
    return bounded(default, lo=1, **kw)


def between(lo: float, hi: float, default: Any = MISSING, **kw: Any) -> Any:
    """A field whose value must lie in [``lo``, ``hi``] (``lo_open``/``hi_open`` for open ends)."""
    return bounded(default, lo=lo, hi=hi, **kw)


def choice(options: Iterable[str], default: Any = MISSING, *, default_factory: Any = MISSING, **metadata: Any) -> Any:
    """A field whose value must be one of ``options`` (or None)."""
    return _field(default, default_factory, {CHOICES: tuple(options), **metadata})


def bounds_of(f: dataclasses.Field) -> Bounds | None:
    return f.metadata.get(BOUNDS)


def choices_of(f: dataclasses.Field) -> tuple[str, ...] | None:
    return f.metadata.get(CHOICES)


def field_error(f: dataclasses.Field, value: Any) -> str | None:
    """Why ``value`` is no value of field ``f`` (a sentence naming both), or None when it is one."""
    if value is None:
        return None
    bounds, options = bounds_of(f), choices_of(f)
    if bounds is None and options is None:
        return None
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    for item in items:
        why = bounds.error(item) if bounds is not None else None
        if why is None and options is not None and item not in options:
            why = f"must be one of {', '.join(options)}, got {item!r}"
        if why is not None:
            return f"{f.metadata.get(LABEL, f.name)} {why}" + (f" in {value!r}" if item is not value else "")
    return None


def check_fields(config: Any) -> None:
    """Raise ValueError naming the field and the value when a field of dataclass ``config`` is outside its
    :func:`bounded` range or its :func:`choice` options (for the config's ``__post_init__``)."""
    for f in dataclasses.fields(config):
        why = field_error(f, getattr(config, f.name))
        if why is not None:
            raise ValueError(why)
