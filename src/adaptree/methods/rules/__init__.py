"""Training-free depth rules: each decides per draft step (or per cycle) from the draft's own scores.

- :mod:`.deagle`: DEAGLE's 2-of-3 vote on survival probabilities
- :mod:`.ddd`: DDD's threshold on the beam's cumulative log-probability at checked depths
- :mod:`.svip`: SVIP's entropy-based acceptance bound
- :mod:`.gammatune`: Gammatune's per-cycle depth from the smoothed acceptance rate
"""
