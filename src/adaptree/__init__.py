"""adaptree: lossless LLM inference acceleration with EAGLE-3 speculative decoding and adaptive draft trees.

The public API (:mod:`adaptree.api`)::

    import adaptree
    p = adaptree.load()            # the default model (SmolLM2-135M-Instruct) with its shipped draft head
    print(p.generate("Name three primes.", method="ltd", max_new_tokens=32).text)

- :func:`load` -> :class:`Pipeline`; :meth:`Pipeline.generate` -> :class:`Generation` (text, ids, cycle
  records); :meth:`Pipeline.stream` -> an iterator over text pieces.
- :data:`METHODS`: the method names; :class:`SamplingConfig`: temperature, top-p, top-k, seed.

Names are imported on first use, so ``import adaptree`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from adaptree._lazy import lazy_exports
from adaptree._version import __version__

_EXPORTS = {
    "load": "adaptree.api", "Pipeline": "adaptree.api", "Generation": "adaptree.api", "Stream": "adaptree.api",
    "DTYPES": "adaptree.adapt.execution", "SamplingConfig": "adaptree.core.verify",
    "GenerationResult": "adaptree.core.records", "CycleRecord": "adaptree.core.records",
    "Controller": "adaptree.core.controller",
    "TreePlan": "adaptree.core.controller", "METHODS": "adaptree.methods", "make_controller": "adaptree.methods",
    "MissingAssetError": "adaptree.methods",
}

__all__ = ["__version__", "load", "Pipeline", "Generation", "Stream", "DTYPES", "SamplingConfig", "GenerationResult",
           "CycleRecord", "Controller", "TreePlan", "METHODS", "make_controller", "MissingAssetError"]

if TYPE_CHECKING:
    from adaptree.adapt.execution import DTYPES
    from adaptree.api import Generation, Pipeline, Stream, load
    from adaptree.core.controller import Controller, TreePlan
    from adaptree.core.records import CycleRecord, GenerationResult
    from adaptree.core.verify import SamplingConfig
    from adaptree.methods import METHODS, MissingAssetError, make_controller


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
