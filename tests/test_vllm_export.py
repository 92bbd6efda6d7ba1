"""adaptree export-head: a head as the EAGLE-3 drafter checkpoint vLLM loads (docs/vllm.md). The format checks
run on tiny models; the run inside vLLM is tests/test_vllm.py's."""

import json
import re

import pytest
import torch
from conftest import tiny_head
from safetensors.torch import load_file

from adaptree.models import load_target
from adaptree.models.eagle3 import Eagle3Head
from adaptree.vllm_plugin.export import LAYER_IDS_KEY, export_for_vllm, export_head, target_config, vllm_layer_ids


@pytest.fixture
def shipped_like(tiny_folders, tmp_path):
    """A tiny target folder and its head stored as adaptree ships heads (int8 rows)."""
    model, _ = tiny_folders
    target, _ = load_target(model)
    head = tiny_head(target, draft_vocab=12, seed=4)
    head.save_pretrained(tmp_path / "int8", dtype=torch.int8)
    return model, target, tmp_path / "int8"


def test_export_writes_vllms_layout_and_the_same_head(shipped_like, tmp_path):
    model, target, folder = shipped_like
    out, found = export_for_vllm(tmp_path / "out", model=model, head=folder, dtype=torch.float32)
    assert found == model
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 12 and cfg["target_hidden_size"] == target.config.hidden_size
    assert cfg["vocab_size"] == target.config.vocab_size and cfg["torch_dtype"] == "float32"
    assert cfg[LAYER_IDS_KEY] == cfg["eagle_config"][LAYER_IDS_KEY] == [l + 1 for l in target.config.feature_layers]
    assert "adaptree_storage" not in cfg
    stored = load_file(str(out / "model.safetensors"))
    # vLLM's names: no int8 scales, no t2d (vLLM skips it), no embeddings (vLLM shares the target's)
    assert not any(k.endswith("_scale") for k in stored) and "t2d" not in stored and "embed_tokens.weight" not in stored
    assert stored["d2t"].dtype == torch.int64 and stored["fc.weight"].dtype == torch.float32
    assert {k.split(".")[0] for k in stored} == {"fc", "midlayer", "norm", "lm_head", "d2t"}
    # the same head: the export loads back (strictly) and drafts what the shipped folder drafts
    before = Eagle3Head.from_pretrained(folder, target=target, dtype=torch.float32)
    after = Eagle3Head.from_pretrained(out, target=target, dtype=torch.float32)
    feats, ids = torch.randn(1, 5, 3 * target.config.hidden_size), torch.randint(0, 12, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(after(feats, ids)[0], before(feats, ids)[0], rtol=0, atol=0)
    assert torch.equal(after.d2t, before.d2t)


@torch.no_grad()
def test_vllm_layer_ids_are_the_layers_whose_input_holds_adaptrees_features(tiny_folders):
    """vLLM taps a layer's input (hidden_states + residual before layer i runs), as Hugging Face's
    hidden_states[i] does; adaptree's features are layer outputs, so vLLM's ids are adaptree's plus one."""
    from transformers import AutoModelForCausalLM

    model, _ = tiny_folders
    ours, _ = load_target(model)
    hf = AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()
    ids = torch.randint(0, ours.config.vocab_size, (1, 9))
    ref = hf(ids, output_hidden_states=True).hidden_states
    feats = ours(ids, features=True).features
    h = ours.config.hidden_size
    layer_ids = vllm_layer_ids(target_config(model))
    assert layer_ids != list(ours.config.feature_layers)
    for j, layer in enumerate(layer_ids):
        torch.testing.assert_close(feats[..., j * h:(j + 1) * h], ref[layer], rtol=1e-4, atol=1e-4)


def test_export_refuses_what_vllm_would_misread(shipped_like, tmp_path):
    model, target, folder = shipped_like
    cfg = target_config(model)
    wide = target_config(model)
    wide.hidden_size *= 2
    with pytest.raises(ValueError, match=f"width {cfg.hidden_size}; the target's hidden_size is {wide.hidden_size}"):
        export_head(folder, wide, tmp_path / "a")
    other = target_config(model)
    other.vocab_size += 1
    with pytest.raises(ValueError, match=f"vocab_size {cfg.vocab_size}; the target's is {other.vocab_size}"):
        export_head(folder, other, tmp_path / "b")
    named = json.loads((folder / "config.json").read_text())
    named["eagle_config"] = {LAYER_IDS_KEY: [0, 1, 2]}
    (folder / "config.json").write_text(json.dumps(named))
    with pytest.raises(ValueError, match=re.escape(f"names feature layers [0, 1, 2] (vLLM's indexing); adaptree's "
                                               f"features of this target are vLLM's {vllm_layer_ids(cfg)}")):
        export_head(folder, cfg, tmp_path / "c")
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_head(folder, cfg, tmp_path / "d", dtype=torch.int8)
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()


def test_export_head_command(shipped_like, tmp_path, capsys):
    from adaptree.cli import main

    model, _, folder = shipped_like
    assert main(["export-head", str(tmp_path / "out"), "--model", str(model), "--head", str(folder)]) == 0
    assert "speculative_config" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert main(["export-head", str(tmp_path / "x"), "--model", str(model)]) == 2  # no shipped head for a folder
    assert "ships no head" in capsys.readouterr().err
    assert main(["export-head", str(tmp_path / "y"), "--model", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
