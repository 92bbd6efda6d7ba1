"""Re-SpS: a PPO policy choosing (total tokens, depth, top-k) from the target's features, kept N cycles.

- :mod:`.controller`: the action set, ``ReSpSState`` (concat / mean / sentence-embedding states),
  ``ReSpSConfig`` and ``ReSpSController`` (action caching)
- :mod:`.env`: the gymnasium environment ``PlanEnv``
- :mod:`.train`: ``ReSpSTrainConfig`` and ``train_resps`` (PPO on the simulator or live, validation)

The shipped policy lives next to the model's head: ``<head>/resps``.
"""
