"""``adaptree bench``: every method over the same prompts, side by side, with results files.

Methods are interleaved per prompt (machine drift hits every arm alike), their order rotated from one
prompt to the next (no arm always runs first, after another prompt's arms, or last), batch size 1, after a
warm-up; the autoregressive baseline runs on the same engine. Reference arms (transformers, llama.cpp) run in worker
processes (:mod:`adaptree.bench.isolation`): one that crashes is dropped with one line naming it and the signal, and
the other arms, the records and the summary go on. Multi-turn prompts (MT-bench) follow the
MT-bench protocol: each method's second turn sees that method's own first answer. Per-run records are
appended to ``results.jsonl`` as they finish (a rerun with the same folder resumes and never duplicates
or loses a record); a running table of the records so far is printed after the first prompt of every arm and
after each dataset; ``summary.json``, ``report.md``, PNG plots and the full table come at the end
(:mod:`adaptree.bench.report`). The metrics are defined in docs/benchmarking.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from adaptree.bench import isolation
from adaptree.bench.hf_arms import HF_METHODS, hf_recipe
from adaptree.bench.isolation import ArmFailed, ArmRecipe, WorkerArm
from adaptree.bench.llama_cpp_arm import LLAMA_CPP_METHODS, llama_cpp_recipe
from adaptree.bench.vllm_arm import VLLM_METHODS, vllm_recipe
from adaptree.core.config import FLAG_HELP, check_fields, positive
from adaptree.core.records import GenerationResult
from adaptree.core.verify import SamplingConfig
from adaptree.offline.runs import check_out_dir

if TYPE_CHECKING:
    from adaptree.core.pipeline import PipelineLike

Arm = Callable[[list[int], int, SamplingConfig], GenerationResult]
"""A benchmarked method: ``arm(prompt_ids, max_new_tokens, sampling) -> GenerationResult``."""

MethodOptions = Mapping[str, Mapping[str, Any]]
"""Per method name, its config fields (``{"static": {"width": 4}, "deagle": {"tau_s": 0.2}}``)."""

RESULTS, SUMMARY, CONFIG = "results.jsonl", "summary.json", "bench_config.json"

# Settings that change what a record measures: a results folder holds records of one setting only.
_RUN_KEYS = ("model", "dtype", "weights", "attention", "compile_tokens", "dense_prefill_rows", "draft_sha256",
             "model_sha256", "draft_model_sha256", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "threads")


REFERENCE_ARMS: dict[str, Callable[[str, BenchConfig, PipelineLike], ArmRecipe]] = {
    **dict.fromkeys(HF_METHODS, hf_recipe), **dict.fromkeys(LLAMA_CPP_METHODS, llama_cpp_recipe),
    **dict.fromkeys(VLLM_METHODS, vllm_recipe)}
"""Arms that are not the engine (transformers' generate, llama.cpp and vLLM on the same weights), by method name:
``recipe(method, cfg, pipeline)`` checks the arm's input in the bench's process and says how a worker process builds
the arm (:mod:`adaptree.bench.isolation`). Every one runs in a worker; a name added here is a valid bench method."""

MAIN_JOB_METHODS = ("ar", "static", "static-gs", "costaware", "deagle", "ltd", "radar")
"""``adaptree bench`` with no ``--methods``: AR, EAGLE-3's static tree, the static tree chosen for this machine, the
training-free cost-aware rule and DEAGLE, and the shipped LTD and RADAR policies (plus this machine's default method
when it is none of them). With the default limit, machine setup included, a first run fits in 10 minutes on 2
cores (docs/benchmarking.md)."""


@dataclass
class BenchConfig:
    """What to run. Defaults: the README's main job (default model, small MT-bench + HumanEval subset)."""

    methods: list[str] = field(default_factory=lambda: list(MAIN_JOB_METHODS))
    """Arms: engine methods (ar, static, ...) and reference arms: Hugging Face (hf_generate, hf_prompt_lookup,
    hf_assisted), llama.cpp on the same GGUF (llama_cpp, llama_cpp_lookup; needs llama-cpp-python) and vLLM (vllm,
    vllm_ngram, vllm_eagle3, vllm_<controller> for static-gs, costaware, hybrid, deagle, radar, ltd; needs
    adaptree[vllm]), which run in worker processes (one that crashes is dropped, the rest go on). Must include
    ``ar``: speedups are measured against it."""
    datasets: list[str] = field(default_factory=lambda: ["mt_bench", "humaneval"])
    """Benchmarks: mt_bench, humaneval, sharegpt, sharegpt_long (long pasted texts), code_edit (edits of HumanEval
    solutions)."""
    question_file: str | None = None
    """An EAGLE-format question.jsonl benchmarked as one more dataset."""
    limit: int = positive(2)
    """Prompts per dataset (the first ``limit`` of each; 2 keeps a first run from an empty cache within 10 minutes on
    2 cores, where EAGLE-3's 60-node tree and DEAGLE's take over half the bench's time)."""
    turns: int | None = positive(None)
    """Turns per conversation (MT-bench has two); None = all of them, 1 = first turns only."""
    max_new_tokens: int = positive(128)
    """Per turn."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(seed=0), metadata={
        FLAG_HELP: {"seed": "Sampling seed of repeat r is seed + r (every arm gets the same seed)."}})
    """How tokens are chosen (greedy by default); repeat r samples with seed ``sampling.seed + r``, every arm alike
    (None counts as 0)."""
    repeats: int = positive(1)
    """Runs of every prompt and arm."""
    streams: int = positive(1)
    """With N > 1, the vLLM arms also serve the first turns N at once after the single-stream runs (continuous
    batching, as N clients): total tok/s and per-stream latency in a table of their own (streams.jsonl,
    report.md; :mod:`adaptree.bench.streams`)."""
    reference: str | None = "static"
    """Method every other one is tested against (paired Wilcoxon, speed ratio); None or absent = skip."""
    assistant_model: str | None = None
    """Draft model of ``hf_assisted`` (default: the registered smaller sibling, e.g. 0.5B for 1.5B)."""
    warmup: bool = True
    """One short untimed generation per arm first."""
    out: str = "runs/bench"
    """Results folder: results.jsonl (resumed if present), summary.json, report.md, plots."""
    oracle_latency: str | None = None
    """Latency model JSON: after a greedy bench, record traces of the first turns and report the oracle's and
    the best static tree's modelled speedup and each method's fraction of the oracle gain
    (:mod:`adaptree.bench.oracle_section`)."""

    def __post_init__(self) -> None:
        from adaptree.data.prompts import DATASETS
        from adaptree.methods import METHODS

        valid = (*METHODS, *REFERENCE_ARMS)
        if not self.methods:
            raise ValueError(f"no methods given; available: {', '.join(valid)}")
        for m in self.methods:
            if m not in valid:
                raise ValueError(f"unknown method {m!r}; available: {', '.join(valid)}")
        if len(set(self.methods)) != len(self.methods):
            raise ValueError(f"a method is listed twice: {self.methods}")
        if "ar" not in self.methods:
            raise ValueError("the methods must include 'ar': speedups are measured against it")
        for d in self.datasets:
            if d not in DATASETS:
                raise ValueError(f"unknown dataset {d!r}; available: {', '.join(DATASETS)} (or --question-file PATH)")
        if not self.datasets and not self.question_file:
            raise ValueError("no datasets given and no --question-file")
        check_fields(self)
        if isinstance(self.sampling, Mapping):  # as bench_config.json saves it
            self.sampling = SamplingConfig(**self.sampling)
        if self.sampling.seed is None:  # every arm, and a resumed run, samples with the same seeds
            self.sampling = replace(self.sampling, seed=0)
        if self.streams > 1 and not any(m in VLLM_METHODS for m in self.methods):
            raise ValueError(f"--streams {self.streams} runs the vLLM arms (vllm, vllm_eagle3, ...) that many requests "
                             "at once; none of the methods is one")
        if self.reference is not None and self.reference not in self.methods:
            self.reference = None
        if self.oracle_latency and not self.sampling.greedy:
            raise ValueError(f"--oracle-latency needs greedy decoding (the traces are greedy), got temperature "
                             f"{self.sampling.temperature}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BenchConfig:
        """The config ``bench_config.json`` saved (older folders: with the sampling fields at the top level)."""
        d = dict(d)
        flat = {k: d.pop(k) for k in ("temperature", "top_p", "top_k", "seed") if k in d}
        if flat:
            d["sampling"] = {**d.get("sampling", {}), **flat}
        return cls(**d)

    def repeat_sampling(self, repeat: int) -> SamplingConfig:
        """The sampling of repeat ``repeat``: seed ``sampling.seed + repeat``."""
        return replace(self.sampling, seed=self.sampling.seed + repeat)


def _digest(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def _load_prompts(cfg: BenchConfig):
    from adaptree.data.prompts import load_prompt_sets

    return load_prompt_sets(cfg.datasets, cfg.question_file, cfg.limit)


def _run_settings(cfg: BenchConfig, pipeline: PipelineLike) -> dict:
    """What must stay fixed across a resumed run, plus checksums of the weights."""
    s = cfg.sampling
    return {**pipeline.settings(), "max_new_tokens": cfg.max_new_tokens, "temperature": s.temperature,
            "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed}


def _check_settings(out: Path, settings: dict) -> None:
    path = out / CONFIG
    results = out / RESULTS
    if not path.exists() and results.exists() and results.stat().st_size:
        raise ValueError(f"{results} has records but no {CONFIG} saying how they were measured; "
                         "use another --out (or delete it)")
    if path.exists():
        try:
            old = json.loads(path.read_text())["settings"]
        except (ValueError, KeyError):
            old = None
        if old is not None:
            diff = [k for k in _RUN_KEYS if old.get(k) != settings.get(k)]
            if diff:
                k = diff[0]
                raise ValueError(f"{out} holds results measured with {k}={old.get(k)!r}, this run has "
                                 f"{k}={settings.get(k)!r}; use another --out (or delete {out / RESULTS})")


def build_arms(cfg: BenchConfig, pipeline: PipelineLike, method_options: MethodOptions | None = None) -> dict[str, Arm]:
    """One arm per method of ``cfg``: the engine with the method's controller (its options from
    ``method_options[method]``), or a reference arm of :data:`REFERENCE_ARMS`, served by a worker process that starts
    on first use (:func:`bench_loop` starts them together and closes them)."""
    recipes = {m: REFERENCE_ARMS[m](m, cfg, pipeline) for m in cfg.methods if m in REFERENCE_ARMS}
    workers = isolation.worker_arms(recipes)
    engine = pipeline.engine
    arms: dict[str, Arm] = {}
    for m in cfg.methods:
        if m in workers:
            arms[m] = workers[m]
        else:
            ctl = pipeline.controller(m, **(method_options or {}).get(m, {}))
            arms[m] = (lambda c: lambda ids, n, s: engine.generate(ids, c, max_new_tokens=n, sampling=s))(ctl)
    return arms


def run_bench(cfg: BenchConfig, pipeline: PipelineLike, method_options: MethodOptions | None = None,
              command: str | None = None) -> dict:
    """Benchmark ``cfg.methods`` with ``pipeline`` (see the module's docstring); returns the summary.

    :param method_options: per method, its config fields (e.g. ``{"static": {"width": 4}}``).
    :param command: the command line, recorded with the results.
    """
    from adaptree.bench.report import print_table, write_report
    from adaptree.core.machine import machine_info

    out = check_out_dir(cfg.out)
    sets = _load_prompts(cfg)  # bad dataset files fail before the models load
    if cfg.oracle_latency:
        from adaptree.offline.latency import load_checked

        load_checked(cfg.oracle_latency)  # a missing or bad file fails now; another machine's warns now
    from adaptree.methods import method as registry_entry

    need = [m for m in cfg.methods if m not in REFERENCE_ARMS and registry_entry(m).needs_head]
    if need and pipeline.head is None:
        raise ValueError(f"{', '.join(need)} need a draft head: pass --draft PATH (or use a model that ships one)")
    settings = _run_settings(cfg, pipeline)
    _check_settings(out, settings)
    arms = build_arms(cfg, pipeline, method_options)
    machine = machine_info()
    setup = pipeline.machine.to_dict() if pipeline.machine is not None else None
    saved = {"config": asdict(cfg), "settings": settings, "machine": machine, "machine_setup": setup,
             "command": command}
    (out / CONFIG).write_text(json.dumps(saved, indent=2))
    dropped: dict[str, str] = {}
    rows = bench_loop(cfg, arms, pipeline.encode, pipeline.tokenizer.decode, sets, max_len=pipeline.engine.max_len,
                      dropped=dropped, running=lambda rs, what: print_running_table(rs, cfg, what))
    if dropped:  # `adaptree report` says it again
        (out / CONFIG).write_text(json.dumps({**saved, "dropped_arms": dropped}, indent=2))
    if cfg.oracle_latency:
        run_oracle(cfg, pipeline, out, sets, method_options)
    summary = finish(cfg, rows, out, settings, command, machine, setup, dropped)
    print_table(summary)
    write_report(summary, out)
    print(f"wrote {out / RESULTS}, {out / SUMMARY} and {out / 'report.md'} (+ plots)")
    return summary


def print_running_table(rows: list[dict], cfg: BenchConfig, what: str) -> None:
    """The table of the records so far (``what`` they cover), printed while the bench goes on (the full table, with
    every prompt and the settings, comes at the end)."""
    from adaptree.bench.report import HEADER, summarize, table_rows
    from adaptree.offline.runs import format_table

    with tqdm.external_write_mode():  # the progress bar steps aside, then comes back below
        print(f"\nrunning table after {what}; the full table comes at the end:")
        print(format_table(HEADER, table_rows(summarize(rows, cfg)), left=2), flush=True)


def run_oracle(cfg: BenchConfig, pipeline: PipelineLike, out: Path, sets,
               method_options: MethodOptions | None = None) -> dict:
    """Traces of the bench's first turns (resumable) and the modelled oracle section (``oracle_modelled.json``).
    The traces' tree width is the static tree's (10 unless its options say otherwise); their depth at least 12."""
    from adaptree.bench import oracle_section as osec

    options = method_options or {}
    engine_methods = [m for m in cfg.methods if m not in REFERENCE_ARMS]
    static = options.get("static", {})
    settings = osec.trace_settings(cfg, pipeline.tokenizer.eos_token_ids, pipeline.max_seq_len,
                                   widths=(static.get("width") or 10,), max_depth=max(12, static.get("depth") or 0))
    prompts = osec.first_turn_prompts(sets, pipeline.encode, pipeline.engine.max_len)
    store = osec.record_traces(out, pipeline.target, pipeline.head, settings, prompts)
    factories = {m: (lambda m=m: pipeline.controller(m, **options.get(m, {}))) for m in engine_methods}
    return osec.modelled(out, store, prompts, cfg.oracle_latency, factories, progress=True)


def finish(cfg: BenchConfig, rows: list[dict], out: Path, settings: dict, command: str | None,
           machine: dict | None, machine_setup: dict | None = None, dropped: Mapping[str, str] | None = None) -> dict:
    """Write ``summary.json`` (metrics, configuration, settings with checksums, machine and what the machine setup
    chose, command, ``dropped_arms``: why each dropped arm was dropped; with ``oracle_latency``, the oracle section
    of :mod:`adaptree.bench.oracle_section`)."""
    from adaptree.bench.oracle_section import merge
    from adaptree.bench.report import summarize
    from adaptree.core.machine import machine_info

    summary = _json_safe(summarize(rows, cfg))
    summary.update(config=asdict(cfg), settings=settings, machine=machine or machine_info(),
                   machine_setup=machine_setup, command=command, dropped_arms=dict(dropped or {}))
    if cfg.streams > 1:
        from adaptree.bench.streams import streams_summary

        summary["streams"] = _json_safe(streams_summary(cfg, out))
    if cfg.oracle_latency:
        section = merge(Path(out), rows, cfg.methods)
        if section is not None:
            summary["oracle"] = _json_safe(section)
    (out / SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary


def _json_safe(obj):
    """NaN (an undefined statistic, e.g. a CI from one run) becomes null: summary.json stays strict JSON."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def read_records(results: Path) -> dict[tuple, dict]:
    """Records already written, by key; a line cut by an interruption is dropped (that run is redone) and
    the file rewritten so later appends stay line-aligned."""
    done: dict[tuple, dict] = {}
    if results.exists():
        for line in results.read_text().splitlines():
            try:
                r = json.loads(line)
                key = _key(r)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            done[key] = r
        tmp = results.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
        os.replace(tmp, results)
    return done


def _key(r: dict) -> tuple:
    return (r["dataset"], r["prompt_id"], r.get("turn", 0), r["method"], r["repeat"])


def _row(ds: str, pid: str, turn: int, method: str, rep: int, ids: list[int], res: GenerationResult) -> dict:
    cyc = res.cycles
    return {"dataset": ds, "prompt_id": pid, "turn": turn, "method": method, "repeat": rep,
            "prompt_tokens": len(ids), "new_tokens": res.new_tokens, "wall_s": res.wall_time_s,
            "prefill_s": res.prefill_s, "cycles": len(cyc),
            "accepted_plus_one": sum(c.accepted + 1 for c in cyc),
            "depth_sum": sum(c.depth for c in cyc), "size_sum": sum(c.size for c in cyc),
            "chain_sum": sum(c.chain for c in cyc), "chain_accepted_sum": sum(c.chain_accepted for c in cyc),
            **res.time_split(), "stop": res.stop_reason, "ids_sha1": _digest(res.token_ids),
            "token_ids": res.token_ids, "cyc_accepted": [c.accepted for c in cyc],
            "cyc_depth": [c.depth for c in cyc], "cyc_size": [c.size for c in cyc]}


def bench_loop(cfg: BenchConfig, arms: dict[str, Arm], encode, decode, sets, max_len: int,
               dropped: dict[str, str] | None = None,
               running: Callable[[list[dict], str], None] | None = None) -> list[dict]:
    """Run every (prompt, repeat) through every arm, interleaved per prompt in an order rotated from one
    prompt to the next; append each record as it finishes. ``encode(messages) -> ids`` renders a
    conversation; ``decode(ids) -> str`` gives an answer back for the next turn. Returns the records of this
    configuration (old ones included on resume).

    ``running(records, what)``, when given, is called with the records so far once every arm has run the first
    prompt and again after each dataset but the last (``what`` says which), when this run measured something new:
    where the bench's running table comes from (:func:`run_bench`).

    Reference arms' workers (:mod:`adaptree.bench.isolation`) start together before the first generation and are
    closed at the end. An arm that fails (:class:`~adaptree.bench.isolation.ArmFailed`: its worker died, or it
    raised) is dropped: one line on stderr names it, why (the signal) and the prompt, ``dropped[arm]`` keeps that
    reason, its later runs are not made (a rerun tries them again) and the other arms go on."""
    from adaptree.data.chat import conversation_turns

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / RESULTS
    done = read_records(results)
    dropped = {} if dropped is None else dropped
    jobs = [(ds, p, rep) for rep in range(cfg.repeats) for ds, ps in sets for p in ps]
    n_turns = {id(p): len(p.turns) if cfg.turns is None else min(cfg.turns, len(p.turns)) for _, p, _ in jobs}
    todo = sum(n_turns[id(p)] for _, p, _ in jobs) * len(arms)

    def left(m: str) -> int:  # runs of arm m not recorded yet
        return sum(1 for ds, p, rep in jobs for t in range(n_turns[id(p)]) if (ds, p.id, t, m, rep) not in done)

    remaining = sum(left(m) for m in arms)
    bar = None

    def drop_one(m: str, why: str) -> None:
        if m not in dropped:
            dropped[m] = why
            tqdm.write(f"{m}: {why}; arm dropped", file=sys.stderr)
            if bar is not None:
                bar.total -= left(m)
                bar.refresh()

    def drop(m: str, why: str) -> None:
        drop_one(m, why)
        arm = arms[m]
        if isinstance(arm, WorkerArm) and arm.worker.dead:  # a dead worker takes every arm it served with it
            for n, other in arms.items():
                if isinstance(other, WorkerArm) and other.worker is arm.worker:
                    drop_one(n, f"{why} (running {m})")

    workers = isolation.workers_of(arms.values())
    try:
        if remaining:
            isolation.start(workers)
            for m, arm in arms.items():
                if isinstance(arm, WorkerArm) and arm.worker.dead:
                    drop_one(m, arm.worker.failure)
        if cfg.warmup and remaining:  # every arm once: kernels, allocator, caches
            warm = encode([{"role": "user", "content": "Hello!"}])
            for m, arm in arms.items():
                if m not in dropped:
                    try:
                        arm(warm, 8, cfg.repeat_sampling(0))
                    except ArmFailed as e:
                        drop(m, f"{e} on the warm-up")
        wanted = []
        bar = tqdm(total=todo - sum(left(m) for m in dropped), initial=todo - remaining, desc="bench", unit="gen")
        names = list(arms)
        with results.open("a") as f:
            for j, (ds, p, rep) in enumerate(jobs):
                # Rotate the arms' order per prompt: a run's speed depends a little on what ran just before it
                # (caches, allocator, clocks), up to ~10% between identical arms in a fixed order.
                for m in names[j % len(names):] + names[:j % len(names)]:
                    if m in dropped:
                        continue
                    arm = arms[m]

                    def answer(messages, m=m, arm=arm, ds=ds, p=p, rep=rep):
                        turn = sum(1 for x in messages if x["role"] == "user") - 1
                        key = (ds, p.id, turn, m, rep)
                        if key not in done:
                            ids = encode(messages)
                            before = done.get((ds, p.id, turn - 1, m, rep), {})
                            if "skipped" in before:  # the conversation cannot go on without the earlier answer
                                row = {"dataset": ds, "prompt_id": p.id, "turn": turn, "method": m, "repeat": rep,
                                       "prompt_tokens": len(ids), "skipped": f"turn {turn} was skipped"}
                            elif len(ids) >= max_len:
                                row = {"dataset": ds, "prompt_id": p.id, "turn": turn, "method": m, "repeat": rep,
                                       "prompt_tokens": len(ids), "skipped": f"prompt has {len(ids)} tokens; the "
                                       f"context limit is {max_len}"}
                            else:
                                try:
                                    res = arm(ids, cfg.max_new_tokens, cfg.repeat_sampling(rep))
                                except ArmFailed as e:
                                    raise ArmFailed(f"{e} on {_where(cfg, ds, p.id, turn, rep)}") from None
                                row = _row(ds, p.id, turn, m, rep, ids, res)
                            f.write(json.dumps(row) + "\n")
                            f.flush()
                            done[key] = row
                            bar.update(1)
                        wanted.append(key)
                        return done[key]

                    try:
                        conversation_turns(p, answer, max_turns=n_turns[id(p)],
                                           to_text=lambda r: decode(r.get("token_ids", [])))
                    except ArmFailed as e:  # the turns it answered are kept
                        drop(m, str(e))
                what = _checkpoint(jobs, j)
                if running is not None and what and bar.n > todo - remaining:
                    running([done[k] for k in wanted], what)
        bar.close()
        if cfg.streams > 1:  # while the vLLM arms' workers are up
            from adaptree.bench.streams import run_streams

            run_streams(cfg, arms, encode, sets, max_len, dropped)
    finally:
        for w in workers:
            w.close()
    return [done[k] for k in wanted]


def _checkpoint(jobs: list[tuple], j: int) -> str | None:
    """What the records reach after job ``j`` (a prompt of a dataset, every arm) when a running table is due
    there: the first prompt, or a dataset's last one when another dataset follows; else None."""
    if j + 1 < len(jobs) and jobs[j + 1][0] != jobs[j][0]:
        return f"{', '.join(dict.fromkeys(d for d, _, _ in jobs[:j + 1]))} ({j + 1} of {len(jobs)} prompts)"
    if j == 0 and len(jobs) > 1:
        return f"the first prompt of every arm (1 of {len(jobs)} prompts)"
    return None


def _where(cfg: BenchConfig, ds: str, prompt_id: str, turn: int, rep: int) -> str:
    return (f"prompt {ds}/{prompt_id}" + (f" turn {turn + 1}" if turn else "")
            + (f" repeat {rep}" if cfg.repeats > 1 else ""))


def rebuild_report(folder: str | Path) -> dict:
    """Summary, report and plots again from a bench folder's records (e.g. after an interrupted run, or
    to re-plot); measures nothing. The records kept are those of the folder's last configuration."""
    from adaptree.bench.report import print_table, write_report

    out = Path(folder)
    if not (out / CONFIG).is_file() or not (out / RESULTS).is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no {CONFIG} and {RESULTS}: not a bench folder")
    saved = json.loads((out / CONFIG).read_text())
    cfg = BenchConfig.from_dict({**saved["config"], "out": str(out)})
    done = read_records(out / RESULTS)
    keep = {(ds, p.id) for ds, ps in _load_prompts(cfg) for p in ps}
    max_turns = cfg.turns or 1_000_000
    rows = [r for k, r in done.items() if (k[0], k[1]) in keep and k[2] < max_turns and k[3] in cfg.methods
            and k[4] < cfg.repeats]
    summary = finish(cfg, rows, out, saved["settings"], saved.get("command"), saved.get("machine"),
                     saved.get("machine_setup"), saved.get("dropped_arms"))
    print_table(summary)
    write_report(summary, out)
    print(f"wrote {out / SUMMARY} and {out / 'report.md'} (+ plots)")
    return summary
