"""Validation of the (W, max depth, V) fields the adaptive controllers share with the static tree."""

from __future__ import annotations

from .base import MAX_DEPTH, MAX_WIDTH


def check_shape(width: int, depth: int, size: int, depth_name: str = "depth") -> None:
    """Raise ValueError naming the bad value when W, the depth or V is out of range."""
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width (W) must be in 1..{MAX_WIDTH}, got {width}")
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"{depth_name} must be in 1..{MAX_DEPTH}, got {depth}")
    if size < 1:
        raise ValueError(f"size (V) must be >= 1, got {size}")
