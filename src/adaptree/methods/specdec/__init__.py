"""SpecDec++: drafting stopped by a classifier on the draft head's hidden states (:mod:`.controller`)."""

from adaptree.methods.specdec.controller import (SpecDecConfig, SpecDecController, samples, train_specdec,
                                                 train_specdec_for)

__all__ = ["SpecDecConfig", "SpecDecController", "samples", "train_specdec", "train_specdec_for"]
