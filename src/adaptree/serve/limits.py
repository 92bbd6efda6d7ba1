"""What one request may cost the server: the nesting depth of its JSON body, scanned before it is parsed, and the
draft tree and verified-node budget of its method (limits in :class:`~adaptree.serve.config.ServeConfig`, each a
flag of ``adaptree serve``). The engine runs one generation at a time, so one request with a huge tree would hold
every other client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from adaptree.serve.config import ServeConfig
from adaptree.serve.errors import InvalidRequest


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``raw`` nest (brackets inside strings do not count), by
    byte operations and numpy scans: linear, a few copies of the body at most, and no recursion (the parser's
    own would hit Python's recursion limit on a body of a hundred thousand ``[``)."""
    # Escapes first, as a JSON reader takes them from the left: "\\" is one escaped backslash, then a
    # backslash escapes the byte after it, so every '"' left delimits a string.
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    a = np.frombuffer(bare, np.uint8)
    if not a.size:
        return 0
    quote = (a == ord('"')).view(np.uint8)
    inside = np.bitwise_xor.accumulate(quote) ^ quote  # 1 after an opening quote, up to its closing one
    step = ((a == ord("[")) | (a == ord("{"))).view(np.int8) - ((a == ord("]")) | (a == ord("}"))).view(np.int8)
    step[inside.view(bool)] = 0
    return int(np.cumsum(step, dtype=np.int32).max(initial=0))


def check_json_depth(raw: bytes, limit: int) -> None:
    """An InvalidRequest when the JSON text ``raw`` nests deeper than ``limit`` (a body with no more opening
    brackets than that is not scanned)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    depth = json_depth(raw)
    if depth > limit:
        raise InvalidRequest(f"the request body nests arrays and objects {depth} levels deep; the limit is {limit}",
                             code="invalid_json")


@dataclass(frozen=True)
class TreeCost:
    """The most a method's cycle may draft and verify, read off its config."""

    width: int
    """Beam width W (0: the method drafts no tree)."""
    depth: int
    """The deepest the tree may grow (draft forwards per cycle)."""
    size: int
    """Draft nodes verified per cycle at most: the tree's V plus a context chain's tokens (the root is extra)."""

    @property
    def nodes_per_cycle(self) -> int:
        return self.size + 1


_NAMES = {"width": ("width",), "depth": ("depth", "max_depth"), "size": ("size", "max_size"),
          "chain": ("chain_tokens", "tokens")}
"""Config fields of each dimension, in every method's config (``tokens``: ngram's chain length)."""


def _field(config: Any, dim: str) -> int:
    for name in _NAMES[dim]:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0  # not set by the request: the method's policy or tuned tree decides (files the operator installed)


def tree_cost(config: Any) -> TreeCost:
    """The :class:`TreeCost` of a method's config (None: autoregressive, one node per cycle)."""
    if config is None:
        return TreeCost(0, 0, 0)
    depth = config.bounds[1] if hasattr(config, "bounds") else _field(config, "depth")  # gammatune: its deepest
    return TreeCost(_field(config, "width"), depth, _field(config, "size") + _field(config, "chain"))


def check_tree(cost: TreeCost, limits: ServeConfig, method: str) -> None:
    """An :class:`~adaptree.serve.errors.InvalidRequest` naming the value, the limit and its flag when the tree of
    ``method`` is wider, deeper or larger than ``limits`` allow."""
    for what, value, limit, flag in (
            ("width", cost.width, limits.max_tree_width, "--max-tree-width"),
            ("depth", cost.depth, limits.max_tree_depth, "--max-tree-depth"),
            ("size (verified nodes per cycle, a context chain's included)", cost.size, limits.max_tree_size,
             "--max-tree-size")):
        if value > limit:
            raise InvalidRequest(f"method {method!r} with these options drafts a tree of {what} {value}; this server "
                                 f"allows at most {limit} (adaptree serve {flag})", param="method_options",
                                 code="limit_exceeded")


def check_budget(cost: TreeCost, max_new: int, limits: ServeConfig) -> None:
    """An InvalidRequest when ``max_new`` tokens at ``cost``'s nodes per cycle (one token per cycle at worst) could
    verify more than ``limits.max_verified_nodes``."""
    total = max_new * cost.nodes_per_cycle
    if total > limits.max_verified_nodes:
        most = limits.max_verified_nodes // cost.nodes_per_cycle
        raise InvalidRequest(f"max_tokens {max_new} with {cost.nodes_per_cycle} verified nodes per cycle may verify "
                             f"{total} nodes; this server allows {limits.max_verified_nodes} per request (adaptree "
                             f"serve --max-verified-nodes): ask for at most {most} tokens or a smaller tree",
                             param="max_tokens", code="limit_exceeded")


def budget_tokens(cost: TreeCost, limits: ServeConfig) -> int:
    """The most tokens a request with ``cost``'s tree may generate within the verified-node budget."""
    return limits.max_verified_nodes // cost.nodes_per_cycle
