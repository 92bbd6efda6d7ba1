"""``adaptree vllm-bench``: vLLM plain, with n-gram drafts, with adaptree's EAGLE-3 head at fixed draft lengths, and
with adaptree's controllers deciding the drafts, at 1 and more streams, side by side; results files and a table.

Every arm is one ``vllm.LLM`` in a worker process of its own (:class:`adaptree.bench.isolation.ArmWorker`: vLLM keeps
process-wide state, and a crash costs that arm only), all loaded before the first timing and served in turn. For
each number of streams N the prompts (token ids of the chat template, the same for every arm) are cycled into
``max(2N, prompts)`` requests, submitted together with at most N running at once (continuous batching: the next is
admitted as one finishes, as a server with N clients runs); the arms run each such set one after the other, their
order rotated from one set to the next. Per set: total tokens per second, each request's latency from admission,
vLLM's own acceptance counters (τ = 1 + accepted / drafts) and the token ids, compared with the plain arm's
(greedy: lossless means equal).

``adaptree_chain:K`` (no vLLM) is adaptree's own engine drafting a chain of K with the same head on the same prompts,
one at a time: its τ is what vLLM's EAGLE-3 at K is checked against (the export reproduces the head when they agree
within 10%).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from adaptree.bench.isolation import ArmFailed, ArmRecipe, ArmWorker, start
from adaptree.core.config import positive
from adaptree.core.verify import SamplingConfig
from adaptree.vllm_plugin.control import COSTED_CONTROLLERS
from adaptree.vllm_plugin.engine import Arm, BatchResult, controller_settings, speculative_config

CONTROLLED_KINDS = tuple(f"vllm_{c}" for c in COSTED_CONTROLLERS)
"""The arms whose drafts an adaptree controller decides (adaptree's scheduler, at most K drafts per step)."""
ARM_KINDS = ("vllm", "vllm_ngram", "vllm_eagle3", *CONTROLLED_KINDS, "adaptree_chain")
"""Arm names: ``vllm``; ``vllm_ngram:K``; ``vllm_eagle3:K`` (vLLM's scheduler, K drafts every step);
``vllm_<controller>:K`` (:data:`CONTROLLED_KINDS`); ``adaptree_chain:K``."""
ARM_HELP = "vllm, vllm_ngram:K, vllm_eagle3:K, " + ", ".join(f"{k}:K" for k in CONTROLLED_KINDS) + ", adaptree_chain:K"


@dataclass
class VllmBenchConfig:
    """What ``adaptree vllm-bench`` runs (docs/vllm.md)."""

    model: str | None = None
    """The target: a short name, a .gguf file or a Hugging Face folder (default: the embedded SmolLM2-135M)."""
    head: str = "auto"
    """adaptree's head folder (auto: the one shipped for the model), exported for vLLM into the results folder."""
    arms: list[str] = field(default_factory=lambda: ["vllm", "vllm_ngram:3", "vllm_eagle3:1", "vllm_eagle3:2",
                                                     "vllm_eagle3:3", "vllm_eagle3:5", "vllm_costaware:5"])
    """Arms (first: the reference every ratio and output comparison uses): vllm, vllm_ngram:K, vllm_eagle3:K,
    vllm_static-gs:K, vllm_costaware:K, vllm_hybrid:K, vllm_deagle:K, vllm_radar:K, vllm_ltd:K, adaptree_chain:K."""
    streams: list[int] = field(default_factory=lambda: [1, 4, 16])
    """Requests submitted together."""
    datasets: list[str] = field(default_factory=lambda: ["mt_bench", "humaneval"])
    limit: int = positive(3)
    """First turns per dataset."""
    max_new_tokens: int = positive(128)
    dtype: str = "bfloat16"
    """vLLM's dtype (bfloat16 or float32; float32 for the losslessness check)."""
    repeats: int = positive(1)
    step_costs: str | None = None
    """vLLM step-cost file for the arms of adaptree's controllers (default: measured into the results folder on
    first use)."""
    threads: int | None = None
    """CPU threads (default: every core this process may use)."""
    prefix_caching: bool = True
    """vLLM's prefix caching (its default). The bench's requests repeat its prompts; with it, plain vLLM and its
    n-gram arm compute only what follows the cached blocks of a prompt seen before, while with EAGLE-3 drafting
    vLLM resumes a block earlier (the drafter needs the hidden states), which for prompts under two blocks is
    none of it. Off: every arm computes every prompt, as with prompts no request shared."""
    out: str = "runs/vllm-bench"

    def __post_init__(self) -> None:
        if not self.arms:
            raise ValueError("no arms given")
        for a in self.arms:
            parse_arm(a)
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"an arm is listed twice: {self.arms}")
        if not self.streams or any(n < 1 for n in self.streams):
            raise ValueError(f"streams must be positive integers, got {self.streams}")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")


def parse_arm(name: str) -> tuple[str, int]:
    """``vllm_eagle3:3`` -> ("vllm_eagle3", 3); ``vllm`` -> ("vllm", 0). A bad name is a ValueError naming it."""
    kind, _, k = name.partition(":")
    if kind not in ARM_KINDS:
        raise ValueError(f"unknown arm {name!r}; arms: {ARM_HELP}")
    if kind == "vllm":
        if k:
            raise ValueError(f"arm {name!r}: plain vllm takes no K")
        return kind, 0
    if not k.isdigit() or not 1 <= int(k) <= 16:
        raise ValueError(f"arm {name!r}: K must be an integer in 1..16")
    return kind, int(k)


def vllm_arm(name: str, head: str | None, step_costs: str | None, source_head: str | None = None,
             model: str | None = None) -> Arm:
    """The vLLM configuration of the arm ``name`` (``head``: the exported drafter folder, for the EAGLE-3 arms;
    ``source_head``: adaptree's head folder, whose RADAR and LTD depth policies ``vllm_radar`` and ``vllm_ltd``
    read)."""
    kind, k = parse_arm(name)
    if kind == "vllm":
        return Arm(name)
    if kind == "vllm_ngram":
        return Arm(name, speculative_config("ngram", k))
    if kind == "vllm_eagle3":  # vLLM's own EAGLE-3, as vLLM configures it
        return Arm(name, speculative_config("eagle3", k, head))
    spec = speculative_config("eagle3", k, head, controlled=True)
    if step_costs is None:
        raise ValueError(f"arm {name}: needs a step-cost file")
    return Arm(name, spec, controller_settings(kind.removeprefix("vllm_"), step_costs, source_head, model))


class _VllmBatchArm:
    """A vLLM arm in a worker: ``arm((prompts, streams), max_new_tokens, sampling) -> BatchResult``."""

    def __init__(self, target: str, arm: Arm, dtype: str, threads: int | None, max_num_seqs: int,
                 prefix_caching: bool = True) -> None:
        from adaptree.vllm_plugin.engine import generate_batch, make_llm

        self.llm = make_llm(target, arm, dtype=dtype, threads=threads, max_num_seqs=max_num_seqs,
                            prefix_caching=prefix_caching)
        self._generate = generate_batch
        self._generate(self.llm, [[1, 2, 3]], 8)  # warm-up

    def __call__(self, run, max_new_tokens: int, sampling: SamplingConfig) -> BatchResult:
        prompts, streams = run
        return self._generate(self.llm, prompts, max_new_tokens, temperature=sampling.temperature or 0.0,
                              seed=sampling.seed or 0, streams=streams)


class _ChainArm:
    """adaptree's engine with a chain of K drafts (static W=1, depth K, V=K), one prompt at a time."""

    def __init__(self, model: str | None, head: str, k: int, dtype: str) -> None:
        import torch

        from adaptree.core.engine import Engine
        from adaptree.methods import StaticConfig, StaticController
        from adaptree.models import load_model
        from adaptree.models.eagle3 import Eagle3Head

        target, tok = load_model(model, getattr(torch, dtype))
        self.engine = Engine(target, Eagle3Head.from_pretrained(head, target=target), tok.eos_token_ids)
        self.controller = StaticController(StaticConfig(width=1, depth=k, size=k))
        self.k = k

    def __call__(self, run, max_new_tokens: int, sampling: SamplingConfig) -> BatchResult:
        prompts, _ = run  # one at a time, whatever the streams: adaptree's engine serves one
        outs, lat, cycles, accepted = [], [], 0, 0
        t0 = time.perf_counter()
        for p in prompts:
            res = self.engine.generate(list(p), self.controller, max_new_tokens=max_new_tokens, sampling=sampling)
            outs.append(list(res.token_ids))
            lat.append(res.wall_time_s)
            cycles += len(res.cycles)
            accepted += sum(c.accepted for c in res.cycles)
        return BatchResult(outs, time.perf_counter() - t0, lat, drafts=cycles, draft_tokens=cycles * self.k,
                           accepted_tokens=accepted, steps=cycles)


def build_arms(methods: Sequence[str], target: str, model: str | None, head_export: str, head: str, dtype: str,
               threads: int | None, max_num_seqs: int, step_costs: str | None, prefix_caching: bool = True) -> dict:
    """The arms ``methods`` (in a worker process)."""
    arms = {}
    for m in methods:
        kind, k = parse_arm(m)
        if kind == "adaptree_chain":
            arms[m] = _ChainArm(model, head, k, dtype)
        else:
            arms[m] = _VllmBatchArm(target, vllm_arm(m, head_export, step_costs, head, model), dtype, threads,
                                    max_num_seqs, prefix_caching)
    return arms


def stream_requests(prompts: list[list[int]], n: int) -> list[list[int]]:
    """The requests of an N-stream run: ``prompts`` cycled to ``max(2N, len(prompts))`` of them, so that N streams
    stay busy while most of them run (the last requests run with fewer beside them, as a server's queue drains)."""
    return [prompts[i % len(prompts)] for i in range(max(2 * n, len(prompts)))]


def summarize_batches(records: list[dict], arms: list[str], streams: list[int]) -> dict:
    """Per arm and number of streams, from the batch records: total tok/s and its ratio to ``arms[0]``'s, τ, median
    per-stream rate and latency, outputs differing from ``arms[0]``'s, steps (the rows :func:`table` prints)."""
    ref = arms[0]
    out: dict = {"reference": ref, "rows": []}
    ref_outputs = {(r["streams"], r["batch"], r["repeat"]): r["outputs"] for r in records if r["arm"] == ref}
    by = {}
    for r in records:
        by.setdefault((r["arm"], r["streams"]), []).append(r)
    ref_rate = {}
    for n in streams:
        rs = by.get((ref, n), [])
        if rs:
            ref_rate[n] = sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs)
    for arm in arms:
        for n in streams:
            rs = by.get((arm, n), [])
            if not rs:
                continue
            tokens, wall = sum(r["tokens"] for r in rs), sum(r["wall_s"] for r in rs)
            drafts = sum(r["drafts"] for r in rs)
            lat = [x for r in rs for x in r["latencies_s"]]
            per_stream = [len(o) / t for r in rs for o, t in zip(r["outputs"], r["latencies_s"]) if t > 0]
            differ = sum(1 for r in rs for i, o in enumerate(r["outputs"])
                         if (r["streams"], r["batch"], r["repeat"]) in ref_outputs
                         and o != ref_outputs[(r["streams"], r["batch"], r["repeat"])][i])
            rate = tokens / wall
            out["rows"].append({
                "arm": arm, "streams": n, "requests": sum(len(r["outputs"]) for r in rs), "tokens": tokens,
                "tokens_per_s": rate, "vs_reference": rate / ref_rate[n] if n in ref_rate else None,
                "tau": 1 + sum(r["accepted_tokens"] for r in rs) / drafts if drafts else None,
                "median_stream_tokens_per_s": statistics.median(per_stream) if per_stream else None,
                "median_latency_s": statistics.median(lat) if lat else None,
                "outputs_differing": differ, "steps": sum(r["steps"] for r in rs),
                "drafter_skips": sum(r.get("drafter_skips", 0) for r in rs),
                "chains": sum(r.get("chains", 0) for r in rs), "stopped": sum(r.get("stopped", 0) for r in rs)})
    return out


def _steps(row: dict) -> str:
    """Engine steps, those with the drafter off, the request-steps that verified a context chain and the drafts a
    stop rule left unverified, where adaptree's scheduler counted them."""
    if not row.get("steps"):
        return "—"
    return f"{row['steps']}, {row.get('drafter_skips', 0)}, {row.get('chains', 0)}, {row.get('stopped', 0)}"


def table(summary: dict) -> str:
    lines = ["| arm | streams | total tok/s | vs " + summary["reference"] + " | τ | per-stream tok/s (median) | "
             "latency s (median) | steps, drafter off, chains, stopped | outputs ≠ ref |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        tau = f"{r['tau']:.2f}" if r["tau"] else "—"
        vs = f"{r['vs_reference']:.2f}x" if r["vs_reference"] else "—"
        lines.append(f"| {r['arm']} | {r['streams']} | {r['tokens_per_s']:.1f} | {vs} | {tau} | "
                     f"{r['median_stream_tokens_per_s']:.1f} | {r['median_latency_s']:.2f} | "
                     f"{_steps(r)} | {r['outputs_differing']}/{r['requests']} |")
    return "\n".join(lines)


def run_vllm_bench(cfg: VllmBenchConfig, progress: bool = True) -> dict:
    """Run ``cfg``; writes ``results.jsonl`` (one record per arm and batch, appended as they finish; a rerun with the
    same folder and settings skips what is there), ``summary.json``, ``report.md``; returns the summary."""
    from tqdm import tqdm

    from adaptree.core.machine import machine_profile
    from adaptree.data.prompts import load_prompt_sets
    from adaptree.models import load_model
    from adaptree.vllm_plugin.engine import vllm_available
    from adaptree.vllm_plugin.export import export_for_vllm, resolve_head

    kinds = {parse_arm(a)[0] for a in cfg.arms}
    if kinds - {"adaptree_chain"} and not vllm_available():
        raise ValueError("the vllm arms need vLLM: pip install 'adaptree[vllm]' (or bash scripts/setup.sh --vllm)")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("out", "arms", "repeats")}
    settings_path = out / "vllm_bench_config.json"
    if settings_path.exists() and json.loads(settings_path.read_text()).get("settings") != settings:
        raise ValueError(f"{out} holds results of other settings ({settings_path}); choose another --out")
    head = str(resolve_head(cfg.model, cfg.head))
    import torch

    exported, target = export_for_vllm(out / "head-vllm", cfg.model, head, getattr(torch, cfg.dtype))
    _, tok = load_model(cfg.model, getattr(torch, cfg.dtype))
    prompts = [tok.apply_chat([{"role": "user", "content": p.turns[0]}])
               for _, ps in load_prompt_sets(cfg.datasets, limit=cfg.limit) for p in ps]
    step_costs = cfg.step_costs
    controlled = [a for a in cfg.arms if parse_arm(a)[0] in CONTROLLED_KINDS]
    if controlled and step_costs is None:
        step_costs = str(out / "step_costs.json")
        if not Path(step_costs).exists():
            from adaptree.vllm_plugin.engine import measure_step_costs_to

            k_max = max(parse_arm(a)[1] for a in controlled)
            bar = tqdm(total=1, desc="vLLM step costs", disable=not progress)

            def tick(done, total):
                bar.total = total
                bar.n = done
                bar.refresh()
            # the batch sizes the run reaches (the controller interpolates between them)
            top = max(cfg.streams)
            sizes = sorted({b for b in (1, 2, 4, 8, 16) if b <= top} | set(cfg.streams))
            tmp = out / "step_costs.json.tmp"  # whole or absent: a run stopped here measures again
            measure_step_costs_to(tmp, target, exported, prompts, batch_sizes=sizes, k_max=k_max, dtype=cfg.dtype,
                                  threads=cfg.threads, progress=tick)
            bar.close()
            tmp.replace(step_costs)
    settings_path.write_text(json.dumps({"settings": settings, "arms": cfg.arms, "machine": machine_profile()},
                                        indent=1))
    results = out / "results.jsonl"
    done = set()
    records = []
    if results.exists():
        for line in results.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                records.append(r)
                done.add((r["arm"], r["streams"], r["batch"], r["repeat"]))
    workers = {a: ArmWorker(ArmRecipe(build_arms, {
        "target": str(target), "model": cfg.model, "head_export": str(exported), "head": head, "dtype": cfg.dtype,
        "threads": cfg.threads, "max_num_seqs": max(cfg.streams), "step_costs": step_costs,
        "prefix_caching": cfg.prefix_caching}), [a]) for a in cfg.arms}
    plan = [(rep, n, 0, stream_requests(prompts, n)) for rep in range(cfg.repeats) for n in cfg.streams]
    todo = sum(1 for rep, n, b, _ in plan for a in cfg.arms if (a, n, b, rep) not in done)
    sampling = SamplingConfig(seed=0)
    try:
        if todo:
            start(list(workers.values()))
        bar = tqdm(total=todo, desc="vllm-bench", disable=not progress)
        with results.open("a") as f:
            for i, (rep, n, b, batch) in enumerate(plan):
                order = cfg.arms[i % len(cfg.arms):] + cfg.arms[:i % len(cfg.arms)]
                for a in order:
                    if (a, n, b, rep) in done or workers[a].dead:
                        continue
                    try:
                        res = workers[a].run(a, (batch, n), cfg.max_new_tokens, sampling)
                    except ArmFailed as exc:  # that arm is dropped; the others, the records and the summary go on
                        tqdm.write(f"vllm-bench: arm {a} dropped: {exc}", file=sys.stderr)
                        continue
                    rec = {"arm": a, "streams": n, "batch": b, "repeat": rep, "tokens": res.tokens,
                           "wall_s": res.wall_s, "latencies_s": res.latencies_s, "drafts": res.drafts,
                           "draft_tokens": res.draft_tokens, "accepted_tokens": res.accepted_tokens,
                           "steps": res.steps, "drafter_skips": res.drafter_skips, "chains": res.chains,
                           "stopped": res.stopped, "outputs": res.outputs}
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    records.append(rec)
                    bar.update(1)
        bar.close()
    finally:
        for w in workers.values():
            w.close()
    summary = summarize_batches(records, cfg.arms, cfg.streams)
    summary["settings"] = settings
    summary["machine"] = machine_profile()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(f"# adaptree vllm-bench\n\n{table(summary)}\n\nSettings: `{json.dumps(settings)}`"
                                   f"\n\nMachine: `{json.dumps(summary['machine'])}`\n")
    return summary
