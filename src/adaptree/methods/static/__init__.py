"""The tuned static tree: ``static-gs`` and the grid search that tunes it.

- :mod:`.gs`: ``StaticGSConfig`` and ``StaticGSController`` (the static tree of a ``static_gs.json``)
- :mod:`.tune`: ``TuneConfig`` and ``run_tune`` (successive halving over (W, depth, V) by measured tokens/s)

The static EAGLE-3 tree and the autoregressive baseline are the controller seam's own defaults
(:mod:`adaptree.core.controller`). A tuned tree ships next to the model's head: ``<head>/static_gs.json``.
"""
