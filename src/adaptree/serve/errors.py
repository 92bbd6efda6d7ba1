"""OpenAI-style errors: every failure a client sees is ``{"error": {"message", "type", "param", "code"}}`` with an
HTTP status, never a stack trace."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client as an OpenAI error object with ``status``."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(APIError):
    """400: the request is malformed or asks for something this server cannot do; the message names the value."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    type = "invalid_request_error"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"


class QueueFull(APIError):
    """429: the queue in front of the engine is full; ``Retry-After`` says when to come back."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, code="queue_full", headers={"Retry-After": str(retry_after)})
        self.retry_after = retry_after


class ShuttingDown(APIError):
    """503: the server is shutting down and takes no new work (queued requests get it too)."""

    status = 503
    type = "server_error"

    def __init__(self, message: str = "the server is shutting down") -> None:
        super().__init__(message, code="shutting_down")


class GenerationFailed(APIError):
    """500: the engine raised while generating; the server logs the traceback and carries on."""

    status = 500
    type = "server_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
