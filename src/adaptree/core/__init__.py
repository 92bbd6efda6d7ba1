"""The core: the one draft-and-verify loop and what it is made of.

- :mod:`.engine`: the live engine (prefill, draft, verify, accept, compact on the models)
- :mod:`.cycle`: the cycle loop's bookkeeping (controller calls, clamps, stop rules, records), run by the
  engine and by the replay simulator
- :mod:`.controller`: the controller seam (``TreePlan``, ``CycleContext``, ``Controller``) and the two
  controllers the loop itself needs: autoregressive and the static EAGLE-3 tree
- :mod:`.tree`: the draft tree (beam expansion, top-V selection, tree mask; a context chain added to it)
- :mod:`.context`: the context index behind n-gram (prompt-lookup) chains: the longest earlier match
- :mod:`.verify`: greedy and lossless sampling verification of a tree
- :mod:`.records`: per-cycle and per-generation records
- :mod:`.machine`: the machine profile recorded with every result
- :mod:`.pipeline`: what the layers above need of a loaded pipeline (``PipelineLike``)
- :mod:`.files`: cache files several processes may write at once (a file lock, unique temporary names)
- :mod:`.config`: ranges and choices of config fields as field metadata (checked by the config, read by the CLI)
"""
