"""Running the app with uvicorn: :func:`serve` in the foreground (``adaptree serve``), :func:`start_server` in a
thread of this process (tests, the load test)."""

from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from adaptree.core.pipeline import PipelineLike
from adaptree.serve.app import Server
from adaptree.serve.config import ServeConfig

BACKSTOP_S = 5
"""Seconds after the grace period at which uvicorn cancels what is still running (the app's own cancellation
comes first and answers every client; this is only a backstop)."""


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins (so it can finish, then cancel, cleanly)."""

    def __init__(self, pipeline: PipelineLike, config: ServeConfig, log_level: str, access_log: bool) -> None:
        self.app_state = Server(pipeline, config)
        super().__init__(uvicorn.Config(self.app_state.app(), host=config.host, port=config.port, log_level=log_level,
                                        access_log=access_log, lifespan="on",
                                        timeout_graceful_shutdown=math.ceil(max(0.0, config.graceful_timeout))
                                        + BACKSTOP_S))

    async def shutdown(self, sockets=None) -> None:
        self.app_state.begin_shutdown()
        await super().shutdown(sockets)


def serve(pipeline: PipelineLike, config: ServeConfig | None = None, *, log_level: str = "info",
          access_log: bool = True) -> None:
    """Serve ``pipeline`` until interrupted (Ctrl-C / SIGTERM: no new connections, the requests in progress get
    ``graceful_timeout`` seconds, then the rest are cancelled at their next cycle)."""
    config = config or ServeConfig()
    server = _Uvicorn(pipeline, config, log_level, access_log)
    server.run()
    if not server.started:
        raise OSError(f"the server did not start on {config.host}:{config.port} (see the log above)")


@dataclass
class RunningServer:
    """A server running in a thread of this process: its base URL and :meth:`stop`."""

    host: str
    port: int
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def app_state(self) -> Server:
        """The app's :class:`~adaptree.serve.app.Server` (its scheduler, metrics, config)."""
        return self.server.app_state

    @property
    def url(self) -> str:
        """``http://host:port`` (the OpenAI base URL is this plus ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 60.0) -> None:
        """Shut down as on Ctrl-C and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(pipeline: PipelineLike, config: ServeConfig | None = None, *, log_level: str = "warning",
                 access_log: bool = False, timeout: float = 120.0) -> RunningServer:
    """Start a server for ``pipeline`` in a background thread (``config.port`` 0: a free port, the default here)
    and return once it accepts connections."""
    config = config or ServeConfig(port=0)
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    port = sock.getsockname()[1]
    server = _Uvicorn(pipeline, config, log_level, access_log)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="adaptree-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive():
            sock.close()
            raise RuntimeError("the server thread ended before it started (see the log)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"the server did not start within {timeout} s")
        time.sleep(0.01)
    return RunningServer(config.host, port, server, thread)
