"""C2T (Huo et al. 2025) as the LTD paper ran it on EAGLE-3's tree (Appendix A.1): a classifier on each drafted
candidate's probability and depth decides which candidates enter the verified tree.

* **Decision.** The tree is drafted to depth 8 (LTD's setting for dynamic-size methods, W=10); the classifier gives
  P(accepted) of every candidate from its cumulative log-probability, its own log-probability and its depth (no
  entropy: the LTD authors found that computing it cost more than it added). The candidates at or above the
  threshold are counted, and the verified tree is that many candidates, the best by cumulative score, capped at
  ``size``. Counting rather than taking the classifier's own set keeps the tree closed under parents (the
  engine's top-V rule) and makes C2T what LTD's comparison calls it, a verification-size method; the two sets
  differ only where the classifier ranks two candidates otherwise than their scores do.
* **Classifier.** An FFN of hidden width 64 (:class:`~adaptree.methods.common.classifier.AcceptanceClassifier`, no
  residual blocks), 50 epochs, AdamW at lr 1e-4, on balanced samples: every candidate of the depth-8 trees at the
  roots EAGLE-3's default tree (W=10, depth 8, V=60) reaches on greedy HumanEval traces (``adaptree train c2t``).
* **Runtime.** The learned methods' shared runtime (:mod:`adaptree.methods.common.runtime`): the AR fallback where no
  tree pays on this machine (with a latency model) and an optional context chain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from adaptree.core.config import between
from adaptree.core.controller import TreePlan, TreeShape
from adaptree.core.tree import DraftTree
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
from adaptree.offline.traces import PromptTrace, match_mask, num_candidates

KIND = "c2t"
PROBE_SIZE = 60
"""What the AR gate prices a C2T cycle at (EAGLE-3's V, about what the classifier counts): a tree of one node would
make probes look nearly free, and where trees of tens of nodes never pay C2T would probe every few steps."""
FEATURES = ["cumulative_logp", "logp", "depth"]
HIDDEN, EPOCHS, DEPTH = 64, 50, 8
"""The LTD paper's C2T: an FFN of hidden size 64, trained 50 epochs, on trees of depth 8."""


def candidate_features(scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """``[C, 3]`` float32 :data:`FEATURES` of candidates with cumulative log-probs ``scores``, parent indices
    ``parents`` (-1: a child of the root) and depths ``depths`` (the last dimension; leading ones are kept)."""
    parent = torch.where(parents >= 0, torch.gather(scores, -1, parents.clamp(min=0)), torch.zeros_like(scores))
    return torch.stack([scores, scores - parent, depths.to(scores.dtype)], dim=-1).float()


@dataclass
class C2TConfig(LearnedRuntime, TreeShape):
    """C2T's inference settings (LTD's for dynamic-size methods: W=10, depth 8)."""

    width: int = 10
    """Beam width W."""
    depth: int = DEPTH
    """Draft depth (every cycle drafts this many levels)."""
    size: int = 240
    """The largest V: the classifier's count is capped here (LTD's largest verification size)."""
    policy: str | None = None
    """Classifier folder (config.json + model.safetensors; ``c2t/`` next to the head in use when built through the
    method registry)."""
    threshold: float | None = between(0.0, 1.0, None, lo_open=True, hi_open=True)
    """A candidate counts when its predicted chance of acceptance is at least this; None = the classifier file's."""


class C2TController(ClassifierController):
    """EAGLE-3's tree of depth 8, its verified size counted by C2T's classifier (module docstring).

    :param classifier: a loaded :class:`~adaptree.methods.common.classifier.AcceptanceClassifier` (overrides
        ``config.policy``).
    """

    name, label = KIND, "C2T"

    def __init__(self, config: C2TConfig | None = None, classifier: AcceptanceClassifier | None = None,
                 chain_calibration=None) -> None:
        cfg = config or C2TConfig()
        self.probe_size = min(PROBE_SIZE, cfg.size)
        self.last_count = 0
        super().__init__(cfg, classifier, chain_calibration)
        if self.classifier.config.features != FEATURES:
            raise ValueError(f"a C2T classifier reads {FEATURES}, this one {self.classifier.config.features}")

    @torch.inference_mode()
    def choose_size(self, tree: DraftTree, plan: TreePlan) -> int:
        x = candidate_features(tree.candidate_scores(), tree.candidate_parents(), tree.candidate_depths())
        self.last_count = count = int((self.accept_prob(x) >= self.threshold).sum())
        return min(count, plan.size)


# ---- training ---------------------------------------------------------------------------------------


def samples(trace: PromptTrace, tree: tuple[int, int, int] = EAGLE_TREE) -> tuple[np.ndarray, np.ndarray]:
    """C2T's samples of one trace: every candidate of the depth-8 tree at every root EAGLE-3's default tree reaches,
    with :data:`FEATURES` and whether its path was accepted."""
    wt = trace.width(tree[0])
    roots = visited_roots(trace, tree)
    c = num_candidates(wt.width, DEPTH)
    _, scores, parents, depths, _ = wt.torch_views()
    x = candidate_features(scores[roots, :c], parents[roots, :c], depths[:c].expand(len(roots), c))
    y = match_mask(wt, trace.output, roots)[:, :c]
    return x.reshape(-1, len(FEATURES)).numpy(), y.reshape(-1)


def train_c2t(traces: list[PromptTrace], cfg: ClassifierTrainConfig, progress: bool = True) -> dict:
    """Train C2T's classifier on ``traces`` (W=10, at least 8 levels)."""
    config = ClassifierConfig(KIND, inputs=len(FEATURES), features=list(FEATURES), hidden=HIDDEN, blocks=0,
                              width=EAGLE_TREE[0], max_depth=DEPTH)
    return train_classifier(config, traces, samples, cfg, progress)


def train_c2t_for(pipeline, cfg: ClassifierTrainConfig, prompts, progress: bool = True) -> dict:
    """Record (or reuse) the greedy traces of ``prompts`` (a :class:`~adaptree.offline.recording.TrainingPrompts`)
    as SpecDec++'s are (:func:`~adaptree.methods.common.classifier.training_traces_for`), then :func:`train_c2t`."""
    return train_c2t(training_traces_for(pipeline, cfg, prompts, progress), cfg, progress=progress)


DEFAULT_TRAINING = replace(ClassifierTrainConfig(), out="runs/c2t", epochs=EPOCHS)
"""``adaptree train c2t``'s defaults."""
