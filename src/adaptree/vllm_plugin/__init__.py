"""adaptree inside vLLM (docs/vllm.md).

- :mod:`~adaptree.vllm_plugin.export`: adaptree's EAGLE-3 heads as the drafter checkpoint vLLM (and SGLang,
  SpecForge) loads with ``speculative_config={"method": "eagle3", "model": OUT}``, and the target folder vLLM loads.
- :mod:`~adaptree.vllm_plugin.control`: the draft-length controllers (plain Python).
- :mod:`~adaptree.vllm_plugin.worker`: vLLM's worker with the drafter off in steps that draft nothing, recording the
  drafter's log-probs for the controllers with a stop rule (``worker_cls``).
- :mod:`~adaptree.vllm_plugin.scheduler`: vLLM's scheduler asking a controller before every step
  (``scheduler_cls``); the only module here that imports vLLM at the top.
- :mod:`~adaptree.vllm_plugin.engine`: a ``vllm.LLM`` with adaptree's settings, batches, the step-cost measurement.
- :mod:`~adaptree.bench.vllm_bench`: ``adaptree vllm-bench``.

:func:`register` is vLLM's general plugin entry point (``vllm.general_plugins`` in pyproject.toml): vLLM calls it in
each of its processes once adaptree is installed beside it.
"""


def register() -> None:
    """On vLLM's CPU platform, the thread binding, reserved cores and KV-cache space adaptree chooses
    (:func:`adaptree.vllm_plugin.engine.cpu_environment`, each only where unset): vLLM's own default bound one thread
    on a 2-core machine. Nothing on other platforms."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return
    if current_platform.is_cpu():
        from adaptree.vllm_plugin.engine import cpu_environment

        cpu_environment(in_process=False)
