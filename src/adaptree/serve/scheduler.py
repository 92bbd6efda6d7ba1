"""One engine, one generation at a time: a bounded FIFO queue in front of it and the thread that runs it.

The engine is batch 1 and owns its KV caches, so requests never run side by side: :meth:`Scheduler.submit`
queues a :class:`Job` (or refuses it with :class:`~adaptree.serve.errors.QueueFull` when ``max_queue`` jobs are
already waiting behind the running one), the engine thread runs the jobs in arrival order and hands each one's
text pieces and result to the event loop that waits for them. :meth:`Job.cancel` (a client that went away) takes
a waiting job out of the queue, or ends a running one at its next cycle; a job that fails is answered with an
error and the thread carries on with the next.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adaptree.core.controller import Controller, CycleContext, TreePlan
from adaptree.core.pipeline import PipelineLike
from adaptree.core.records import CycleRecord, GenerationResult
from adaptree.core.text import TextAssembler
from adaptree.core.verify import SamplingConfig
from adaptree.serve.errors import GenerationFailed, QueueFull, ShuttingDown

log = logging.getLogger(__name__)

_ids = itertools.count(1)


class _Halt(Exception):
    """Raised at the start of a cycle to end a generation that was cancelled or reached a stop sequence."""


class _Watched(Controller):
    """The job's controller, unchanged (every hook of the seam delegated to it), with two additions: a cycle does
    not begin once the job is cancelled or its text reached a stop sequence, and every cycle's record is kept (for
    the figures of a generation that was ended early)."""

    def __init__(self, inner: Controller, job: Job) -> None:
        self.inner, self.job = inner, job
        self.name, self.uses_draft, self.reads_features = inner.name, inner.uses_draft, inner.reads_features
        self.records: list[CycleRecord] = []

    def reset(self) -> None:
        self.records.clear()
        self.inner.reset()

    def context_index(self):
        return self.inner.context_index()

    def use_latency(self, latency) -> None:
        self.inner.use_latency(latency)

    def begin_cycle(self, ctx: CycleContext) -> TreePlan:
        if self.job.halt_requested:
            raise _Halt
        return self.inner.begin_cycle(ctx)

    def continue_drafting(self, step) -> bool:
        return self.inner.continue_drafting(step)

    def choose_size(self, tree, plan: TreePlan) -> int:
        return self.inner.choose_size(tree, plan)

    def choose_chain(self, tree, plan: TreePlan, size: int) -> int:
        return self.inner.choose_chain(tree, plan, size)

    def end_cycle(self, record: CycleRecord) -> None:
        self.records.append(record)
        self.inner.end_cycle(record)


@dataclass
class JobResult:
    """A finished generation as the server answers it."""

    text: str
    finish_reason: str
    """OpenAI's: ``stop`` (EOS or a stop sequence) or ``length`` (max_tokens or the context limit)."""
    result: GenerationResult
    """The engine's figures; ``stop_reason`` is eos, max_new_tokens, context_limit, stop_sequence or cancelled."""
    queue_s: float
    """Seconds between the request's arrival and the engine starting it."""
    ttft_s: float | None
    """Seconds between the request's arrival and its first text."""
    latency_s: float
    """Seconds between the request's arrival and the end of its generation."""


class Job:
    """One generation request on its way through the queue; its events (``("text", piece)``, ``("done",
    JobResult)``, ``("error", APIError)``) arrive on the event loop that created it."""

    def __init__(self, prompt_ids: Sequence[int], controller: Controller, max_new_tokens: int, sampling: SamplingConfig,
                 stop: Sequence[str] = (), *, endpoint: str = "", arrived: float | None = None,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.id = next(_ids)
        self.prompt_ids, self.controller = list(prompt_ids), controller
        self.max_new_tokens, self.sampling, self.stop = max_new_tokens, sampling, tuple(stop)
        self.endpoint = endpoint
        self.arrived = time.perf_counter() if arrived is None else arrived
        self.loop = loop or asyncio.get_running_loop()
        self.state = "new"
        """new, queued, running or finished."""
        self.generated = 0
        """Tokens generated so far."""
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self._stop_seen = False
        self._shutdown = False
        self._scheduler: Scheduler | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def halt_requested(self) -> bool:
        return self._cancel.is_set() or self._stop_seen

    @property
    def finished(self) -> bool:
        return self.state == "finished"

    def cancel(self) -> None:
        """The client went away: leave the queue, or end the generation at its next cycle."""
        if self.finished or self._cancel.is_set():
            return
        self._cancel.set()
        if self._scheduler is not None:
            self._scheduler._discard(self)

    def send(self, kind: str, value: Any = None) -> None:
        """Hand an event to the waiting coroutine (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    async def next_event(self) -> tuple[str, Any]:
        return await self._events.get()


class Scheduler:
    """A bounded FIFO queue in front of ``pipeline``'s engine and the one thread that runs it.

    :param max_queue: jobs that may wait behind the running one; one more is refused (429).
    :param metrics: a :class:`~adaptree.serve.metrics.Metrics` told about every job's end.
    :param tokenizer_lock: held around every use of the tokenizer (shared with the request handlers).
    """

    def __init__(self, pipeline: PipelineLike, max_queue: int = 16, metrics=None,
                 tokenizer_lock: threading.Lock | None = None) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.pipeline, self.max_queue, self.metrics = pipeline, max_queue, metrics
        self.tokenizer_lock = tokenizer_lock or threading.Lock()
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._service_s = 1.0
        """Running mean of a job's seconds in the engine (for Retry-After)."""

    # ---------------------------------------------------------------------------------------------- state

    @property
    def depth(self) -> int:
        """Jobs waiting (the running one not included)."""
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely free (at least 1)."""
        return max(1, min(3600, math.ceil(self._service_s * (len(self._waiting) + 1))))

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="adaptree-engine", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`QueueFull` when ``max_queue`` jobs already wait behind a running one,
        :class:`ShuttingDown` after :meth:`close`."""
        with self._cond:
            if self._closed:
                raise ShuttingDown()
            if len(self._waiting) + (self._running is not None) > self.max_queue:
                raise QueueFull(f"the server is busy: one generation is running and {len(self._waiting)} "
                                f"{'request is' if len(self._waiting) == 1 else 'requests are'} waiting (the "
                                f"queue holds {self.max_queue}); retry later", self.retry_after())
            job._scheduler = self
            job.state = "queued"
            self._waiting.append(job)
            self._cond.notify_all()

    def _discard(self, job: Job) -> None:
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running (it stops at its next cycle) or already taken
            job.state = "finished"
        self._count(job, "cancelled")

    def stop_accepting(self) -> None:
        """Refuse new jobs (:class:`ShuttingDown`); the queued ones still run, then the engine thread ends."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def cancel_all(self) -> None:
        """Refuse new jobs, answer the waiting ones with :class:`ShuttingDown` and end the running one at its next
        cycle (its client gets the same error). Does not wait."""
        with self._cond:
            self._closed = True
            waiting = list(self._waiting)
            self._waiting.clear()
            running = self._running
            self._cond.notify_all()
        for job in waiting:
            job.state = "finished"
            self._count(job, "shutdown")  # counted before the client can see the answer (metrics read after it agree)
            job.send("error", ShuttingDown("the server shut down before this request's turn came"))
        if running is not None:
            running._shutdown = True
            running._cancel.set()

    def close(self, timeout: float | None = 30.0) -> None:
        """:meth:`cancel_all`, then wait (at most ``timeout`` seconds) for the engine thread to end."""
        self.cancel_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------ the engine

    def _count(self, job: Job, outcome: str, out: JobResult | None = None) -> None:
        if self.metrics is not None:
            self.metrics.job_done(job, outcome, out)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running = job
                job.state = "running"
            try:
                self._run(job)
            except BaseException:  # never expected (_run answers every error); keep the thread alive regardless
                log.exception("the engine thread failed on request %s", job.id)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job) -> None:
        if job.cancelled:
            job.state = "finished"
            self._count(job, "cancelled")
            return
        pipe = self.pipeline
        t0 = time.perf_counter()
        queue_s = t0 - job.arrived
        if self.metrics is not None:
            self.metrics.job_started(job, queue_s)
        ctl = _Watched(job.controller, job)
        text = TextAssembler(pipe.tokenizer, job.stop, self.tokenizer_lock)
        first: dict[str, float] = {}

        def on_tokens(new: list[int]) -> None:
            first.setdefault("prefill", time.perf_counter())
            job.generated += len(new)
            piece = text.add(new)
            if piece:
                first.setdefault("text", time.perf_counter())
                job.send("text", piece)
            if text.stop_seen:
                job._stop_seen = True

        try:
            try:
                res = pipe.engine.generate(job.prompt_ids, ctl, max_new_tokens=job.max_new_tokens,
                                           sampling=job.sampling, on_tokens=on_tokens)
            except _Halt:
                wall = time.perf_counter() - t0
                res = GenerationResult(prompt_len=len(job.prompt_ids), token_ids=list(text.ids), cycles=ctl.records,
                                       prefill_s=first.get("prefill", t0) - t0, wall_time_s=wall,
                                       stop_reason="stop_sequence" if text.stop_seen else "cancelled",
                                       method=ctl.name)
            final, piece = text.finish()
        except Exception as exc:
            log.exception("request %s failed in the engine", job.id)
            job.state = "finished"
            self._count(job, "failed")
            job.send("error", GenerationFailed(f"the generation failed: {type(exc).__name__}: {exc}"))
            return
        end = time.perf_counter()
        self._service_s = 0.7 * self._service_s + 0.3 * (end - t0)
        if piece:
            first.setdefault("text", end)
            job.send("text", piece)
        if text.stop_seen and res.stop_reason != "cancelled":
            res.stop_reason = "stop_sequence"
        finish = "stop" if res.stop_reason in ("eos", "stop_sequence") else "length"
        out = JobResult(final, finish, res, queue_s, first["text"] - job.arrived if "text" in first else None,
                        end - job.arrived)
        job.state = "finished"
        if res.stop_reason == "cancelled" and job._shutdown:
            self._count(job, "shutdown", out)
            job.send("error", ShuttingDown(f"the server shut down during the generation (after {res.new_tokens} "
                                           "tokens)"))
            return
        self._count(job, "cancelled" if res.stop_reason == "cancelled" else "completed", out)
        job.send("done", out)
