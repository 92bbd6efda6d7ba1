"""Load test of ``adaptree serve``: concurrent streaming chat clients (the official ``openai`` client, one thread
each), a few requests per client, then one results JSON: requests, concurrency, completed, 429s, lost, p50/p95
latency and time to first token (client side), the server's own figures from /metrics (τ, tokens/s, queue wait)
and the machine.

    # starts `adaptree serve` with the arguments after `--` (its own process, a free port), stops it with SIGINT
    python scripts/load_test.py --out docs/results/serving/load-16x4.json -- --dtype float32 --weights float --no-adapt

    # a server that is already running
    python scripts/load_test.py --url http://127.0.0.1:8000 --out load.json

Needs the ``openai`` client (``pip install -e '.[test]'``). Every request ends completed, rejected (429) or lost
(any other error); the script exits 1 when one was lost or a check failed (docs/serving.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from adaptree.serve.loadtest import PROMPTS, run_load_test


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], timeout: float, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "adaptree.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}; its log: {log_path}")
        try:
            if json.loads(_get(url + "/health", 2))["status"] == "ok":
                return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the server did not answer /health within {timeout} s; its log: {log_path}")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, timeout: float = 120.0) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def server_figures(url: str) -> dict:
    """The server's own totals from /metrics: requests by outcome, tokens, τ over every cycle, engine tokens/s."""
    from prometheus_client.parser import text_string_to_metric_families

    text = _get(url + "/metrics").decode()
    totals: dict[str, float] = {}
    outcomes: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "adaptree_requests_total":
                outcomes[s.labels["outcome"]] = outcomes.get(s.labels["outcome"], 0) + s.value
            elif s.name in ("adaptree_completion_tokens_total", "adaptree_cycles_total", "adaptree_cycle_tokens_total",
                            "adaptree_generation_seconds_total", "adaptree_prompt_tokens_total"):
                totals[s.name] = totals.get(s.name, 0) + s.value
    cycles = totals.get("adaptree_cycles_total", 0)
    seconds = totals.get("adaptree_generation_seconds_total", 0)
    return {"requests_by_outcome": outcomes, "prompt_tokens": totals.get("adaptree_prompt_tokens_total"),
            "completion_tokens": totals.get("adaptree_completion_tokens_total"), "cycles": cycles,
            "tau": round(totals.get("adaptree_cycle_tokens_total", 0) / cycles, 4) if cycles else None,
            "engine_seconds": round(seconds, 3),
            "engine_tokens_per_s": round(totals.get("adaptree_completion_tokens_total", 0) / seconds, 3)
            if seconds else None}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, server_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (http://host:port); default: start one")
    p.add_argument("--model-name", help="the model's name on the server (default: the one /v1/models lists)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    p.add_argument("--requests", type=int, default=4, help="requests per client, one after the other (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request (default 16)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy: the texts are checked)")
    p.add_argument("--method", default=None, help="the method every request names (default: the server's)")
    p.add_argument("--api-key", default=os.environ.get("ADAPTREE_API_KEY", "none"))
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for the server to start")
    p.add_argument("--out", required=True, help="the results JSON")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    proc = None
    log_path = Path(tempfile.gettempdir()) / f"adaptree-load-test-server-{os.getpid()}.log"
    url = args.url
    if url is None:
        proc, url = start_server(server_args, args.start_timeout, log_path)
    try:
        health = json.loads(_get(url + "/health"))
        model = args.model_name or json.loads(_get(url + "/v1/models"))["data"][0]["id"]
        res = run_load_test(url, model=model, clients=args.clients, requests_per_client=args.requests,
                            max_tokens=args.max_tokens, temperature=args.temperature, method=args.method,
                            api_key=args.api_key, prompts=PROMPTS)
        res["server"] = {**health, "url": url, "started_here": proc is not None, "args": server_args,
                         "after": json.loads(_get(url + "/health")), "metrics": server_figures(url)}
    finally:
        if proc is not None:
            res_code = stop_server(proc)
            print(f"server stopped (exit status {res_code}); log: {log_path}", file=sys.stderr)
    from adaptree.core.machine import machine_info

    waits = sorted(r["queue_wait_s"] for r in res["records"] if r.get("queue_wait_s") is not None)
    res["queue_wait_s"] = {"p50": waits[len(waits) // 2] if waits else None, "max": waits[-1] if waits else None}
    res["command"] = "python scripts/load_test.py " + " ".join(sys.argv[1:])
    res["machine"] = machine_info()
    res["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    records = res.pop("records")
    res["records"] = [{k: v for k, v in r.items() if k != "ids"} | {"id": r["ids"][0] if r["ids"] else None}
                      for r in records]
    out.write_text(json.dumps(res, indent=2) + "\n")
    lat, ttft = res["latency_s"], res["ttft_s"]
    print(f"{res['requests']} requests, {res['concurrency']} clients: {res['completed']} completed, "
          f"{res['rejected_429']} rejected (429), {res['lost']} lost; latency p50 {lat['p50']} s, p95 {lat['p95']} s; "
          f"TTFT p50 {ttft['p50']} s, p95 {ttft['p95']} s; server tau {res['server']['metrics']['tau']}, "
          f"{res['server']['metrics']['engine_tokens_per_s']} tok/s in the engine; checks {res['checks']} -> {out}")
    return 0 if res["lost"] == 0 and all(v is not False for v in res["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
