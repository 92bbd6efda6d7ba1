"""Adapting to the machine at hand: a cached per-machine calibration, the dtype, the static tree and the default
method chosen by measurement here, never shipped from the machine adaptree was developed on.

:func:`~adaptree.adapt.setup.adapt` makes (once per machine profile, model, head, dtype and torch threads) and
caches under ``$ADAPTREE_CACHE/machines``:

- ``latency.json``: this machine's latency model (a quick :func:`~adaptree.offline.latency.calibrate` plus a few
  live cycles for the per-cycle overhead);
- ``static_gs.json``: the static tree (W, D, V) that minimises the modelled time of recorded greedy traces under
  that latency model (:func:`~adaptree.offline.oracle.best_static`), what ``static-gs`` then uses;
- ``setup.json``: the machine profile it is valid for, and every available method's modelled throughput on the
  traces (the simulator), from which the default method is the best one (never EAGLE-3's default tree).

The traces (greedy, machine-independent: acceptance does not depend on the hardware) and the acceptance
calibration of ``costaware`` are cached once per model and head under ``$ADAPTREE_CACHE/traces``.

The package, by job:

- :mod:`~adaptree.adapt.setup`: the machine setup (:class:`~adaptree.adapt.setup.MachineSetup`,
  :func:`~adaptree.adapt.setup.adapt`, :func:`~adaptree.adapt.setup.find_setup`, the default method's live check);
- :mod:`~adaptree.adapt.execution`: the execution mode (:data:`~adaptree.adapt.execution.DTYPES`,
  :func:`~adaptree.adapt.execution.execution_name`, ...); :func:`~adaptree.adapt.execution.choose_execution` is
  ``dtype="auto"`` / ``weights="auto"``: it probes each candidate execution mode (bfloat16, float32, bfloat16 with
  the GGUF's int4 weights) and makes the full setup of the best-probed one, keeping the mode whose default method
  models fastest;
- :mod:`~adaptree.adapt.probe`: the short probe of an execution mode (a few shapes timed once, every method
  replayed on the shared traces) and the estimates of how long the choice takes;
- :mod:`~adaptree.adapt.attention`: :func:`~adaptree.adapt.attention.attention_dtype` times attention in the
  model's dtype against float32;
- :mod:`~adaptree.adapt.compile`: :func:`~adaptree.adapt.compile.compile_tokens` times ``torch.compile``'d
  forwards against eager ones;
- :mod:`~adaptree.adapt.cache`: where all of it is cached, keyed and locked (one process measures, others wait
  and reuse what it measured).

:func:`adaptree.load` runs them on first use unless told not to.
"""

from adaptree.adapt.attention import attention_dtype
from adaptree.adapt.cache import machines_dir
from adaptree.adapt.compile import compile_tokens
from adaptree.adapt.execution import (
    DTYPES,
    WEIGHTS,
    choose_execution,
    dtype_of,
    execution_name,
    parse_execution,
)
from adaptree.adapt.setup import (
    AdaptConfig,
    AdaptError,
    MachineSetup,
    adapt,
    find_setup,
    fingerprint,
)

__all__ = ["AdaptConfig", "AdaptError", "MachineSetup", "adapt", "attention_dtype", "choose_execution", "find_setup",
           "fingerprint", "machines_dir", "DTYPES", "WEIGHTS", "execution_name", "parse_execution", "dtype_of",
           "compile_tokens"]
