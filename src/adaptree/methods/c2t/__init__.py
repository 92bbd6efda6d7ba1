"""C2T: the verified tree sized by a classifier on each candidate's probability and depth (:mod:`.controller`)."""

from adaptree.methods.c2t.controller import (C2TConfig, C2TController, candidate_features, samples, train_c2t,
                                             train_c2t_for)

__all__ = ["C2TConfig", "C2TController", "candidate_features", "samples", "train_c2t", "train_c2t_for"]
