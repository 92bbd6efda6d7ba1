"""Reference arms in worker processes: a crash in a library the bench does not own costs that arm, not the bench.

llama.cpp and transformers run native kernels adaptree cannot vouch for: llama-cpp-python built with native flags
can die with SIGILL on a CPU its build did not expect, and the signal would end the whole ``adaptree bench`` with no
message and no summary. So every reference arm runs in a worker process (started with ``spawn``: no forked torch
or OpenMP state) that builds its arms once, loading their model, then serves the bench's generations one at a time.
The arm times its generation inside the worker exactly as it would in the bench's process, so neither the start
nor the transfer of prompts and results is in ``wall_time_s``; the worker runs on the bench's torch thread count.

When a worker dies (a signal or an exit status) or an arm raises, the call raises :class:`ArmFailed`; the bench
drops the arm and goes on (:func:`adaptree.bench.runner.bench_loop`). An error while building the arms (a missing
file, a bad option) is raised in the bench's process as it was raised in the worker: it is bad input, not a crash.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import pickle
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from adaptree.core.records import GenerationResult
from adaptree.core.verify import SamplingConfig


@dataclass(frozen=True)
class ArmRecipe:
    """How a worker builds reference arms: ``build(methods, **kwargs) -> {method: arm}``, called in the worker.

    ``build`` is pickled by reference (a module-level function) and ``kwargs`` by value. Arms whose recipes name
    the same ``group`` share one worker and what it loaded (the Hugging Face arms share one copy of the weights);
    ``None`` gives the arm a worker of its own."""

    build: Callable[..., Mapping[str, Callable[[list[int], int, SamplingConfig], GenerationResult]]]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    group: str | None = None


class ArmFailed(RuntimeError):
    """A reference arm cannot go on: its worker died, or its generation raised."""


class ArmWorker:
    """One worker process serving the arms ``methods`` built from ``recipe``; started on first use."""

    def __init__(self, recipe: ArmRecipe, methods: Sequence[str]) -> None:
        self.recipe, self.methods = recipe, list(methods)
        self.failure: str | None = None
        """Why the worker serves no more (``worker died with SIGILL``), or None."""
        self._process = None
        self._conn = None
        self._ready = False
        self._busy = False

    @property
    def dead(self) -> bool:
        return self.failure is not None

    @property
    def running(self) -> bool:
        """Started and not closed (it may have died since)."""
        return self._process is not None

    def launch(self) -> None:
        """Start the worker process (it builds its arms in the background: :meth:`wait_ready`)."""
        if self._process is not None or self.dead:
            return
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, name=f"adaptree-arm-{'+'.join(self.methods)}", daemon=True,
                                    args=(child, self.recipe.build, self.methods, dict(self.recipe.kwargs),
                                          torch.get_num_threads()))
        self._process.start()
        self._busy = True  # loading
        child.close()  # the worker's end lives in the worker only: its death closes the pipe, so recv sees EOF

    def wait_ready(self) -> None:
        """Wait until the worker has built its arms. Raises what the build raised, or :class:`ArmFailed` when the
        worker died while building (``... while loading``)."""
        if self.dead:
            raise ArmFailed(self.failure)
        if self._ready:
            return
        self.launch()
        kind, payload = self._receive(" while loading")
        self._busy = False
        if kind == "error":
            self.close()
            raise payload
        self._ready = True

    def run(self, method: str, ids: Sequence[int], max_new_tokens: int, sampling: SamplingConfig) -> GenerationResult:
        self.wait_ready()
        self._busy = True
        try:
            self._conn.send((method, list(ids), max_new_tokens, sampling))
        except OSError:  # it died between two generations
            self._died("")
        kind, payload = self._receive("")
        self._busy = False
        if kind == "error":
            raise ArmFailed(f"raised {type(payload).__name__}: {payload}")
        return payload

    def _receive(self, when: str) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._died(when)

    def _died(self, when: str) -> NoReturn:
        proc = self._process
        proc.join(timeout=10)
        code = proc.exitcode
        if code is None:  # the pipe broke yet the process lives on: end it, it cannot be talked to
            proc.kill()
            proc.join()
            self.failure = "worker stopped answering"
        elif code < 0:
            try:
                self.failure = f"worker died with {signal.Signals(-code).name}"
            except ValueError:
                self.failure = f"worker died with signal {-code}"
        else:
            self.failure = f"worker exited with status {code}"
        self.failure += when
        self._conn.close()
        raise ArmFailed(self.failure)

    def close(self) -> None:
        """Ask the worker to exit (ended after 10 s if it does not; at once if interrupted mid-generation)."""
        proc, self._process = self._process, None
        if proc is None:
            return
        if proc.is_alive() and self._busy:  # the bench was interrupted: its answer is not wanted
            proc.kill()
        if proc.is_alive():
            try:
                self._conn.send(None)
            except OSError:
                pass
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        proc.join()
        self._conn.close()
        self._ready = self._busy = False


class WorkerArm:
    """A reference arm served by an :class:`ArmWorker`, called like an engine arm."""

    def __init__(self, worker: ArmWorker, method: str) -> None:
        self.worker, self.method = worker, method

    def __call__(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingConfig) -> GenerationResult:
        return self.worker.run(self.method, prompt_ids, max_new_tokens, sampling)


def worker_arms(recipes: Mapping[str, ArmRecipe]) -> dict[str, WorkerArm]:
    """An arm per method of ``recipes``; methods whose recipes share a group share a worker (their recipes must be
    equal: one worker builds them all)."""
    groups: dict[str, list[str]] = {}
    for m, r in recipes.items():
        groups.setdefault(r.group if r.group is not None else f"\0{m}", []).append(m)
    arms = {}
    for methods in groups.values():
        recipe = recipes[methods[0]]
        for m in methods[1:]:
            if recipes[m] != recipe:
                raise ValueError(f"arms {methods[0]} and {m} share worker group {recipe.group!r} with different "
                                 "recipes")
        worker = ArmWorker(recipe, methods)
        arms.update({m: WorkerArm(worker, m) for m in methods})
    return arms


def workers_of(arms: Iterable) -> list[ArmWorker]:
    """The distinct workers behind ``arms`` (engine arms have none)."""
    return list({id(a.worker): a.worker for a in arms if isinstance(a, WorkerArm)}.values())


def start(workers: Sequence[ArmWorker]) -> None:
    """Start ``workers`` together (their models load side by side), then wait for each; a worker that died while
    loading is left :attr:`~ArmWorker.dead` for the caller to report. What a build raised is raised here, after
    every worker is closed."""
    for w in workers:
        w.launch()
    try:
        for w in workers:
            try:
                w.wait_ready()
            except ArmFailed:
                pass
    except BaseException:
        for w in workers:
            w.close()
        raise


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a RuntimeError with its type and message (it must cross the pipe)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _serve(conn, build, methods: list[str], kwargs: dict, threads: int) -> None:
    """The worker's main loop: build the arms, then answer ``(method, ids, max_new_tokens, sampling)`` requests with
    ``("ok", GenerationResult)`` or ``("error", exception)`` until ``None`` or the bench's end of the pipe closes."""
    faulthandler.enable()  # a native crash prints the worker's Python stack before the signal ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's to handle: it closes the workers
    torch.set_num_threads(threads)
    try:
        arms = build(methods, **kwargs)
    except Exception as exc:
        conn.send(("error", _portable(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        method, ids, max_new_tokens, sampling = request
        try:
            reply = ("ok", arms[method](ids, max_new_tokens, sampling))
        except Exception as exc:
            reply = ("error", _portable(exc))
        conn.send(reply)
