"""The server's settings (:class:`ServeConfig`); ``adaptree serve`` makes its flags from the fields. No web framework
is imported here, so the command line stays quick to start."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adaptree.core.config import at_least, check_fields, positive


@dataclass
class ServeConfig:
    """How ``adaptree serve`` serves a pipeline."""

    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every interface)."""
    port: int = 8000
    """Port to listen on (0: any free port)."""
    served_model_name: str | None = None
    """The model's name in requests and /v1/models (default: the model's short name or path)."""
    max_queue: int = at_least(0, 16, integer=True)
    """Requests that may wait behind the running generation; one more gets 429 with Retry-After."""
    default_max_tokens: int = positive(256, integer=True)
    """max_tokens of a request that gives none (capped by the room left in the context)."""
    api_key: str | None = None
    """A key clients must send as 'Authorization: Bearer KEY' (default: none needed)."""
    graceful_timeout: float = 30.0
    """On shutdown, seconds the requests in progress and queued get to finish before they are cancelled."""
    warmup: bool = True
    """Run one short generation before taking requests (the first forwards are slower)."""
    max_body_bytes: int = positive(8 * 1024 * 1024, integer=True)
    """Larger request bodies are refused (413), as soon as that many bytes have arrived."""
    max_json_depth: int = positive(64, integer=True)
    """Request bodies whose arrays and objects nest deeper are refused (400) before they are parsed."""
    max_tree_width: int = positive(32, integer=True)
    """The widest draft tree (beam width W) a request's method may draft; a wider one is refused (400)."""
    max_tree_depth: int = positive(32, integer=True)
    """The deepest draft tree (draft forwards per cycle) a request's method may draft; a deeper one is refused."""
    max_tree_size: int = positive(256, integer=True)
    """The most draft nodes a request's method may verify per cycle (V plus a context chain's tokens)."""
    max_verified_nodes: int = positive(1 << 20, integer=True)
    """The most nodes one request may verify: max_tokens x nodes per cycle (the root included; one token per cycle
    at worst) beyond it is refused, a request without max_tokens is capped to it. The default lets every method's
    default tree run over an 8192-token context."""
    method: str | None = None
    """The method of requests that name none (default: the pipeline's default_method, this machine's best)."""
    method_options: dict[str, Any] = field(default_factory=dict)
    """That method's options (config fields)."""

    def __post_init__(self) -> None:
        check_fields(self)
