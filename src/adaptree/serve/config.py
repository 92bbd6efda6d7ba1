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
    """Larger request bodies are refused (413)."""
    method: str | None = None
    """The method of requests that name none (default: the pipeline's default_method, this machine's best)."""
    method_options: dict[str, Any] = field(default_factory=dict)
    """That method's options (config fields)."""
