"""``adaptree bench --streams N``: the vLLM arms serve the bench's first turns N at once, after the single-stream runs.

adaptree's engine serves one generation at a time; vLLM batches requests continuously. With ``--streams N`` the
bench's first turns (the same token ids as the single-stream table's) are cycled into ``max(2N, prompts)`` requests
and submitted to each vLLM arm together, at most N running at once (as a server with N clients), every repeat with
the arms in a rotated order: total tokens per second, each request's latency from admission, vLLM's acceptance
counts and the token ids, compared with the plain ``vllm`` arm's (or the first vLLM arm's). Records go to
``streams.jsonl`` (resumed like ``results.jsonl``), the table to ``summary.json`` (``streams``) and ``report.md``,
in the form of ``adaptree vllm-bench``'s (:mod:`adaptree.bench.vllm_bench`, which measures several N in one run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm

from adaptree.bench.isolation import ArmFailed

STREAMS = "streams.jsonl"


def stream_arms(methods) -> list[str]:
    """The arms of ``methods`` that serve many streams (vLLM's), the plain one first."""
    from adaptree.bench.vllm_arm import VLLM_METHODS

    arms = [m for m in methods if m in VLLM_METHODS]
    return sorted(arms, key=lambda m: m != "vllm")


def run_streams(cfg, arms, encode, sets, max_len: int, dropped: dict[str, str]) -> list[dict]:
    """Run the ``cfg.streams``-stream batches through the vLLM arms of ``arms`` (their workers running) and append
    them to ``streams.jsonl``; returns every record of this configuration (old ones included)."""
    from adaptree.bench.oracle_section import first_turn_prompts
    from adaptree.bench.vllm_bench import stream_requests

    n = cfg.streams
    prompts = [ids for turns in first_turn_prompts(sets, encode, max_len).values() for _, ids in turns]
    path = Path(cfg.out) / STREAMS
    records = read_streams(path, n)
    done = {(r["arm"], r["repeat"]) for r in records}
    names = [m for m in stream_arms(arms) if m not in dropped]
    todo = [(rep, m) for rep in range(cfg.repeats)
            for m in names[rep % len(names):] + names[:rep % len(names)] if (m, rep) not in done]
    if not todo or not prompts:
        return records
    batch = stream_requests(prompts, n)
    with path.open("a") as f, tqdm(total=len(todo), desc=f"{n} streams", unit="batch") as bar:
        for rep, m in todo:
            if m in dropped:
                continue
            try:
                res = arms[m]([batch, n], cfg.max_new_tokens, cfg.repeat_sampling(rep))
            except ArmFailed as e:
                dropped[m] = f"{e} on the {n}-stream batch"
                tqdm.write(f"{m}: {dropped[m]}; arm dropped", file=sys.stderr)
                continue
            rec = {"arm": m, "streams": n, "batch": 0, "repeat": rep, "tokens": res.tokens, "wall_s": res.wall_s,
                   "latencies_s": res.latencies_s, "drafts": res.drafts, "draft_tokens": res.draft_tokens,
                   "accepted_tokens": res.accepted_tokens, "steps": res.steps, "drafter_skips": res.drafter_skips,
                   "chains": res.chains, "stopped": res.stopped, "outputs": res.outputs}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            records.append(rec)
            bar.update(1)
    return records


def read_streams(path: Path, streams: int) -> list[dict]:
    """The records of ``path`` at ``streams`` streams (none if the file is absent)."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("streams") == streams]


def streams_summary(cfg, out: Path) -> dict | None:
    """The N-stream table's data from ``out/streams.jsonl`` (None without ``--streams`` or records)."""
    from adaptree.bench.vllm_bench import summarize_batches

    if cfg.streams <= 1:
        return None
    records = [r for r in read_streams(Path(out) / STREAMS, cfg.streams) if r["repeat"] < cfg.repeats]
    arms = [m for m in stream_arms(cfg.methods) if any(r["arm"] == m for r in records)]
    if not arms:
        return None
    return summarize_batches(records, arms, [cfg.streams])


def report_lines(section: dict | None) -> list[str]:
    """``report.md``'s N-stream section."""
    from adaptree.bench.vllm_bench import table

    if not section:
        return []
    n = section["rows"][0]["streams"]
    return [f"## {n} streams (vLLM arms)", "",
            f"The first turns cycled into requests submitted together, at most {n} running at once; total tokens/s "
            f"over the batch, ratios against {section['reference']}, latency from a request's admission.", "",
            table(section), ""]
