"""SpecDec++ (Huang et al. 2025) as the LTD paper ran it on EAGLE-3's tree (Appendix A.1): a classifier on the draft
head's hidden states predicts whether the token just drafted will be accepted, and drafting stops when the
predicted chance of a rejection passes a threshold.

* **Decision.** After the draft forward of depth ``d`` the classifier reads the head's output hidden state that
  drafted the best node of the new beam (:meth:`~adaptree.core.tree.DraftTree.best_hidden`; at depth 1 the root's)
  and gives P(accepted) of that node's path; drafting stops when ``1 - P > threshold``. The label it was trained on
  is the whole path's acceptance, so the probability is already cumulative along the path, as SpecDec++'s stopping
  rule (P(at least one rejection so far) > h) asks. The tree is EAGLE-3's (W=10), at most 12 levels (LTD's setting
  for dynamic-depth methods). V follows the machine as RADAR's does: a cycle that stopped at depth d verifies the V
  of the machine's best static tree of that depth (``tuned``, the machine setup's static_gs.json, or a family
  member's own), since LTD's fixed V = 60 makes every tree lose where verification is dear (CPUs); without one,
  and with ``size`` given, a fixed V (60: LTD's).
* **Classifier.** A ResNet of hidden width 1024 (:class:`~adaptree.methods.common.classifier.AcceptanceClassifier`,
  one residual block), trained 5 epochs with AdamW at lr 1e-4 on balanced samples: every level 1..12 of the trees at
  the roots EAGLE-3's default tree (W=10, depth 8, V=60) reaches on greedy HumanEval traces recorded with the hidden
  states (``adaptree train specdec``). The threshold defaults to the classifier file's (0.5: the classes were
  balanced).
* **Runtime.** The learned methods' shared runtime (:mod:`adaptree.methods.common.runtime`): the AR fallback where no
  tree pays on this machine (with a latency model) and an optional context chain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from adaptree.core.config import between
from adaptree.core.controller import TreePlan, TreeShape
from adaptree.core.tree import DraftStep, DraftTree
from adaptree.methods.common import LearnedRuntime
from adaptree.methods.common.classifier import (
    EAGLE_TREE,
    AcceptanceClassifier,
    ClassifierConfig,
    ClassifierController,
    ClassifierTrainConfig,
    train_classifier,
    training_traces_for,
    visited_roots,
)
from adaptree.offline.traces import PromptTrace, level_offset, match_mask

KIND = "specdec"
HIDDEN, BLOCKS, EPOCHS = 1024, 1, 5
"""The LTD paper's SpecDec++: a ResNet of hidden size 1024 (one residual block), trained 5 epochs."""


@dataclass
class SpecDecConfig(LearnedRuntime, TreeShape):
    """SpecDec++'s inference settings (LTD's for dynamic-depth methods: W=10, at most 12 levels; V the machine's)."""

    width: int = 10
    """Beam width W."""
    depth: int = 12
    """Maximum draft depth."""
    size: int | None = None
    """Verification size V at every depth; None = the machine's best V at the depth the cycle stopped (``tuned``),
    60 (LTD's) without a machine tree."""
    policy: str | None = None
    """Classifier folder (config.json + model.safetensors; ``specdec/`` next to the head in use when built through
    the method registry)."""
    threshold: float | None = between(0.0, 1.0, None, lo_open=True, hi_open=True)
    """Stop drafting when the predicted chance of a rejection exceeds this; None = the classifier file's (0.5)."""


class SpecDecController(ClassifierController):
    """EAGLE-3's tree, drafting stopped by SpecDec++'s acceptance classifier (module docstring).

    :param classifier: a loaded :class:`~adaptree.methods.common.classifier.AcceptanceClassifier` (overrides
        ``config.policy``).
    """

    name, label = KIND, "SpecDec++"

    def __init__(self, config: SpecDecConfig | None = None, classifier: AcceptanceClassifier | None = None,
                 chain_calibration=None) -> None:
        cfg = config or SpecDecConfig()
        # The AR gate prices probes at EAGLE-3's tree, not at the machine's V of one level: SpecDec++ drafts on while
        # its classifier expects acceptances, so a probe costs several levels, and priced at one node probes would come
        # every few steps where no tree pays (docs/methods.md).
        self.probe_size = cfg.plan().size  # the config's V, else EAGLE-3's (TreeShape.unset_size)
        self.last_p_accept = float("nan")
        super().__init__(cfg, classifier, chain_calibration)

    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        if self.config.size is None and self.machine_tree is not None:
            return self.machine_tree.size_at(tree.depth)
        return plan.size

    @torch.inference_mode()
    def continue_drafting(self, step: DraftStep) -> bool:
        h = step.tree.best_hidden()
        if h.shape[-1] != self.classifier.config.inputs:
            raise ValueError(f"the SpecDec++ classifier reads hidden states of width {self.classifier.config.inputs}, "
                             f"this draft head's are {h.shape[-1]} wide: train one for this head")
        self.last_p_accept = p = float(self.accept_prob(h))
        return 1.0 - p <= self.threshold


# ---- training ---------------------------------------------------------------------------------------


def samples(trace: PromptTrace, max_depth: int = 12, tree: tuple[int, int, int] = EAGLE_TREE
            ) -> tuple[np.ndarray, np.ndarray]:
    """SpecDec++'s samples of one trace: at every root EAGLE-3's default tree reaches and every level 1..``max_depth``,
    the hidden state that drafted the level's best beam node and whether that node's path was accepted."""
    wt = trace.width(tree[0])
    if wt.hidden is None:
        raise ValueError(f"trace {trace.key!r} holds no draft hidden states: record the traces with hidden_dtype "
                         f"float16 (adaptree train specdec does)")
    if wt.max_depth < max_depth:
        raise ValueError(f"trace {trace.key!r} has {wt.max_depth} levels, SpecDec++ samples {max_depth}")
    roots = visited_roots(trace, tree)
    match = match_mask(wt, trace.output, roots)
    w = wt.width
    x = wt.hidden[roots, :max_depth].astype(np.float32).reshape(-1, wt.hidden.shape[-1])
    best = np.stack([level_offset(w, d) + wt.beam[roots, d - 1, 0].astype(np.int64)
                     for d in range(1, max_depth + 1)], axis=1)  # [roots, depth] candidate index
    y = np.take_along_axis(match, best, axis=1).reshape(-1)
    return x, y


def train_specdec(traces: list[PromptTrace], cfg: ClassifierTrainConfig, max_depth: int = 12,
                  progress: bool = True) -> dict:
    """Train SpecDec++'s classifier on ``traces`` (recorded with hidden states, W=10, at least ``max_depth`` levels)."""
    if not traces:
        raise ValueError("SpecDec++ training needs traces")
    wt = traces[0].width(EAGLE_TREE[0])
    if wt.hidden is None:
        samples(traces[0], max_depth)  # the error that says how to record them
    config = ClassifierConfig(KIND, inputs=int(wt.hidden.shape[-1]), features=[], hidden=HIDDEN, blocks=BLOCKS,
                              width=EAGLE_TREE[0], max_depth=max_depth)
    return train_classifier(config, traces, lambda t: samples(t, max_depth), cfg, progress)


def train_specdec_for(pipeline, cfg: ClassifierTrainConfig, prompts, progress: bool = True) -> dict:
    """Record (or reuse) the greedy traces of ``prompts`` (a :class:`~adaptree.offline.recording.TrainingPrompts`)
    with the draft hidden states (:func:`~adaptree.methods.common.classifier.training_traces_for`), then
    :func:`train_specdec`."""
    return train_specdec(training_traces_for(pipeline, cfg, prompts, progress), cfg, progress=progress)


DEFAULT_TRAINING = replace(ClassifierTrainConfig(), out="runs/specdec", epochs=EPOCHS)
"""``adaptree train specdec``'s defaults."""
