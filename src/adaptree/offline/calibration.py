"""``adaptree calibrate``: measure a latency model on this machine and validate it against live cycles.

1. :func:`~adaptree.offline.latency.calibrate` micro-benchmarks one draft step per (W, L) and one tree
   verification per (V, L) and fits the two bilinear forms.
2. Validation: the live :class:`~adaptree.core.engine.Engine` generates a few short prompts with several
   tree shapes (static (W, D, V) trees, small and large V, and AR). Every cycle's measured draft,
   verify and overhead seconds are compared with the model's prediction for the same (W, depth, V, L).
   The prompts are split in two halves (alternately): the per-cycle overhead ``other_s`` (which
   micro-benchmarks cannot see) and a second candidate model refitted from the live cycles
   (:meth:`~adaptree.offline.latency.LatencyModel.fit_records`) come from the first half; both candidates
   are scored on the held-out half by the median absolute relative error of the predicted cycle time
   (the goal, ``CalibrationConfig.goal``, is at most 10%). ``refit="auto"`` keeps the better one.

The cycle time compared is ``draft_s + verify_s + other_s`` (what the simulator charges); the
controller's own time (``policy_s``) is not part of the model and is left out on both sides. The
first cycle of a generation also feeds the whole prompt to the draft head (its first draft forward is
a prefill); the model charges it like any draft step, so it counts as an error like any other cycle.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from adaptree.core.config import between, check_fields, choice, positive
from adaptree.offline.latency import CALIBRATION_SIZES, LatencyModel, calibrate

DEFAULT_VALIDATION = ((10, 0, 0), (10, 8, 60), (10, 4, 16), (4, 3, 4), (16, 6, 120), (8, 12, 240))
"""(W, D, V) shapes run live for validation; D = 0 is an AR step (the engine's zero-depth plan)."""
REFIT = ("auto", "micro", "live")


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"ar,10:8:60,4:3:4"`` -> ((1, 0, 0), (10, 8, 60), (4, 3, 4)); ``ar`` = an AR step."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.lower() == "ar":
            out.append((1, 0, 0))
            continue
        bits = part.split(":")
        try:
            w, d, v = (int(b) for b in bits)
        except ValueError:
            raise ValueError(f"a validation shape is W:D:V (integers) or 'ar', got {part!r}") from None
        out.append((w, d, v))
    if not out:
        raise ValueError(f"no validation shapes in {text!r}")
    return tuple(out)


def shape_name(shape: tuple[int, int, int]) -> str:
    w, d, v = shape
    return "AR" if d == 0 else f"W{w} D{d} V{v}"


@dataclass
class CalibrationConfig:
    """Everything ``adaptree calibrate`` measures (the defaults take a few minutes on a 135M model, 2 cores)."""

    widths: tuple[int, ...] = (4, 8, 10, 16)
    """Draft widths W micro-benchmarked."""
    sizes: tuple[int, ...] = CALIBRATION_SIZES
    """Verification sizes V micro-benchmarked (the target forward has V + 1 rows); each is a knot of the
    piecewise-linear verification model."""
    verify_model: str = choice(("knots", "bilinear"), "knots")
    """knots: verification time piecewise linear in V + 1 (a knot per size), linear in L at each; bilinear:
    b0 + b1*N + b2*L + b3*N*L (the live refit candidate is always bilinear)."""
    lengths: tuple[int, ...] = (64, 256, 512, 1024)
    """Context lengths L the caches are filled to (those past the context limit are skipped)."""
    repeats: int = positive(5)
    """Timed repetitions per shape (median kept), after one warm-up."""
    shapes: tuple[tuple[int, int, int], ...] = DEFAULT_VALIDATION
    """(W, D, V) trees run live for validation; empty = no validation (other_s stays 0)."""
    max_new_tokens: int = positive(48)
    """Tokens per validation generation."""
    refit: str = choice(REFIT, "auto")
    """Which model to save: ``micro`` (micro-benchmark fit + live overhead), ``live`` (refit from the live
    cycles) or ``auto`` (the lower held-out median error)."""
    goal: float = between(0.0, 1.0, 0.10, lo_open=True, hi_open=True)
    """Target median absolute relative error of the predicted cycle time (reported, not enforced)."""
    warmup: bool = True
    """One short untimed generation per validation shape first."""

    def __post_init__(self) -> None:
        from adaptree.core.controller import MAX_DEPTH, MAX_WIDTH

        for name, low in (("widths", 1), ("sizes", 0), ("lengths", 1)):
            vals = tuple(int(x) for x in getattr(self, name))
            if not vals or any(x < low for x in vals):
                raise ValueError(f"{name} must be integers >= {low}, got {list(getattr(self, name))}")
            if len(set(vals)) < 2:  # either fit needs two values of each variable
                raise ValueError(f"{name} needs at least two distinct values to fit the latency model, "
                                 f"got {list(vals)}")
            setattr(self, name, vals)
        check_fields(self)
        shapes = tuple(tuple(int(x) for x in s) for s in self.shapes)
        for w, d, v in shapes:
            if not 1 <= w <= MAX_WIDTH or not 0 <= d <= MAX_DEPTH or v < 0 or (d > 0 and v < 1):
                raise ValueError(f"validation shape W={w} D={d} V={v} is invalid (W in 1..{MAX_WIDTH}, D in "
                                 f"0..{MAX_DEPTH}, V >= 1 unless D = 0 for AR)")
        self.shapes = shapes


# ---------------------------------------------------------------------------------------------- validation


def live_cycles(engine, prompts: Sequence[Sequence[int]], shapes: Sequence[tuple[int, int, int]],
                max_new_tokens: int, warmup: bool = True, progress: bool = False) -> list[dict]:
    """Generate every prompt with every shape (greedy) on the live engine; every cycle as a dict
    (:class:`~adaptree.core.records.CycleRecord` fields plus ``shape`` and ``prompt`` index)."""
    from tqdm import tqdm

    from adaptree.core.controller import (
        AutoregressiveController,
        StaticConfig,
        StaticController,
    )

    def controller(shape):
        w, d, v = shape
        return AutoregressiveController() if d == 0 else StaticController(StaticConfig(w, d, v))

    if warmup and prompts:
        for shape in shapes:
            engine.generate(list(prompts[0]), controller(shape), max_new_tokens=min(8, max_new_tokens))
    out = []
    bar = tqdm(total=len(prompts) * len(shapes), desc="validate", unit="gen", disable=not progress)
    for i, ids in enumerate(prompts):
        for shape in shapes:  # shapes interleaved per prompt: machine drift hits them alike
            res = engine.generate(list(ids), controller(shape), max_new_tokens=max_new_tokens)
            out += [{**c.to_dict(), "shape": shape_name(shape), "prompt": i} for c in res.cycles]
            bar.update(1)
    bar.close()
    return out


def _rel(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas if meas > 0 else float("inf")


def predicted(model: LatencyModel, r: dict) -> dict:
    """The model's draft / verify / cycle seconds for one cycle record."""
    d = model.draft_time(r["width"], r["depth"], r["context_len"])
    v = model.verify_time(r["size"], r["context_len"])
    return {"draft_s": d, "verify_s": v, "cycle_s": d + v + model.other_s}


def measured_cycle_s(r: dict) -> float:
    return r["draft_s"] + r["verify_s"] + r["other_s"]


def cycle_errors(model: LatencyModel, records: Sequence[dict]) -> dict:
    """Median absolute relative errors of the predicted cycle, draft (cycles that drafted) and verify
    times over ``records``; ``bias`` = Σ predicted / Σ measured cycle time. None where no record applies."""
    if not records:
        return {"cycles": 0, "cycle_mare": None, "draft_mare": None, "verify_mare": None, "bias": None}
    cyc, dra, ver = [], [], []
    sp = sm = 0.0
    for r in records:
        p = predicted(model, r)
        m = measured_cycle_s(r)
        cyc.append(_rel(p["cycle_s"], m))
        ver.append(_rel(p["verify_s"], r["verify_s"]))
        if r["depth"] > 0:
            dra.append(_rel(p["draft_s"], r["draft_s"]))
        sp += p["cycle_s"]
        sm += m
    return {"cycles": len(records), "cycle_mare": statistics.median(cyc),
            "draft_mare": statistics.median(dra) if dra else None, "verify_mare": statistics.median(ver),
            "bias": sp / sm if sm > 0 else None}


def split_records(records: Sequence[dict]) -> tuple[list[dict], list[dict], bool]:
    """(fit half, held-out half, held_out): prompts alternate between the halves; with a single prompt
    both halves are all records and ``held_out`` is False."""
    prompts = sorted({r["prompt"] for r in records})
    if len(prompts) < 2:
        return list(records), list(records), False
    fit_p = set(prompts[0::2])
    return ([r for r in records if r["prompt"] in fit_p], [r for r in records if r["prompt"] not in fit_p], True)


@dataclass
class CalibrationResult:
    model: LatencyModel
    """The model saved (``meta["source"]`` says which candidate)."""
    micro: LatencyModel
    """The micro-benchmark fit (``other_s`` from the live cycles when validated)."""
    live: LatencyModel | None
    """The refit from the live cycles (None without validation or when it cannot be fitted)."""
    records: list[dict] = field(default_factory=list)
    """Every live validation cycle."""
    validation: dict = field(default_factory=dict)
    """Errors per candidate, overall and per shape (see :func:`validate_models`)."""


def validate_models(micro: LatencyModel, records: Sequence[dict], refit: str = "auto",
                    goal: float = 0.10) -> tuple[LatencyModel, LatencyModel, LatencyModel | None, dict]:
    """Fit ``other_s`` and the live candidate on the fit half, score both on the held-out half.

    Returns (chosen, micro with other_s, live or None, validation summary)."""
    fit, held, held_out = split_records(records)
    other = statistics.median(r["other_s"] for r in fit) if fit else 0.0
    micro = replace(micro, other_s=float(other), meta=dict(micro.meta))
    live, live_error = None, None
    try:
        live = LatencyModel.fit_records(fit, meta={})
    except (ValueError, ZeroDivisionError) as exc:  # too few cycles of a kind to fit four coefficients
        live_error = str(exc)
    cands = {"micro": micro, **({"live": live} if live is not None else {})}
    shapes = sorted({r["shape"] for r in held}, key=lambda s: [r["shape"] for r in held].index(s))
    summary = {"held_out": held_out, "fit_cycles": len(fit), "held_out_cycles": len(held), "goal": goal,
               "other_s": other, "candidates": {}, "live_fit_error": live_error}
    for name, m in cands.items():
        summary["candidates"][name] = {
            "all": cycle_errors(m, held),
            "per_shape": {s: cycle_errors(m, [r for r in held if r["shape"] == s]) for s in shapes}}
    if refit == "live" and live is None:
        raise ValueError(f"--refit live: the live cycles cannot be fitted ({live_error})")
    if refit == "auto":
        scores = {k: v["all"]["cycle_mare"] for k, v in summary["candidates"].items()}
        chosen = min(scores, key=lambda k: (float("inf") if scores[k] is None else scores[k], k != "micro"))
    else:
        chosen = refit
    summary["chosen"] = chosen
    err = summary["candidates"][chosen]["all"]["cycle_mare"]
    summary["cycle_mare"] = err
    summary["goal_met"] = None if err is None else bool(err <= goal)
    return cands[chosen], micro, live, summary


def run_calibration(target, head, engine, prompts: Sequence[Sequence[int]], cfg: CalibrationConfig,
                    progress: bool = False) -> CalibrationResult:
    """Micro-benchmarks, then (when ``cfg.shapes`` and prompts are given) live validation and the choice."""
    micro = calibrate(target, head, widths=cfg.widths, sizes=cfg.sizes, lengths=cfg.lengths, repeats=cfg.repeats,
                      progress=progress, knots=cfg.verify_model == "knots")
    if not cfg.shapes or not prompts:
        micro.meta["source"] = "micro"
        micro.meta["validation"] = None
        return CalibrationResult(micro, micro, None, [], {})
    records = live_cycles(engine, prompts, cfg.shapes, cfg.max_new_tokens, warmup=cfg.warmup, progress=progress)
    if not records:
        raise ValueError("the validation generations ran no cycle (every prompt stopped at its first token)")
    chosen, micro_o, live, summary = validate_models(micro, records, cfg.refit, cfg.goal)
    model = replace(chosen, meta=dict(micro.meta))
    model.meta["source"] = summary["chosen"]
    model.meta["validation"] = summary
    return CalibrationResult(model, micro_o, live, records, summary)


def format_validation(summary: dict) -> str:
    """A plain-text table of the held-out errors per shape for each candidate."""
    if not summary:
        return "no validation run (other_s = 0: the model has no per-cycle overhead)"
    names = list(summary["candidates"])

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    head = f"{'shape':<16} {'cycles':>6}" + "".join(f" {n + ' cycle':>12} {n + ' draft':>12} {n + ' verify':>12} "
                                                     f"{n + ' bias':>10}" for n in names)
    lines = [head, "-" * len(head)]
    shapes = list(summary["candidates"][names[0]]["per_shape"]) + ["all"]
    for s in shapes:
        rows = [summary["candidates"][n]["per_shape"][s] if s != "all" else summary["candidates"][n]["all"]
                for n in names]
        line = f"{s:<16} {rows[0]['cycles']:>6}"
        for r in rows:
            bias = "-" if r["bias"] is None else f"{r['bias']:.3f}"
            line += f" {pct(r['cycle_mare']):>12} {pct(r['draft_mare']):>12} {pct(r['verify_mare']):>12} {bias:>10}"
        lines.append(line)
    where = "held-out prompts" if summary["held_out"] else "the same prompts (only one: no held-out half)"
    lines.append(f"median |relative error| of predicted vs measured times on {where}; bias = sum predicted / "
                 f"sum measured cycle time")
    met = summary["goal_met"]
    lines.append(f"saved: {summary['chosen']} (cycle-time error {pct(summary['cycle_mare'])}, goal <= "
                 f"{pct(summary['goal'])}: {'met' if met else 'NOT met' if met is not None else '-'})")
    if summary.get("live_fit_error"):
        lines.append(f"live refit unavailable: {summary['live_fit_error']}")
    return "\n".join(lines)


def config_dict(cfg: CalibrationConfig) -> dict:
    d = asdict(cfg)
    d["shapes"] = [list(s) for s in cfg.shapes]
    return d


def calibrate_pipeline(pipeline, prompts: Sequence, cfg: CalibrationConfig, out, *, chat: bool | None = None,
                       command: str | None = None, progress: bool = False) -> tuple[CalibrationResult, list]:
    """Calibrate a loaded :class:`~adaptree.api.Pipeline` (:func:`run_calibration` on its engine, validated on the
    first user turn of each :class:`~adaptree.data.prompts.Prompt`), save the chosen model at ``out`` with what it
    was measured with in its ``meta`` (model, head, dtype, torch, fingerprints, config, prompts, ``command``) and
    every live cycle with each candidate's prediction next to it (``<stem>.validation.json``).

    Returns the result and the paths written.
    """
    import json
    from pathlib import Path

    import torch

    from adaptree.offline.recording import require_head
    from adaptree.offline.traces import head_fingerprint, model_fingerprint

    require_head(pipeline, "calibrating")
    chat = pipeline.use_chat(chat)
    ids = [pipeline.encode(p.turns[0], chat) for p in prompts]
    if cfg.shapes and not ids:
        raise ValueError("validation needs prompts: give --datasets or --question-file (or --validate '' to skip)")
    target, head = pipeline.target, pipeline.head
    res = run_calibration(target, head, pipeline.engine, ids, cfg, progress=progress)
    res.model.meta.update(model=pipeline.model_label, head=pipeline.head_label,
                          dtype=str(target.dtype).removeprefix("torch."), torch=torch.__version__,
                          model_sha256=model_fingerprint(target), head_sha256=head_fingerprint(head),
                          config=config_dict(cfg), prompts=len(ids), command=command)
    out = Path(out)
    res.model.save(out)
    written = [out]
    if res.records:
        vpath = out.with_name(out.stem + ".validation.json")
        cands = {"micro": res.micro, **({"live": res.live} if res.live is not None else {})}
        rows = [{**r, **{f"{k}_pred": predicted(c, r) for k, c in cands.items()}} for r in res.records]
        vpath.write_text(json.dumps({"summary": res.validation, "micro": res.micro.to_dict(),
                                     "live": res.live.to_dict() if res.live is not None else None,
                                     "cycles": rows}, indent=1) + "\n")
        written.append(vpath)
    return res, written
