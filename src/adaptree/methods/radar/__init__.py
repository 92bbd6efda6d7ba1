"""RADAR: an LSTM stop/continue policy over the draft beam's scores, trained offline by REINFORCE.

- :mod:`.controller`: ``RadarConfig`` and ``RadarController``
- :mod:`.policy`: the LSTM network (``RadarPolicy``), safetensors + JSON, strict loading
- :mod:`.dataset`: exact accepted-length distributions per stop point, recorded on the live engine
- :mod:`.train`: ``RadarTrainConfig`` and ``train_radar`` (REINFORCE, a grid over alpha, the best exported)

The shipped policy lives next to the model's head: ``<head>/radar``.
"""
