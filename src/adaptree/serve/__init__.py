"""An OpenAI-compatible HTTP server on one :class:`~adaptree.api.Pipeline` (``adaptree serve``; docs/serving.md).

    import adaptree
    from adaptree.serve import ServeConfig, serve
    serve(adaptree.load(), ServeConfig(port=8000))      # http://127.0.0.1:8000/v1

- :mod:`~adaptree.serve.config`: :class:`ServeConfig`, the server's settings.
- :mod:`~adaptree.serve.app`: the Starlette app (:func:`create_app`): ``/v1/models``, ``/v1/chat/completions``,
  ``/v1/completions`` (streaming or not), ``/health``, ``/metrics``.
- :mod:`~adaptree.serve.protocol`: request checking and the response and chunk bodies.
- :mod:`~adaptree.serve.scheduler`: the bounded FIFO queue in front of the batch-1 engine and its thread.
- :mod:`~adaptree.serve.metrics`: the Prometheus metrics.
- :mod:`~adaptree.serve.server`: uvicorn (:func:`serve`, :func:`start_server` in a thread).
- :mod:`~adaptree.serve.loadtest`: concurrent streaming clients against a server (needs the ``openai`` client).

Names are imported on first use, so ``import adaptree.serve.config`` does not load the web framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptree._lazy import lazy_exports

_EXPORTS = {"ServeConfig": "adaptree.serve.config", "Server": "adaptree.serve.app", "create_app": "adaptree.serve.app",
            "serve": "adaptree.serve.server", "start_server": "adaptree.serve.server",
            "RunningServer": "adaptree.serve.server", "run_load_test": "adaptree.serve.loadtest"}

__all__ = ["ServeConfig", "Server", "create_app", "serve", "start_server", "RunningServer", "run_load_test"]

if TYPE_CHECKING:
    from adaptree.serve.app import Server, create_app
    from adaptree.serve.config import ServeConfig
    from adaptree.serve.loadtest import run_load_test
    from adaptree.serve.server import RunningServer, serve, start_server


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
