"""vLLM as adaptree runs it: the engine built with adaptree's settings, generation over token ids with the figures
the bench reports, and the step-cost measurement the cost-aware controller reads.

vLLM is imported inside the functions (``pip install 'adaptree[vllm]'``; docs/vllm.md). The settings adaptree makes
for vLLM's CPU backend, each only where the user has not set it:

- ``VLLM_CPU_OMP_THREADS_BIND``: the cores this process may run on (``os.sched_getaffinity``), or the first
  ``threads`` of them; vLLM's own default on a 2-core machine bound one thread;
- ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (vLLM reserves a core for its front end otherwise) and
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB; 1 by default: 45k tokens of SmolLM2's cache, 87k of Qwen2.5-Coder-0.5B's);
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core in this process, so the bench reads its scheduler's step
  records and a worker process of the bench hosts one engine, not two processes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_ARM_PREFIX = "vllm"
SCHEDULER = "adaptree.vllm_plugin.scheduler.AdaptiveDraftAsyncScheduler"
"""With async scheduling (vLLM's default where the executor has it, as for the plain and fixed-K arms beside it):
the scheduler plans step t+1 while step t runs."""
SYNC_SCHEDULER = "adaptree.vllm_plugin.scheduler.AdaptiveDraftScheduler"
"""Without: for a controller that reads each request's output or drafts when it decides (``hybrid``, ``deagle``,
``radar``, ``ltd``)."""


def speculative_config(method: str, k: int, head: str | Path | None = None,
                       controlled: bool = False) -> dict[str, Any]:
    """vLLM's ``speculative_config`` of ``k`` drafts per step: ``eagle3`` (``head``: the exported drafter folder)
    or ``ngram`` (vLLM's prompt lookup, 2- to 4-token matches as adaptree's ``ngram``). ``controlled``: for
    adaptree's scheduler and worker, which keep every prefix-cache block a prompt shares with an earlier one, as
    plain decoding does.

    With EAGLE, vLLM's prefix cache resumes a prompt one block (128 tokens on its CPU backend) before the cached
    prefix ends: the drafter's entry at a block's last position was computed with the token after it, which a prompt
    sharing only that block may not have. That costs the prefix cache a whole block of every shared prompt, and all
    of any prompt under two blocks, for one drafter position whose draft the target verifies anyway. adaptree's
    worker already leaves the drafter's cache with holes where it skips the drafter under load, and its controllers
    learn the acceptance that results; so its arms keep the block (vLLM's ``disable_eagle_block_drop``, which vLLM
    calls experimental and which never changes the text, only how often drafts are accepted)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "eagle3":
        if head is None:
            raise ValueError("eagle3 drafts need the head exported for vLLM (adaptree export-head)")
        spec: dict[str, Any] = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
        if controlled:
            spec["disable_eagle_block_drop"] = True
        return spec
    raise ValueError(f"speculative method must be eagle3 or ngram, got {method!r}")


def controller_settings(controller: str, step_costs: str | Path, head: str | Path | None = None,
                        model: str | None = None) -> dict[str, Any]:
    """``additional_config["adaptree"]`` for the controller named ``controller`` (one reading the step costs, vLLM's
    step costs on this machine ``step_costs``); for ``radar`` and ``ltd`` also the RADAR or LTD depth policy next to
    adaptree's head folder ``head`` (a ValueError naming the command that makes one when there is none)."""
    from adaptree.vllm_plugin.control import COSTED_CONTROLLERS

    if controller not in COSTED_CONTROLLERS:
        raise ValueError(f"controller must be one of {COSTED_CONTROLLERS}, got {controller!r}")
    out: dict[str, Any] = {"controller": controller, "step_costs": str(step_costs)}
    if controller in ("radar", "ltd"):  # the policy next to the head, as adaptree's own methods find it
        from adaptree.methods import resolve_assets

        method, option = ("radar", "policy") if controller == "radar" else ("ltd-depth", "depth_policy")
        out["policy"] = str(resolve_assets(method, {}, head, model)[option])
    return out


def plugin_settings(controller: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's engine settings that put adaptree's scheduler and worker in charge of the drafts, ``controller``
    being ``additional_config["adaptree"]`` (:func:`adaptree.vllm_plugin.control.build_controller`): the keyword
    arguments of ``vllm.LLM``, the flags of vLLM's server by the same names."""
    from adaptree.vllm_plugin.control import SYNC_CONTROLLERS

    sync = controller.get("controller") in SYNC_CONTROLLERS  # outputs and drafts async scheduling has not yet
    return {"scheduler_cls": SYNC_SCHEDULER if sync else SCHEDULER, "worker_cls": worker_class(),
            "async_scheduling": not sync, "additional_config": {"adaptree": dict(controller)}}


def worker_class() -> str:
    """adaptree's worker for this vLLM's platform (:mod:`adaptree.vllm_plugin.worker`: the drafter off in steps that
    draft nothing)."""
    from vllm.platforms import current_platform

    name = "AdaptiveCPUWorker" if current_platform.is_cpu() else "AdaptiveGPUWorker"
    return f"adaptree.vllm_plugin.worker.{name}"


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def cpu_environment(threads: int | None = None, kv_cache_gib: float = 1.0, in_process: bool = True) -> dict[str, str]:
    """The environment variables adaptree sets for vLLM's CPU backend (only those not set already); applied to
    ``os.environ`` and returned. ``in_process=False`` (the plugin's default for any vLLM, ``vllm serve`` too) leaves
    vLLM's engine-core process alone."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads is not None:
        if not 1 <= threads <= len(cores):
            raise ValueError(f"threads must be in 1..{len(cores)} (the cores this process may use), got {threads}")
        cores = cores[:threads]
    wanted = {
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
        "OMP_NUM_THREADS": str(len(cores)),
    }
    if in_process:
        wanted["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    set_now = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(set_now)
    return set_now


@dataclass(frozen=True)
class Arm:
    """One vLLM configuration: ``spec`` is vLLM's ``speculative_config`` (None: plain decoding); ``adaptree`` the
    controller settings (``additional_config["adaptree"]``), None for vLLM's own scheduler."""

    name: str
    spec: Mapping[str, Any] | None = None
    adaptree: Mapping[str, Any] | None = None


def make_llm(target: str | Path, arm: Arm, dtype: str = "bfloat16", seed: int = 0, max_model_len: int = 4096,
             enforce_eager: bool = True, threads: int | None = None, max_num_seqs: int = 32,
             prefix_caching: bool = True):
    """A ``vllm.LLM`` on the Hugging Face folder ``target`` configured as ``arm`` (``prefix_caching``: vLLM's, on
    by default as in vLLM)."""
    cpu_environment(threads)
    from vllm import LLM

    kwargs: dict[str, Any] = {}
    if arm.spec is not None:
        kwargs["speculative_config"] = dict(arm.spec)
    if arm.adaptree is not None:
        if arm.spec is None:
            raise ValueError(f"arm {arm.name}: adaptree's controller decides drafts; the arm needs a speculative_config")
        kwargs.update(plugin_settings(arm.adaptree))
    return LLM(model=str(target), dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=enforce_eager,
               max_num_seqs=max_num_seqs, disable_log_stats=False, enable_prefix_caching=prefix_caching, **kwargs)


def scheduler_of(llm):
    """The engine core's scheduler of an in-process ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    core = getattr(llm.llm_engine, "engine_core", None)
    core = getattr(core, "engine_core", core)
    sched = getattr(core, "scheduler", None)
    if sched is None:
        raise RuntimeError("this vLLM's engine core is not in this process (set VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    return sched


def model_runner_of(llm):
    """The model runner of an in-process ``LLM`` with one worker in this process (CPU: vLLM's uniprocess executor),
    or None."""
    core = getattr(llm.llm_engine, "engine_core", None)
    core = getattr(core, "engine_core", core)
    driver = getattr(getattr(core, "model_executor", None), "driver_worker", None)
    return getattr(getattr(driver, "worker", None), "model_runner", None)


def _spec_counters(llm) -> tuple[int, int, int]:
    """vLLM's running totals (drafts, draft tokens, accepted tokens) of speculative decoding."""
    totals = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
              "vllm:spec_decode_num_accepted_tokens": 0}
    for m in llm.get_metrics():
        if m.name in totals and hasattr(m, "value"):
            totals[m.name] += int(m.value)
    return tuple(totals.values())  # type: ignore[return-value]


@dataclass
class BatchResult:
    """N requests run at once (N streams)."""

    outputs: list[list[int]]
    wall_s: float
    latencies_s: list[float]
    """Per request, from its admission to its last token."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    """Engine steps (adaptree's scheduler counts them; 0 under vLLM's own)."""
    drafter_skips: int = 0
    """Steps in which adaptree's worker left the drafter off (K = 0)."""
    chains: int = 0
    """Request-steps that verified the context's chain in place of the head's drafts (the hybrid controller)."""
    stopped: int = 0
    """Drafts a stop rule left unverified (the deagle, radar and ltd controllers)."""

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def tau(self) -> float:
        """Mean tokens per verification of a request that drafted (vLLM's mean acceptance length); nan without
        drafts."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else float("nan")


def generate_batch(llm, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                   seed: int = 0, eos: bool = True, streams: int | None = None) -> BatchResult:
    """``prompts`` (token ids) submitted together; greedy unless ``temperature`` > 0. ``streams``: at most that many
    requests run at once, the next admitted as one finishes (continuous batching, as a server with that many
    clients runs; vLLM's scheduler's admission limit for the call); default: all at once."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed if temperature else None,
                            ignore_eos=not eos, detokenize=False)
    before = _spec_counters(llm)
    runner = model_runner_of(llm)
    skips_before = getattr(runner, "drafter_skips", 0)
    sched = scheduler_of(llm)
    steps_before = getattr(sched, "steps_done", 0)
    controller = getattr(sched, "controller", None)
    chains_before = getattr(controller, "chain_steps", 0)
    stopped_before = getattr(controller, "stopped", 0)
    admitted = sched.max_num_active_reqs
    if streams is not None:
        if not 1 <= streams <= sched.max_num_running_reqs:
            raise ValueError(f"streams must be in 1..{sched.max_num_running_reqs} (max_num_seqs), got {streams}")
        sched.max_num_active_reqs = streams
    try:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        sched.max_num_active_reqs = admitted
    after = _spec_counters(llm)
    latencies = []
    for o in outs:
        m = o.metrics
        ok = m is not None and getattr(m, "last_token_ts", 0) and getattr(m, "scheduled_ts", 0)
        latencies.append(float(m.last_token_ts - m.scheduled_ts) if ok else wall)  # from admission: no queueing
    return BatchResult([list(o.outputs[0].token_ids) for o in outs], wall, latencies,
                       *(a - b for a, b in zip(after, before)), steps=getattr(sched, "steps_done", 0) - steps_before,
                       drafter_skips=getattr(runner, "drafter_skips", 0) - skips_before,
                       chains=getattr(controller, "chain_steps", 0) - chains_before,
                       stopped=getattr(controller, "stopped", 0) - stopped_before)


def measure_step_costs(target: str | Path, head: str | Path, prompts: Sequence[Sequence[int]],
                       batch_sizes: Sequence[int] = (1, 2, 4, 8, 16), k_max: int = 5, dtype: str = "bfloat16",
                       new_tokens: int = 64, repeats: int = 2, threads: int | None = None, progress=None):
    """vLLM's step time at each batch size x K = 0..k_max drafts (:class:`~adaptree.vllm_plugin.control.StepCosts`): B
    requests (``prompts`` cycled) decode ``new_tokens`` each under a fixed K, and the steps in which all B decoded,
    each verifying K drafts and drafting K more, are timed by adaptree's scheduler; the median over ``repeats``
    interleaved passes, then per batch size K = 0 as measured and the least-squares line over K >= 1 (the raw medians
    are kept in the profile as ``measured_seconds``). The same runs are a grid search: the median tokens per second
    of each (B, K) run is kept (``tokens_per_s``, what ``static-gs`` reads). ``progress(done, total)`` is called
    after each run."""
    import statistics

    from adaptree.core.machine import machine_profile
    from adaptree.vllm_plugin.control import FixedLength, StepCosts

    if not prompts:
        raise ValueError("measure_step_costs needs at least one prompt")
    arm = Arm("step-costs", spec=speculative_config("eagle3", k_max, head, controlled=True),
              adaptree={"controller": "fixed", "k": k_max})
    llm = make_llm(target, arm, dtype=dtype, threads=threads, max_num_seqs=max(batch_sizes))
    sched = scheduler_of(llm)
    generate_batch(llm, [prompts[0]], 8)  # warm-up
    times: dict[tuple[int, int], list[float]] = {}
    rates: dict[tuple[int, int], list[float]] = {}
    total, done = repeats * len(batch_sizes) * (k_max + 1), 0
    for _ in range(repeats):
        for b in batch_sizes:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            for k in range(k_max + 1):
                sched.controller = FixedLength(k)
                first = sched.steps_done
                run = generate_batch(llm, batch, new_tokens, eos=False)
                rates.setdefault((b, k), []).append(run.tokens_per_s)
                records = list(sched.step_records)[-(sched.steps_done - first):] if sched.steps_done > first else []
                times.setdefault((b, k), []).extend(
                    r.seconds for r in records
                    if r.decoding == b and r.prefill_tokens == 0 and r.drafted_after == k
                    and all(v == k for v in r.verified))
                done += 1
                if progress is not None:
                    progress(done, total)
    missing = [key for key in times if not times[key]]
    if missing:
        raise RuntimeError(f"no pure decode step was timed at (B, K) = {missing}; raise new_tokens")
    profile = machine_profile()
    # the folders by their last parts (a cached model's sha and dtype): no machine's paths in a committed file
    profile.update({"engine": "vllm", "target": "/".join(Path(target).parts[-3:]),
                    "head": "/".join(Path(head).parts[-2:]), "dtype": dtype,
                    "threads": os.environ.get("OMP_NUM_THREADS")})
    try:
        import vllm

        profile["vllm"] = vllm.__version__
    except (ImportError, AttributeError):
        pass
    measured = [[statistics.median(times[(b, k)]) for k in range(k_max + 1)] for b in batch_sizes]
    profile["measured_seconds"] = measured
    grid = [[statistics.median(rates[(b, k)]) for k in range(k_max + 1)] for b in batch_sizes]
    return StepCosts(list(batch_sizes), [_line(row) for row in measured], profile, grid)


def measure_step_costs_to(path: str | Path, target: str | Path, head: str | Path, prompts: Sequence[Sequence[int]],
                          progress=None, **kwargs):
    """:func:`measure_step_costs` saved to ``path``, measured in a process of its own (spawned) where this one may
    start one: vLLM's engine and KV cache leave with it, where an engine built in this process keeps its memory (2-3
    GB with SmolLM2) for as long as the process runs, beside every arm a bench starts next. In a daemonic process (a
    bench arm's worker) it measures here. ``progress(done, total)`` is called here either way."""
    import multiprocessing as mp
    import queue

    from adaptree.vllm_plugin.control import StepCosts

    if mp.current_process().daemon:
        costs = measure_step_costs(target, head, prompts, progress=progress, **kwargs)
        costs.save(path)
        return costs
    ctx = mp.get_context("spawn")
    ticks = ctx.Queue()
    proc = ctx.Process(target=_measure_and_save, name="adaptree-step-costs",
                       args=(str(path), str(target), str(head), [list(p) for p in prompts], kwargs, ticks))
    proc.start()
    try:
        while proc.is_alive() or not ticks.empty():
            try:
                done, total = ticks.get(timeout=0.5)
            except queue.Empty:
                continue
            if progress is not None:
                progress(done, total)
        proc.join()
    finally:
        if proc.is_alive():  # interrupted: the measurement goes too
            proc.terminate()
            proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"the vLLM step-cost measurement failed (exit code {proc.exitcode}); its output above "
                           "says why")
    return StepCosts.load(path)


def _measure_and_save(path: str, target: str, head: str, prompts: list[list[int]], kwargs: dict, ticks) -> None:
    costs = measure_step_costs(target, head, prompts, progress=lambda done, total: ticks.put((done, total)), **kwargs)
    costs.save(path)


def _line(row: Sequence[float]) -> list[float]:
    """A batch size's step times over K = 0, 1, ...: K = 0 as measured (the drafter off: no speculative work at
    all), K >= 1 on their least-squares line (slope at least 0), never below K = 0. Drafting has a fixed cost on top
    of one per draft (the drafter's first pass, the rejection sampler), so one line through K = 0 would make short
    drafts look cheap; and a single median's noise (a few ms on a shared machine) must not make K=2 look cheaper
    than K=1."""
    if len(row) <= 2:
        return [row[0]] + [max(t, row[0]) for t in row[1:]]
    drafting = row[1:]
    n = len(drafting)
    mk, mt = (n - 1) / 2, sum(drafting) / n
    slope = max(sum((k - mk) * (t - mt) for k, t in enumerate(drafting)) / sum((k - mk) ** 2 for k in range(n)), 0.0)
    return [row[0]] + [max(mt + slope * (k - mk), row[0]) for k in range(n)]
