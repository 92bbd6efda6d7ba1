"""What SpecDec++ and C2T share: a small network that predicts whether a drafted token is accepted, trained by
supervised learning on samples of greedy traces, as the LTD paper trained both for its comparison (Appendix A.1):
samples from the drafts of the default EAGLE-3 tree on HumanEval, each labelled accepted or not by the target,
as many positives as negatives, AdamW at lr 1e-4.

* :class:`AcceptanceClassifier`: features -> one logit of "accepted". A feature-wise standardisation (fitted on the
  training samples, stored as buffers), then ``Linear -> SiLU`` to the hidden width, ``blocks`` residual blocks
  (``x + Linear(SiLU(Linear(x)))``: SpecDec++'s ResNet) and a last ``Linear`` to one logit; ``blocks = 0`` is a
  plain FFN (C2T's).
* Files: a folder with ``config.json`` (:class:`ClassifierConfig`, unknown fields refused, with the training facts)
  and ``model.safetensors``, loaded strictly (:func:`~adaptree.offline.policy.load_policy`).
* Samples (:func:`visited_roots`): the roots a greedy run of EAGLE-3's default tree (W=10, depth 8, V=60) reaches;
  each method turns a root's recorded tree into feature rows and labels (``samples`` of its module).
* Training (:func:`train_classifier`): held-out prompts for validation (by a hash of the trace key), classes
  balanced by subsampling the larger one (seeded, per side), minibatch BCE with AdamW; a checkpoint after every epoch
  (an interrupted run resumes from it: same settings, same samples, the shuffles seeded by epoch), the policy of the
  last epoch exported with the validation's balanced accuracy and accept/reject rates per epoch in
  ``summary.json``, and the float16 weights' (what ships) under ``exported_validation``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from adaptree.core.config import between, check_fields, positive
from adaptree.core.controller import Controller
from adaptree.methods.common.runtime import LearnedSeam
from adaptree.offline.policy import load_policy, save_policy
from adaptree.offline.runs import (
    check_out_dir,
    checkpoint_state,
    dataclass_from_dict,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    split_by_key,
    write_json,
)
from adaptree.offline.traces import PromptTrace, acceptance_table, num_candidates

EAGLE_TREE = (10, 8, 60)
"""(W, depth, V) of EAGLE-3's default tree: the drafts the samples come from (LTD Appendix A.1)."""


@dataclass
class ClassifierConfig:
    """Shape of an acceptance classifier and what it was trained for."""

    kind: str
    """``specdec`` or ``c2t`` (checked by the controller that loads it)."""
    inputs: int = positive(3)
    """Features per sample."""
    features: list[str] = field(default_factory=list)
    """What each feature is, in order (the controller builds them the same way)."""
    hidden: int = positive(64)
    """Width of the hidden layers."""
    blocks: int = between(0, 16, 0)
    """Residual blocks after the first layer (0: a plain FFN)."""
    threshold: float = between(0.0, 1.0, 0.5, lo_open=True, hi_open=True)
    """The decision threshold the controller uses by default (the classes were balanced: 0.5 is the even odds)."""
    width: int = positive(10)
    """Beam width W of the trees the samples came from."""
    max_depth: int = positive(12)
    """Deepest level the samples came from."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.features and len(self.features) != self.inputs:
            raise ValueError(f"features names {len(self.features)} features, inputs says {self.inputs}")

    @classmethod
    def from_dict(cls, d: dict) -> "ClassifierConfig":
        return dataclass_from_dict(cls, d, "classifier", allowed=("version", "training"))


class AcceptanceClassifier(nn.Module):
    """Features ``[..., inputs]`` -> logit ``[...]`` of "accepted" (module docstring)."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = c = config
        self.register_buffer("shift", torch.zeros(c.inputs))
        self.register_buffer("scale", torch.ones(c.inputs))
        self.first = nn.Linear(c.inputs, c.hidden)
        h = c.hidden
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, h)) for _ in range(c.blocks))
        self.last = nn.Linear(c.hidden, 1)
        self.act = nn.SiLU()

    def fit_scaling(self, x: torch.Tensor) -> None:
        """Standardise each feature over the training samples ``x`` (a constant feature keeps scale 1)."""
        std = x.std(0)
        self.shift.copy_(x.mean(0))
        self.scale.copy_(torch.where(std > 1e-6, std, torch.ones_like(std)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.first((x - self.shift) / self.scale))
        for block in self.blocks:
            h = h + block(h)
        return self.last(self.act(h)).squeeze(-1)

    @torch.inference_mode()
    def accept_prob(self, x: torch.Tensor) -> torch.Tensor:
        """P(accepted) of each row of ``x`` (float32)."""
        return torch.sigmoid(self.forward(x.float()))

    def save(self, folder: str | os.PathLike, training: dict | None = None) -> Path:
        """Write the folder, the weights in float16: half the file (SpecDec++'s is 2.7M parameters); the trainer
        reports the validation of the weights as stored."""
        return save_policy(folder, self, {"version": 1, **asdict(self.config)}, training, dtype=torch.float16)

    @classmethod
    def load(cls, folder: str | os.PathLike, kind: str) -> "AcceptanceClassifier":
        """Load a folder written by :meth:`save`, strictly; a ValueError when it is another method's."""
        model = load_policy(folder, lambda d: cls(ClassifierConfig.from_dict(d)), f"{kind} classifier")
        if model.config.kind != kind:
            raise ValueError(f"{folder}: a {model.config.kind!r} classifier, not a {kind!r} one")
        return model


class ClassifierController(LearnedSeam, Controller):
    """What SpecDec++'s and C2T's controllers share: the classifier (given, or loaded from ``config.policy``), its
    threshold (``config.threshold``, else the file's), the plan of the config and the learned methods' runtime (the
    AR gate prices a probe at ``probe_size`` nodes)."""

    label: str
    """The method's name in messages."""
    probe_size: int

    def __init__(self, config, classifier: AcceptanceClassifier | None = None, chain_calibration=None) -> None:
        self.config = cfg = config
        if classifier is None:
            if not cfg.policy:
                raise ValueError(f"no {self.label} classifier given: pass --{self.name}-policy PATH (train one with "
                                 f"`adaptree train {self.name}`)")
            classifier = AcceptanceClassifier.load(cfg.policy, self.name)
        self.classifier = classifier.eval()
        self.threshold = classifier.config.threshold if cfg.threshold is None else cfg.threshold
        self.plan = cfg.plan()
        self.observes = False
        self.smallest = (cfg.width, self.probe_size, cfg.depth)
        self.start_runtime(cfg, chain_calibration, False)
        self.load_latency(cfg)

    def accept_prob(self, x: torch.Tensor) -> torch.Tensor:
        """The classifier's P(accepted) of the rows of ``x``, on ``x``'s device."""
        if self.classifier.last.weight.device != x.device:
            self.classifier.to(x.device)
        return self.classifier.accept_prob(x)


# ---- samples ----------------------------------------------------------------------------------------


def visited_roots(trace: PromptTrace, tree: tuple[int, int, int] = EAGLE_TREE) -> np.ndarray:
    """Root positions a greedy run of the static tree ``(W, depth, V)`` drafts at over ``trace`` (each cycle
    emits its accepted draft tokens plus one)."""
    w, depth, size = tree
    wt = trace.width(w)
    if depth > wt.max_depth:
        raise ValueError(f"trace {trace.key!r} has {wt.max_depth} levels, the sampled tree needs {depth}")
    table = acceptance_table(wt, trace.output, depth)
    v = min(size, num_candidates(w, depth))
    roots, j = [], 0
    while j + 1 < trace.end:  # root y_j is the (j+1)-th token emitted: at ``end`` the run has stopped
        roots.append(j)
        j += int(table[j, v]) + 1
    return np.asarray(roots, np.int64)


def balance(x: np.ndarray, y: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """As many positives as negatives: the larger class subsampled (seeded), order shuffled."""
    rng = np.random.default_rng(seed)
    pos, neg = np.flatnonzero(y), np.flatnonzero(~y)
    n = min(len(pos), len(neg))
    keep = np.concatenate([rng.choice(pos, n, replace=False), rng.choice(neg, n, replace=False)])
    rng.shuffle(keep)
    return x[keep], y[keep]


Sampler = Callable[[PromptTrace], tuple[np.ndarray, np.ndarray]]
"""One trace -> ``(features [N, inputs] float32, accepted [N] bool)``."""


def training_traces_for(pipeline, cfg: "ClassifierTrainConfig", prompts, progress: bool = True) -> list[PromptTrace]:
    """The greedy traces of ``prompts`` (a :class:`~adaptree.offline.recording.TrainingPrompts`), recorded into
    ``prompts.traces`` or ``cfg.out``/traces if missing, as both classifiers need them (W=10, 12 levels, the draft
    hidden states): one folder (``--traces``) serves SpecDec++ and C2T."""
    from adaptree.offline.recording import training_traces

    return training_traces(pipeline, prompts.trace_folder(cfg.out), prompts.prompts(), prompts.max_new_tokens,
                           (EAGLE_TREE[0],), 12, progress=progress, hidden_dtype="float16")


def gather(traces: Sequence[PromptTrace], sampler: Sampler, inputs: int) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = zip(*(sampler(t) for t in traces)) if traces else ((), ())
    return (np.concatenate(xs) if xs else np.zeros((0, inputs), np.float32),
            np.concatenate(ys) if ys else np.zeros(0, bool))


# ---- training ---------------------------------------------------------------------------------------


@dataclass
class ClassifierTrainConfig:
    """How an acceptance classifier is trained (LTD Appendix A.1 for the defaults the methods give)."""

    out: str = "runs/classifier"
    """Run folder: checkpoint/, policy/ (the classifier to ship), summary.json."""
    epochs: int = positive(5)
    """Passes over the balanced training samples."""
    lr: float = between(0.0, 1.0, 1e-4, lo_open=True)
    """AdamW learning rate."""
    weight_decay: float = between(0.0, 1.0, 0.01)
    """AdamW weight decay (torch's default)."""
    batch: int = positive(256)
    """Samples per minibatch."""
    val_fraction: float = between(0.0, 0.9, 0.15)
    """Share of the prompts held out for validation (by a hash of their key)."""
    seed: int = 0
    """Seed of the class balancing, the initial weights and the shuffles."""

    def __post_init__(self) -> None:
        check_fields(self)


def balanced_accuracy(prob: torch.Tensor, y: torch.Tensor, threshold: float) -> dict[str, float]:
    """Accept rate on accepted samples, reject rate on rejected ones, and their mean."""
    pred = prob >= threshold
    tpr = float(pred[y].float().mean()) if y.any() else float("nan")
    tnr = float((~pred[~y]).float().mean()) if (~y).any() else float("nan")
    return {"accept_rate_on_accepted": tpr, "reject_rate_on_rejected": tnr, "balanced_accuracy": (tpr + tnr) / 2}


def train_classifier(config: ClassifierConfig, traces: Sequence[PromptTrace], sampler: Sampler,
                     cfg: ClassifierTrainConfig, progress: bool = True) -> dict:
    """Train a classifier of ``config``'s shape on the samples ``sampler`` draws from ``traces`` (module docstring);
    returns the summary (also in ``cfg.out``/summary.json) with ``export``, the policy folder."""
    from tqdm import tqdm

    out = check_out_dir(cfg.out)
    train, val = split_by_key(traces, cfg.val_fraction, cfg.seed, key=lambda t: t.key,
                              both=f"{config.kind} training needs at least 2 traces")
    xt, yt = balance(*gather(train, sampler, config.inputs), cfg.seed)
    xv, yv = gather(val, sampler, config.inputs)
    if len(yt) == 0:
        raise ValueError(f"no {config.kind} training sample has both classes: the traces hold no accepted (or no "
                         f"rejected) draft token")
    settings = {"config": asdict(config), "train": asdict(cfg) | {"out": None, "epochs": None},  # more epochs resume
                "traces": sorted(t.key for t in traces), "samples": int(len(yt))}
    torch.manual_seed(cfg.seed)
    model = AcceptanceClassifier(config)
    x_train, y_train = torch.from_numpy(xt), torch.from_numpy(yt)
    model.fit_scaling(x_train)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt, history, start = out / "checkpoint", [], 0
    found = find_checkpoint(ckpt)
    if found is not None:
        state = checkpoint_state(found)
        if state["settings"] != settings:
            raise ValueError(f"{found} was written with other settings or traces; use another --out to start over")
        load_checkpoint(found, model, opt)
        history, start = state["history"], state["epoch"]
    x_val, y_val = torch.from_numpy(xv), torch.from_numpy(yv)
    bar = tqdm(range(start, cfg.epochs), desc=f"{config.kind} epochs", unit="epoch", disable=not progress)
    for epoch in bar:
        model.train()
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        total = 0.0
        for i in range(0, len(order), cfg.batch):
            idx = order[i:i + cfg.batch]
            loss = nn.functional.binary_cross_entropy_with_logits(model(x_train[idx]), y_train[idx].float())
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        model.eval()
        row = {"epoch": epoch + 1, "train_loss": total / len(order)}
        if len(y_val):
            row |= {f"val_{k}": v for k, v in balanced_accuracy(model.accept_prob(x_val), y_val,
                                                               config.threshold).items()}
        history.append(row)
        bar.set_postfix({k: round(v, 4) for k, v in row.items() if k != "epoch"})
        save_checkpoint(ckpt, model, {"settings": settings, "epoch": epoch + 1, "history": history}, opt)
    bar.close()
    facts = {"samples": int(len(yt)), "validation_samples": int(len(yv)),
             "validation_accepted_share": float(yv.mean()) if len(yv) else None,
             "train_prompts": len(train), "validation_prompts": len(val), "epochs": cfg.epochs, "lr": cfg.lr,
             "batch": cfg.batch, "history": history}
    export = model.save(out / "policy", facts)
    if len(y_val):  # what ships: the float16 weights
        shipped = AcceptanceClassifier.load(export, config.kind)
        facts["exported_validation"] = balanced_accuracy(shipped.accept_prob(x_val), y_val, config.threshold)
        model.save(export, facts)
    summary = {"kind": config.kind, "export": str(export), **facts}
    write_json(summary, out / "summary.json")
    return summary


__all__ = ["AcceptanceClassifier", "ClassifierConfig", "ClassifierController", "ClassifierTrainConfig", "EAGLE_TREE",
           "balance", "balanced_accuracy", "gather", "train_classifier", "training_traces_for", "visited_roots"]
