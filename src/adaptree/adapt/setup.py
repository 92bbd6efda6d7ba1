"""The per-machine setup (see :mod:`adaptree.adapt`): made once, cached, checked against the machine every time.

A setup is valid for one :func:`fingerprint`: the machine profile (CPU model and kernel-relevant flags, PyTorch's
and oneDNN's kernel levels, cores, torch threads and version, GPU), the device, the dtype and the sha256 of the
target's and the head's weights. Its folder is named by the fingerprint's digest, so a change of any field
(another CPU, ``ATEN_CPU_CAPABILITY=avx2``, another thread count, a retrained head) finds no setup and makes a
new one; :func:`find_setup` also compares the stored fingerprint field by field.

A setup is whole or absent: one process measures it while others wait at its lock
(:func:`~adaptree.adapt.cache.measure_lock`) and then find it; its files are written first, each through a
temporary file of its own, and ``setup.json`` last, listing their sha256, which :func:`find_setup` checks.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from adaptree.adapt.cache import digest, machine_fields, machines_dir, measure_lock, say, traces_dir
from adaptree.core.config import at_least, check_fields, positive
from adaptree.core.pipeline import PipelineLike

SETUP_VERSION = 5
"""2: the default method is confirmed live against AR (:func:`confirm_default`); 3: ``ngram`` and ``hybrid`` are
candidates for the default too; 4: ``setup.json`` lists the sha256 of the setup's files (:attr:`MachineSetup.files`);
5: the tuning traces carry the target features, so Re-SpS is modelled too. A setup of an older version is measured
again."""
TRACE_FEATURES = "float16"
"""How the tuning traces store the target features (Re-SpS's state) and the draft head's hidden states (SpecDec++'s
input)."""
SETUP_FILES = ("latency.json", "static_gs.json")
"""The files of a setup folder that ``setup.json`` lists with their sha256."""
ADAPT_ENV = "ADAPTREE_ADAPT"
"""``ADAPTREE_ADAPT=0`` turns the automatic adaptation of :func:`adaptree.load` off (a cached setup is still used)."""

CANDIDATES = ("ar", "static", "static-gs", "costaware", "deagle", "ltd", "radar", "resps", "ngram", "hybrid", "specdec",
              "c2t")
"""Methods :func:`adapt` models on the traces; every one that can run here (its files exist, its widths are
recorded) is a candidate for the default except ``static`` (EAGLE-3's default tree, the papers' baseline)."""

NOT_DEFAULT = ("static",)

CHAIN_SAMPLES = 4
"""Outputs sampled per tuning prompt at each sampled temperature for ``hybrid``'s chain calibration (a prompt has
one greedy output, but many sampled ones)."""


class AdaptError(ValueError):
    """The measurement could not run for this model (e.g. a context too short for the calibrated shapes); the
    pipeline still works, without a machine setup."""


def adapt_enabled(flag: bool | None = None) -> bool:
    """``flag``, or (None) unless ``$ADAPTREE_ADAPT`` is 0/false/no/off."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ADAPT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def fingerprint(pipeline: PipelineLike) -> dict:
    """What a setup of ``pipeline`` is valid for: the machine fields, device, dtype, the target's and the head's
    weight digests (dtype included)."""
    from adaptree.offline.store import head_fingerprint, model_fingerprint

    return {**machine_fields(), "device": str(pipeline.target.device), "dtype": pipeline.dtype_name,
            "weights": pipeline.weights, "attention": pipeline.attention_name,
            "compile_tokens": pipeline.target.compile_tokens, "model": model_fingerprint(pipeline.target),
            "head": head_fingerprint(pipeline.head) if pipeline.head is not None else None}


@dataclass
class AdaptConfig:
    """What :func:`adapt` measures (defaults: about two minutes on a 135M model, 2 cores, at the first use)."""

    prompts: int = positive(12)
    """Tuning prompts (ShareGPT validation split + the last HumanEval problems: never a benchmark prompt) whose
    greedy traces the simulator replays."""
    max_new_tokens: int = positive(128)
    """Tokens per traced prompt."""
    max_depth: int = positive(12)
    """Levels recorded at every position (LTD's maximum depth; the static grid searches depths 1..this)."""
    width: int = positive(10)
    """Beam width W of the recorded trees (EAGLE-3's, the learned policies')."""
    widths: tuple[int, ...] = (4, 8, 10, 16)
    """Draft widths the latency calibration times."""
    sizes: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)
    """Verification sizes V the latency calibration times (each a knot of the model)."""
    lengths: tuple[int, ...] = (128, 768)
    """Context lengths the latency calibration fills the caches to."""
    repeats: int = positive(3)
    """Timed repetitions per calibrated shape (median kept)."""
    validate_tokens: int = positive(24)
    """Tokens of the two live generations (AR and a small tree) that measure the per-cycle overhead."""
    methods: tuple[str, ...] = CANDIDATES
    """Methods modelled on the traces (those that cannot run here are listed as skipped)."""
    confirm_rounds: int = at_least(0, 3)
    """Interleaved rounds of the live check of the default (:func:`confirm_default`): a method becomes the default
    only if it also beats AR live, median over rounds; 0 = no check (the best modelled method is the default)."""
    confirm_tokens: int = positive(48)
    """Tokens per generation of the live check (two tuning prompts per round)."""
    confirm_candidates: int = positive(2)
    """Best-modelled methods (each modelled faster than AR) the live check runs against AR."""
    probe_sizes: tuple[int, ...] = at_least(0, (0, 1, 2, 4, 8, 16, 32, 64))
    """Verification sizes V the short probe of each candidate execution mode times (:mod:`adaptree.adapt.probe`),
    at the smallest and largest of :attr:`widths` and both :attr:`lengths`."""
    probe_repeats: int = positive(3)
    """Timed repetitions per shape of the probe (after one warm-up; the median kept, so that one slow repetition on
    a busy machine does not decide the mode)."""

    def __post_init__(self) -> None:
        check_fields(self)
        self.probe_sizes = tuple(int(v) for v in self.probe_sizes)
        if len(set(self.probe_sizes)) < 2:  # the probe's latency model needs two sizes to fit
            raise ValueError(f"probe_sizes needs at least two distinct sizes, got {list(self.probe_sizes)}")
        from adaptree.methods import method

        self.methods = tuple(self.methods)
        for m in self.methods:
            method(m)
        if "ar" not in self.methods:
            raise ValueError("the adapted methods must include 'ar' (the default when no tree pays)")


@dataclass
class MachineSetup:
    """A cached setup (``setup.json`` in :attr:`folder`)."""

    folder: Path
    fingerprint: dict
    default_method: str
    """The candidate the live check confirmed fastest (``ar`` when none beat AR live; see :attr:`confirmed`)."""
    static_tree: dict
    """``{"width", "depth", "size", "modelled_speedup"}``: the best static tree here (``static-gs``)."""
    methods: dict
    """Method -> ``{"tokens_per_s", "speedup", "tau", "mean_depth", "mean_size"}`` (modelled on the traces), or
    ``{"skipped": reason}``."""
    took_s: dict = field(default_factory=dict)
    """Seconds spent: calibration, traces, choice, total."""
    traces: str | None = None
    """The trace folder the choice was made on."""
    created: str = ""
    confirmed: dict = field(default_factory=dict)
    """The live check of the default (:func:`confirm_default`): ``{"rounds", "tokens", "ar_tokens_per_s",
    "methods": {name: {"speedup", "rounds": [...]}}}``; empty when it did not run."""
    files: dict = field(default_factory=dict)
    """File name -> sha256 of the setup's files (:data:`SETUP_FILES`), written before ``setup.json``: a setup whose
    files are missing or differ (half of one measurement, half of another) is not used."""
    execution_choice: dict = field(default_factory=dict)
    """How this setup's execution mode was chosen when it was chosen by measurement
    (:func:`~adaptree.adapt.execution.choose_execution`): ``{"candidates", "probes": {mode: {"method",
    "tokens_per_s", ...}}, "set_up": [modes given a full setup]}``; empty when the mode was given."""

    @property
    def latency_path(self) -> Path:
        return self.folder / "latency.json"

    @property
    def static_gs_path(self) -> Path:
        return self.folder / "static_gs.json"

    @property
    def acceptance_path(self) -> Path | None:
        return Path(self.traces) / "acceptance.json" if self.traces else None

    def whole(self) -> bool:
        """Every file of :data:`SETUP_FILES` is in :attr:`folder` with the sha256 that ``setup.json`` lists."""
        return sorted(self.files) == sorted(SETUP_FILES) and all(
            file_sha256(self.folder / name) == sha for name, sha in self.files.items())

    @property
    def assets(self) -> dict[str, str]:
        """Config option -> file, for the methods that take this machine's files (``make_controller(machine=...)``)."""
        return machine_assets(self.folder, self.acceptance_path)

    def latency(self):
        from adaptree.offline.latency import LatencyModel

        return LatencyModel.load(self.latency_path)

    def modelled_tokens_per_s(self, method: str | None = None) -> float:
        row = self.methods.get(method or self.default_method, {})
        return float(row.get("tokens_per_s", 0.0))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("folder")
        return {"version": SETUP_VERSION, **d}

    @classmethod
    def read(cls, folder: Path) -> MachineSetup:
        d = json.loads((folder / "setup.json").read_text())
        if d.pop("version", None) != SETUP_VERSION:
            raise ValueError(f"{folder}/setup.json: another setup format version")
        return cls(folder=folder, **d)

    def table(self) -> str:
        """The modelled methods, one line each (what ``adaptree adapt`` prints)."""
        lines = [f"{'method':<12} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'depth':>6} {'V':>6}"]
        for name, row in self.methods.items():
            if "skipped" in row:
                lines.append(f"{name:<12} skipped: {row['skipped']}")
                continue
            mark = "  <- default" if name == self.default_method else ""
            lines.append(f"{name:<12} {row['tokens_per_s']:>8.1f} {row['speedup']:>7.2f}x {row['tau']:>6.2f} "
                         f"{row['mean_depth']:>6.2f} {row['mean_size']:>6.1f}{mark}")
        checked = live_speedups(self.confirmed)
        if checked:
            lines.append(f"live check vs AR (median of {self.confirmed.get('rounds')} interleaved rounds): {checked}"
                         + ("" if self.default_method != "ar" else "; none beats AR live, so the default is ar"))
        t = self.static_tree
        lines.append(f"static tree here: W{t['width']} D{t['depth']} V{t['size']} (modelled {t['modelled_speedup']:.2f}x"
                     f" AR); modelled on the greedy traces of {self.traces_prompts} prompts with this machine's "
                     "latency model")
        return "\n".join(lines)

    @property
    def traces_prompts(self) -> int:
        return int(self.took_s.get("trace_prompts", 0))


MACHINE_POLICIES = {"depth_policy": "ltd/depth", "size_policy": "ltd/size"}
"""Method option -> policy folder inside a setup folder: what ``adaptree train ltd --machine`` exports there (used
instead of the policies shipped next to the head once it exists)."""


def machine_assets(folder: Path, acceptance: Path | None) -> dict[str, str]:
    """The files of a setup folder as method options: ``latency``, ``tuned`` and (when they exist) ``acceptance``,
    ``chain`` (next to it) and this machine's own retrained policies (:data:`MACHINE_POLICIES`)."""
    out = {"latency": str(folder / "latency.json"), "tuned": str(folder / "static_gs.json")}
    if acceptance is not None and acceptance.is_file():
        out["acceptance"] = str(acceptance)
    if acceptance is not None and acceptance.with_name("chain.json").is_file():
        out["chain"] = str(acceptance.with_name("chain.json"))
    for option, sub in MACHINE_POLICIES.items():
        if (folder / sub / "config.json").is_file():
            out[option] = str(folder / sub)
    return out


def file_sha256(path: Path) -> str | None:
    """:func:`~adaptree.models.cache.sha256_file` of ``path``; None when it cannot be read."""
    from adaptree.models.cache import sha256_file

    try:
        return sha256_file(path)
    except OSError:
        return None


def find_setup(pipeline: PipelineLike, fp: dict | None = None) -> MachineSetup | None:
    """The cached setup valid for ``pipeline`` on this machine (None if there is none, it is stale or not
    whole)."""
    fp = fingerprint(pipeline) if fp is None else fp
    folder = machines_dir() / digest(fp)
    try:
        setup = MachineSetup.read(folder)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if setup.fingerprint != json.loads(json.dumps(fp)) or not setup.whole():
        return None
    _complete(setup, pipeline)
    return setup


def _complete(setup: MachineSetup, pipeline: PipelineLike) -> None:
    """Fit the calibrations a setup made by an older adaptree lacks (``chain.json`` next to ``acceptance.json``, with
    its rates at :data:`~adaptree.methods.common.chain.SAMPLED_TEMPERATURES`: from the setup's own traces and, for
    the sampled rates, outputs sampled from their prompts)."""
    acc = setup.acceptance_path
    if acc is None or not acc.is_file() or _chain_complete(acc.with_name("chain.json")):
        return
    from adaptree.offline.traces import TraceStore

    try:
        traces = TraceStore(acc.parent).load_all()
    except (OSError, ValueError):
        return  # the traces are gone: methods that need the file say so
    if traces:
        _acceptance(acc.parent, traces, pipeline, say)


def _chain_complete(path: Path) -> bool:
    """``path`` is a chain calibration of the current occurrence rule with greedy rates and rates at every sampled
    temperature."""
    from adaptree.core.context import DEFAULT_SELECT
    from adaptree.methods.common.chain import SAMPLED_TEMPERATURES, ChainCalibration

    try:
        cal = ChainCalibration.load(path)
    except (OSError, ValueError):
        return False
    have = cal.temperatures.tolist()
    return cal.select == DEFAULT_SELECT and all(t in have for t in (0.0, *SAMPLED_TEMPERATURES))


def fit_lengths(lengths: Sequence[int], max_len: int, max_size: int) -> tuple[int, int]:
    """Two calibration context lengths that fit a context of ``max_len`` with ``max_size + 1`` tree rows: the
    smallest and largest of ``lengths``, each moved down to fit (a short-context model is still measured)."""
    room = max_len - max_size - 2
    if room < 2:
        raise ValueError(f"a context of {max_len} tokens is too short to time trees of {max_size} nodes")
    lo, hi = min(min(lengths), room // 4 or 1), min(max(lengths), room)
    return (lo, hi) if hi > lo else (max(1, hi // 2), hi)


def tuning_prompt_ids(pipeline: PipelineLike, n: int) -> list[tuple[str, list[int]]]:
    """``n`` tuning prompts (never a benchmark prompt) as ``(key, ids)``, through the chat template when the model
    has one."""
    from adaptree.methods.static.tune import tuning_prompts

    chat = pipeline.use_chat()
    return [(f"{p.dataset}/{p.id}", pipeline.encode(p.turns[0], chat)) for p in tuning_prompts(n)]


def _traces(pipeline: PipelineLike, cfg: AdaptConfig, folder: Path | None, prompt_ids, progress: bool):
    """The greedy traces the choice is made on: ``folder`` (reused as it is when it already holds traces, e.g. the
    other dtype's), else the cache's folder of this model and head, recorded there if missing (under its lock:
    setups of other execution modes share the folder)."""
    from adaptree.offline.store import head_fingerprint, model_fingerprint
    from adaptree.offline.traces import TraceSettings, TraceStore, open_store_for

    if folder is not None and (Path(folder) / "manifest.json").is_file():
        store = TraceStore(folder)
        return Path(folder), store.load_all()
    if folder is None:
        # the traces carry the target features Re-SpS observes and the draft hidden states SpecDec++ reads (older
        # folders, without the "-hidden", recorded no hidden states; those before them no features either)
        folder = traces_dir() / (f"{model_fingerprint(pipeline.target)[:16]}-{head_fingerprint(pipeline.head)[:16]}"
                                 f"-{TRACE_FEATURES}-hidden")
    settings = TraceSettings(widths=(cfg.width,), max_depth=cfg.max_depth, max_new_tokens=cfg.max_new_tokens,
                             eos_token_ids=tuple(pipeline.tokenizer.eos_token_ids), max_seq_len=pipeline.max_seq_len,
                             feature_dtype=TRACE_FEATURES, hidden_dtype=TRACE_FEATURES)
    keyed = prompt_ids if prompt_ids is not None else tuning_prompt_ids(pipeline, cfg.prompts)
    with measure_lock(Path(folder)):
        store = open_store_for(folder, pipeline.target, pipeline.head, settings)
        store.record(pipeline.target, pipeline.head, keyed, progress=progress)
    keys = {k for k, _ in keyed}
    return Path(folder), [t for t in store.load_all() if t.key in keys]


def tuning_traces(pipeline: PipelineLike, cfg: AdaptConfig, prompt_ids=None, folder: Path | None = None,
                  progress: bool = True, message: Callable[[str], None] | None = None) -> tuple[Path, list, Path]:
    """The greedy traces of the tuning prompts (``prompt_ids`` instead when given) and their acceptance and chain
    calibrations, recorded once per model and head (:func:`_traces`; ``folder`` as it is when it holds traces):
    what every execution mode's probe and setup replay (acceptance does not depend on the mode). Returns
    (folder, traces, ``acceptance.json``)."""
    tuning = list(prompt_ids) if prompt_ids is not None else tuning_prompt_ids(pipeline, cfg.prompts)
    tfolder, recorded = _traces(pipeline, cfg, folder, tuning, progress)
    if not recorded:
        raise ValueError(f"no traces to model the methods on in {tfolder}")
    return tfolder, recorded, _acceptance(tfolder, recorded, pipeline, message)


def _acceptance(folder: Path, traces, pipeline: PipelineLike, message: Callable[[str], None] | None = None) -> Path:
    """``costaware``'s acceptance calibration of the traces in ``folder`` and ``hybrid``'s chain calibration
    (``chain.json``: greedy rates from the traces, combined with rates at each of
    :data:`~adaptree.methods.common.chain.SAMPLED_TEMPERATURES` from outputs sampled from the traces' prompts;
    fitted once, kept next to them, under the folder's lock)."""
    with measure_lock(folder):
        return _fit_acceptance(folder, traces, pipeline, message)


def _fit_acceptance(folder: Path, traces, pipeline: PipelineLike, message: Callable[[str], None] | None) -> Path:
    from adaptree.methods.costaware.acceptance import AcceptanceCalibration
    from adaptree.methods.common.chain import SAMPLED_TEMPERATURES, ChainCalibration

    path = folder / "acceptance.json"
    if not path.is_file():
        AcceptanceCalibration.fit(traces).save(path)
    chain = folder / "chain.json"
    if not _chain_complete(chain):
        greedy = ChainCalibration.fit(traces)
        prompts = [t.prompt.tolist() for t in traces]
        new = max(t.end for t in traces)  # the traces' token limit, as near as they say
        per = CHAIN_SAMPLES
        sampled = []
        for temperature in SAMPLED_TEMPERATURES:
            if message is not None:
                message(f"chain calibration: sampling {len(prompts)} prompts x {per} at T={temperature:g} "
                        f"({new} tokens)")
            sampled.append(ChainCalibration.fit_sampled(
                pipeline.target, prompts, temperature, new, pipeline.tokenizer.eos_token_ids, per,
                max_ngram=greedy.max_ngram, max_tokens=greedy.max_tokens, edges=greedy.edges))
        ChainCalibration.combine([greedy, *sampled]).save(chain)
    return path


def static_tree(traces, latency, cfg: AdaptConfig, path: Path, fp: dict) -> dict:
    """The static tree (W, D, V) that models fastest on ``traces`` under ``latency`` (``static-gs``'s), written to
    ``path``; returns ``{"width", "depth", "size", "modelled_speedup", "size_by_depth"}`` (the best V of a tree of
    each depth, as strings -> V: what RADAR verifies when it stops at that depth)."""
    from adaptree.offline.oracle import best_static
    from adaptree.offline.runs import write_json

    width = traces[0].widths[0] if cfg.width not in traces[0].widths else cfg.width
    depth = min(cfg.max_depth, traces[0].max_depth)
    best = best_static(traces, latency, widths=(width,), depths=range(1, depth + 1))
    by_depth = best.size_by_depth()  # what RADAR verifies at each depth
    tree = {"width": best.width, "depth": best.depth, "size": best.size, "modelled_speedup": best.speedup,
            "size_by_depth": {str(d): v for d, v in by_depth.items()}}
    write_json({**tree, "source": "adaptree adapt (simulator: this machine's latency model on greedy traces)",
                "fingerprint": fp}, path)
    return tree


def model_methods(pipeline: PipelineLike, cfg: AdaptConfig, traces, latency, assets: dict[str, str]) -> dict:
    """Every method of ``cfg.methods`` replayed on ``traces`` with ``latency`` (the simulator; the controller's own
    time measured here): method -> ``{"tokens_per_s", "speedup", "tau", "mean_depth", "mean_size"}``, or
    ``{"skipped": reason}`` for one that cannot run here."""
    from adaptree.methods import make_controller
    from adaptree.offline.simulator import simulate

    out = {}
    for name in cfg.methods:
        try:
            ctl = make_controller(name, head_folder=pipeline.head_folder, model=pipeline.model_label,
                                  tokenizer=pipeline.tokenizer, machine=assets)
            res = simulate(ctl, traces, latency)
        except (ValueError, FileNotFoundError, KeyError) as e:  # no policy for this head, widths not recorded...
            out[name] = {"skipped": str(e).splitlines()[0][:200]}
            continue
        s = res.summary()
        total = s["modelled_s"] + s["policy_s"]  # the controller's own time, measured here, counts too
        out[name] = {"tokens_per_s": s["new_tokens"] / total if total > 0 else 0.0,
                     "speedup": s["modelled_ar_s"] / total if total > 0 else 0.0, "tau": s["tau"],
                     "mean_depth": s["mean_depth"], "mean_size": s["mean_size"]}
    return out


def adapt(pipeline: PipelineLike, cfg: AdaptConfig | None = None, *, force: bool = False, progress: bool = True,
          traces: str | os.PathLike | None = None, prompt_ids: Sequence[tuple[str, Sequence[int]]] | None = None,
          message: Callable[[str], None] = say, choice: dict | None = None) -> MachineSetup:
    """The setup of ``pipeline`` on this machine: the cached one (:func:`find_setup`), else made now and cached (one
    process measures; others wait for it and take its setup).

    :param force: measure again even when a valid setup is cached.
    :param traces: a trace folder to replay instead of the cache's (used as it is when it exists).
    :param prompt_ids: ``(key, ids)`` prompts to trace instead of the tuning prompts.
    :param choice: how the execution mode was chosen, kept in a setup measured now
        (:attr:`MachineSetup.execution_choice`).
    :raises AdaptError: the measurement failed (the message says why).
    """
    if pipeline.head is None:
        raise ValueError("adapting to the machine needs a draft head (with none, the only method is ar)")
    cfg = cfg or AdaptConfig()
    fp = fingerprint(pipeline)
    if not force:
        found = find_setup(pipeline, fp)
        if found is not None:
            return found
    with measure_lock(machines_dir() / digest(fp)):
        if not force:
            found = find_setup(pipeline, fp)  # made by another process while this one waited
            if found is not None:
                return found
        try:
            return _measure(pipeline, cfg, fp, traces, prompt_ids, progress, message, choice or {})
        except (ValueError, RuntimeError) as e:
            raise AdaptError(str(e)) from e


def _measure(pipeline: PipelineLike, cfg: AdaptConfig, fp: dict, traces, prompt_ids, progress: bool,
             message: Callable[[str], None], choice: dict) -> MachineSetup:
    from adaptree.offline.calibration import CalibrationConfig, run_calibration
    from adaptree.offline.runs import write_json

    folder = machines_dir() / digest(fp)
    traced = traces is not None and (Path(traces) / "manifest.json").is_file()  # e.g. by the execution-mode probe
    message(f"measuring this machine once for {pipeline.model_label} in {pipeline.execution} ({fp['cpu']}, "
            f"{fp['cpu_capability']} kernels, {fp['torch_threads']} threads): "
            + ("latency, the tree and the default method on the traces recorded" if traced else
               "latency, traces, the tree and the default method (about 2 minutes)") + f"; cached in {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    keyed = list(prompt_ids) if prompt_ids is not None else None
    tuning = keyed if keyed is not None else tuning_prompt_ids(pipeline, cfg.prompts)
    val = [ids[:256] for _, ids in tuning[:2]]
    ccfg = CalibrationConfig(widths=cfg.widths, sizes=cfg.sizes, repeats=cfg.repeats,
                             lengths=fit_lengths(cfg.lengths, pipeline.engine.max_len, max(cfg.sizes)),
                             shapes=((1, 0, 0), (10, 3, 8)), max_new_tokens=cfg.validate_tokens, refit="micro")
    cal = run_calibration(pipeline.target, pipeline.head, pipeline.engine, val, ccfg, progress=progress)
    cal.model.meta.update(model=pipeline.model_label, head=pipeline.head_label, fingerprint=fp, source="adapt")
    cal.model.save(folder / "latency.json")
    t1 = time.perf_counter()
    tfolder, recorded, acc = tuning_traces(pipeline, cfg, tuning, Path(traces) if traces else None, progress)
    t2 = time.perf_counter()
    tree = static_tree(recorded, cal.model, cfg, folder / "static_gs.json", fp)
    assets = machine_assets(folder, acc)
    methods = model_methods(pipeline, cfg, recorded, cal.model, assets)
    default, confirmed = confirm_default(pipeline, cfg, methods, val, assets, progress)
    t3 = time.perf_counter()
    setup = MachineSetup(folder, json.loads(json.dumps(fp)), default, tree, methods,
                         {"calibration": t1 - t0, "traces": t2 - t1, "choice": t3 - t2, "total": t3 - t0,
                          "trace_prompts": len(recorded)},
                         str(tfolder), time.strftime("%Y-%m-%dT%H:%M:%S"), confirmed,
                         {name: file_sha256(folder / name) for name in SETUP_FILES}, json.loads(json.dumps(choice)))
    write_json(setup.to_dict(), folder / "setup.json")  # last: it makes the setup whole
    checked = live_speedups(confirmed)
    message(f"machine setup done in {t3 - t0:.0f} s: default method {default} (modelled "
            f"{methods[default]['speedup']:.2f}x AR" + (f"; live vs AR: {checked}" if checked else "")
            + f"), static tree W{tree['width']} D{tree['depth']} V{tree['size']}")
    return setup


def ranked(methods: dict) -> list[str]:
    """The candidates for the default (modelled here, not in :data:`NOT_DEFAULT`), best modelled first."""
    return sorted((m for m, r in methods.items() if "skipped" not in r and m not in NOT_DEFAULT),
                  key=lambda m: -methods[m]["tokens_per_s"])


def contenders(methods: dict, n: int) -> list[str]:
    """The ``n`` best-modelled candidates for the default that model faster than AR, best first."""
    ar = methods.get("ar", {}).get("tokens_per_s", 0.0)
    return [m for m in ranked(methods) if m != "ar" and methods[m]["tokens_per_s"] > ar][:n]


def live_speedups(confirmed: dict) -> str:
    """``"name 0.89x, ..."``: the live check's speedups (:attr:`MachineSetup.confirmed`); empty when it did not run."""
    return ", ".join(f"{k} {v['speedup']:.2f}x" for k, v in (confirmed.get("methods") or {}).items())


def pick_default(live: dict[str, float]) -> str:
    """The method with the highest live speedup over AR among those at 1.0x or more; ``ar`` when none is."""
    passed = {m: s for m, s in live.items() if s >= 1.0}
    return max(passed, key=passed.get) if passed else "ar"


def confirm_default(pipeline: PipelineLike, cfg: AdaptConfig, methods: dict, prompts: Sequence[Sequence[int]],
                    assets: dict[str, str], progress: bool = False) -> tuple[str, dict]:
    """The default method, checked live: the simulator's latency model misses costs the live engine pays (the
    drafter's per-step overhead, int4 dequantisation growing with the tree), so a method it models a few percent
    faster than AR can be slower. The :func:`contenders` and AR generate ``prompts`` greedily, interleaved (the
    order rotates each round, so machine drift hits them alike), ``cfg.confirm_rounds`` times; a method's speedup
    is the median over rounds of its tokens/s over AR's in that round, and :func:`pick_default` chooses.

    Returns (default, record for :attr:`MachineSetup.confirmed`)."""
    from tqdm import tqdm

    from adaptree.core.controller import AutoregressiveController
    from adaptree.methods import make_controller

    if cfg.confirm_rounds == 0:
        return ranked(methods)[0], {}
    names = contenders(methods, cfg.confirm_candidates)
    if not names:
        return "ar", {}
    ctls = {"ar": AutoregressiveController()}
    for m in names:
        ctls[m] = make_controller(m, head_folder=pipeline.head_folder, model=pipeline.model_label,
                                  tokenizer=pipeline.tokenizer, machine=assets)
    engine = pipeline.engine
    for ctl in ctls.values():  # warm-up: the first generation of a tree shape pays one-off allocations
        engine.generate(list(prompts[0]), ctl, max_new_tokens=min(8, cfg.confirm_tokens))
    order = list(ctls)
    rate = {m: [] for m in order}
    bar = tqdm(total=cfg.confirm_rounds * len(order), desc="live check", unit="method", disable=not progress)
    for r in range(cfg.confirm_rounds):
        for m in order[r % len(order):] + order[:r % len(order)]:
            toks = secs = 0.0
            for ids in prompts:
                res = engine.generate(list(ids), ctls[m], max_new_tokens=cfg.confirm_tokens)
                toks, secs = toks + res.new_tokens, secs + res.wall_time_s
            rate[m].append(toks / secs if secs > 0 else 0.0)
            bar.update(1)
    bar.close()
    ratios = {m: [a / b if b > 0 else 0.0 for a, b in zip(rate[m], rate["ar"])] for m in names}
    live = {m: statistics.median(v) for m, v in ratios.items()}
    record = {"rounds": cfg.confirm_rounds, "tokens": cfg.confirm_tokens, "prompts": len(prompts),
              "ar_tokens_per_s": statistics.median(rate["ar"]),
              "methods": {m: {"speedup": live[m], "rounds": ratios[m]} for m in names}}
    return pick_default(live), record
