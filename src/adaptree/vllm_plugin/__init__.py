"""adaptree inside vLLM (docs/vllm.md).

- :mod:`~adaptree.vllm_plugin.export`: adaptree's EAGLE-3 heads as the drafter checkpoint vLLM (and SGLang, SpecForge)
  loads with ``speculative_config={"method": "eagle3", "model": OUT}``, and the target folder vLLM loads.

This package imports vLLM only inside the functions that run it, so the rest of adaptree never needs it.
"""
