"""The server's settings (:class:`ServeConfig`); ``adaptree serve`` makes its flags from the fields. No web framework
is imported here, so the command line stays quick to start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ServeConfig:
    """How ``adaptree serve`` serves a pipeline."""

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every interface)."""
    port: int = 8000
    """Port to listen on (0: any free port)."""
    served_model_name: str | None = None
    """The model's name in requests and /v1/models (default: the model's short name or path)."""
    max_queue: int = 16
    """Requests that may wait behind the running generation; one more gets 429 with Retry-After."""
    default_max_tokens: int = 256
    """max_tokens of a request that gives none (capped by the room left in the context)."""
    api_key: str | None = None
    """A key clients must send as 'Authorization: Bearer KEY' (default: none needed)."""
    graceful_timeout: float = 30.0
    """On shutdown, seconds the requests in progress and queued get to finish before they are cancelled."""
    warmup: bool = True
    """Run one short generation before taking requests (the first forwards are slower)."""
    max_body_bytes: int = 8 * 1024 * 1024
    """Larger request bodies are refused (413), as soon as that many bytes have arrived."""
    max_json_depth: int = 64
    """Request bodies whose arrays and objects nest deeper are refused (400) before they are parsed."""
    max_tree_width: int = 32
    """The widest draft tree (beam width W) a request's method may draft; a wider one is refused (400)."""
    max_tree_depth: int = 32
    """The deepest draft tree (draft forwards per cycle) a request's method may draft; a deeper one is refused."""
    max_tree_size: int = 256
    """The most draft nodes a request's method may verify per cycle (V plus a context chain's tokens)."""
    max_verified_nodes: int = 1 << 20
    """The most nodes one request may verify: max_tokens x nodes per cycle (the root included; one token per cycle
    at worst) beyond it is refused, a request without max_tokens is capped to it. The default lets every method's
    default tree run over an 8192-token context."""
    method: str | None = None
    """The method of requests that name none (default: the pipeline's default_method, this machine's best)."""
    method_options: dict[str, Any] = field(default_factory=dict)
    """That method's options (config fields)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_json_depth", "max_tree_width", "max_tree_depth", "max_tree_size",
                     "max_verified_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
