"""``adaptree serve --engine vllm`` (adaptree.serve.vllm): the settings refused before anything loads, and
vLLM's server command line, without vLLM. The real server is tested in tests/test_vllm.py."""

from __future__ import annotations

import json
import os

import pytest

from adaptree.serve.config import ServeConfig
from adaptree.serve.vllm import check_config, vllm_serve_command


@pytest.fixture(autouse=True)
def _environment():
    """vllm_serve_command sets vLLM's CPU variables in this process, as the CLI does before it execs vLLM."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("field, value, flag", [("max_queue", 3, "--max-queue"), ("warmup", False, "--warmup"),
                                                ("max_tree_width", 4, "--max-tree-width")])
def test_adaptrees_own_server_settings_are_refused_by_name(field, value, flag):
    with pytest.raises(ValueError, match=f"^{flag} is a setting of adaptree's own server"):
        check_config(ServeConfig(**{field: value}))
    check_config(ServeConfig(port=9000, api_key="k", default_max_tokens=10, graceful_timeout=3.0))


@pytest.mark.parametrize("kwargs, why", [({"method": "resps"}, "--method resps decides trees in adaptree's own engine"),
                                         ({"dtype": "int4"}, "--dtype must be one of"),
                                         ({"method": "static", "depth": 0}, "--depth must be in 1..16"),
                                         ({"method": "static", "step_costs": "x.json"}, "--step-costs is read by"),
                                         ({"max_num_seqs": 0}, "--max-num-seqs must be in")])
def test_bad_values_fail_before_anything_loads(kwargs, why):
    with pytest.raises(ValueError, match=why):
        vllm_serve_command(ServeConfig(), **kwargs)


def test_plain_and_ngram_commands_pass_the_servers_settings():
    for var in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE",
                "OMP_NUM_THREADS"):
        os.environ.pop(var, None)
    config = ServeConfig(port=8123, api_key="secret", default_max_tokens=77, served_model_name="smol")
    argv, env = vllm_serve_command(config, dtype="float32", method="ar")
    assert argv[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert os.path.isfile(os.path.join(flags["--model"], "config.json"))
    assert flags["--port"] == "8123" and flags["--served-model-name"] == "smol" and flags["--dtype"] == "float32"
    assert json.loads(flags["--override-generation-config"]) == {"max_new_tokens": 77}
    assert "--speculative-config" not in argv and "secret" not in " ".join(argv)  # the key goes by environment
    assert env["VLLM_API_KEY"] == "secret" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    argv, _ = vllm_serve_command(ServeConfig(), dtype="float32", method="ngram", depth=2)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 2


def test_static_exports_the_head_once_into_the_cache():
    argv, _ = vllm_serve_command(ServeConfig(), dtype="float32", method="static")
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 3
    head = spec["model"]
    config = json.loads(open(os.path.join(head, "config.json"), encoding="utf-8").read())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["torch_dtype"] == "float32"
    stamp = os.stat(os.path.join(head, "model.safetensors")).st_mtime_ns
    again, _ = vllm_serve_command(ServeConfig(), dtype="float32", method="static", depth=2)
    assert json.loads(again[again.index("--speculative-config") + 1])["model"] == head
    assert os.stat(os.path.join(head, "model.safetensors")).st_mtime_ns == stamp


def test_the_command_refuses_what_vllm_does_not_run(capsys):
    from adaptree import cli
    from adaptree.vllm_plugin.engine import vllm_available

    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--engine", "vllm", "--width", "4", "--max-queue", "3"])
    message = str(exc.value.code)
    if not vllm_available():
        assert "--engine vllm needs vLLM: pip install 'adaptree[vllm]'" in message
        return
    assert "--width set adaptree's own engine" in message
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--engine", "vllm", "--max-queue", "3"])
    assert "--max-queue is a setting of adaptree's own server" in str(exc.value.code)
