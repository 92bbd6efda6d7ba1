"""LTD (learned tree drafting): two PPO policies, draft depth per step and verification size per cycle.

- :mod:`.controller`: ``LTDObservation`` (the policies' input, shared by training and inference), the
  configs of ``ltd``, ``ltd-depth``, ``ltd-size`` and ``LTDController``
- :mod:`.env`: the gymnasium environments ``DepthEnv`` and ``SizeEnv`` and stage 1's random depth rule
- :mod:`.train`: ``LTDTrainConfig`` and ``train_ltd`` (stage 1, then co-adaptation; the best pair exported)

Shipped policies live next to the model's head: ``<head>/ltd/depth`` and ``<head>/ltd/size``.
"""
