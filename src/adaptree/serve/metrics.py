"""The server's Prometheus metrics (``GET /metrics``, text format), one registry per app.

Counters (``_total``): requests by endpoint and outcome (completed, cancelled, failed, rejected = 429, invalid =
400/401/404, shutdown), prompt and completion tokens, cycles, cycle tokens (accepted draft tokens + 1 summed over
cycles: τ over any window = cycle tokens / cycles), generation seconds (tokens/s over any window = completion
tokens / generation seconds). Gauges: queue depth, engine busy. Histograms: per-request τ, tokens/s, latency,
time to first token and queue wait. ``adaptree_model_info`` names the model, execution mode and default method.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

OUTCOMES = ("completed", "cancelled", "failed", "rejected", "invalid", "shutdown")

_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """Every figure ``/metrics`` shows; the scheduler and the request handlers report to it."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("adaptree_requests", "Requests by endpoint and outcome (completed, cancelled, "
                                "failed, rejected = 429 queue full, invalid = 4xx, shutdown)",
                                ["endpoint", "outcome"], registry=r)
        self.queue_depth = Gauge("adaptree_queue_depth", "Requests waiting for the engine (the running one not "
                                 "included)", registry=r)
        self.busy = Gauge("adaptree_engine_busy", "1 while a generation runs", registry=r)
        self.prompt_tokens = Counter("adaptree_prompt_tokens", "Prompt tokens of the generations started",
                                     registry=r)
        self.completion_tokens = Counter("adaptree_completion_tokens", "Tokens generated", ["method"], registry=r)
        self.cycles = Counter("adaptree_cycles", "Draft-and-verify cycles run", ["method"], registry=r)
        self.cycle_tokens = Counter("adaptree_cycle_tokens", "Accepted draft tokens + 1 summed over cycles (tau = "
                                    "this / adaptree_cycles_total)", ["method"], registry=r)
        self.generation_seconds = Counter("adaptree_generation_seconds", "Seconds the engine spent generating "
                                          "(prefill included)", ["method"], registry=r)
        self.tau = Histogram("adaptree_request_tau", "Acceptance length tau of each generation (mean accepted "
                             "draft tokens + 1 per cycle)", ["method"], registry=r,
                             buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0))
        self.speed = Histogram("adaptree_request_tokens_per_second", "Tokens per second of each generation "
                               "(prefill included)", ["method"], registry=r,
                               buckets=(1, 2, 5, 10, 15, 20, 30, 40, 60, 80, 120, 200, 500, 1000))
        self.latency = Histogram("adaptree_request_latency_seconds", "Seconds from a request's arrival to the end "
                                 "of its generation (queue wait included)", registry=r, buckets=_SECONDS)
        self.ttft = Histogram("adaptree_time_to_first_token_seconds", "Seconds from a request's arrival to its "
                              "first text", registry=r, buckets=_SECONDS)
        self.queue_wait = Histogram("adaptree_queue_wait_seconds", "Seconds a request waited for the engine",
                                    registry=r, buckets=_SECONDS)
        self.info = Info("adaptree_model", "The model served", registry=r)

    def bind(self, scheduler) -> None:
        """Read the queue depth and the engine's state from ``scheduler`` at every scrape."""
        self.queue_depth.set_function(lambda: scheduler.depth)
        self.busy.set_function(lambda: 1.0 if scheduler.busy else 0.0)

    def rejected(self, endpoint: str, outcome: str) -> None:
        """A request answered without a generation (``rejected``, ``invalid``, ``shutdown``)."""
        self.requests.labels(endpoint, outcome).inc()

    def job_started(self, job, queue_s: float) -> None:
        self.queue_wait.observe(queue_s)
        self.prompt_tokens.inc(len(job.prompt_ids))

    def job_done(self, job, outcome: str, out=None) -> None:
        self.requests.labels(job.endpoint, outcome).inc()
        if out is None:
            return
        res = out.result
        m = res.method
        self.completion_tokens.labels(m).inc(res.new_tokens)
        self.generation_seconds.labels(m).inc(res.wall_time_s)
        if res.cycles:
            self.cycles.labels(m).inc(len(res.cycles))
            self.cycle_tokens.labels(m).inc(sum(c.accepted + 1 for c in res.cycles))
            self.tau.labels(m).observe(res.tau)
        if outcome == "completed":
            self.speed.labels(m).observe(res.tokens_per_s)
            self.latency.observe(out.latency_s)
            if out.ttft_s is not None:
                self.ttft.observe(out.ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
