"""The ASGI app (Starlette): the OpenAI endpoints on one :class:`~adaptree.api.Pipeline`, ``/health`` and
``/metrics``.

- ``GET /v1/models``, ``GET /v1/models/{id}``: the one model served.
- ``POST /v1/chat/completions``: chat messages through the model's chat template.
- ``POST /v1/completions``: a raw prompt (a string or token ids), no template.
- ``GET /health``: ``{"status": "ok", ...}`` with the queue's state; ``GET /metrics``: Prometheus text.

Every request is checked before it queues (a bad value is a 400 naming it, :mod:`adaptree.serve.protocol`), then
waits for the engine in a :class:`~adaptree.serve.scheduler.Scheduler`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from adaptree.core.pipeline import PipelineLike
from adaptree.serve import limits, protocol
from adaptree.serve.config import ServeConfig
from adaptree.serve.errors import APIError, InvalidRequest, NotFound, Unauthorized, error_body
from adaptree.serve.metrics import Metrics
from adaptree.serve.protocol import CHAT, COMPLETION, GenerationRequest
from adaptree.serve.scheduler import Job, JobResult, Scheduler

log = logging.getLogger(__name__)


def _model_name(pipeline: PipelineLike) -> str:
    return pipeline.model_label


class Server:
    """The app's state: the pipeline, its scheduler and metrics, and the endpoints."""

    def __init__(self, pipeline: PipelineLike, config: ServeConfig | None = None) -> None:
        self.pipeline = pipeline
        self.config = config = config or ServeConfig()
        if config.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {config.default_max_tokens}")
        self.model = config.served_model_name or _model_name(pipeline)
        self.default_method = config.method or pipeline.default_method
        # a bad default fails now, not per request
        default = pipeline.controller(self.default_method, **config.method_options)
        try:
            limits.check_tree(limits.tree_cost(getattr(default, "config", None)), config, self.default_method)
        except InvalidRequest as exc:
            raise ValueError(f"the server's default method: {exc.message}") from None
        self.tokenizer_lock = threading.Lock()
        self.metrics = Metrics()
        self.scheduler = Scheduler(pipeline, config.max_queue, self.metrics, self.tokenizer_lock)
        self.metrics.bind(self.scheduler)
        self.created = int(time.time())
        from adaptree._version import __version__

        self.fingerprint = f"adaptree-{__version__}-{pipeline.execution}"
        self.metrics.info.info({"model": self.model, "execution": pipeline.execution,
                                "default_method": self.default_method, "version": __version__,
                                "context": str(pipeline.engine.max_len)})

    # ----------------------------------------------------------------------------------------- lifecycle

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        if self.config.warmup:
            await run_in_threadpool(self._warmup)
        self.scheduler.start()
        log.info("serving %s (%s, default method %s)", self.model, self.pipeline.execution, self.default_method)
        try:
            yield
        finally:
            await run_in_threadpool(self.scheduler.close, self.config.graceful_timeout)

    def begin_shutdown(self) -> None:
        """The HTTP server is shutting down: new requests get 503; the ones running and queued get
        ``graceful_timeout`` seconds, then the rest are cancelled (the running one at its next cycle), each
        answered with a 503 error object (an error event on a stream). Call it on the event loop."""
        self.scheduler.stop_accepting()
        asyncio.get_running_loop().call_later(max(0.0, self.config.graceful_timeout), self.scheduler.cancel_all)

    def _warmup(self) -> None:
        p = self.pipeline
        ids = p.encode("Hello", chat=False) or [0]
        ids = ids[: max(1, p.engine.max_len - 8)]
        p.engine.generate(ids, p.controller(self.default_method, **self.config.method_options),
                          max_new_tokens=min(4, p.engine.max_len - len(ids)))

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model_endpoint, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]
        app = Starlette(routes=routes, lifespan=self.lifespan,
                        exception_handlers={HTTPException: _http_error, APIError: _api_error, Exception: _server_error})
        app.state.server = self
        return app

    # ----------------------------------------------------------------------------------------- endpoints

    async def health(self, request: Request) -> Response:
        s = self.scheduler
        status = "shutting_down" if s.closed else "ok"
        return JSONResponse({"status": status, "model": self.model, "execution": self.pipeline.execution,
                             "default_method": self.default_method, "busy": s.busy, "queue_depth": s.depth,
                             "max_queue": s.max_queue, "context": self.pipeline.engine.max_len},
                            status_code=503 if s.closed else 200)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    def _model_card(self) -> dict[str, Any]:
        from adaptree.methods import METHODS

        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "adaptree",
                "max_model_len": self.pipeline.engine.max_len, "execution": self.pipeline.execution,
                "default_method": self.default_method, "methods": list(METHODS)}

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_endpoint(self, request: Request) -> Response:
        self._authorize(request)
        name = request.path_params["model"]
        if name != self.model:
            raise NotFound(f"the model {name!r} does not exist; this server serves {self.model!r}", param="model",
                           code="model_not_found")
        return JSONResponse(self._model_card())

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, CHAT, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETION, "completions")

    # -------------------------------------------------------------------------------------------- helpers

    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key and request.headers.get("authorization", "") != f"Bearer {key}":
            raise Unauthorized("a valid API key is needed: send 'Authorization: Bearer KEY'", code="invalid_api_key")

    async def _body(self, request: Request) -> Any:
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise _TooLarge(f"the request body has {length} bytes; the limit is {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():  # counted as it arrives: a chunked upload without a length is cut off too
            size += len(chunk)
            if size > limit:
                raise _TooLarge(f"the request body has more than {limit} bytes (the limit)")
            chunks.append(chunk)
        return await run_in_threadpool(self._parse, b"".join(chunks))  # megabytes of JSON: off the event loop

    def _parse(self, raw: bytes) -> Any:
        limits.check_json_depth(raw, self.config.max_json_depth)  # before the parser recurses into it
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:  # past the depth scan (it cannot be, but a 500 would be the wrong answer)
            raise InvalidRequest("the request body nests too deep to parse", code="invalid_json") from None

    def _prepare(self, req: GenerationRequest) -> tuple[list[int], Any, int]:
        """Token ids, controller and max new tokens of ``req`` (in a worker thread: tokenising and loading a
        policy take time); an InvalidRequest names what does not fit."""
        p = self.pipeline
        method = req.method or self.default_method
        options = protocol.check_method_options(method, req.method_options)  # the request's: no file paths
        if req.method is None:  # the server's default method with the server's options (files allowed there)
            options = {**self.config.method_options, **options}
        cost = self._tree_cost(method, options)
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            vocab = p.target.config.vocab_size
            bad = [t for t in req.prompt if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                     param="prompt", code="invalid_value")
            ids = list(req.prompt)
        else:
            try:
                with self.tokenizer_lock:
                    ids = p.encode(req.prompt, chat=req.chat if req.kind == COMPLETION else None)
            except ValueError as exc:
                raise InvalidRequest(str(exc), param=req.prompt_param, code="invalid_value") from None
            except Exception as exc:  # the chat template refusing these messages (a jinja error), ...
                raise InvalidRequest(f"the {req.prompt_param} could not be tokenised: {type(exc).__name__}: {exc}",
                                     param=req.prompt_param, code="invalid_value") from None
        n, limit = len(ids), p.engine.max_len
        if n == 0:
            raise InvalidRequest("the prompt is empty (it has no tokens)", param=req.prompt_param,
                                 code="invalid_value")
        if n >= limit:
            raise InvalidRequest(f"the prompt has {n} tokens; this model's context is {limit} tokens (prompt and "
                                 "completion together), so there is no room to generate", param=req.prompt_param,
                                 code="context_length_exceeded")
        if req.max_tokens is not None:
            if n + req.max_tokens > limit:
                raise InvalidRequest(f"the prompt ({n} tokens) and max_tokens ({req.max_tokens}) add up to "
                                     f"{n + req.max_tokens} tokens; this model's context is {limit} tokens",
                                     param="max_tokens", code="context_length_exceeded")
            max_new = req.max_tokens
        else:
            max_new = max(1, min(self.config.default_max_tokens, limit - n, limits.budget_tokens(cost, self.config)))
        limits.check_budget(cost, max_new, self.config)
        from adaptree.methods import MissingAssetError

        try:
            controller = p.controller(method, **options)
        except MissingAssetError as exc:
            raise InvalidRequest(f"method {method!r} cannot run on this model: {exc}", param="method",
                                 code="method_unavailable") from None
        except (ValueError, TypeError, ArithmeticError) as exc:
            raise InvalidRequest(f"bad options for method {method!r}: {exc}", param="method_options",
                                 code="invalid_value") from None
        return ids, controller, max_new

    def _tree_cost(self, method: str, options: dict[str, Any]) -> limits.TreeCost:
        """The tree ``method`` may draft with ``options``, within this server's limits (its config alone is built:
        a controller may size tables by its tree)."""
        from adaptree.methods import REGISTRY

        config_class = REGISTRY[method].config
        try:
            config = config_class(**options) if config_class is not None else None
        except (ValueError, TypeError, ArithmeticError) as exc:
            raise InvalidRequest(f"bad options for method {method!r}: {exc}", param="method_options",
                                 code="invalid_value") from None
        cost = limits.tree_cost(config)
        limits.check_tree(cost, self.config, method)
        return cost

    async def _generate(self, request: Request, kind: str, endpoint: str) -> Response:
        arrived = time.perf_counter()
        try:
            self._authorize(request)
            body = await self._body(request)
            req = protocol.parse_request(body, kind)
            if req.model is not None and req.model != self.model:
                raise InvalidRequest(f"the model {req.model!r} does not exist; this server serves {self.model!r}",
                                     param="model", code="model_not_found")
            ids, controller, max_new = await run_in_threadpool(self._prepare, req)
            job = Job(ids, controller, max_new, req.sampling, req.stop, endpoint=endpoint, arrived=arrived,
                      loop=asyncio.get_running_loop())
            self.scheduler.submit(job)
        except APIError as exc:
            self.metrics.rejected(endpoint, {429: "rejected", 503: "shutdown"}.get(exc.status, "invalid"))
            return _api_error(request, exc)
        except Exception as exc:  # a bug of ours, not the client's: answered, logged, and the server carries on
            self.metrics.rejected(endpoint, "failed")
            return _server_error(request, exc)
        rid = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(self._events(job, req, rid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._reply(request, job, req, rid, created)

    def _usage(self, job: Job, out: JobResult) -> dict[str, Any]:
        extra = {"queue_wait_s": round(out.queue_s, 4),
                 "time_to_first_token_s": None if out.ttft_s is None else round(out.ttft_s, 4)}
        return protocol.usage(len(job.prompt_ids), out.result, extra)

    async def _reply(self, request: Request, job: Job, req: GenerationRequest, rid: str, created: int) -> Response:
        """Wait for the job; a client that disconnects meanwhile cancels it."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                event = asyncio.ensure_future(job.next_event())
                done, _ = await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
                if event not in done:
                    event.cancel()
                    job.cancel()
                    return Response(status_code=499)  # nobody reads it
                kind, value = event.result()
                if kind == "done":
                    return JSONResponse(protocol.response_body(req, rid, created, self.model, value.text,
                                                               value.finish_reason, self._usage(job, value),
                                                               self.fingerprint))
                if kind == "error":
                    return _api_error(request, value)
        finally:
            gone.cancel()
            if not job.finished:
                job.cancel()

    async def _events(self, job: Job, req: GenerationRequest, rid: str, created: int):
        """The SSE stream of a job; leaving it early (the client disconnected) cancels the job."""

        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        args = (req, rid, created, self.model, self.fingerprint)
        try:
            if req.kind == CHAT:
                yield sse(protocol.chunk_body(*args, role=True))
            while True:
                kind, value = await job.next_event()
                if kind == "text":
                    yield sse(protocol.chunk_body(*args, text=value))
                elif kind == "done":
                    yield sse(protocol.chunk_body(*args, text="" if req.kind == COMPLETION else None,
                                                  finish_reason=value.finish_reason))
                    if req.include_usage:
                        yield sse(protocol.chunk_body(*args, usage_obj=self._usage(job, value)))
                    break
                elif kind == "error":
                    yield sse(value.body())
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not job.finished:
                job.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: nothing else arrives before that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _TooLarge(APIError):
    status = 413
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_too_large")


def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _http_error(request: Request, exc: HTTPException) -> Response:
    messages = {404: f"no such endpoint: {request.method} {request.url.path}",
                405: f"method {request.method} is not allowed on {request.url.path}"}
    body = error_body(messages.get(exc.status_code, str(exc.detail)), "invalid_request_error",
                      code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)


def create_app(pipeline: PipelineLike, config: ServeConfig | None = None) -> Starlette:
    """The ASGI app serving ``pipeline`` (run it with uvicorn: :func:`adaptree.serve.serve`, which also tells it
    when shutdown begins; under a plain uvicorn the requests still running at the end of uvicorn's graceful
    shutdown are cancelled by uvicorn)."""
    return Server(pipeline, config).app()
