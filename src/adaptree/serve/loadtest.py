"""A bounded load test: concurrent streaming chat clients (the official ``openai`` client, one per thread), each
sending a few requests one after the other, against a running server (``scripts/load_test.py`` runs it and writes
the results JSON; docs/serving.md).

Every request ends in one of: ``completed`` (a ``[DONE]``-terminated stream with a finish reason), ``rejected``
(429, queue full) or ``error`` (anything else: a lost request). The summary checks what the server promises:
nothing lost, every stream one response (one id per stream, ids unique), and with greedy decoding the same
prompt gives the same text whichever client sent it and whatever ran around it (nothing interleaved).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

PROMPTS = ("Name three primes.", "What is a KV cache?", "Write a haiku about the sea.",
           "Explain recursion in one sentence.", "What is the capital of France?", "Count from one to five.",
           "Give a synonym for quick.", "What does a compiler do?")
"""The default prompts (client c's request i sends prompt (c * requests + i) mod len)."""


def _one_request(client, model: str, prompt: str, max_tokens: int, temperature: float, seed: int | None,
                 method: str | None) -> dict[str, Any]:
    import openai

    extra = {"method": method} if method else {}
    rec: dict[str, Any] = {"prompt": prompt, "status": "error", "text": "", "ids": [], "chunks": 0}
    t0 = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=temperature, seed=seed, stream=True, stream_options={"include_usage": True},
            extra_body=extra or None)
        pieces = []
        for chunk in stream:
            rec["chunks"] += 1
            rec["ids"].append(chunk.id)
            if chunk.usage is not None:
                rec["completion_tokens"] = chunk.usage.completion_tokens
                own = (chunk.usage.model_extra or {}).get("adaptree") or {}
                rec["tau"], rec["method"] = own.get("tau"), own.get("method")
                rec["server_ttft_s"], rec["queue_wait_s"] = own.get("time_to_first_token_s"), own.get("queue_wait_s")
            for choice in chunk.choices:
                if choice.delta.content:
                    if "ttft_s" not in rec:
                        rec["ttft_s"] = time.perf_counter() - t0
                    pieces.append(choice.delta.content)
                if choice.finish_reason:
                    rec["finish_reason"] = choice.finish_reason
        rec["text"] = "".join(pieces)
        rec["status"] = "completed" if rec.get("finish_reason") else "error"
    except openai.RateLimitError as exc:
        rec["status"] = "rejected"
        rec["retry_after"] = exc.response.headers.get("retry-after")
    except openai.OpenAIError as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["latency_s"] = time.perf_counter() - t0
    rec["ids"] = sorted(set(rec["ids"]))
    return rec


def _pct(xs: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if len(xs) else None


def run_load_test(base_url: str, *, model: str, clients: int = 16, requests_per_client: int = 4,
                  max_tokens: int = 16, prompts: Sequence[str] = PROMPTS, temperature: float = 0.0,
                  seed: int | None = None, method: str | None = None, api_key: str = "none",
                  timeout: float = 600.0) -> dict[str, Any]:
    """Run ``clients`` concurrent streaming clients, ``requests_per_client`` requests each, against the server at
    ``base_url`` (``http://host:port``) and return the summary (counts, latency and time-to-first-token
    percentiles in seconds, checks) with every request's record under ``records``."""
    try:
        import openai
    except ImportError as exc:  # a test dependency, not the server's
        raise ImportError("the load test needs the openai client: pip install openai (or adaptree[test])") from exc

    records: list[list[dict]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients)

    def work(c: int) -> None:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=timeout)
        start.wait()
        for i in range(requests_per_client):
            prompt = prompts[(c * requests_per_client + i) % len(prompts)]
            rec = _one_request(client, model, prompt, max_tokens, temperature, seed, method)
            rec.update(client=c, index=i)
            records[c].append(rec)
        client.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(c,), name=f"load-client-{c}") for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    flat = [r for rs in records for r in rs]
    done = [r for r in flat if r["status"] == "completed"]
    rejected = [r for r in flat if r["status"] == "rejected"]
    errors = [r for r in flat if r["status"] == "error"]
    ids = [r["ids"][0] for r in done if len(r["ids"]) == 1]
    by_prompt: dict[str, set[str]] = {}
    for r in done:
        by_prompt.setdefault(r["prompt"], set()).add(r["text"])
    tokens = sum(r.get("completion_tokens") or 0 for r in done)
    taus = [r["tau"] for r in done if r.get("tau")]
    lat = [r["latency_s"] for r in done]
    ttft = [r["ttft_s"] for r in done if "ttft_s" in r]
    return {
        "requests": len(flat), "concurrency": clients, "requests_per_client": requests_per_client,
        "max_tokens": max_tokens, "temperature": temperature, "method": method or "(server default)",
        "completed": len(done), "rejected_429": len(rejected), "errors": len(errors),
        "lost": len(flat) - len(done) - len(rejected),
        "latency_s": {"p50": _pct(lat, 50), "p95": _pct(lat, 95), "max": _pct(lat, 100)},
        "ttft_s": {"p50": _pct(ttft, 50), "p95": _pct(ttft, 95), "max": _pct(ttft, 100)},
        "rejected_latency_s": {"p50": _pct([r["latency_s"] for r in rejected], 50),
                               "max": _pct([r["latency_s"] for r in rejected], 100)},
        "wall_s": round(wall, 3), "completion_tokens": tokens,
        "throughput_tokens_per_s": round(tokens / wall, 3) if wall > 0 else None,
        "mean_tau": round(float(np.mean(taus)), 4) if taus else None,
        "checks": {
            "one_id_per_stream": all(len(r["ids"]) == 1 for r in done),
            "ids_unique": len(ids) == len(set(ids)),
            "greedy_text_per_prompt_identical": (all(len(t) == 1 for t in by_prompt.values())
                                                 if temperature == 0 else None),
            "every_429_has_retry_after": all(r.get("retry_after") for r in rejected),
        },
        "error_messages": sorted({r.get("error", "no finish reason") for r in errors}),
        "records": flat,
    }
